//! The verbs provider: RC queue pairs and RDMA writes with immediate data, for
//! InfiniBand and RoCE NICs, with GPUDirect registration of device memory.
//!
//! - **Connection.** [`Fabric::endpoint`] creates the queue pair for a peer
//!   (INIT, receives posted) and returns its endpoint: number, PSN, LID, MTU, GID
//!   and initial credits, authenticated by an HMAC-SHA256 under the job secret
//!   bound to job, epoch, world size and both ranks. The engine passes it through
//!   its rendezvous store; [`Fabric::connect`] refuses an endpoint whose MAC does
//!   not verify, then moves the queue pair to RTR and RTS.
//! - **Writes** are `IBV_WR_RDMA_WRITE_WITH_IMM`, signalled; the peer's receive
//!   completion (`IBV_WC_RECV_RDMA_WITH_IMM`) becomes its `Landed` completion.
//! - **Messages** are `IBV_WR_SEND_WITH_IMM` with the payload inline, into the
//!   peer's posted receive buffers.
//! - **Credits.** Every write and message consumes one of the peer's posted
//!   receives. A sender holds one credit per receive the peer has posted and stops
//!   (with [`FabricError::QueueFull`]) before the last, which is kept for credit
//!   returns; a receiver re-posts each receive at once and returns credits in a
//!   4-byte `IBV_WR_SEND` when half its receives have been consumed. So a write
//!   never meets a receiver that is not ready.
//! - **Registration.** [`Fabric::register`] is `ibv_reg_mr` on any address: host
//!   memory, or GPU memory where the nvidia-peermem module is loaded.
//!   [`VerbsFabric::register_dmabuf`] is `ibv_reg_dmabuf_mr`, for a dmabuf
//!   exported by `cuMemGetHandleForAddressRange`.
//! - **Failure.** A work request that fails (the transport's retries exhausted
//!   after about `retry_count` × 4.096 µs × 2^`ack_timeout`, or a remote access
//!   error) fails its peer: one `PeerFailed`, and a `SendFailed` for each request
//!   the queue pair flushes. An idle dead peer is noticed at the next request; the
//!   engine's own messages serve as keep-alives.
//! - **Polling.** Completions come from one completion queue per fabric, polled
//!   by the caller's `poll` or `wait` (which polls, yielding, until its timeout).
//!
//! # What has run on hardware
//!
//! Nothing. No machine this code has been developed or tested on has an RDMA
//! device, so the provider is written against rdma-core's documentation
//! (`ibv_create_qp(3)`, `ibv_modify_qp(3)`, `ibv_post_send(3)`, `ibv_poll_cq(3)`,
//! `ibv_reg_mr(3)`) and only compiled and linked in CI. Its tests that need a
//! device are `#[ignore = "needs an RDMA device"]`; run them with
//! `cargo test -p fairring-rdma --features verbs -- --include-ignored` where one
//! (or Soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`) exists. What does run
//! everywhere: endpoint authentication, and the error when a device is missing.
//!
//! The `ibverbs` crate is not used: it can neither register caller memory nor
//! post RDMA writes or immediates, and it keeps its raw handles private, so it
//! cannot be mixed with `ibverbs-sys` calls on the same objects.

mod data_path;
mod device;
mod endpoint;
mod region;

use crate::sync::unmodelled::{AtomicUsize, Ordering};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use fairring_core::wire::MAX_MESSAGE_PAYLOAD;
use ibverbs_sys as sys;

use self::data_path::send_wr;
use self::device::{Device, MemoryRegion, QueuePair, RemoteQueuePair, Timing};
use self::endpoint::Binding;
pub use self::region::VerbsRegion;
use self::region::{RegionInner, SourceUse};
use crate::fabric::{
    Completion, CompletionEvent, Endpoint, Fabric, FabricError, LocalRegion, Message, PeerFailure,
    RegionKey, RemoteRegion, WriteRequest,
};
use crate::secret::JobSecret;

/// Bytes of one receive buffer: the largest message.
const SLOT: usize = MAX_MESSAGE_PAYLOAD as usize;
/// [`SLOT`] as the verbs calls take it.
const SLOT_U32: u32 = MAX_MESSAGE_PAYLOAD;
/// Marks a receive request's id; the rest holds the peer and the buffer slot.
const RECEIVE: u64 = 1 << 63;

/// Everything a [`VerbsFabric`] needs to know.
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// This process's rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world_size: u32,
    /// The job's tag.
    pub job_tag: u64,
    /// The job's incarnation.
    pub epoch: u64,
    /// The job secret.
    pub secret: JobSecret,
    /// The device to open (`mlx5_0`, say); the first one when `None`.
    pub device: Option<String>,
    /// The port. Default 1.
    pub port: u8,
    /// The GID index (RoCE v2 usually needs the index of its IPv4-mapped GID).
    /// Default 0.
    pub gid_index: u8,
    /// Send work requests per queue pair. Default 256.
    pub send_queue_depth: u32,
    /// Receive work requests per queue pair, and so the credits each peer gets.
    /// Default 256; at least 4.
    pub receive_depth: u16,
    /// Writes and messages outstanding across all peers. Default 4096.
    pub max_outstanding: usize,
    /// ACK timeout exponent (4.096 µs × 2^n). Default 18, about 1 s.
    pub ack_timeout: u8,
    /// Transport retries. Default 7.
    pub retry_count: u8,
}

impl VerbsConfig {
    /// A configuration with the defaults above.
    pub fn new(rank: u32, world_size: u32, job_tag: u64, secret: JobSecret) -> VerbsConfig {
        VerbsConfig {
            rank,
            world_size,
            job_tag,
            epoch: 0,
            secret,
            device: None,
            port: 1,
            gid_index: 0,
            send_queue_depth: 256,
            receive_depth: 256,
            max_outstanding: 4096,
            ack_timeout: 18,
            retry_count: 7,
        }
    }
}

/// The verbs provider of [`Fabric`].
pub struct VerbsFabric {
    inner: Arc<Inner>,
}

struct Inner {
    config: VerbsConfig,
    device: Arc<Device>,
    data: Mutex<DataPath>,
}

struct DataPath {
    peers: Vec<Link>,
    ops: Vec<Option<Op>>,
    free: Vec<usize>,
    /// Completions found while a dropping region waited; delivered first.
    overflow: VecDeque<Completion>,
    scratch: Vec<sys::ibv_wc>,
}

/// Receive buffers of one queue pair, registered.
struct Receives {
    mr: MemoryRegion,
    buffer: Box<[u8]>,
}

enum Link {
    None,
    Created {
        qp: QueuePair,
        psn: u32,
        receives: Receives,
    },
    Connected(Connected),
    Failed {
        _qp: QueuePair,
        _receives: Receives,
        failure: PeerFailure,
    },
}

struct Connected {
    qp: QueuePair,
    receives: Receives,
    credits: u32,
    consumed: u32,
    outstanding: u32,
}

struct Op {
    peer: u32,
    /// `None` for an internal credit return.
    token: Option<u64>,
    _source: Option<SourceUse>,
}

/// The names of this host's RDMA devices (`ibv_get_device_list`); empty when it
/// has none.
pub fn devices() -> Vec<String> {
    device::device_names()
}

impl VerbsFabric {
    /// Opens the device, its protection domain and completion queue.
    pub fn new(config: VerbsConfig) -> Result<VerbsFabric, FabricError> {
        if config.rank >= config.world_size {
            return Err(FabricError::Config {
                variable: "rank",
                reason: format!(
                    "{} is outside a world of {}",
                    config.rank, config.world_size
                ),
            });
        }
        if config.receive_depth < 4 {
            return Err(FabricError::Config {
                variable: "receive_depth",
                reason: "must be at least 4".into(),
            });
        }
        let cq_depth = i32::try_from(
            u64::from(config.world_size)
                * (u64::from(config.send_queue_depth) + u64::from(config.receive_depth)),
        )
        .unwrap_or(i32::MAX)
        .min(1 << 20);
        let device = Device::open(
            config.device.as_deref(),
            config.port,
            config.gid_index,
            cq_depth,
        )?;
        log::info!(
            "fairring verbs rank {}: opened {} port {}",
            config.rank,
            device.name,
            config.port
        );
        let data = DataPath {
            peers: (0..config.world_size).map(|_| Link::None).collect(),
            ops: (0..config.max_outstanding).map(|_| None).collect(),
            free: (0..config.max_outstanding).rev().collect(),
            overflow: VecDeque::with_capacity(1024),
            // SAFETY: an all-zero work completion is a valid value to overwrite.
            scratch: vec![unsafe { std::mem::zeroed() }; 32],
        };
        Ok(VerbsFabric {
            inner: Arc::new(Inner {
                config,
                device,
                data: Mutex::new(data),
            }),
        })
    }

    /// Registers `len` bytes at `offset` of a dmabuf (GPU memory exported with
    /// `cuMemGetHandleForAddressRange`); peers address it from `iova`.
    ///
    /// # Safety
    ///
    /// As for [`Fabric::register`], for the dmabuf's memory.
    pub unsafe fn register_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<VerbsRegion, FabricError> {
        // SAFETY: forwarded contract.
        let mr =
            unsafe { MemoryRegion::register_dmabuf(&self.inner.device, fd, offset, len, iova) }?;
        Ok(self.region(mr, iova as *mut u8, len))
    }

    fn region(&self, mr: MemoryRegion, address: *mut u8, len: usize) -> VerbsRegion {
        VerbsRegion {
            inner: Arc::new(RegionInner {
                mr,
                address,
                len,
                in_flight: AtomicUsize::new(0),
            }),
            fabric: Arc::clone(&self.inner),
        }
    }

    fn binding(&self) -> Binding<'_> {
        let c = &self.inner.config;
        Binding {
            version: fairring_core::wire::VERSION,
            secret: &c.secret,
            job_tag: c.job_tag,
            epoch: c.epoch,
            world_size: c.world_size,
        }
    }

    fn check_peer(&self, peer: u32) -> Result<usize, FabricError> {
        let c = &self.inner.config;
        if peer >= c.world_size || peer == c.rank {
            return Err(FabricError::InvalidArgument {
                argument: "peer",
                reason: format!(
                    "rank {peer} is not a peer of rank {} of {}",
                    c.rank, c.world_size
                ),
            });
        }
        Ok(peer as usize)
    }
}

impl Fabric for VerbsFabric {
    type Region = VerbsRegion;

    fn rank(&self) -> u32 {
        self.inner.config.rank
    }

    fn world_size(&self) -> u32 {
        self.inner.config.world_size
    }

    fn endpoint(&self, peer: u32) -> Result<Endpoint, FabricError> {
        let index = self.check_peer(peer)?;
        let c = &self.inner.config;
        let mut data = self.inner.lock();
        if let Link::None = data.peers[index] {
            let depth = usize::from(c.receive_depth);
            let qp = QueuePair::create(
                &self.inner.device,
                c.send_queue_depth,
                u32::from(c.receive_depth),
                SLOT_U32,
            )?;
            let mut buffer = vec![0u8; depth * SLOT].into_boxed_slice();
            // SAFETY: the buffer lives in the link as long as the queue pair.
            let mr = unsafe {
                MemoryRegion::register(&self.inner.device, buffer.as_mut_ptr(), buffer.len())
            }?;
            let receives = Receives { mr, buffer };
            for slot in 0..depth {
                Inner::post_receive(&qp, &receives, peer, slot)?;
            }
            let mut psn = [0u8; 4];
            getrandom::fill(&mut psn)
                .map_err(|e| FabricError::io("random PSN", std::io::Error::other(e)))?;
            data.peers[index] = Link::Created {
                qp,
                psn: u32::from_le_bytes(psn) & 0xff_ffff,
                receives,
            };
        }
        let (qp_num, psn) = match &data.peers[index] {
            Link::Created { qp, psn, .. } => (qp.number(), *psn),
            _ => {
                return Err(FabricError::InvalidArgument {
                    argument: "peer",
                    reason: format!("rank {peer} is already connected; its endpoint was used"),
                });
            }
        };
        let device = &self.inner.device;
        let local = RemoteQueuePair {
            qp_num,
            psn,
            lid: device.lid,
            mtu: device.active_mtu,
            gid: device.gid,
        };
        Ok(endpoint::encode(
            &self.binding(),
            c.rank,
            peer,
            &local,
            c.receive_depth,
        ))
    }

    fn connect(&self, peer: u32, endpoint: &Endpoint) -> Result<(), FabricError> {
        let index = self.check_peer(peer)?;
        let (remote, credits) =
            endpoint::decode(&self.binding(), peer, self.inner.config.rank, endpoint).map_err(
                |refusal| FabricError::Refused {
                    peer: Some(peer),
                    address: None,
                    refusal,
                    by_peer: false,
                },
            )?;
        let mut data = self.inner.lock();
        let link = std::mem::replace(&mut data.peers[index], Link::None);
        let Link::Created { qp, psn, receives } = link else {
            data.peers[index] = link;
            return Err(FabricError::InvalidArgument {
                argument: "peer",
                reason: format!("publish endpoint({peer}) before connecting to rank {peer}, once"),
            });
        };
        if let Err(e) = qp.connect(&remote, psn, self.inner.timing()) {
            data.peers[index] = Link::Created { qp, psn, receives };
            return Err(e);
        }
        data.peers[index] = Link::Connected(Connected {
            qp,
            receives,
            credits: u32::from(credits),
            consumed: 0,
            outstanding: 0,
        });
        Ok(())
    }

    unsafe fn register(&self, memory: NonNull<u8>, len: usize) -> Result<VerbsRegion, FabricError> {
        // SAFETY: forwarded contract.
        let mr = unsafe { MemoryRegion::register(&self.inner.device, memory.as_ptr(), len) }?;
        Ok(self.region(mr, memory.as_ptr(), len))
    }

    fn write(&self, peer: u32, request: WriteRequest<'_, VerbsRegion>) -> Result<(), FabricError> {
        self.check_peer(peer)?;
        request.check()?;
        let len = request.len;
        let source = &request.source.inner;
        let mut sge = sys::ibv_sge {
            addr: source.address as u64 + request.source_offset as u64,
            // At most 2 GiB, checked above.
            length: u32::try_from(len).unwrap_or(u32::MAX),
            lkey: source.mr.lkey(),
        };
        let mut wr = send_wr(
            &mut sge,
            sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            false,
        );
        wr.__bindgen_anon_1.imm_data = request.immediate.to_be();
        wr.wr.rdma.remote_addr = request.target.address + request.target_offset;
        wr.wr.rdma.rkey = request.target.key;
        source.in_flight.fetch_add(1, Ordering::AcqRel);
        let used = SourceUse(Arc::clone(source));
        let mut data = self.inner.lock();
        self.inner
            .post(&mut data, peer, &mut wr, Some(request.token), Some(used), 1)
    }

    fn send_message(
        &self,
        peer: u32,
        immediate: u32,
        payload: &[u8],
        token: u64,
    ) -> Result<(), FabricError> {
        self.check_peer(peer)?;
        crate::fabric::check_message(payload)?;
        let mut sge = sys::ibv_sge {
            addr: payload.as_ptr() as u64,
            length: u32::try_from(payload.len()).unwrap_or(u32::MAX),
            lkey: 0,
        };
        let mut wr = send_wr(&mut sge, sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, true);
        wr.__bindgen_anon_1.imm_data = immediate.to_be();
        let mut data = self.inner.lock();
        self.inner
            .post(&mut data, peer, &mut wr, Some(token), None, 1)
    }

    fn poll(&self, out: &mut [Completion]) -> usize {
        let mut data = self.inner.lock();
        if data.overflow.len() < out.len()
            && let Err(e) = self.inner.progress(&mut data)
        {
            log::error!("fairring verbs: polling the completion queue: {e}");
        }
        let n = out.len().min(data.overflow.len());
        for (slot, completion) in out.iter_mut().zip(data.overflow.drain(..n)) {
            *slot = completion;
        }
        n
    }

    fn wait(&self, out: &mut [Completion], timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out);
            if n > 0 || Instant::now() >= deadline {
                return n;
            }
            std::thread::yield_now();
        }
    }
}

impl core::fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("VerbsFabric")
            .field("rank", &self.inner.config.rank)
            .field("device", &self.inner.device.name)
            .finish()
    }
}
