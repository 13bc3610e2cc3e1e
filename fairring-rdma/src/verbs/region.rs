//! Memory registered with the verbs provider: kept registered while a posted
//! write reads from it, deregistered once none does.

use super::*;

/// Keeps a region registered while a posted write reads from it.
pub(super) struct SourceUse(pub(super) Arc<RegionInner>);

impl Drop for SourceUse {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(super) struct RegionInner {
    pub(super) mr: MemoryRegion,
    pub(super) address: *mut u8,
    pub(super) len: usize,
    pub(super) in_flight: AtomicUsize,
}

// SAFETY: the address is only handed to the NIC and reported back to the owner;
// the registration contract governs access to the memory.
unsafe impl Send for RegionInner {}
// SAFETY: as for `Send`; the counter is atomic.
unsafe impl Sync for RegionInner {}

/// Memory registered with a [`VerbsFabric`]. Dropping it waits (polling the
/// fabric's completion queue, whose completions are kept for the next `poll`)
/// until no posted write reads from it, then deregisters it; peers' writes into
/// it fail from then on, failing the writer.
pub struct VerbsRegion {
    pub(super) inner: Arc<RegionInner>,
    pub(super) fabric: Arc<Inner>,
}

impl LocalRegion for VerbsRegion {
    fn key(&self) -> RegionKey {
        RegionKey(self.inner.mr.rkey())
    }
    fn len(&self) -> usize {
        self.inner.len
    }
    fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            key: self.inner.mr.rkey(),
            address: self.inner.address as u64,
            len: self.inner.len as u64,
        }
    }
    fn as_ptr(&self) -> *mut u8 {
        self.inner.address
    }
}

impl Drop for VerbsRegion {
    fn drop(&mut self) {
        while self.inner.in_flight.load(Ordering::Acquire) > 0 {
            let mut data = self.fabric.lock();
            if let Err(e) = self.fabric.progress(&mut data) {
                log::error!("fairring verbs: polling while deregistering: {e}");
            }
            drop(data);
            std::thread::yield_now();
        }
    }
}
