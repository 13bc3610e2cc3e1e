//! The collectives on host memory: the blocking typed forms, [`Communicator::scope`],
//! and the raw forms a runtime calls with pointers.

use super::*;

impl Communicator {
    /// All-reduces `data` in place and waits for it.
    pub fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.scope(|s| s.all_reduce(data, op)?.wait())
    }

    /// Copies `data` of rank `root` into `data` of every rank, and waits.
    pub fn broadcast<T: Element>(&self, data: &mut [T], root: u32) -> Result<()> {
        self.scope(|s| s.broadcast(data, root)?.wait())
    }

    /// Gathers every rank's `input` into `output` (rank `r`'s at
    /// `r * input.len()`), and waits. `output` holds `world_size` inputs.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.scope(|s| s.all_gather(input, output)?.wait())
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
        self.scope(|s| s.reduce_scatter(input, output, op)?.wait())
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.scope(|s| s.barrier()?.wait())
    }

    /// All-reduces every tensor of `tensors` in place, and waits.
    ///
    /// The tensors are packed, in list order, into fusion buffers of one full
    /// slice each ([`Fusion`]): many small tensors become few full all-reduces.
    pub fn all_reduce_coalesced<T: Element>(
        &self,
        tensors: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        check_op(op, T::DTYPE)?;
        let buffer_bytes = usize::try_from(self.slice_bytes()).unwrap_or(usize::MAX);
        fusion::all_reduce_list(self, tensors, op, buffer_bytes)
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
        check_pointer(data, count, dtype)?;
        let seq = self.submit(Request::all_reduce(data, count, dtype, op, algorithm))?;
        Ok(Work::new(&self.engine, seq, seq))
    }

    /// Starts a broadcast of `count` elements of `dtype` at `data` from rank
    /// `root` (see [`Scope::broadcast`]).
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_raw`], for `data`.
    pub unsafe fn broadcast_raw(
        &self,
        data: *mut u8,
        count: u64,
        dtype: DataType,
        root: u32,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.broadcast_raw_with(data, count, dtype, root, None) }
    }

    /// [`Communicator::broadcast_raw`] with `algorithm` (`None`: the
    /// communicator's).
    ///
    /// # Safety
    ///
    /// As [`Communicator::broadcast_raw`].
    pub(super) unsafe fn broadcast_raw_with(
        &self,
        data: *mut u8,
        count: u64,
        dtype: DataType,
        root: u32,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        self.check_root(root)?;
        check_pointer(data, count, dtype)?;
        let bytes = byte_len(count, dtype)?;
        // The all-reduce a broadcast otherwise runs as sums the other ranks'
        // zeros into the root's bytes, as does a relay over the machines inside
        // each; the relay over the ranks overwrites them.
        let summed = self.zero_fills(Collective::Broadcast, algorithm, bytes)?;
        if root != self.rank() && bytes > 0 && summed {
            // SAFETY: the caller guarantees `data` is valid for `bytes` bytes.
            unsafe { std::ptr::write_bytes(data, 0, bytes) };
        }
        // SAFETY: the caller keeps `data` valid and untouched until it finishes.
        unsafe {
            self.start(Request::broadcast(
                data, bytes, dtype, count, root, algorithm,
            ))
        }
    }

    /// Starts an all-gather of every rank's `count` elements of `dtype` at
    /// `input` into `output`, which holds `world_size * count` (see
    /// [`Scope::all_gather`]). `input` may lie anywhere, inside `output` too
    /// (at this rank's place, as an in-place all-gather passes it).
    ///
    /// # Safety
    ///
    /// `input` must be valid for reads of `count` elements until this call
    /// returns; `output` as `data` in [`Communicator::all_reduce_raw`], for
    /// `world_size * count` elements.
    pub unsafe fn all_gather_raw(
        &self,
        input: *const u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.all_gather_raw_with(input, output, count, dtype, None) }
    }

    /// [`Communicator::all_gather_raw`] with `algorithm` (`None`: the
    /// communicator's).
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_gather_raw`].
    pub(super) unsafe fn all_gather_raw_with(
        &self,
        input: *const u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        let total = self.times_world(count)?;
        check_pointer(input.cast_mut(), count, dtype)?;
        check_pointer(output, total, dtype)?;
        let n = byte_len(count, dtype)?;
        let bytes = byte_len(total, dtype)?;
        let at = self.rank() as usize * n;
        // As in a broadcast, only the sums need the zeros.
        let summed = self.zero_fills(Collective::AllGather, algorithm, bytes)?;
        if bytes > 0 {
            // SAFETY: the caller guarantees `output` spans `bytes` bytes, of
            // which this rank's place `at..at + n` is a part.
            let place = unsafe { output.add(at) };
            // SAFETY: `input` spans `n` readable bytes and `place` `n` writable
            // ones; `copy` allows them to overlap. The input is in place before
            // the rest of `output` (where it may also lie) is zeroed.
            unsafe { std::ptr::copy(input, place, n) };
            if summed {
                // SAFETY: `0..at` lies within `output`.
                unsafe { std::ptr::write_bytes(output, 0, at) };
                // SAFETY: `at + n <= bytes`: the end of this rank's place.
                let rest = unsafe { place.add(n) };
                // SAFETY: `at + n..bytes` lies within `output`; `rest` is its start.
                unsafe { std::ptr::write_bytes(rest, 0, bytes - at - n) };
            }
        }
        // SAFETY: the caller keeps `output` valid and untouched until it finishes.
        unsafe { self.start(Request::all_gather(output, bytes, dtype, count, algorithm)) }
    }

    /// Starts a reduce-scatter: `input` holds `world_size * count` elements of
    /// `dtype`, reduced across ranks; this rank's `count` of the result are
    /// copied into `output` when it finishes. `input` is workspace (see
    /// [`Scope::reduce_scatter`]).
    ///
    /// # Safety
    ///
    /// As `data` in [`Communicator::all_reduce_raw`], for `input` and for
    /// `output`, which must not overlap.
    pub unsafe fn reduce_scatter_raw(
        &self,
        input: *mut u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.reduce_scatter_raw_with(input, output, count, dtype, op, None) }
    }

    /// [`Communicator::reduce_scatter_raw`] with `algorithm` (`None`: the
    /// communicator's).
    ///
    /// # Safety
    ///
    /// As [`Communicator::reduce_scatter_raw`].
    pub(super) unsafe fn reduce_scatter_raw_with(
        &self,
        input: *mut u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        let total = self.times_world(count)?;
        check_pointer(input, total, dtype)?;
        check_pointer(output, count, dtype)?;
        let n = byte_len(count, dtype)?;
        let share = self.share(n);
        let to = PlacedTensor::Host(HostTensor::new(output, n));
        let r = Request::reduce_scatter(input, total, dtype, op, count, to, share, algorithm);
        // SAFETY: the caller keeps `input` and `output` valid and untouched
        // until it finishes; the delivered range lies within `input`.
        unsafe { self.start(r) }
    }

    /// Whether the callers of a broadcast or an all-gather (`collective`) of
    /// `bytes` with `algorithm` zero their tensors where their own bytes are
    /// not (see `engine::choice`).
    pub(super) fn zero_fills(
        &self,
        collective: Collective,
        algorithm: Option<Algorithm>,
        bytes: usize,
    ) -> Result<bool> {
        let call = choice::Call {
            collective,
            dtype: DataType::U8,
            bytes: bytes as u64,
            algorithm,
            wire: None,
        };
        Ok(choice::choose(call, &self.job())?.zero_fill)
    }

    /// The job, as the choice of what a call runs sees it.
    pub(super) fn job(&self) -> choice::Job {
        choice::Job {
            topology: self.topology,
            servers: self.servers,
            algorithm: self.algorithm,
            wire: self.wire,
        }
    }

    /// Refuses a root outside the job.
    pub(super) fn check_root(&self, root: u32) -> Result<()> {
        let world = self.world_size();
        if root >= world {
            return Err(Error::invalid(
                "root",
                format!("rank {root} is not in a job of {world} ranks"),
            ));
        }
        Ok(())
    }

    /// This rank's bytes of a reduce-scatter's input, of `n` bytes per rank.
    pub(super) fn share(&self, n: usize) -> Range<usize> {
        let offset = self.rank() as usize * n;
        offset..offset + n
    }

    /// `count` elements per rank, for every rank.
    pub(super) fn times_world(&self, count: u64) -> Result<u64> {
        let world = u64::from(self.world_size());
        count.checked_mul(world).ok_or_else(|| {
            Error::invalid(
                "count",
                format!("{count} elements x {world} ranks overflow"),
            )
        })
    }

    /// Starts an all-reduce of every `(data, count)` in `tensors`, all of
    /// `dtype`, one operation each and all in flight at once; the returned
    /// [`Work`] covers them all.
    ///
    /// # Safety
    ///
    /// As `data` in [`Communicator::all_reduce_raw`], for every tensor; no two
    /// may overlap.
    pub unsafe fn all_reduce_coalesced_raw(
        &self,
        tensors: &[(*mut u8, u64)],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Work<'_>> {
        check_op(op, dtype)?;
        for (i, &(data, count)) in tensors.iter().enumerate() {
            check_pointer(data, count, dtype).map_err(|e| in_list(i, e))?;
        }
        self.group(tensors.len(), |i| {
            let (data, count) = tensors[i];
            // SAFETY: forwarded from the caller, per tensor.
            unsafe { self.all_reduce_raw(data, count, dtype, op, None) }
        })
    }

    /// Starts `n` operations, the `i`th with `start(i)`, and returns one
    /// [`Work`] covering them all. If one is refused (only a failed engine
    /// refuses after validation), those started are waited for and the error
    /// returned.
    pub(super) fn group<'c>(
        &'c self,
        n: usize,
        mut start: impl FnMut(usize) -> Result<Work<'c>>,
    ) -> Result<Work<'c>> {
        let mut range: Option<(u64, u64)> = None;
        for i in 0..n {
            match start(i) {
                Ok(w) => {
                    let seq = w.first;
                    // Its entry is given back by the group's `Work`.
                    std::mem::forget(w);
                    range = Some(range.map_or((seq, seq), |(a, _)| (a, seq)));
                }
                Err(e) => {
                    // Only a failed engine refuses here; the group started so
                    // far is waited for and its entries given back.
                    if let Some((first, last)) = range {
                        drop(Work::new(&self.engine, first, last));
                    }
                    return Err(e);
                }
            }
        }
        Ok(match range {
            Some((first, last)) => Work::new(&self.engine, first, last),
            None => Work::empty(&self.engine),
        })
    }

    /// Starts a barrier: its [`Work`] finishes once every rank has entered it.
    pub fn start_barrier(&self) -> Result<Work<'_>> {
        let mut r = Request::all_reduce(std::ptr::null_mut(), 1, DataType::U8, ReduceOp::Sum, None);
        r.collective = Collective::Barrier;
        // SAFETY: the engine substitutes the communicator's own barrier byte.
        unsafe { self.start(r) }
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
        let (first, last) = (work.first, work.last);
        std::mem::forget(work);
        Ok(OwnedWork {
            comm: Arc::clone(self),
            first,
            last,
        })
    }
}
