//! The collectives a [`Communicator`] enqueues: reduce-scatter, all-gather,
//! all-reduce, reduce and broadcast, each checked (lengths, roots, the
//! stream's and buffers' device) and enqueued through one path.

use super::*;

impl Communicator {
    /// Enqueues an in-place reduce-scatter on `stream`: `buffer` holds `size`
    /// equal chunks; afterwards chunk `rank` holds the reduction of every rank's
    /// chunk `rank` (the rest is left as NCCL leaves it). `buffer`'s length must
    /// be a multiple of `size` elements.
    pub fn reduce_scatter_in_place(
        &self,
        stream: &Stream,
        buffer: &mut DeviceSliceMut<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let chunk = self.chunk_bytes(buffer.len(), dtype, "reduce-scatter buffer")?;
        let own = buffer.raw() + u64::from(self.rank) * chunk as u64;
        self.reduce_scatter_raw(stream, buffer.device(), buffer.raw(), own, chunk, dtype, op)
    }

    /// Enqueues an in-place all-gather on `stream`: chunk `rank` of `buffer` is
    /// this rank's contribution; afterwards chunk `i` holds rank `i`'s.
    pub fn all_gather_in_place(
        &self,
        stream: &Stream,
        buffer: &mut DeviceSliceMut<'_>,
        dtype: DataType,
    ) -> Result<()> {
        let chunk = self.chunk_bytes(buffer.len(), dtype, "all-gather buffer")?;
        let own = buffer.raw() + u64::from(self.rank) * chunk as u64;
        self.all_gather_raw(stream, buffer.device(), own, buffer.raw(), chunk, dtype)
    }

    /// Enqueues a reduce-scatter of `send` (`size` chunks) into `recv` (one
    /// chunk) on `stream`.
    pub fn reduce_scatter(
        &self,
        stream: &Stream,
        send: DeviceSlice<'_>,
        recv: &mut DeviceSliceMut<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let chunk = self.chunk_bytes(send.len(), dtype, "reduce-scatter input")?;
        check_length("reduce-scatter output", recv.len(), chunk)?;
        self.device
            .check_same("reduce-scatter input", send.device())?;
        self.reduce_scatter_raw(
            stream,
            recv.device(),
            send.raw(),
            recv.raw(),
            chunk,
            dtype,
            op,
        )
    }

    /// Enqueues an all-gather of `send` (one chunk) into `recv` (`size` chunks)
    /// on `stream`.
    pub fn all_gather(
        &self,
        stream: &Stream,
        send: DeviceSlice<'_>,
        recv: &mut DeviceSliceMut<'_>,
        dtype: DataType,
    ) -> Result<()> {
        let chunk = self.chunk_bytes(recv.len(), dtype, "all-gather output")?;
        check_length("all-gather input", send.len(), chunk)?;
        self.device.check_same("all-gather input", send.device())?;
        self.all_gather_raw(stream, recv.device(), send.raw(), recv.raw(), chunk, dtype)
    }

    /// Enqueues an in-place all-reduce of `buffer` on `stream`: afterwards
    /// every rank's `buffer` holds the reduction of every rank's.
    pub fn all_reduce_in_place(
        &self,
        stream: &Stream,
        buffer: &mut DeviceSliceMut<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let nccl_op = reduce_op(op, dtype)?;
        let count = count_of(buffer.len(), dtype, "all-reduce buffer")?;
        let at = buffer.raw();
        let nccl_type = data_type(dtype)?;
        self.enqueue(
            stream,
            buffer.device(),
            "ncclAllReduce",
            |comm, raw_stream| {
                // SAFETY: `at` holds `count` elements on this device, valid until the
                // stream passes the call (the view's contract); in place is allowed;
                // the handle is live and locked.
                unsafe {
                    sys::ncclAllReduce(
                        at as *const _,
                        at as *mut _,
                        count,
                        nccl_type,
                        nccl_op,
                        comm,
                        raw_stream,
                    )
                }
            },
        )
    }

    /// Enqueues an in-place reduce onto rank `root` on `stream`: afterwards
    /// `root`'s `buffer` holds the reduction of every rank's; the others'
    /// are only read. Every rank passes a buffer of the same length.
    pub fn reduce_in_place(
        &self,
        stream: &Stream,
        buffer: &mut DeviceSliceMut<'_>,
        dtype: DataType,
        op: ReduceOp,
        root: u32,
    ) -> Result<()> {
        let nccl_op = reduce_op(op, dtype)?;
        let count = count_of(buffer.len(), dtype, "reduce buffer")?;
        let root = root_of(root, self.size)?;
        let at = buffer.raw();
        let nccl_type = data_type(dtype)?;
        self.enqueue(stream, buffer.device(), "ncclReduce", |comm, raw_stream| {
            // SAFETY: as in `all_reduce_in_place`; NCCL writes only the root's.
            unsafe {
                sys::ncclReduce(
                    at as *const _,
                    at as *mut _,
                    count,
                    nccl_type,
                    nccl_op,
                    root,
                    comm,
                    raw_stream,
                )
            }
        })
    }

    /// Enqueues an in-place broadcast from rank `root` on `stream`:
    /// afterwards every rank's `buffer` holds `root`'s. Every rank passes a
    /// buffer of the same length.
    pub fn broadcast_in_place(
        &self,
        stream: &Stream,
        buffer: &mut DeviceSliceMut<'_>,
        dtype: DataType,
        root: u32,
    ) -> Result<()> {
        let count = count_of(buffer.len(), dtype, "broadcast buffer")?;
        let root = root_of(root, self.size)?;
        let at = buffer.raw();
        let nccl_type = data_type(dtype)?;
        self.enqueue(
            stream,
            buffer.device(),
            "ncclBroadcast",
            |comm, raw_stream| {
                // SAFETY: as in `all_reduce_in_place`; the root's is only read.
                unsafe {
                    sys::ncclBroadcast(
                        at as *const _,
                        at as *mut _,
                        count,
                        nccl_type,
                        root,
                        comm,
                        raw_stream,
                    )
                }
            },
        )
    }

    #[expect(clippy::too_many_arguments, reason = "NCCL's own argument list")]
    fn reduce_scatter_raw(
        &self,
        stream: &Stream,
        buffer_device: u32,
        send: u64,
        recv: u64,
        chunk: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let nccl_op = reduce_op(op, dtype)?;
        let count = chunk / elem_bytes(dtype);
        let nccl_type = data_type(dtype)?;
        self.enqueue(
            stream,
            buffer_device,
            "ncclReduceScatter",
            |comm, raw_stream| {
                // SAFETY: `send` holds `size * count`, `recv` `count` elements on this
                // device, valid until the stream passes the call (the views' contracts);
                // the handle is live and locked.
                unsafe {
                    sys::ncclReduceScatter(
                        send as *const _,
                        recv as *mut _,
                        count,
                        nccl_type,
                        nccl_op,
                        comm,
                        raw_stream,
                    )
                }
            },
        )
    }

    fn all_gather_raw(
        &self,
        stream: &Stream,
        buffer_device: u32,
        send: u64,
        recv: u64,
        chunk: usize,
        dtype: DataType,
    ) -> Result<()> {
        let count = chunk / elem_bytes(dtype);
        let nccl_type = data_type(dtype)?;
        self.enqueue(
            stream,
            buffer_device,
            "ncclAllGather",
            |comm, raw_stream| {
                // SAFETY: as in `reduce_scatter_raw`, with `send` holding `count` and
                // `recv` `size * count` elements.
                unsafe {
                    sys::ncclAllGather(
                        send as *const _,
                        recv as *mut _,
                        count,
                        nccl_type,
                        comm,
                        raw_stream,
                    )
                }
            },
        )
    }

    /// Enqueues `call` (NCCL's, named `name`) on `stream`, with the handle:
    /// checks placement, makes the device's context current, holds the lock,
    /// and waits while NCCL reports the call in progress.
    fn enqueue(
        &self,
        stream: &Stream,
        buffer_device: u32,
        name: &'static str,
        call: impl FnOnce(ncclComm_t, sys::cudaStream_t) -> ncclResult_t,
    ) -> Result<()> {
        let _bound = self.check_placement(stream, buffer_device)?;
        let handle = self.lock()?;
        let status = call(handle.0, stream.raw().cast());
        self.finish(&handle, name, status)
    }
}
