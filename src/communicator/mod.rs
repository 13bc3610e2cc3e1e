//! [`Communicator`]: the user-facing all-reduce.

mod call;
#[cfg(feature = "cuda")]
mod device_calls;
mod host;
mod lowering;
mod point_to_point;
mod prelude;
mod scope;
mod start;
mod submit;
mod tensor;
mod work;

pub use crate::engine::descriptor::Collective;
pub use call::{Call, Memory, Options};
pub use scope::Scope;
pub use tensor::{Tensor, TensorMut};
pub use work::{OwnedWork, Work};

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fairring_core::reduce::Element;
use fairring_core::topology::{Location, Topology};
use fairring_core::{DataType, ReduceOp, WireFormat};

use crate::bootstrap::job_id::{self, JobId};
use crate::bootstrap::{self, start_progress, stop_progress};
use crate::config::{Algorithm, Config, FabricChoice};
use crate::engine::links::Traffic;
use crate::engine::work_table::{Delivery, Submission, WORK_CAPACITY, slot_of};
use crate::engine::{Engine, choice};
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::memory::DeviceTensor;
use crate::memory::{HostTensor, Placed, PlacedTensor};
use crate::store::{PrefixStore, Store, TcpStoreServer};
use crate::sync::unmodelled::AtomicU8;
use fairring_rdma::any::AnyFabric;
#[cfg(feature = "cuda")]
use lowering::byte_len;
use lowering::check_op;
pub(crate) use lowering::check_pointer;
use point_to_point::PointToPoint;
use submit::*;
use work::Covers;
#[cfg(feature = "cuda")]
use work::wait_range;

/// The engine a communicator runs: host (and, with the `cuda` feature, device)
/// memory, on the fabric chosen at run time.
pub(crate) type WorkerEngine = Engine<AnyFabric, Placed>;

/// A group of ranks that all-reduce together.
///
/// Every rank of the job builds one (collectively: construction rendezvouses) and
/// then issues the same operations in the same order.
///
/// ```no_run
/// use fairring::{Algorithm, Communicator, ReduceOp};
///
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1 << 20];
/// let mut more = vec![2.0f32; 1 << 20];
/// comm.scope(|s| -> fairring::Result<()> {
///     let a = s.all_reduce(&mut grads, ReduceOp::Sum, ())?;
///     let b = s.all_reduce(&mut more, ReduceOp::Avg, Algorithm::Ring)?; // in flight with `a`
///     a.wait()?;
///     b.wait()
/// })?;
/// # Ok::<(), fairring::Error>(())
/// ```
pub struct Communicator {
    engine: Arc<WorkerEngine>,
    progress: Option<JoinHandle<()>>,
    /// The next operation's sequence number; held while submitting, so that one
    /// rank's operations are numbered in the order they are queued.
    next_seq: Mutex<u64>,
    topology: Topology,
    location: Location,
    algorithm: Algorithm,
    wire: WireFormat,
    servers: u32,
    /// Whether the machines serve all-reduces themselves beside dedicated
    /// servers (`FAIRRING_MACHINES_SERVE`).
    machines_serve: crate::MachinesServe,
    timeout: Duration,
    /// The byte each barrier all-reduces, per operation-table entry.
    barrier_bytes: Box<[AtomicU8]>,
    /// Makes the machine's NCCL communicators at the first device operation.
    #[cfg(feature = "cuda")]
    nccl: crate::local::NcclSetup,
    // Dropped last: other ranks may still be reading the store while this one
    // tears down. The job's keys, scoped as the rendezvous scoped them.
    #[cfg_attr(
        not(feature = "cuda"),
        expect(dead_code, reason = "read by the NCCL set-up")
    )]
    store: PrefixStore<Arc<dyn Store>>,
    /// Point-to-point messages' own state: the gate, the linker, the pool
    /// (`point_to_point`).
    pub(crate) p2p: Arc<PointToPoint>,
    _server: Option<TcpStoreServer>,
}

impl Communicator {
    /// Joins the job torchrun's environment describes (see [`Config`]).
    pub fn from_env() -> Result<Communicator> {
        Communicator::new(Config::from_env()?)
    }

    /// Joins the job of `config`, meeting through the TCP store rank 0 serves, or,
    /// under torchrun's agent store, through PyTorch's TCPStore that torchrun
    /// serves at the same address.
    pub fn new(config: Config) -> Result<Communicator> {
        refuse_server(&config)?;
        let (store, server) = bootstrap::job_store(&config)?;
        Communicator::build(config, store, server)
    }

    /// Joins the job of `id` (made by [`JobId::new`] in one process and handed
    /// to every rank by the host runtime) as rank `rank` of `world_size`,
    /// meeting through the store the id's maker serves; every other knob from
    /// the environment, as [`Config::from_env_with`] reads it, and `timeout`,
    /// where given, in place of `FAIRRING_TIMEOUT`. An id that cannot be
    /// joined (its maker has exited, or this machine cannot reach it) fails
    /// within the timeout, naming the id; one that was changed on the way
    /// fails at once, naming `id`.
    pub fn from_id(
        id: &JobId,
        rank: u32,
        world_size: u32,
        timeout: Option<Duration>,
    ) -> Result<Communicator> {
        if rank >= world_size {
            return Err(Error::invalid(
                "rank",
                format!("{rank} is not a rank of {world_size}"),
            ));
        }
        let parts = id.parts()?;
        let (ip, port) = (
            parts.address.ip().to_string(),
            parts.address.port().to_string(),
        );
        let (secret, run) = (parts.secret.to_hex(), parts.run_id());
        let config = Config::for_group(rank, world_size, timeout, |name| match name {
            "MASTER_ADDR" => Some(ip.clone()),
            "MASTER_PORT" => Some(port.clone()),
            "FAIRRING_JOB_SECRET" => Some(secret.clone()),
            "TORCHELASTIC_RUN_ID" => Some(run.clone()),
            _ => std::env::var(name).ok(),
        })?;
        refuse_server(&config)?;
        // The maker's process serves the store; its communicator keeps it.
        let server = job_id::take_served(&parts.nonce);
        let store = bootstrap::connect_store(&config).map_err(|e| {
            Error::store(
                "joining by id",
                format!(
                    "{id:?}: {e} (an id whose maker has exited, or whose machine this one \
                     cannot reach)"
                ),
            )
        })?;
        Communicator::build(config, Arc::new(store), server)
    }

    /// Joins the job of `config`, meeting through `store` (for instance the host
    /// runtime's own store).
    pub fn with_store(config: Config, store: Arc<dyn Store>) -> Result<Communicator> {
        refuse_server(&config)?;
        Communicator::build(config, store, None)
    }

    /// Joins the job through `store`; this process serves the store where
    /// `server` is given, and keeps serving it while the communicator lives.
    /// Where joining fails, the server first lets its clients read what is
    /// set and tells those left waiting why this rank failed
    /// ([`TcpStoreServer::close_failed`]), so that every rank ends with an
    /// error naming the cause rather than a closed store.
    fn build(
        config: Config,
        store: Arc<dyn Store>,
        server: Option<TcpStoreServer>,
    ) -> Result<Communicator> {
        let (rank, timeout) = (config.rank, config.timeout);
        match Communicator::join(config, store) {
            Ok(mut communicator) => {
                communicator._server = server;
                Ok(communicator)
            }
            Err(e) => {
                if let Some(server) = server {
                    server.close_failed(rank, &e.to_string(), timeout.min(FAILED_STORE_LINGER));
                }
                Err(e)
            }
        }
    }

    /// [`Communicator::build`] up to the store's server.
    fn join(config: Config, store: Arc<dyn Store>) -> Result<Communicator> {
        let scoped = bootstrap::scoped(&config, &store);
        let p2p = PointToPoint::new(&config, Arc::clone(&store));
        let built = bootstrap::build(&config, &scoped)?;
        #[cfg(feature = "cuda")]
        let nccl = crate::local::NcclSetup {
            cell: built.nccl,
            choice: config.device_local,
            machine: built.location.machine,
            local_rank: built.location.device,
            local_ranks: built.topology.devices_per_machine(),
            rank: built
                .topology
                .rank(built.location)
                .map_err(|e| Error::internal("a rank's location is in its job", e.to_string()))?,
            world: built.topology.world_size(),
            across_job: if crate::engine::nccl_across_job_may_run(built.topology) {
                config.nccl_across_machines
            } else {
                crate::NcclAcrossMachines::Off
            },
            // Whatever FAIRRING_MACHINES_SERVE says, so that a worker set
            // otherwise fails as a mismatch of calls, not a wait.
            agree_on_switches: config.servers > 0,
            timeout: config.timeout,
            making: Mutex::new(()),
        };
        #[cfg(not(feature = "cuda"))]
        if let Some(ordinal) = config.device {
            return Err(Error::config(
                "FAIRRING_DEVICE",
                ordinal,
                "this build of fairring has no device calls (the `cuda` feature)",
            ));
        }
        let engine = Arc::new(built.engine);
        p2p.attach(&engine);
        let progress = start_progress(&engine, format!("fairring-progress-{}", config.rank))?;
        let communicator = Communicator {
            engine,
            progress: Some(progress),
            next_seq: Mutex::new(0),
            topology: built.topology,
            location: built.location,
            algorithm: config.algorithm,
            wire: config.wire,
            servers: config.servers,
            machines_serve: config.machines_serve,
            timeout: config.timeout,
            barrier_bytes: (0..WORK_CAPACITY).map(|_| AtomicU8::new(0)).collect(),
            #[cfg(feature = "cuda")]
            nccl,
            store: scoped,
            p2p,
            _server: None,
        };
        // What cannot be enqueued is done now, before any stream can wait
        // for an operation of this communicator.
        #[cfg(feature = "cuda")]
        if let Some(ordinal) = config.device {
            communicator.device_side(ordinal)?;
        }
        Ok(communicator)
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.engine.rank()
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> u32 {
        self.engine.world()
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

    /// The fabric this rank runs on: [`FabricChoice::Tcp`] or
    /// [`FabricChoice::Verbs`] (`auto` resolved).
    pub fn fabric(&self) -> FabricChoice {
        bootstrap::choice_of(&self.engine.links.fabric)
    }

    /// The data bytes this rank's fabric has written into peers and received
    /// from them so far (see [`Traffic`]), its point-to-point messages'
    /// included.
    pub fn traffic(&self) -> Traffic {
        self.engine.links.traffic()
    }

    /// Dedicated reduction servers in the job (0: the machines serve).
    pub fn servers(&self) -> u32 {
        self.servers
    }

    /// How `f32` all-reduces and reduce-scatters travel between machines
    /// unless a call says otherwise (`FAIRRING_WIRE`).
    pub fn wire(&self) -> WireFormat {
        self.wire
    }

    /// Largest slice, in bytes.
    pub fn slice_bytes(&self) -> u64 {
        self.engine.geometry.full_slice_bytes()
    }

    /// Fails every operation and message in flight and every later one with
    /// [`Error::Aborted`], and wakes every waiter. Callable from any thread.
    pub fn abort(&self) {
        self.engine.fail(Error::Aborted);
        self.p2p.abort();
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Messages first: their linker uses the job's store.
        self.p2p.close();
        let operations = *self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        // What is still in flight finishes (a stream may wait for it) while
        // the progress thread still drives.
        self.engine.finish_in_flight(operations, self.timeout);
        stop_progress(&self.engine, &mut self.progress);
        self.engine.say_goodbye(operations);
    }
}

/// Most a rank that failed to join keeps serving the job's store, for its
/// peers to read what they need to reach their own verdict (bounded further
/// by the job's timeout).
const FAILED_STORE_LINGER: Duration = Duration::from_secs(10);

/// A communicator is a worker; a server's configuration runs a [`Server`].
fn refuse_server(config: &Config) -> Result<()> {
    match config.role {
        crate::config::Role::Worker => Ok(()),
        crate::config::Role::Server(i) => Err(Error::config(
            "FAIRRING_ROLE",
            format!("server (FAIRRING_SERVER_RANK={i})"),
            "a dedicated server runs as fairring::Server (the fairring-server binary), not \
             as a Communicator",
        )),
    }
}
