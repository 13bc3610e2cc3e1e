//! Owned handles over libibverbs objects: the "result" layer.
//!
//! Each type owns one verbs object, frees it in `Drop`, and turns the C calls'
//! failures into [`FabricError`]s naming the call. Children keep their parents
//! alive through `Arc<Device>`, so objects are always destroyed before the objects
//! they were created from.

use std::ffi::CStr;
use std::io;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as sys;

use crate::fabric::FabricError;

/// The error of a verbs call that returns an errno value (0 on success).
fn check(rc: c_int, call: &str) -> Result<(), FabricError> {
    if rc == 0 {
        Ok(())
    } else {
        let errno = if rc > 0 {
            rc
        } else {
            io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc_eio())
        };
        Err(FabricError::io(call, io::Error::from_raw_os_error(errno)))
    }
}

const fn libc_eio() -> c_int {
    5
}

/// A non-null pointer from a verbs constructor, or the error it set in errno.
fn created<T>(ptr: *mut T, call: &str) -> Result<NonNull<T>, FabricError> {
    NonNull::new(ptr).ok_or_else(|| FabricError::io(call, io::Error::last_os_error()))
}

/// An opened RDMA device with one protection domain and one completion queue,
/// shared by every queue pair and memory region of a fabric.
pub(crate) struct Device {
    context: NonNull<sys::ibv_context>,
    pd: NonNull<sys::ibv_pd>,
    cq: NonNull<sys::ibv_cq>,
    pub(crate) name: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) lid: u16,
    pub(crate) active_mtu: sys::ibv_mtu,
    pub(crate) gid: [u8; 16],
}

// SAFETY: libibverbs objects may be used from any thread; the provider serialises
// its own use of the completion queue and queue pairs behind a mutex.
unsafe impl Send for Device {}
// SAFETY: as for `Send`.
unsafe impl Sync for Device {}

/// Calls `f` with every RDMA device of this host and its name, while the device
/// list lives.
fn with_devices<T>(
    f: impl FnOnce(&[(*mut sys::ibv_device, String)]) -> T,
) -> Result<T, FabricError> {
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid out-pointer; the list is freed below.
    let list = unsafe { sys::ibv_get_device_list(&mut count) };
    let list = NonNull::new(list).ok_or_else(|| {
        FabricError::io(
            "no RDMA device (ibv_get_device_list)",
            io::Error::last_os_error(),
        )
    })?;
    let count = usize::try_from(count).unwrap_or(0);
    let mut devices = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: the list holds `count` device pointers; `i < count`.
        let entry = unsafe { list.as_ptr().add(i) };
        // SAFETY: `entry` points into the live list.
        let device = unsafe { *entry };
        // SAFETY: `device` is valid while the list is.
        let raw_name = unsafe { sys::ibv_get_device_name(device) };
        // SAFETY: a device name is a NUL-terminated string owned by the device.
        let name = unsafe { CStr::from_ptr(raw_name) }
            .to_string_lossy()
            .into_owned();
        devices.push((device, name));
    }
    let result = f(&devices);
    // SAFETY: the list came from `ibv_get_device_list` and is freed once; the
    // device pointers are not used past this point.
    unsafe { sys::ibv_free_device_list(list.as_ptr()) };
    Ok(result)
}

/// The names of this host's RDMA devices; empty when it has none (or when the
/// verbs library finds no driver for them).
pub(crate) fn device_names() -> Vec<String> {
    with_devices(|devices| devices.iter().map(|(_, n)| n.clone()).collect()).unwrap_or_default()
}

impl Device {
    /// Opens `name` (or the first device), queries `port` and its GID at
    /// `gid_index`, and creates a protection domain and a completion queue of
    /// `cq_depth` entries.
    pub(crate) fn open(
        name: Option<&str>,
        port: u8,
        gid_index: u8,
        cq_depth: c_int,
    ) -> Result<Arc<Device>, FabricError> {
        let (opened, names) = with_devices(|devices| {
            let names: Vec<String> = devices.iter().map(|(_, n)| n.clone()).collect();
            let opened = devices
                .iter()
                .find(|(_, n)| name.is_none_or(|want| want == n))
                .map(|(device, device_name)| {
                    // SAFETY: `device` comes from the live list; opened contexts
                    // stay valid after it is freed (documented by libibverbs).
                    (
                        unsafe { sys::ibv_open_device(*device) },
                        device_name.clone(),
                    )
                });
            (opened, names)
        })?;
        let Some((context, device_name)) = opened else {
            return Err(FabricError::Config {
                variable: "device",
                reason: format!(
                    "no RDMA device {}; devices found: {}",
                    name.unwrap_or("at all"),
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                ),
            });
        };
        let context = created(context, "ibv_open_device")?;
        // From here on, `guard` closes the context if anything fails.
        let guard = ContextGuard(context);

        // SAFETY: all-zero is a valid `ibv_port_attr` for the call to fill.
        let mut port_attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: the exported `ibv_query_port` fills the leading, compatible
            // part of the larger `ibv_port_attr` it is given.
            unsafe {
                sys::ibv_query_port(
                    context.as_ptr(),
                    port,
                    (&raw mut port_attr).cast::<sys::_compat_ibv_port_attr>(),
                )
            },
            "ibv_query_port",
        )?;
        // SAFETY: all-zero is a valid GID for the call to fill.
        let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: valid context and out-pointer.
            unsafe { sys::ibv_query_gid(context.as_ptr(), port, c_int::from(gid_index), &mut gid) },
            "ibv_query_gid",
        )?;
        // SAFETY: valid context.
        let pd = created(
            unsafe { sys::ibv_alloc_pd(context.as_ptr()) },
            "ibv_alloc_pd",
        )?;
        // SAFETY: valid context; no completion channel, no vector.
        let cq = unsafe {
            sys::ibv_create_cq(
                context.as_ptr(),
                cq_depth,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let cq = match created(cq, "ibv_create_cq") {
            Ok(cq) => cq,
            Err(e) => {
                // SAFETY: `pd` was just allocated and nothing uses it.
                unsafe { sys::ibv_dealloc_pd(pd.as_ptr()) };
                return Err(e);
            }
        };
        std::mem::forget(guard);
        Ok(Arc::new(Device {
            context,
            pd,
            cq,
            name: device_name,
            port,
            gid_index,
            lid: port_attr.lid,
            active_mtu: port_attr.active_mtu,
            // SAFETY: every bit pattern of the union is a valid byte array.
            gid: unsafe { gid.raw },
        }))
    }

    /// Polls up to `entries.len()` work completions.
    pub(crate) fn poll(&self, entries: &mut [sys::ibv_wc]) -> Result<usize, FabricError> {
        // SAFETY: `context` is live; `ops.poll_cq` is set by every provider driver.
        let poll_cq = unsafe { (*self.context.as_ptr()).ops.poll_cq }
            .ok_or_else(|| FabricError::io("poll_cq", io::ErrorKind::Unsupported.into()))?;
        let max = c_int::try_from(entries.len()).unwrap_or(c_int::MAX);
        // SAFETY: the CQ is live and `entries` has room for `max` completions.
        let n = unsafe { poll_cq(self.cq.as_ptr(), max, entries.as_mut_ptr()) };
        usize::try_from(n).map_err(|_| {
            FabricError::io(
                "ibv_poll_cq",
                io::Error::other("the completion queue failed"),
            )
        })
    }
}

struct ContextGuard(NonNull<sys::ibv_context>);

impl Drop for ContextGuard {
    fn drop(&mut self) {
        // SAFETY: the context was opened and nothing created from it survives.
        unsafe { sys::ibv_close_device(self.0.as_ptr()) };
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every queue pair and memory region holds an `Arc<Device>`, so
        // none is left; destroy in reverse order of creation.
        unsafe {
            sys::ibv_destroy_cq(self.cq.as_ptr());
        }
        // SAFETY: as above.
        unsafe {
            sys::ibv_dealloc_pd(self.pd.as_ptr());
        }
        // SAFETY: as above.
        unsafe {
            sys::ibv_close_device(self.context.as_ptr());
        }
    }
}

/// A registered memory region.
pub(crate) struct MemoryRegion {
    mr: NonNull<sys::ibv_mr>,
    _device: Arc<Device>,
}

// SAFETY: an MR is an immutable descriptor once registered.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for `Send`.
unsafe impl Sync for MemoryRegion {}

const ACCESS: c_int = (sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
    | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0) as c_int;

impl MemoryRegion {
    /// Registers `len` bytes at `address` (host memory, or device memory where a
    /// peer-memory driver such as nvidia-peermem is loaded).
    ///
    /// # Safety
    ///
    /// The memory stays valid until the region is dropped.
    pub(crate) unsafe fn register(
        device: &Arc<Device>,
        address: *mut u8,
        len: usize,
    ) -> Result<MemoryRegion, FabricError> {
        // SAFETY: the PD is live; the caller guarantees the memory.
        let mr = unsafe { sys::ibv_reg_mr(device.pd.as_ptr(), address.cast(), len, ACCESS) };
        Ok(MemoryRegion {
            mr: created(mr, "ibv_reg_mr")?,
            _device: Arc::clone(device),
        })
    }

    /// Registers `len` bytes at `offset` of a dmabuf (GPU memory exported with
    /// `cuMemGetHandleForAddressRange`), addressed by peers as `iova`.
    ///
    /// # Safety
    ///
    /// The dmabuf's memory stays allocated until the region is dropped.
    pub(crate) unsafe fn register_dmabuf(
        device: &Arc<Device>,
        fd: c_int,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> Result<MemoryRegion, FabricError> {
        // SAFETY: the PD is live; the caller guarantees the dmabuf.
        let mr =
            unsafe { sys::ibv_reg_dmabuf_mr(device.pd.as_ptr(), offset, len, iova, fd, ACCESS) };
        Ok(MemoryRegion {
            mr: created(mr, "ibv_reg_dmabuf_mr")?,
            _device: Arc::clone(device),
        })
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the MR is live and its keys never change.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: the MR is live and no posted work request uses it any more
        // (operations hold the region until their completion is polled).
        let rc = unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            log::error!(
                "fairring verbs: ibv_dereg_mr failed: {}",
                io::Error::from_raw_os_error(rc)
            );
        }
    }
}

/// What a queue pair needs to know of its remote side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RemoteQueuePair {
    pub(crate) qp_num: u32,
    pub(crate) psn: u32,
    pub(crate) lid: u16,
    pub(crate) mtu: sys::ibv_mtu,
    pub(crate) gid: [u8; 16],
}

/// Transport tuning of a queue pair.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout.
    pub(crate) timeout: u8,
    /// Retries before an unacknowledged request fails.
    pub(crate) retry_count: u8,
}

/// A reliable-connected queue pair.
pub(crate) struct QueuePair {
    qp: NonNull<sys::ibv_qp>,
    device: Arc<Device>,
}

// SAFETY: posting is serialised by the provider; a QP may be used from any thread.
unsafe impl Send for QueuePair {}
// SAFETY: as for `Send`.
unsafe impl Sync for QueuePair {}

fn mask(bits: &[sys::ibv_qp_attr_mask]) -> c_int {
    bits.iter().fold(0, |m, b| m | b.0) as c_int
}

impl QueuePair {
    /// Creates an RC queue pair on the device's completion queue and moves it to
    /// INIT with remote write allowed.
    pub(crate) fn create(
        device: &Arc<Device>,
        send_depth: u32,
        receive_depth: u32,
        inline: u32,
    ) -> Result<QueuePair, FabricError> {
        // SAFETY: all-zero is a valid init-attribute value, filled in below.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = device.cq.as_ptr();
        init.recv_cq = device.cq.as_ptr();
        init.cap.max_send_wr = send_depth;
        init.cap.max_recv_wr = receive_depth;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = inline;
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        // SAFETY: the PD and CQ are live; `init` is fully initialised.
        let qp = unsafe { sys::ibv_create_qp(device.pd.as_ptr(), &mut init) };
        let qp = QueuePair {
            qp: created(qp, "ibv_create_qp")?,
            device: Arc::clone(device),
        };
        // SAFETY: all-zero is a valid attribute value, filled in below.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = device.port;
        attr.qp_access_flags = ACCESS as u32;
        use sys::ibv_qp_attr_mask as m;
        qp.modify(
            &mut attr,
            mask(&[
                m::IBV_QP_STATE,
                m::IBV_QP_PKEY_INDEX,
                m::IBV_QP_PORT,
                m::IBV_QP_ACCESS_FLAGS,
            ]),
            "ibv_modify_qp(INIT)",
        )?;
        Ok(qp)
    }

    /// The driver's operations, through which posting goes (`ibv_post_send` and
    /// `ibv_post_recv` are inline functions in the C header, so they are not
    /// bound).
    fn context_ops(&self) -> Result<sys::ibv_context_ops, FabricError> {
        // SAFETY: the QP is live, so is the context it points to.
        let context = unsafe { (*self.qp.as_ptr()).context };
        // SAFETY: `context` is a live context; `ops` is plain function pointers.
        Ok(unsafe { (*context).ops })
    }

    pub(crate) fn number(&self) -> u32 {
        // SAFETY: the QP is live; its number never changes.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: c_int,
        call: &str,
    ) -> Result<(), FabricError> {
        // SAFETY: the QP is live and `attr` holds every field `mask` names.
        check(
            unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask) },
            call,
        )
    }

    /// INIT -> RTR -> RTS, connected to `remote`, sending from `local_psn`.
    pub(crate) fn connect(
        &self,
        remote: &RemoteQueuePair,
        local_psn: u32,
        timing: Timing,
    ) -> Result<(), FabricError> {
        use sys::ibv_qp_attr_mask as m;
        let device = &self.device;
        // SAFETY: all-zero is a valid attribute value, filled in below.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = device.active_mtu.min(remote.mtu);
        attr.dest_qp_num = remote.qp_num;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = device.port;
        if remote.gid != [0; 16] {
            // RoCE, or IB across subnets: route by GID.
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid;
            attr.ah_attr.grh.sgid_index = device.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut attr,
            mask(&[
                m::IBV_QP_STATE,
                m::IBV_QP_AV,
                m::IBV_QP_PATH_MTU,
                m::IBV_QP_DEST_QPN,
                m::IBV_QP_RQ_PSN,
                m::IBV_QP_MAX_DEST_RD_ATOMIC,
                m::IBV_QP_MIN_RNR_TIMER,
            ]),
            "ibv_modify_qp(RTR)",
        )?;
        // SAFETY: as above.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = local_psn;
        attr.timeout = timing.timeout;
        attr.retry_cnt = timing.retry_count;
        attr.rnr_retry = 7; // retry forever on receiver-not-ready; credits prevent it
        attr.max_rd_atomic = 1;
        self.modify(
            &mut attr,
            mask(&[
                m::IBV_QP_STATE,
                m::IBV_QP_TIMEOUT,
                m::IBV_QP_RETRY_CNT,
                m::IBV_QP_RNR_RETRY,
                m::IBV_QP_SQ_PSN,
                m::IBV_QP_MAX_QP_RD_ATOMIC,
            ]),
            "ibv_modify_qp(RTS)",
        )
    }

    /// Posts one send work request.
    ///
    /// # Safety
    ///
    /// Every buffer `wr` names (its scatter list, unless inline) stays valid and
    /// registered until the request's completion is polled.
    pub(crate) unsafe fn post_send(&self, wr: &mut sys::ibv_send_wr) -> Result<(), FabricError> {
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        let post = self
            .context_ops()?
            .post_send
            .ok_or_else(|| FabricError::io("post_send", io::ErrorKind::Unsupported.into()))?;
        // SAFETY: `wr` is a valid chain of one request; buffers per the contract.
        check(
            unsafe { post(self.qp.as_ptr(), wr, &mut bad) },
            "ibv_post_send",
        )
    }

    /// Posts one receive work request.
    ///
    /// # Safety
    ///
    /// The buffer `wr` names stays valid and registered until its completion is
    /// polled.
    pub(crate) unsafe fn post_recv(&self, wr: &mut sys::ibv_recv_wr) -> Result<(), FabricError> {
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        let post = self
            .context_ops()?
            .post_recv
            .ok_or_else(|| FabricError::io("post_recv", io::ErrorKind::Unsupported.into()))?;
        // SAFETY: as in `post_send`.
        check(
            unsafe { post(self.qp.as_ptr(), wr, &mut bad) },
            "ibv_post_recv",
        )
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the QP is live; destroying it flushes its outstanding requests.
        let rc = unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            log::error!(
                "fairring verbs: ibv_destroy_qp failed: {}",
                io::Error::from_raw_os_error(rc)
            );
        }
    }
}
