//! The fabric API: what every provider offers and all the engine uses.
//!
//! The shape is RDMA's, as in libfabric:
//!
//! - **Regions.** Memory is registered from the caller's own storage
//!   ([`Fabric::register`]) and named to peers by a [`RemoteRegion`] descriptor
//!   (24 bytes, exchanged through the job's rendezvous store).
//! - **Peers.** Each rank publishes an [`Endpoint`] per peer ([`Fabric::endpoint`])
//!   and connects with the peer's ([`Fabric::connect`]); a peer is admitted only
//!   after a mutual HMAC-SHA256 challenge over the job secret.
//! - **Writes.** [`Fabric::write`] posts a one-sided *write with immediate data*:
//!   bytes of a local region go into a peer's region at an offset, and the peer
//!   learns of it, with the 32-bit immediate, from its completion queue.
//! - **Messages.** [`Fabric::send_message`] sends a small control message (a
//!   credit, an abort) of at most [`MESSAGE_CAPACITY`] bytes, delivered whole.
//! - **Completions.** [`Fabric::poll`] and [`Fabric::wait`] fill a caller's slice
//!   with [`Completion`]s, without allocating: local sends done, peers' writes
//!   landed, messages, and failures naming the peer.
//!
//! # Memory lifetime
//!
//! Registration is `unsafe`: the caller promises the memory stays valid until the
//! region handle is dropped, and keeps its own accesses from racing the fabric's
//! (a write's source range is the fabric's from posting until its `Sent` or
//! `SendFailed` completion; which ranges peers may be writing is the caller's
//! protocol). The rest is enforced by the providers: every posted write holds its
//! source region registered until it completes, and dropping a region waits until
//! no transfer touches it, so a region always outlives every write that touches
//! it, and posting is safe.
//!
//! # Ordering
//!
//! Writes and messages to one peer are delivered in the order they were posted;
//! nothing is promised across peers. A `Landed` completion is reported only once
//! every byte of its write is in place.
//!
//! # Example
//!
//! Two ranks in one process, over the tcp provider on loopback:
//!
//! ```
//! use std::ptr::NonNull;
//! use std::time::Duration;
//! use fairring_rdma::fabric::{Completion, CompletionEvent, Fabric, LocalRegion, WriteRequest};
//! use fairring_rdma::tcp::{BindTo, TcpConfig, TcpFabric};
//! use fairring_rdma::JobSecret;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let secret = JobSecret::generate()?;
//! let config = |rank| TcpConfig::new(rank, 2, 0x5eed, secret.clone(), BindTo::loopback());
//! let (zero, one) = (TcpFabric::new(config(0))?, TcpFabric::new(config(1))?);
//! let (endpoint_of_zero, endpoint_of_one) = (zero.endpoint(1)?, one.endpoint(0)?);
//! // Each side connects; rank 1 dials, rank 0 waits for it (in another thread here).
//! std::thread::scope(|s| {
//!     s.spawn(|| zero.connect(1, &endpoint_of_one));
//!     one.connect(0, &endpoint_of_zero)
//! })?;
//!
//! let mut source = vec![7u8; 4096];
//! let mut target = vec![0u8; 8192];
//! // SAFETY: both vectors outlive their regions, and are not touched while the
//! // write is in flight.
//! let source_region = unsafe { one.register(NonNull::new(source.as_mut_ptr()).unwrap(), source.len())? };
//! let target_region = unsafe { zero.register(NonNull::new(target.as_mut_ptr()).unwrap(), target.len())? };
//!
//! one.write(0, WriteRequest {
//!     source: &source_region,
//!     source_offset: 0,
//!     len: 4096,
//!     target: target_region.remote(),
//!     target_offset: 1024,
//!     immediate: 42,
//!     token: 1,
//! })?;
//!
//! let mut completions = [Completion { peer: 0, event: CompletionEvent::Sent { token: 0 } }; 8];
//! let n = zero.wait(&mut completions, Duration::from_secs(10));
//! assert!(n >= 1);
//! assert!(matches!(completions[0].event, CompletionEvent::Landed { len: 4096, immediate: 42 }));
//! drop(target_region);
//! assert!(target[1024..5120].iter().all(|&b| b == 7));
//! # drop(source_region);
//! # Ok(())
//! # }
//! ```

mod completion;
mod error;
#[cfg(all(test, loom))]
mod loom_models;
mod region;

use core::ptr::NonNull;
use std::time::Duration;

use fairring_core::wire::MAX_WRITE_PAYLOAD;

pub(crate) use completion::CompletionQueue;
pub use completion::{Completion, CompletionEvent, CompletionNotifier, MESSAGE_CAPACITY, Message};
pub use error::{FabricError, PeerFailure, ProtocolViolation, Refusal};
pub use region::{Endpoint, RegionKey, RemoteRegion};

/// A registered memory region, as its owner sees it.
pub trait LocalRegion: Send + Sync {
    /// The region's key.
    fn key(&self) -> RegionKey;
    /// The region's length in bytes.
    fn len(&self) -> usize;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The descriptor a peer writes through.
    fn remote(&self) -> RemoteRegion;
    /// The region's first byte.
    fn as_ptr(&self) -> *mut u8;
}

/// A one-sided write: `len` bytes of `source` from `source_offset` into the peer's
/// `target` region at `target_offset`.
#[derive(Debug)]
pub struct WriteRequest<'a, R> {
    /// The local region the bytes come from.
    pub source: &'a R,
    /// Offset of the first byte in `source`.
    pub source_offset: usize,
    /// Bytes to write (at most 2 GiB, RDMA's limit).
    pub len: usize,
    /// The peer's region.
    pub target: RemoteRegion,
    /// Offset of the first byte in `target`.
    pub target_offset: u64,
    /// Immediate data delivered with the peer's `Landed` completion.
    pub immediate: u32,
    /// Reported back in this write's `Sent` or `SendFailed` completion.
    pub token: u64,
}

// By hand: a derive would demand `R: Copy`, but only a reference to `R` is held.
impl<R> Clone for WriteRequest<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for WriteRequest<'_, R> {}

impl<R: LocalRegion> WriteRequest<'_, R> {
    /// Checks the request against the write size limit and both regions; returns
    /// the end of the source range. Every provider checks this before posting.
    pub fn check(&self) -> Result<usize, FabricError> {
        let len = self.len;
        if len as u64 > u64::from(MAX_WRITE_PAYLOAD) {
            return Err(FabricError::InvalidArgument {
                argument: "len",
                reason: format!(
                    "{len} bytes is over the {MAX_WRITE_PAYLOAD}-byte limit of a write"
                ),
            });
        }
        let source_len = self.source.len();
        let end = self
            .source_offset
            .checked_add(len)
            .filter(|&end| end <= source_len)
            .ok_or(FabricError::OutOfBounds {
                range: "source",
                offset: self.source_offset as u64,
                len: len as u64,
                region_len: source_len as u64,
            })?;
        if !self.target.contains(self.target_offset, len as u64) {
            return Err(FabricError::OutOfBounds {
                range: "target",
                offset: self.target_offset,
                len: len as u64,
                region_len: self.target.len,
            });
        }
        Ok(end)
    }
}

/// Checks a control message's payload against [`MESSAGE_CAPACITY`].
pub fn check_message(payload: &[u8]) -> Result<(), FabricError> {
    if payload.len() > MESSAGE_CAPACITY {
        return Err(FabricError::InvalidArgument {
            argument: "payload",
            reason: format!(
                "{} bytes is over the {MESSAGE_CAPACITY}-byte limit of a message",
                payload.len()
            ),
        });
    }
    Ok(())
}

/// An RDMA-shaped transport between the ranks of one job.
pub trait Fabric: Send + Sync {
    /// This provider's registered memory.
    type Region: LocalRegion;

    /// This process's rank.
    fn rank(&self) -> u32;

    /// Ranks in the job.
    fn world_size(&self) -> u32;

    /// The endpoint `peer` must connect to, to reach this process.
    fn endpoint(&self, peer: u32) -> Result<Endpoint, FabricError>;

    /// Connects to `peer` through its `endpoint` and waits until it is admitted
    /// (both ways), refused, or the provider's connect deadline passes.
    fn connect(&self, peer: u32, endpoint: &Endpoint) -> Result<(), FabricError>;

    /// Registers `len` bytes at `memory`.
    ///
    /// # Safety
    ///
    /// The memory must be valid for reads and writes of `len` bytes until the
    /// returned region is dropped, and the caller must not access it in a way that
    /// races the fabric: not a write's source range from posting until its `Sent`
    /// or `SendFailed` completion, and not a range a peer may be writing (the
    /// caller's protocol decides which; a `Landed` completion says a write has
    /// finished). The verbs provider also accepts device memory here.
    #[allow(unsafe_code)]
    unsafe fn register(&self, memory: NonNull<u8>, len: usize)
    -> Result<Self::Region, FabricError>;

    /// Whether [`Fabric::register_source`] registers memory. The default is
    /// `false`: a provider that pins memory to register it (verbs) leaves it
    /// out.
    fn registers_sources(&self) -> bool {
        false
    }

    /// Registers `len` bytes at `memory` as a source of this process's writes
    /// only: a peer's write into it is refused as if the region did not exist.
    /// For a provider whose registration is a table entry (tcp), so that a
    /// caller may send from memory it did not register up front (a tensor)
    /// instead of copying it into memory it did, and keep the registration
    /// while it reuses that memory. The default refuses.
    ///
    /// # Safety
    ///
    /// While a write from the region is in flight (from posting until its
    /// `Sent` or `SendFailed` completion) its source range must be valid for
    /// reads and not written, but by the provider itself: a provider that
    /// registers sources reads a write's source only until it has handed the
    /// last byte on, before the peer can have all of it, so the range may take
    /// a write from the peer (into a window over the same memory) that the
    /// peer sends only once it has the whole write. Nothing more: between
    /// writes the memory may be freed and reused. Dropping the region waits
    /// until no write from it is in flight.
    #[allow(unsafe_code)]
    unsafe fn register_source(
        &self,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<Self::Region, FabricError> {
        let _ = (memory, len);
        Err(FabricError::InvalidArgument {
            argument: "memory",
            reason: "this provider registers only memory peers may write into".into(),
        })
    }

    /// Whether [`Fabric::register_window`] registers memory. The default is
    /// `false`: a provider that pins memory to register it (verbs) leaves it
    /// out.
    fn registers_windows(&self) -> bool {
        false
    }

    /// Registers `len` bytes at `memory` as a *window*: memory peers may write
    /// into only while it is open ([`Fabric::open_window`] to
    /// [`Fabric::close_window`]); a write into it while it is closed is
    /// refused as a write into no region. It starts closed, and touches no
    /// memory until opened. For a provider whose registration is a table entry
    /// (tcp), so that a caller may have a peer write into memory it did not
    /// register up front (a tensor), and keep the registration while it reuses
    /// that memory. The default refuses.
    fn register_window(
        &self,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<Self::Region, FabricError> {
        let _ = (memory, len);
        Err(FabricError::InvalidArgument {
            argument: "memory",
            reason: "this provider registers no windows".into(),
        })
    }

    /// Opens `window` (a region from [`Fabric::register_window`]) to peers'
    /// writes. The default refuses.
    ///
    /// # Safety
    ///
    /// Until [`Fabric::close_window`] returns (or the region is dropped), the
    /// window's memory must be valid for writes, and the caller must not
    /// access a range a peer may be writing (the caller's protocol decides
    /// which; a `Landed` completion says a write has finished).
    #[allow(unsafe_code)]
    unsafe fn open_window(&self, window: &Self::Region) -> Result<(), FabricError> {
        let _ = window;
        Err(FabricError::InvalidArgument {
            argument: "window",
            reason: "this provider registers no windows".into(),
        })
    }

    /// Closes `window`: peers' writes into it are refused from now on, and
    /// this returns once none is landing in it any more. Closing a closed
    /// window, or a region that is not a window, does nothing.
    fn close_window(&self, window: &Self::Region) {
        let _ = window;
    }

    /// Posts a write to `peer`. Checks both ranges against their regions first and
    /// fails without side effects if either is outside.
    fn write(&self, peer: u32, request: WriteRequest<'_, Self::Region>) -> Result<(), FabricError>;

    /// Posts a control message of at most [`MESSAGE_CAPACITY`] bytes to `peer`.
    fn send_message(
        &self,
        peer: u32,
        immediate: u32,
        payload: &[u8],
        token: u64,
    ) -> Result<(), FabricError>;

    /// Moves up to `out.len()` completions into `out`; returns how many.
    fn poll(&self, out: &mut [Completion]) -> usize;

    /// Like [`Fabric::poll`], but waits up to `timeout` for the first completion.
    fn wait(&self, out: &mut [Completion], timeout: Duration) -> usize;

    /// Has the provider call `notify` each time it queues a completion, from the
    /// thread that queues it, so that a user can sleep on a wake-up of its own
    /// (one that other event sources ring too) instead of in [`Fabric::wait`].
    /// `notify` must be quick and must not call into the fabric.
    ///
    /// Returns `false` if the provider cannot (its completions appear only when
    /// polled, so its user must keep polling) or already has a notifier.
    fn notify_completions(&self, notify: CompletionNotifier) -> bool {
        let _ = notify;
        false
    }

    /// Lends the calling thread to the provider for a moment, without blocking:
    /// a provider whose completions come from a thread of its own may do that
    /// thread's work here (take what has arrived), so that a caller about to spin
    /// for completions sees them without a thread hand-off. Returns whether
    /// anything arrived (then [`Fabric::poll`] may have more). The default does
    /// nothing.
    fn progress(&self) -> bool {
        false
    }

    /// The calling thread, which has been lending itself through
    /// [`Fabric::progress`], stops spinning and may sleep: a provider that kept
    /// its own thread quiet while callers took the arrivals hands them back to
    /// it now. The default does nothing.
    fn spin_ends(&self) {}

    /// The calling thread, which has been lending itself through
    /// [`Fabric::progress`], returns to its caller without sleeping (what it
    /// waited for is done): a provider that keeps its own thread quiet while
    /// callers take the arrivals hands it what the caller left undone (frames
    /// not yet written), and may leave later arrivals to the next caller that
    /// spins, or sleeps. The default does nothing.
    fn spinner_leaves(&self) {}

    /// Starts a batch on the calling thread: what it posts from here to the
    /// matching [`Fabric::end_batch`] may stay queued until then, so that a burst
    /// (a control message, a credit and the data write behind them) leaves
    /// together, in one system call on tcp rather than one per post. Posts keep
    /// their order to each peer, and other threads' posts are not held.
    ///
    /// Batches nest: only the outermost end sends. Every call must be matched by
    /// one `end_batch` on the same thread; [`Fabric::batch`] pairs them. The
    /// default holds nothing.
    fn begin_batch(&self) {}

    /// Ends the calling thread's batch (see [`Fabric::begin_batch`]): at the
    /// outermost end, everything it held goes out as posts do outside a batch.
    fn end_batch(&self) {}

    /// A batch that ends when the guard drops, on every path out of its scope.
    fn batch(&self) -> Batch<'_, Self>
    where
        Self: Sized,
    {
        self.begin_batch();
        Batch { fabric: self }
    }
}

/// The guard of [`Fabric::batch`]: ends the batch when dropped.
#[must_use = "the batch ends when the guard drops"]
pub struct Batch<'f, F: Fabric> {
    fabric: &'f F,
}

impl<F: Fabric> Drop for Batch<'_, F> {
    fn drop(&mut self) {
        self.fabric.end_batch();
    }
}
