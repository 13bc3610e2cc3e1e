//! The blocking typed forms on host memory, [`Communicator::scope`], and the
//! checks every call shares.

use super::*;

impl Communicator {
    /// All-reduces `data` in place and waits for it.
    pub fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.scope(|s| s.all_reduce(data, op, ())?.wait())
    }

    /// Copies `data` of rank `root` into `data` of every rank, and waits.
    pub fn broadcast<T: Element>(&self, data: &mut [T], root: u32) -> Result<()> {
        self.scope(|s| s.broadcast(data, root, ())?.wait())
    }

    /// Gathers every rank's `input` into `output` (rank `r`'s at
    /// `r * input.len()`), and waits. `output` holds `world_size` inputs.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.scope(|s| s.all_gather(input, output, ())?.wait())
    }

    /// Reduces `input` across ranks and leaves share `rank` of the result in
    /// `output`, and waits. `input` holds `world_size` shares of `output.len()`
    /// elements and is used as workspace: afterwards its share `rank` holds the
    /// result too, and the rest is unspecified.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &mut [T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.scope(|s| s.reduce_scatter(input, output, op, ())?.wait())
    }

    /// Reduces every rank's `input` with `op` into `output` of rank `root`,
    /// and waits. Elsewhere `output` (as long as `input`) is workspace,
    /// unspecified afterwards. Large ones between machines of one rank each
    /// run as a chain of messages (see [`Call::reduce`]).
    pub fn reduce<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: u32,
    ) -> Result<()> {
        self.scope(|s| s.reduce(input, output, op, root, ())?.wait())
    }

    /// Gathers every rank's `input` into `output` of rank `root` (rank `r`'s
    /// at `r * input.len()`), and waits. `output` holds `world_size` inputs on
    /// every rank; elsewhere than the root it is workspace. Each rank's part
    /// moves once, as a message to the root (see [`Call::gather`]).
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: u32) -> Result<()> {
        self.scope(|s| s.gather(input, output, root, ())?.wait())
    }

    /// Scatters rank `root`'s `input` (`world_size` parts of `output.len()`
    /// elements): part `r` into `output` of rank `r`, bit for bit, and waits.
    /// `input` is workspace on every rank. Each part moves once, as a message
    /// from the root (see [`Call::scatter`]).
    pub fn scatter<T: Element>(&self, input: &mut [T], output: &mut [T], root: u32) -> Result<()> {
        self.scope(|s| s.scatter(input, output, root, ())?.wait())
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.scope(|s| s.barrier()?.wait())
    }

    /// All-reduces every tensor of `tensors` in place, and waits.
    ///
    /// The tensors are packed, in list order, into fusion buffers of one full
    /// slice each ([`Fusion`](crate::Fusion)): many small tensors become few full all-reduces.
    /// (A coalesced all-reduce, [`Scope::all_reduce_coalesced`], runs one
    /// operation per tensor under one [`Work`] instead.)
    pub fn all_reduce_fused<T: Element>(
        &self,
        tensors: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        check_op(op, T::DTYPE)?;
        let buffer_bytes = usize::try_from(self.slice_bytes()).unwrap_or(usize::MAX);
        crate::fusion::all_reduce_list(self, tensors, op, buffer_bytes)
    }

    /// Runs `f` with a [`Scope`] in which operations run asynchronously; when `f`
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

    /// The job, as the choice of what a call runs sees it.
    pub(super) fn job(&self) -> choice::Job {
        choice::Job {
            topology: self.topology,
            servers: self.servers,
            routing: self.engine.geometry.routing(),
            algorithm: self.algorithm,
            wire: self.wire,
            nccl_over_workers: self.nccl_over_workers(),
            machines_serve: self.machines_serve,
            gpus_in_switch: self.gpus_in_switch(),
            machines_can_serve: self.engine.machines_can_serve(),
            groups_for_small_tensors: self.engine.groups_for_small_tensors(),
        }
    }

    /// Whether every worker's GPU reduces in its NVSwitch and the machines'
    /// ranks reduce through NCCL: settled alike on every rank when its
    /// device side was made, where the job has dedicated servers and
    /// `FAIRRING_MACHINES_SERVE` is `auto`.
    fn gpus_in_switch(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            matches!(self.nccl.cell.get(), Some(Ok(Some(comms))) if comms.gpus_in_switch())
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Whether one NCCL all-reduce can reduce a device tensor over every
    /// worker: the job's communicator was made, or the workers are one
    /// machine beside dedicated servers and the machine's communicators
    /// were made (settled alike on every rank when its device side was
    /// made).
    fn nccl_over_workers(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            matches!(
                self.nccl.cell.get(),
                Some(Ok(Some(comms)))
                    if comms.across_job()
                        || crate::engine::nccl_beside_servers(self.topology, self.servers)
            )
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Refuses a list named `argument` of `total` elements that is not
    /// `world_size` lists of `n` (the other list, named `per_rank`).
    pub(super) fn check_shares(
        &self,
        argument: &'static str,
        total: u64,
        n: u64,
        per_rank: &'static str,
    ) -> Result<()> {
        let world = u64::from(self.world_size());
        if n.checked_mul(world) != Some(total) {
            return Err(Error::invalid(
                argument,
                format!(
                    "holds {total} elements; {world} ranks x {n} {per_rank} elements need {}",
                    n.saturating_mul(world)
                ),
            ));
        }
        Ok(())
    }

    /// Turns `work`, started on this communicator, into an [`OwnedWork`] that
    /// keeps the communicator alive: for runtimes that track operations by
    /// handle (the C ABI). The memory contract of the call that started it
    /// stays the caller's.
    pub fn own(self: &Arc<Self>, work: Work<'_>) -> Result<OwnedWork> {
        if !std::ptr::eq(work.engine, Arc::as_ptr(&self.engine)) {
            return Err(Error::invalid(
                "work",
                "was started on another communicator",
            ));
        }
        let mut work = work;
        // The work, left covering nothing, drops without waiting.
        let covers = std::mem::replace(&mut work.covers, Covers::nothing());
        Ok(OwnedWork {
            comm: Arc::clone(self),
            covers,
        })
    }
}
