//! `--device cuda`: the benchmark's tensors in GPU memory.

use std::sync::Arc;

use fairring::cuda::{Device, DeviceBuffer, Stream, probe};
use fairring::{Algorithm, Communicator, DataType, ReduceOp};

/// One device buffer per operation in flight, and the rank's stream.
pub(crate) struct DeviceTensors {
    stream: Stream,
    bufs: Vec<DeviceBuffer>,
    _device: Arc<Device>,
}

fn gpu(e: fairring::cuda::Error) -> fairring::Error {
    fairring::Error::Gpu(e.to_string())
}

impl DeviceTensors {
    /// `parallel` buffers of `bytes` on GPU `LOCAL_RANK % visible devices`.
    pub(crate) fn new(parallel: usize, bytes: usize) -> fairring::Result<DeviceTensors> {
        let visible = probe::driver_info().map_err(gpu)?.devices.max(1);
        let local: u32 = std::env::var("LOCAL_RANK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let device = Device::open(local % visible).map_err(gpu)?;
        let stream = Stream::new(&device, false).map_err(gpu)?;
        let bufs = (0..parallel)
            .map(|_| DeviceBuffer::zeroed(&device, bytes.max(1)))
            .collect::<fairring::cuda::Result<Vec<_>>>()
            .map_err(gpu)?;
        Ok(DeviceTensors {
            stream,
            bufs,
            _device: device,
        })
    }

    /// Copies the first `n` elements of each host buffer to its device buffer.
    pub(crate) fn upload<T: Copy>(&mut self, host: &[Vec<T>], n: usize) -> fairring::Result<()> {
        for (d, h) in self.bufs.iter_mut().zip(host) {
            let bytes = as_bytes(&h[..n]);
            let mut view = d.slice_mut().split_at(bytes.len()).map_err(gpu)?.0;
            self.stream.upload_blocking(&mut view, bytes).map_err(gpu)?;
        }
        Ok(())
    }

    /// Copies the first `n` elements of each device buffer to its host buffer.
    pub(crate) fn download<T: Copy>(&self, host: &mut [Vec<T>], n: usize) -> fairring::Result<()> {
        for (d, h) in self.bufs.iter().zip(host) {
            let bytes = as_bytes_mut(&mut h[..n]);
            let view = d.slice().range(0..bytes.len()).map_err(gpu)?;
            self.stream.download_blocking(bytes, view).map_err(gpu)?;
        }
        Ok(())
    }

    /// All-reduces the first `count` elements of every buffer, all in flight
    /// at once, and waits for them on the host.
    pub(crate) fn all_reduce(
        &mut self,
        comm: &Communicator,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> fairring::Result<()> {
        let mut works = Vec::with_capacity(self.bufs.len());
        for b in &mut self.bufs {
            // SAFETY: the buffer is this value's, untouched until the work
            // is waited on below (works are waited on, or dropped, which
            // waits, before this returns); the stream lives in `self`.
            works.push(unsafe {
                comm.all_reduce_device_raw(
                    b.raw(),
                    count,
                    dtype,
                    op,
                    self.stream.raw(),
                    Some(algorithm),
                )?
            });
        }
        works.into_iter().try_for_each(fairring::Work::wait)
    }
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: the bench's element types are plain numbers without padding;
    // the byte view covers exactly the slice and borrows it.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn as_bytes_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid value of the
    // bench's element types.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}
