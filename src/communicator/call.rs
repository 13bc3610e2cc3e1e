//! [`Call`]: one description of any call (a collective, a send or a
//! receive), which [`Communicator::start`] starts. Every other entry (the
//! blocking forms, [`Scope`]'s borrowing forms, the posted messages, the C
//! ABI) fills one in and starts it.

use super::*;

/// What a call may ask for beyond its collective: every collective takes the
/// same options. `None` is the communicator's (its [`Config`]). Every rank
/// must ask alike (the descriptor check compares what runs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// The algorithm to run (`auto` included); see [`Algorithm`].
    pub algorithm: Option<Algorithm>,
    /// The format values cross between machines in. A compressed wire
    /// carries `f32` only: asked for any other type, the call is refused,
    /// naming `wire`. Where it applies and would not otherwise run, `auto`
    /// keeps the hierarchical algorithm (the rules of `engine::choice`).
    pub wire: Option<WireFormat>,
}

/// The communicator's own options.
impl From<()> for Options {
    fn from((): ()) -> Options {
        Options::default()
    }
}

impl From<WireFormat> for Options {
    fn from(wire: WireFormat) -> Options {
        Options {
            algorithm: None,
            wire: Some(wire),
        }
    }
}

impl From<Algorithm> for Options {
    fn from(algorithm: Algorithm) -> Options {
        Options {
            algorithm: Some(algorithm),
            wire: None,
        }
    }
}

/// Where a call's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory of this process.
    Host,
    /// Device memory of one GPU, ordered on `stream` (a stream of that GPU's
    /// primary context; null: the legacy default stream): the call starts
    /// after everything already enqueued there, and never makes the host wait
    /// for the GPU (see [`Work::enqueue_wait`]).
    #[cfg(feature = "cuda")]
    Device {
        /// The stream the call is ordered on.
        stream: crate::cuda::sys::CUstream,
    },
}

/// One call, described: which collective (or a send or a receive), on which
/// memory, of how many elements of which type, with which operator, root (or
/// peer and tag) and [`Options`].
/// Built by the constructor of its collective; started by
/// [`Communicator::start`] (one call) or [`Communicator::start_group`]
/// (several, one [`Work`]).
///
/// `count` is what one rank contributes: the whole tensor of an all-reduce, a
/// broadcast or a reduce, the input of an all-gather or a gather, the output of
/// a reduce-scatter or a scatter (whose input holds `world_size * count`).
///
/// ```no_run
/// use fairring::{Algorithm, Call, Communicator, DataType, ReduceOp};
///
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![0.5f32; 1 << 20];
/// let n = grads.len() as u64;
/// let call = Call::all_reduce(grads.as_mut_ptr().cast(), n, DataType::F32, ReduceOp::Sum)
///     .with(Algorithm::Ring);
/// // SAFETY: `grads` is neither touched nor freed until the work finishes.
/// let work = unsafe { comm.start(&call) }?;
/// work.wait()?;
/// # Ok::<(), fairring::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Which collective.
    pub collective: Collective,
    /// What the call reads: the tensor of an in-place call (all-reduce,
    /// broadcast), else the input.
    pub input: *const u8,
    /// What the call writes: the tensor of an in-place call, else the output.
    pub output: *mut u8,
    /// Elements per rank (see above).
    pub count: u64,
    /// The element type.
    pub dtype: DataType,
    /// The operator of an all-reduce, a reduce or a reduce-scatter.
    pub op: ReduceOp,
    /// The root of a broadcast, a reduce, a gather or a scatter.
    pub root: u32,
    /// The other rank of a send or a receive.
    pub peer: u32,
    /// The tag of a send or a receive: a peer's sends of one tag match this
    /// rank's receives of that tag in the order both were posted.
    pub tag: u32,
    /// Where `input` and `output` live.
    pub memory: Memory,
    /// The options.
    pub options: Options,
}

impl Call {
    /// An all-reduce with `op` of `count` elements of `dtype` at `data`, in
    /// place.
    pub fn all_reduce(data: *mut u8, count: u64, dtype: DataType, op: ReduceOp) -> Call {
        Call::in_place(Collective::AllReduce, data, count, dtype, op)
    }

    /// A broadcast of `count` elements of `dtype` at `data` from rank `root`,
    /// bit-exact for every type.
    pub fn broadcast(data: *mut u8, count: u64, dtype: DataType, root: u32) -> Call {
        Call {
            root,
            ..Call::in_place(Collective::Broadcast, data, count, dtype, ReduceOp::Sum)
        }
    }

    /// An all-gather of every rank's `count` elements of `dtype` at `input`
    /// into `output`, which holds `world_size * count`, rank `r`'s at
    /// `r * count`. `input` may lie at this rank's place in `output` (an
    /// in-place all-gather), and nowhere else in it.
    pub fn all_gather(input: *const u8, output: *mut u8, count: u64, dtype: DataType) -> Call {
        Call {
            input,
            ..Call::in_place(Collective::AllGather, output, count, dtype, ReduceOp::Sum)
        }
    }

    /// A reduce-scatter with `op`: `input`, `world_size * count` elements of
    /// `dtype`, is reduced across ranks, and this rank's `count` elements of
    /// the result are written to `output`, which must not overlap it. `input`
    /// is workspace: afterwards its share of this rank holds the result too,
    /// and the rest is unspecified.
    pub fn reduce_scatter(
        input: *mut u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
    ) -> Call {
        Call {
            input,
            ..Call::in_place(Collective::ReduceScatter, output, count, dtype, op)
        }
    }

    /// A reduce with `op` to rank `root`: every rank's `count` elements of
    /// `dtype` at `input` are reduced into the root's `output`. On the other
    /// ranks `output` is workspace (`count` elements, unspecified afterwards);
    /// `input` is only read, and may be `output` itself (in place) but must
    /// not otherwise overlap it.
    ///
    /// On host memory, of 2 MiB or more, in a job of up to 32 machines of one
    /// rank each, it runs as a chain of messages ending at the root, each
    /// rank's contribution crossing one link once (sums are combined in the
    /// chain's order; not for `f16` and `bf16`); elsewhere as an all-reduce
    /// into every rank's `output`.
    pub fn reduce(
        input: *const u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        root: u32,
    ) -> Call {
        Call {
            input,
            root,
            ..Call::in_place(Collective::Reduce, output, count, dtype, op)
        }
    }

    /// A gather to rank `root`: every rank's `count` elements of `dtype` at
    /// `input` land, in rank order, in the root's `output` (`world_size *
    /// count` elements). On the other ranks `output` is workspace of the same
    /// size. `input` may lie at this rank's place in `output`, and nowhere
    /// else in it; it is read before the call is started.
    ///
    /// On host memory (in a job of up to 32 ranks) each rank's part moves
    /// once, as a message to the root, sent from the rank's place in its own
    /// `output` (the only place of the workspace it writes); on device memory,
    /// and in larger jobs, it runs as an all-gather into every rank's
    /// `output`.
    pub fn gather(
        input: *const u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        root: u32,
    ) -> Call {
        Call {
            input,
            root,
            ..Call::in_place(Collective::Gather, output, count, dtype, ReduceOp::Sum)
        }
    }

    /// A scatter from rank `root`: part `r` (`count` elements of `dtype`) of
    /// the root's `input` (`world_size * count` elements) lands in rank `r`'s
    /// `output`, bit for bit. `input` is workspace on every rank. `output`
    /// must not overlap `input`.
    ///
    /// On host memory (in a job of up to 32 ranks) each part moves once, as a
    /// message from the root, and `input` is only read (on the root); on
    /// device memory, and in larger jobs, it runs as a broadcast of the
    /// root's whole input, which every rank's `input` then holds.
    pub fn scatter(
        input: *mut u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        root: u32,
    ) -> Call {
        Call {
            input,
            root,
            ..Call::in_place(Collective::Scatter, output, count, dtype, ReduceOp::Sum)
        }
    }

    /// A send of `count` elements of `dtype` at `data` to rank `peer`, with
    /// `tag`: it finishes once its bytes have left `data` for the peer. It
    /// matches the peer's receive from this rank of the same tag, in the
    /// order both were posted (per tag: NCCL's and MPI's order), which must
    /// be of the same size and type: another fails both messages, each
    /// naming both calls, and the communicator goes on. Except for a send
    /// of at most 16 KiB over the fabric (between machines, or between ranks
    /// of one that may not read each other's memory), which goes eagerly
    /// (its bytes may land before the receive is posted) and does not learn
    /// of a mismatch: only its receive fails. Host memory only; `options` do
    /// not apply.
    pub fn send(peer: u32, tag: u32, data: *const u8, count: u64, dtype: DataType) -> Call {
        Call {
            input: data,
            output: data.cast_mut(),
            peer,
            tag,
            ..Call::in_place(
                Collective::Send,
                std::ptr::null_mut(),
                count,
                dtype,
                ReduceOp::Sum,
            )
        }
    }

    /// A receive of `count` elements of `dtype` into `data` from rank `peer`,
    /// with `tag` (see [`Call::send`]).
    pub fn recv(peer: u32, tag: u32, data: *mut u8, count: u64, dtype: DataType) -> Call {
        Call {
            peer,
            tag,
            ..Call::in_place(Collective::Recv, data, count, dtype, ReduceOp::Sum)
        }
    }

    /// A barrier: it finishes once every rank has entered it.
    pub fn barrier() -> Call {
        Call::in_place(
            Collective::Barrier,
            std::ptr::null_mut(),
            0,
            DataType::U8,
            ReduceOp::Sum,
        )
    }

    /// This call with `options` (an [`Algorithm`] converts into them).
    pub fn with(self, options: impl Into<Options>) -> Call {
        Call {
            options: options.into(),
            ..self
        }
    }

    /// This call on device memory, ordered on `stream` (see
    /// [`Memory::Device`]).
    #[cfg(feature = "cuda")]
    pub fn on_stream(self, stream: crate::cuda::sys::CUstream) -> Call {
        Call {
            memory: Memory::Device { stream },
            ..self
        }
    }

    fn in_place(
        collective: Collective,
        data: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
    ) -> Call {
        Call {
            collective,
            input: data,
            output: data,
            count,
            dtype,
            op,
            root: 0,
            peer: 0,
            tag: 0,
            memory: Memory::Host,
            options: Options::default(),
        }
    }
}
