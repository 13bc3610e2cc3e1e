//! [`Communicator`]: the user-facing all-reduce.

mod bootstrap;

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fairring_core::reduce::Element;
use fairring_core::topology::{Location, Topology};
use fairring_core::{DataType, ReduceOp};
use fairring_rdma::tcp::TcpFabric;

use crate::config::{Algorithm, Config};
use crate::engine::Engine;
use crate::engine::work::Submission;
use crate::error::{Error, Result};
use crate::store::{PrefixStore, Store, TcpStore, TcpStoreServer};

/// A group of ranks that all-reduce together.
///
/// Every rank of the job builds one (collectively: construction rendezvouses) and
/// then issues the same operations in the same order.
///
/// ```no_run
/// use fairring::{Communicator, ReduceOp};
///
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1 << 20];
/// let mut more = vec![2.0f32; 1 << 20];
/// comm.scope(|s| -> fairring::Result<()> {
///     let a = s.all_reduce(&mut grads, ReduceOp::Sum)?;
///     let b = s.all_reduce(&mut more, ReduceOp::Avg)?; // in flight with `a`
///     a.wait()?;
///     b.wait()
/// })?;
/// # Ok::<(), fairring::Error>(())
/// ```
pub struct Communicator {
    engine: Arc<Engine<TcpFabric>>,
    progress: Option<JoinHandle<()>>,
    /// The next operation's sequence number; held while submitting, so that one
    /// rank's operations are numbered in the order they are queued.
    next_seq: Mutex<u64>,
    topology: Topology,
    location: Location,
    algorithm: Algorithm,
    timeout: Duration,
    // Dropped last: other ranks may still be reading the store while this one
    // tears down.
    _store: Arc<dyn Store>,
    _server: Option<TcpStoreServer>,
}

impl Communicator {
    /// Joins the job torchrun's environment describes (see [`Config`]).
    pub fn from_env() -> Result<Communicator> {
        Communicator::new(Config::from_env()?)
    }

    /// Joins the job of `config`, meeting through the TCP store rank 0 serves.
    pub fn new(config: Config) -> Result<Communicator> {
        let server = if config.rank == 0 {
            let addr = crate::store::tcp::resolve_master(&config.master_addr, config.master_port)?;
            let cap = 2 * config.world_size as usize + 16;
            Some(TcpStoreServer::bind(
                addr,
                config.secret.clone(),
                config.job_tag,
                cap,
            )?)
        } else {
            None
        };
        let store = TcpStore::connect(
            &config.master_addr,
            config.master_port,
            &config.secret,
            config.job_tag,
            config.timeout,
        )?;
        Communicator::build(config, Arc::new(store), server)
    }

    /// Joins the job of `config`, meeting through `store` (for instance the host
    /// runtime's own store).
    pub fn with_store(config: Config, store: Arc<dyn Store>) -> Result<Communicator> {
        Communicator::build(config, store, None)
    }

    fn build(
        config: Config,
        store: Arc<dyn Store>,
        server: Option<TcpStoreServer>,
    ) -> Result<Communicator> {
        let scoped = PrefixStore::new(
            format!("fairring/{:016x}", config.job_tag),
            Arc::clone(&store),
        );
        let built = bootstrap::build(&config, &scoped)?;
        let engine = Arc::new(built.engine);
        let progress = {
            let engine = Arc::clone(&engine);
            std::thread::Builder::new()
                .name(format!("fairring-progress-{}", config.rank))
                .spawn(move || engine.run())
                .map_err(|e| Error::io("starting the progress thread", e))?
        };
        Ok(Communicator {
            engine,
            progress: Some(progress),
            next_seq: Mutex::new(0),
            topology: built.topology,
            location: built.location,
            algorithm: config.algorithm,
            timeout: config.timeout,
            _store: store,
            _server: server,
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.engine.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> u32 {
        self.engine.world
    }

    /// Machines and devices per machine, as the rendezvous found them.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// Where this rank runs.
    pub fn location(&self) -> Location {
        self.location
    }

    /// Staging buffers: how many slices can be in flight at once.
    pub fn staging_buffers(&self) -> u32 {
        self.engine.buffers
    }

    /// Largest slice, in bytes.
    pub fn slice_bytes(&self) -> u64 {
        self.engine.geometry.full_slice_bytes()
    }

    /// All-reduces `data` in place and waits for it.
    pub fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.scope(|s| s.all_reduce(data, op)?.wait())
    }

    /// Runs `f` with a [`Scope`] in which all-reduces run asynchronously; when `f`
    /// returns, every operation started in the scope has finished.
    pub fn scope<'env, R>(
        &'env self,
        f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> R,
    ) -> R {
        let first = *self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        let scope = Scope {
            comm: self,
            first,
            _scope: PhantomData,
        };
        let out = f(&scope);
        scope.finish();
        out
    }

    /// Starts an all-reduce of `count` elements of `dtype` at `data`.
    ///
    /// # Safety
    ///
    /// `data` must be valid for reads and writes of `count` elements of `dtype`
    /// and aligned for `dtype`, and nothing else may access that memory until the
    /// returned [`Work`] reports completion (or is dropped, which waits).
    pub unsafe fn all_reduce_raw(
        &self,
        data: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        if count > 0 {
            if data.is_null() {
                return Err(Error::invalid("data", "null pointer"));
            }
            let align = usize::try_from(dtype.size_bytes()).unwrap_or(usize::MAX);
            if !(data as usize).is_multiple_of(align) {
                return Err(Error::invalid(
                    "data",
                    format!("{data:p} is not aligned to {align} bytes for {dtype}"),
                ));
            }
        }
        let seq = self.submit(data, count, dtype, op, algorithm.unwrap_or(self.algorithm))?;
        Ok(Work {
            engine: &self.engine,
            seq,
            _data: PhantomData,
        })
    }

    fn submit(
        &self,
        data: *mut u8,
        elements: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> Result<u64> {
        if !op.supports(dtype) {
            return Err(Error::invalid(
                "op",
                format!("{op} is not defined on {dtype}"),
            ));
        }
        if elements
            .checked_mul(dtype.size_bytes())
            .is_none_or(|b| b > isize::MAX as u64)
        {
            return Err(Error::invalid(
                "count",
                format!("{elements} elements of {dtype} overflow"),
            ));
        }
        if let Some(e) = self.engine.failure() {
            return Err(Error::Failed { first: Box::new(e) });
        }
        let mut next = self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = *next;
        let start = Instant::now();
        while !self.engine.works.try_take(seq) {
            if let Some(e) = self.engine.failure() {
                return Err(Error::Failed { first: Box::new(e) });
            }
            if start.elapsed() > self.timeout {
                return Err(Error::timeout(
                    format!(
                        "a free operation slot ({} operations are outstanding; wait on or drop earlier ones)",
                        crate::engine::work::WORK_CAPACITY
                    ),
                    self.timeout,
                ));
            }
            if !self.engine.try_drive() {
                std::thread::yield_now();
            }
        }
        let sub = Submission {
            seq,
            data,
            elements,
            dtype,
            op,
            algorithm,
        };
        if let Err(e) = self.engine.submit(sub) {
            self.engine.works.give_back(seq);
            return Err(e);
        }
        *next += 1;
        Ok(seq)
    }

    /// Fails every operation in flight and every later one with [`Error::Aborted`],
    /// and wakes every waiter. Callable from any thread.
    pub fn abort(&self) {
        self.engine.fail(Error::Aborted);
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.engine.stop_progress();
        if let Some(t) = self.progress.take()
            && t.join().is_err()
        {
            log::error!("fairring: the progress thread panicked");
        }
        let operations = *self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        self.engine.say_goodbye(operations, &self.engine.linked);
    }
}

/// Where asynchronous all-reduces live: see [`Communicator::scope`]. Operations
/// may borrow data for `'scope`; the scope ends only when all have finished.
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'env Communicator,
    first: u64,
    _scope: PhantomData<&'scope mut &'scope ()>,
}

impl<'scope> Scope<'scope, '_> {
    /// Starts an all-reduce of `data` in place with the communicator's algorithm.
    pub fn all_reduce<T: Element>(
        &'scope self,
        data: &'scope mut [T],
        op: ReduceOp,
    ) -> Result<Work<'scope>> {
        self.all_reduce_with(data, op, self.comm.algorithm)
    }

    /// Starts an all-reduce of `data` in place with `algorithm`.
    pub fn all_reduce_with<T: Element>(
        &'scope self,
        data: &'scope mut [T],
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> Result<Work<'scope>> {
        let count = data.len() as u64;
        // SAFETY: `data` is borrowed mutably for 'scope, and the scope does not
        // end before the operation finishes (`finish` waits), even if the `Work`
        // is leaked; it is valid, aligned for `T` and of `count` elements.
        unsafe {
            self.comm.all_reduce_raw(
                data.as_mut_ptr().cast(),
                count,
                T::DTYPE,
                op,
                Some(algorithm),
            )
        }
    }

    fn finish(&self) {
        let last = *self
            .comm
            .next_seq
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for seq in self.first..last {
            // Waits for every operation of the scope (and any other thread's in
            // between, which is harmless); errors belong to the `Work`s.
            while !matches!(
                self.comm.engine.wait(seq, Some(Duration::from_secs(1))),
                Ok(true) | Err(_)
            ) {}
        }
    }
}

/// One all-reduce in flight.
///
/// Dropping it waits for it to finish; if it has not finished within the
/// communicator's timeout, the communicator is failed (every peer's operations
/// then fail too) so that the drop returns and nothing more touches the memory.
#[must_use = "an all-reduce runs until waited on or dropped"]
pub struct Work<'a> {
    engine: &'a Engine<TcpFabric>,
    seq: u64,
    _data: PhantomData<&'a mut [u8]>,
}

impl Work<'_> {
    /// Waits for the all-reduce to finish.
    pub fn wait(self) -> Result<()> {
        let timeout = self.engine.timeout;
        self.wait_timeout(timeout)
    }

    /// Waits up to `timeout`: an error if it failed or is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        match self.engine.wait(self.seq, Some(timeout))? {
            true => Ok(()),
            false => Err(Error::timeout(format!("all-reduce #{}", self.seq), timeout)),
        }
    }

    /// Whether the all-reduce has finished, without waiting or driving it (the
    /// progress thread does); its error if it failed.
    pub fn test(&self) -> Result<bool> {
        self.engine.test(self.seq)
    }

    /// The operation's sequence number (the same on every rank).
    pub fn sequence(&self) -> u64 {
        self.seq
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if !matches!(
            self.engine.wait(self.seq, Some(self.engine.timeout)),
            Ok(true) | Err(_)
        ) {
            self.engine.fail(Error::timeout(
                format!("all-reduce #{} (dropped while running)", self.seq),
                self.engine.timeout,
            ));
        }
        self.engine.works.give_back(self.seq);
    }
}
