//! [`Prelude`]: what a broadcast or an all-gather writes into its own output
//! before it starts (zeros where other ranks' bytes go, an all-gather's input
//! into its place). It is applied only once the call has passed every check
//! (`Communicator::submit`), so a refused call leaves its memory (and its
//! stream) as they were: on the host, by this thread; on a device, enqueued
//! on the caller's stream, so that it too is ordered there without the host
//! waiting.

/// One fill of a call's own memory, at addresses of its memory space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fill {
    /// `bytes` zeroed at `at`.
    Zero { at: u64, bytes: usize },
    /// `bytes` copied from `from` to `to`.
    Copy { to: u64, from: u64, bytes: usize },
}

/// The fills of one call, in the order they apply (an all-gather's copy
/// before the zeros around it).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Prelude {
    fills: [Option<Fill>; 3],
}

impl Prelude {
    /// Adds `fill`, unless it is empty. A call has at most three.
    pub(super) fn push(&mut self, fill: Fill) {
        let empty = match fill {
            Fill::Zero { bytes, .. } | Fill::Copy { bytes, .. } => bytes == 0,
        };
        if empty {
            return;
        }
        if let Some(free) = self.fills.iter_mut().find(|f| f.is_none()) {
            *free = Some(fill);
        }
    }

    /// The fills, in the order they apply.
    #[cfg(test)]
    pub(super) fn fills(&self) -> Vec<Fill> {
        self.fills.iter().flatten().copied().collect()
    }

    /// Applies the fills to host memory, now.
    ///
    /// # Safety
    ///
    /// Every range is host memory the call hands to the operation, valid for
    /// writes (a copy's source for reads); a copy's ranges may overlap.
    pub(super) unsafe fn apply_on_host(&self) {
        for fill in self.fills.iter().flatten() {
            match *fill {
                Fill::Zero { at, bytes } => {
                    // SAFETY: this function's contract.
                    unsafe { std::ptr::write_bytes(host(at), 0, bytes) };
                }
                Fill::Copy { to, from, bytes } => {
                    let (to, from) = (host(to), host(from).cast_const());
                    // SAFETY: this function's contract; `copy` allows overlap.
                    unsafe { std::ptr::copy(from, to, bytes) };
                }
            }
        }
    }

    /// Enqueues the fills on `stream`.
    ///
    /// # Safety
    ///
    /// Every range is device memory of `side`'s GPU that the call hands to the
    /// operation, and a copy's ranges do not overlap.
    #[cfg(feature = "cuda")]
    pub(super) unsafe fn enqueue(
        &self,
        side: &crate::memory::DeviceSide,
        stream: &fairring_cuda::Stream,
    ) -> crate::error::Result<()> {
        use fairring_cuda::{DeviceSlice, DeviceSliceMut};
        for fill in self.fills.iter().flatten() {
            match *fill {
                Fill::Zero { at, bytes } => {
                    // SAFETY: this function's contract.
                    let mut dst = unsafe { DeviceSliceMut::from_raw(at, bytes, side.device()) };
                    stream
                        .fill(&mut dst, 0)
                        .map_err(crate::memory::cuda_error)?;
                }
                Fill::Copy { to, from, bytes } => {
                    // SAFETY: this function's contract.
                    let src = unsafe { DeviceSlice::from_raw(from, bytes, side.device()) };
                    // SAFETY: this function's contract.
                    let mut dst = unsafe { DeviceSliceMut::from_raw(to, bytes, side.device()) };
                    stream
                        .copy(&mut dst, src)
                        .map_err(crate::memory::cuda_error)?;
                }
            }
        }
        Ok(())
    }
}

/// The host pointer at `address`, which was made from one of this process.
#[expect(
    clippy::cast_possible_truncation,
    reason = "a host address came from a pointer of this machine, so it fits one"
)]
fn host(address: u64) -> *mut u8 {
    address as usize as *mut u8
}
