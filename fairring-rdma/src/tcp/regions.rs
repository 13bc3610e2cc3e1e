//! Registered memory: the table a receiver looks regions up in, and the counted
//! uses that keep a region registered while a transfer touches it.

use crate::sync::unmodelled::{AtomicU32, Ordering};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};

use crate::fabric::{FabricError, LocalRegion, RegionKey, RemoteRegion};

/// The key of every region registered to send from only: no key the table
/// hands out (they start at 1).
const SOURCE_ONLY: u32 = 0;

/// The regions registered with one fabric, by key.
pub struct RegionTable {
    regions: RwLock<HashMap<u32, Arc<RegionShared>>>,
    next_key: AtomicU32,
}

impl Default for RegionTable {
    fn default() -> Self {
        RegionTable::new()
    }
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> RegionTable {
        RegionTable {
            regions: RwLock::new(HashMap::new()),
            next_key: AtomicU32::new(1),
        }
    }

    /// Registers `len` bytes at `memory`.
    ///
    /// # Safety
    ///
    /// The memory must be valid for reads and writes of `len` bytes until the
    /// returned region is dropped, and the caller must not access it in any way
    /// that races with the fabric: not a write's source range from posting until
    /// its `Sent` or `SendFailed` completion, and not a range a peer may be writing
    /// (the caller's protocol decides which ranges those are; a `Landed` completion
    /// says a write has finished).
    pub unsafe fn register(
        self: &Arc<Self>,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<TcpRegion, FabricError> {
        check_len(len)?;
        let key = self
            .next_key
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |k| k.checked_add(1))
            .map_err(|_| FabricError::InvalidArgument {
                argument: "memory",
                reason: "this fabric has used all 2^32 region keys".into(),
            })?;
        let shared = RegionShared::new(key, memory, len);
        self.regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, Arc::clone(&shared));
        Ok(TcpRegion {
            shared,
            table: Arc::clone(self),
        })
    }

    /// Registers `len` bytes at `memory` to send from only: the region stays
    /// out of the table receivers look targets up in (its key, 0, names no
    /// region), so a peer's write into it is refused as unknown.
    ///
    /// # Safety
    ///
    /// While a send from the region is in flight its source range must be
    /// valid for reads and not written (`Fabric::register_source`).
    pub unsafe fn register_source(
        self: &Arc<Self>,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<TcpRegion, FabricError> {
        check_len(len)?;
        Ok(TcpRegion {
            shared: RegionShared::new(SOURCE_ONLY, memory, len),
            table: Arc::clone(self),
        })
    }

    /// Registers `len` bytes at `memory` as a window: in the table, but
    /// refused to peers' writes until [`RegionTable::open`] (see
    /// `Fabric::register_window`). Nothing touches the memory while it is
    /// closed, so registering it is safe.
    pub fn register_window(
        self: &Arc<Self>,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<TcpRegion, FabricError> {
        // SAFETY: the region starts closed to peers, and a window is never a
        // write's source (a caller sends from a source registration of its
        // own), so nothing reads or writes the memory through it before
        // `open`, whose contract is the caller's.
        let region = unsafe { self.register(memory, len) }?;
        region
            .shared
            .users
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .window = Some(false);
        Ok(region)
    }

    /// Opens `window` to peers' writes.
    ///
    /// # Safety
    ///
    /// `Fabric::open_window`'s contract.
    pub unsafe fn open(window: &TcpRegion) -> Result<(), FabricError> {
        let mut users = window
            .shared
            .users
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match users.window {
            _ if users.closed => Err(FabricError::RegionClosed),
            Some(_) => {
                users.window = Some(true);
                Ok(())
            }
            None => Err(FabricError::InvalidArgument {
                argument: "window",
                reason: "a region registered as a window opens; this one is always open".into(),
            }),
        }
    }

    /// Closes `window` to peers' writes and waits until none is landing.
    pub fn close(window: &TcpRegion) {
        let shared = &window.shared;
        let mut users = shared.users.lock().unwrap_or_else(PoisonError::into_inner);
        if users.window.is_none() {
            return;
        }
        users.window = Some(false);
        while users.count > 0 {
            users = shared
                .released
                .wait(users)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// A counted use of region `key`, or `None` if no such region is registered.
    pub(crate) fn acquire(&self, key: u32) -> Option<RegionUse> {
        let region = Arc::clone(
            self.regions
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&key)?,
        );
        RegionUse::new(region).ok()
    }
}

struct Users {
    count: usize,
    closed: bool,
    /// For a window, whether it is open; `None`: not a window (always open
    /// while registered).
    window: Option<bool>,
}

/// One registered region, shared by its handle and the transfers touching it.
pub(crate) struct RegionShared {
    key: u32,
    memory: NonNull<u8>,
    len: usize,
    users: Mutex<Users>,
    released: Condvar,
}

impl RegionShared {
    /// Region `key`: `len` bytes at `memory`, no transfer touching it yet.
    fn new(key: u32, memory: NonNull<u8>, len: usize) -> Arc<RegionShared> {
        Arc::new(RegionShared {
            key,
            memory,
            len,
            users: Mutex::new(Users {
                count: 0,
                closed: false,
                window: None,
            }),
            released: Condvar::new(),
        })
    }
}

/// Refuses a length no allocation can have.
fn check_len(len: usize) -> Result<(), FabricError> {
    if isize::try_from(len).is_err() {
        return Err(FabricError::InvalidArgument {
            argument: "len",
            reason: format!("{len} bytes is more than any allocation can hold"),
        });
    }
    Ok(())
}

// SAFETY: `RegionShared` holds a pointer to memory the registrant promised (in
// `RegionTable::register`'s contract) stays valid until the region is dropped, and
// whose concurrent use the contract leaves to the caller's protocol. The pointer
// itself is only read; the use count is behind a mutex.
unsafe impl Send for RegionShared {}
// SAFETY: as for `Send`: every field is either immutable or behind a mutex.
unsafe impl Sync for RegionShared {}

/// A counted use of a region: while one exists, the region's handle cannot
/// finish dropping, so the memory stays valid for the transfer that holds it.
pub(crate) struct RegionUse {
    region: Arc<RegionShared>,
}

impl RegionUse {
    pub(crate) fn new(region: Arc<RegionShared>) -> Result<RegionUse, FabricError> {
        let mut users = region.users.lock().unwrap_or_else(PoisonError::into_inner);
        if users.closed || users.window == Some(false) {
            return Err(FabricError::RegionClosed);
        }
        users.count += 1;
        drop(users);
        Ok(RegionUse { region })
    }

    pub(crate) fn key(&self) -> u32 {
        self.region.key
    }

    pub(crate) fn len(&self) -> usize {
        self.region.len
    }

    /// The bytes `start..end` of the region, to send from.
    ///
    /// # Safety
    ///
    /// `start <= end <= len()`, and nothing writes these bytes while the slice lives
    /// (the registration contract makes that the caller's duty for source ranges).
    pub(crate) unsafe fn bytes(&self, start: usize, end: usize) -> &[u8] {
        debug_assert!(start <= end && end <= self.region.len);
        // SAFETY: the region's memory is valid for `len` bytes while registered,
        // this use keeps it registered, and `start <= len` (caller's contract).
        let first = unsafe { self.region.memory.as_ptr().add(start) };
        // SAFETY: `first..first + (end - start)` lies in the region (caller's
        // contract); the registration contract rules out concurrent writes.
        unsafe { std::slice::from_raw_parts(first, end - start) }
    }

    /// The bytes `start..end` of the region, to receive into.
    ///
    /// # Safety
    ///
    /// `start <= end <= len()`, and nothing else reads or writes these bytes while
    /// the slice lives (the receiver holds one such slice at a time; the
    /// registration contract keeps the caller off ranges peers write).
    #[expect(
        clippy::mut_from_ref,
        reason = "the memory is the registrant's, not self's"
    )]
    pub(crate) unsafe fn bytes_mut(&self, start: usize, end: usize) -> &mut [u8] {
        debug_assert!(start <= end && end <= self.region.len);
        // SAFETY: as in `bytes`.
        let first = unsafe { self.region.memory.as_ptr().add(start) };
        // SAFETY: as in `bytes`, with exclusivity from this function's contract.
        unsafe { std::slice::from_raw_parts_mut(first, end - start) }
    }
}

impl Drop for RegionUse {
    fn drop(&mut self) {
        let mut users = self
            .region
            .users
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        users.count -= 1;
        if users.count == 0 && (users.closed || users.window == Some(false)) {
            self.region.released.notify_all();
        }
    }
}

/// A memory region registered with a [`TcpFabric`](super::TcpFabric).
///
/// Dropping it deregisters the region: peers' writes into it are refused from then
/// on (as a protocol violation of the writer), and the drop waits until no
/// transfer touches the memory any more. A transfer that stalls is ended by the
/// fabric's silence bound, so the wait is bounded too.
pub struct TcpRegion {
    shared: Arc<RegionShared>,
    table: Arc<RegionTable>,
}

impl TcpRegion {
    /// A counted use of this region, for a send.
    pub(crate) fn use_for_send(&self) -> Result<RegionUse, FabricError> {
        RegionUse::new(Arc::clone(&self.shared))
    }
}

impl LocalRegion for TcpRegion {
    fn key(&self) -> RegionKey {
        RegionKey(self.shared.key)
    }

    fn len(&self) -> usize {
        self.shared.len
    }

    fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            key: self.shared.key,
            address: 0,
            len: self.shared.len as u64,
        }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.shared.memory.as_ptr()
    }
}

impl core::fmt::Debug for TcpRegion {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TcpRegion")
            .field("key", &self.shared.key)
            .field("len", &self.shared.len)
            .finish()
    }
}

impl Drop for TcpRegion {
    fn drop(&mut self) {
        if self.shared.key != SOURCE_ONLY {
            self.table
                .regions
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&self.shared.key);
        }
        let mut users = self
            .shared
            .users
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        users.closed = true;
        while users.count > 0 {
            users = self
                .shared
                .released
                .wait(users)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}
