//! [`Scope`]: asynchronous operations that may borrow data for the scope.

use super::*;

/// Where asynchronous all-reduces live: see [`Communicator::scope`]. Operations
/// may borrow data for `'scope`; the scope ends only when all have finished.
pub struct Scope<'scope, 'env: 'scope> {
    pub(super) comm: &'env Communicator,
    pub(super) first: u64,
    pub(super) _scope: PhantomData<&'scope mut &'scope ()>,
}

impl<'scope> Scope<'scope, '_> {
    /// Starts an all-reduce of `data` in place with `options`: an
    /// [`Algorithm`], a [`WireFormat`], [`Options`], or `()` for the
    /// communicator's own. Every rank must ask alike.
    ///
    /// `data` is a host slice (`&mut v`, `&mut v[..]`), or, with the `cuda`
    /// feature, device memory ordered on a stream (`TensorMut::device`); so
    /// are every collective's tensors.
    pub fn all_reduce(
        &'scope self,
        data: impl Into<TensorMut<'scope>>,
        op: ReduceOp,
        options: impl Into<Options>,
    ) -> Result<Work<'scope>> {
        let data = data.into();
        let d = data.place();
        let call = d.placed(Call::all_reduce(d.at, d.count, d.dtype, op));
        // SAFETY: `data` is borrowed mutably for 'scope, which outlasts the
        // operation (`finish` waits, even for a leaked `Work`); it is valid,
        // aligned and of `count` elements (checked when the tensor was made).
        unsafe { self.comm.start(&call.with(options)) }
    }

    /// Starts a broadcast of `data` from rank `root` (see
    /// [`Communicator::broadcast`]) with `options`: an
    /// [`Algorithm`], a [`WireFormat`], [`Options`], or `()` for the
    /// communicator's own. Every rank must ask alike. On device memory,
    /// every rank but the root zeroes `data` on its stream first.
    ///
    /// With [`Algorithm::Ring`] it is a pipelined chain from the root around the
    /// ring, each byte sent once per hop. With [`Algorithm::Hierarchical`] it
    /// runs as a byte-wise wrapping-sum all-reduce to which every rank but the
    /// root contributes zeros, at twice the bytes per rank. `auto` picks the
    /// chain on two or three machines, and on more from 256 KiB (the rules of
    /// `engine::choice`, in the `FAIRRING_ALGO` row of docs/manual.md). Both are exact
    /// for every type (NaN payloads and negative zeros included).
    pub fn broadcast(
        &'scope self,
        data: impl Into<TensorMut<'scope>>,
        root: u32,
        options: impl Into<Options>,
    ) -> Result<Work<'scope>> {
        let data = data.into();
        let d = data.place();
        let call = d.placed(Call::broadcast(d.at, d.count, d.dtype, root));
        // SAFETY: `data` is borrowed mutably for 'scope, which outlasts the
        // operation (`finish` waits); it is valid and aligned for its length.
        unsafe { self.comm.start(&call.with(options)) }
    }

    /// Starts an all-gather of every rank's `input` into `output` (see
    /// [`Communicator::all_gather`]) with `options`: an
    /// [`Algorithm`], a [`WireFormat`], [`Options`], or `()` for the
    /// communicator's own. Every rank must ask alike.
    ///
    /// With [`Algorithm::Ring`] each rank's input goes around the ring, sent
    /// once per hop. With [`Algorithm::Hierarchical`] it is a byte-wise sum over
    /// `output` to which each rank contributes its input at its offset and
    /// zeros elsewhere, at twice the bytes per rank. `auto` picks the ring on
    /// two or three machines, and on more from 256 KiB (the
    /// `FAIRRING_ALGO` row of docs/manual.md). Both are exact for every type.
    pub fn all_gather(
        &'scope self,
        input: impl Into<Tensor<'scope>>,
        output: impl Into<TensorMut<'scope>>,
        options: impl Into<Options>,
    ) -> Result<Work<'scope>> {
        let (input, output) = (input.into(), output.into());
        let (i, o) = (input.place(), output.place());
        i.check_alike("output", o)?;
        self.comm
            .check_shares("output", o.count, i.count, "input")?;
        let call = o.placed(Call::all_gather(i.at, o.at, i.count, i.dtype));
        // SAFETY: `input` is borrowed for 'scope (its copy into place may be
        // enqueued on a stream) and `output` mutably, spanning `world * n`
        // elements (checked above).
        unsafe { self.comm.start(&call.with(options)) }
    }

    /// Starts a reduce-scatter (see [`Communicator::reduce_scatter`]): `input`
    /// reduced across ranks, this rank's share of it copied into `output` when
    /// it finishes. `input` is workspace: afterwards this rank's share of it
    /// holds the result too, and the rest is unspecified.
    ///
    /// With [`Algorithm::Ring`] each share goes around the ring once, reduced
    /// on the way to its rank: `(N-1)/N` of the input leaves each rank. With
    /// [`Algorithm::Hierarchical`] or [`Algorithm::Doubling`] it is an
    /// all-reduce of the whole input, twice the bytes. `auto` picks the ring
    /// on one machine of several ranks, on two or three machines, and on more
    /// from 256 KiB, with or without dedicated servers (the `FAIRRING_ALGO`
    /// row of docs/manual.md).
    ///
    /// `options`: an [`Algorithm`], a [`WireFormat`], [`Options`], or `()` for the
    /// communicator's own. Every rank must ask alike.
    pub fn reduce_scatter(
        &'scope self,
        input: impl Into<TensorMut<'scope>>,
        output: impl Into<TensorMut<'scope>>,
        op: ReduceOp,
        options: impl Into<Options>,
    ) -> Result<Work<'scope>> {
        let (input, output) = (input.into(), output.into());
        let (i, o) = (input.place(), output.place());
        i.check_alike("output", o)?;
        self.comm
            .check_shares("input", i.count, o.count, "output")?;
        let call = i.placed(Call::reduce_scatter(i.at, o.at, o.count, i.dtype, op));
        // SAFETY: both are borrowed mutably for 'scope (so they do not overlap)
        // and have the lengths checked above.
        unsafe { self.comm.start(&call.with(options)) }
    }

    /// Starts a reduce to rank `root` (see [`Communicator::reduce`]): every
    /// rank's `input` reduced with `op` into the root's `output`; elsewhere
    /// `output` is workspace. Runs as an all-reduce.
    ///
    /// `options`: an [`Algorithm`], a [`WireFormat`], [`Options`], or `()` for the
    /// communicator's own. Every rank must ask alike.
    pub fn reduce(
        &'scope self,
        input: impl Into<Tensor<'scope>>,
        output: impl Into<TensorMut<'scope>>,
        op: ReduceOp,
        root: u32,
        options: impl Into<Options>,
    ) -> Result<Work<'scope>> {
        let (input, output) = (input.into(), output.into());
        let (i, o) = (input.place(), output.place());
        i.check_alike("output", o)?;
        if o.count != i.count {
            return Err(Error::invalid(
                "output",
                format!("holds {} elements; the input holds {}", o.count, i.count),
            ));
        }
        let call = o.placed(Call::reduce(i.at, o.at, i.count, i.dtype, op, root));
        // SAFETY: `input` is borrowed for 'scope and `output` mutably (so
        // they do not overlap), both of `n` elements.
        unsafe { self.comm.start(&call.with(options)) }
    }

    /// Starts a gather to rank `root` (see [`Communicator::gather`]): every
    /// rank's `input` into the root's `output` (rank `r`'s at `r *
    /// input.len()`); elsewhere `output` is workspace. Runs as an all-gather.
    ///
    /// `options`: an [`Algorithm`], a [`WireFormat`], [`Options`], or `()` for the
    /// communicator's own. Every rank must ask alike.
    pub fn gather(
        &'scope self,
        input: impl Into<Tensor<'scope>>,
        output: impl Into<TensorMut<'scope>>,
        root: u32,
        options: impl Into<Options>,
    ) -> Result<Work<'scope>> {
        let (input, output) = (input.into(), output.into());
        let (i, o) = (input.place(), output.place());
        i.check_alike("output", o)?;
        self.comm
            .check_shares("output", o.count, i.count, "input")?;
        let call = o.placed(Call::gather(i.at, o.at, i.count, i.dtype, root));
        // SAFETY: `input` is borrowed for 'scope; `output` is borrowed mutably
        // for 'scope and spans `world * n` elements (checked above).
        unsafe { self.comm.start(&call.with(options)) }
    }

    /// Starts a scatter from rank `root` (see [`Communicator::scatter`]):
    /// part `r` of the root's `input` into rank `r`'s `output`. `input` is
    /// workspace on every rank (see [`Call::scatter`]).
    ///
    /// `options`: an [`Algorithm`], a [`WireFormat`], [`Options`], or `()` for the
    /// communicator's own. Every rank must ask alike.
    pub fn scatter(
        &'scope self,
        input: impl Into<TensorMut<'scope>>,
        output: impl Into<TensorMut<'scope>>,
        root: u32,
        options: impl Into<Options>,
    ) -> Result<Work<'scope>> {
        let (input, output) = (input.into(), output.into());
        let (i, o) = (input.place(), output.place());
        i.check_alike("output", o)?;
        self.comm
            .check_shares("input", i.count, o.count, "output")?;
        let call = i.placed(Call::scatter(i.at, o.at, o.count, i.dtype, root));
        // SAFETY: both are borrowed mutably for 'scope (so they do not
        // overlap) and have the lengths checked above.
        unsafe { self.comm.start(&call.with(options)) }
    }

    /// Starts a barrier: its [`Work`] finishes once every rank has entered it.
    pub fn barrier(&'scope self) -> Result<Work<'scope>> {
        // SAFETY: a barrier touches no memory of the caller's.
        unsafe { self.comm.start(&Call::barrier()) }
    }

    /// Starts a coalesced all-reduce: every tensor in `tensors`, one operation
    /// each, all in flight at once; the returned [`Work`] covers them all.
    /// Every tensor is checked before any starts. (The blocking
    /// [`Communicator::all_reduce_fused`] packs host tensors into fusion
    /// buffers instead.)
    pub fn all_reduce_coalesced<T: Into<TensorMut<'scope>>>(
        &'scope self,
        tensors: impl IntoIterator<Item = T>,
        op: ReduceOp,
    ) -> Result<Work<'scope>> {
        let calls: Vec<Call> = tensors
            .into_iter()
            .map(|t| {
                let t = t.into();
                let d = t.place();
                d.placed(Call::all_reduce(d.at, d.count, d.dtype, op))
            })
            .collect();
        // SAFETY: every tensor is borrowed mutably for 'scope (so none overlap),
        // valid and aligned for its length.
        unsafe { self.comm.start_list(&calls, |i| ("tensors", i)) }
    }

    pub(super) fn finish(&self) {
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
