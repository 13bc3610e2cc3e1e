//! Where every collective call ends: its lowered [`Operation`] numbered and
//! queued on the engine.

use super::lowering::{Operation, Share, Tensor};
use super::*;

impl Communicator {
    /// Queues a lowered collective: applies its prelude once nothing can refuse it
    /// any more, assigns its sequence number and hands it to the engine, on
    /// the GPU and stream of `device` where it runs on device memory. Only a
    /// failed engine (or one whose operation table stays full past the
    /// timeout) refuses it here, with no side effect.
    ///
    /// # Safety
    ///
    /// `lowered`'s memory must stay valid and untouched by the caller until
    /// the operation finishes, and its prelude's ranges be the call's own.
    pub(super) unsafe fn submit(
        &self,
        lowered: Operation,
        device: Option<DeviceCall>,
    ) -> Result<u64> {
        if let Some(e) = self.engine.failure() {
            return Err(Error::Failed { first: Box::new(e) });
        }
        #[cfg(feature = "cuda")]
        let device = match device {
            Some(call) => Some((self.device_side(call.ordinal)?, call)),
            None => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        let Operation {
            descriptor,
            tensor,
            deliver,
            prelude,
        } = lowered;
        let mut next = self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = *next;
        self.engine.take_entry(&self.engine.works, seq, || {
            format!("a free operation slot ({WORK_CAPACITY} operations are outstanding)")
        })?;
        let (data, len) = match tensor {
            Tensor::Call { at, bytes } => (at, bytes),
            Tensor::BarrierByte => (self.barrier_bytes[slot_of(seq)].as_ptr(), 1),
        };
        let host_share = |Share { to, range }: Share| Delivery {
            to: PlacedTensor::Host(HostTensor::new(to, range.len())),
            range,
        };
        #[cfg(feature = "cuda")]
        let (tensor, deliver) = match device {
            Some((side, call)) => {
                // SAFETY: the caller vouches for the stream (the device
                // calls' contract); the view lives only for this call.
                let stream = unsafe { fairring_cuda::Stream::from_raw(side.device(), call.stream) };
                // Every check has passed: from here the call is not refused,
                // so what it enqueues on the caller's stream is its own.
                // SAFETY: the prelude's ranges are the call's own device
                // memory (this function's contract).
                let enqueued = unsafe { prelude.enqueue(side, &stream) };
                if let Err(e) = enqueued.and_then(|()| side.record_start(seq, &stream)) {
                    self.engine.works.give_back(seq);
                    return Err(e);
                }
                // A device delivery is part of this operation's program.
                let deliver = deliver.map(|Share { to, range }| Delivery {
                    to: PlacedTensor::Device(DeviceTensor::new(to as u64, range.len(), seq)),
                    range,
                });
                let tensor = PlacedTensor::Device(DeviceTensor::new(data as u64, len, seq));
                (tensor, deliver)
            }
            None => {
                // SAFETY: this function's contract: the prelude's ranges are
                // the call's own host memory.
                unsafe { prelude.apply_on_host() };
                let tensor = PlacedTensor::Host(HostTensor::new(data, len));
                (tensor, deliver.map(host_share))
            }
        };
        #[cfg(not(feature = "cuda"))]
        let (tensor, deliver) = {
            // SAFETY: as above.
            unsafe { prelude.apply_on_host() };
            let tensor = PlacedTensor::Host(HostTensor::new(data, len));
            (tensor, deliver.map(host_share))
        };
        let Some(sub) = Submission::new(seq, tensor, descriptor, deliver, self.world_size()) else {
            self.engine.works.give_back(seq);
            return Err(Error::invalid(
                "count",
                format!(
                    "{descriptor} overflows in a job of {} ranks",
                    self.world_size()
                ),
            ));
        };
        if let Err(e) = self.engine.submit(sub) {
            #[cfg(feature = "cuda")]
            if device.is_some() {
                // The prelude and the start are on the caller's stream: the
                // call was accepted, and fails as an operation, so that its
                // work reports the error and streams waiting for it go on.
                self.engine.fail_accepted(seq, e);
                *next += 1;
                return Ok(seq);
            }
            self.engine.works.give_back(seq);
            return Err(e);
        }
        *next += 1;
        Ok(seq)
    }
}

/// A refusal of entry `i` of a list, named as the list's `argument`.
pub(super) fn in_list(argument: &'static str, i: usize, e: Error) -> Error {
    match e {
        Error::InvalidArgument { reason, .. } => {
            // "tensors" names tensor `i`, "calls" call `i`.
            let entry = argument.strip_suffix('s').unwrap_or(argument);
            Error::invalid(argument, format!("{entry} {i}: {reason}"))
        }
        other => other,
    }
}

/// Where a device operation's tensor lives and which stream orders it.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
pub(super) struct DeviceCall {
    pub(super) ordinal: u32,
    pub(super) stream: fairring_cuda::sys::CUstream,
}

/// No device calls without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Copy)]
pub(super) enum DeviceCall {}
