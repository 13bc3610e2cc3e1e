//! `--device cuda`: the benchmark's tensors in GPU memory.

use std::sync::Arc;

use fairring::cuda::{Device, DeviceBuffer, Stream, probe};
use fairring::{Algorithm, Call, Communicator, DataType, ReduceOp};

use super::Timed;

/// One device buffer per operation in flight, the other side of each
/// all-gather (its input) or reduce-scatter (its output), and the rank's
/// stream.
pub(crate) struct DeviceTensors {
    stream: Stream,
    bufs: Vec<DeviceBuffer>,
    parts: Vec<DeviceBuffer>,
    _device: Arc<Device>,
}

fn gpu(e: fairring::cuda::Error) -> fairring::Error {
    fairring::Error::Gpu(e.to_string())
}

impl DeviceTensors {
    /// `parallel` buffers of `bytes`, and `parallel` parts of `part_bytes`,
    /// on GPU `local % visible devices` (`local`: the rank's index on its
    /// machine).
    pub(crate) fn new(
        local: u32,
        parallel: usize,
        bytes: usize,
        part_bytes: usize,
    ) -> fairring::Result<DeviceTensors> {
        let visible = probe::driver_info().map_err(gpu)?.devices.max(1);
        let device = Device::open(local % visible).map_err(gpu)?;
        let stream = Stream::new(&device, false).map_err(gpu)?;
        let buffers = |len: usize| {
            (0..parallel)
                .map(|_| DeviceBuffer::zeroed(&device, len.max(1)))
                .collect::<fairring::cuda::Result<Vec<_>>>()
                .map_err(gpu)
        };
        Ok(DeviceTensors {
            bufs: buffers(bytes)?,
            parts: buffers(part_bytes)?,
            stream,
            _device: Arc::clone(&device),
        })
    }

    /// Copies the first `n` elements of each host buffer, and the first `k`
    /// of each part, to the device.
    pub(crate) fn upload<T: Copy>(
        &mut self,
        host: &[Vec<T>],
        parts: &[Vec<T>],
        n: usize,
        k: usize,
    ) -> fairring::Result<()> {
        let pairs = self.bufs.iter_mut().zip(host).map(|(d, h)| (d, &h[..n]));
        let part_pairs = self.parts.iter_mut().zip(parts).map(|(d, h)| (d, &h[..k]));
        for (d, h) in pairs.chain(part_pairs) {
            let bytes = as_bytes(h);
            let mut view = d.slice_mut().split_at(bytes.len()).map_err(gpu)?.0;
            self.stream.upload_blocking(&mut view, bytes).map_err(gpu)?;
        }
        Ok(())
    }

    /// Copies the first `n` elements of each device buffer, and the first
    /// `k` of each part, to the host.
    pub(crate) fn download<T: Copy>(
        &self,
        host: &mut [Vec<T>],
        parts: &mut [Vec<T>],
        n: usize,
        k: usize,
    ) -> fairring::Result<()> {
        let pairs = self.bufs.iter().zip(host).map(|(d, h)| (d, &mut h[..n]));
        let part_pairs = self.parts.iter().zip(parts).map(|(d, h)| (d, &mut h[..k]));
        for (d, h) in pairs.chain(part_pairs) {
            let bytes = as_bytes_mut(h);
            let view = d.slice().range(0..bytes.len()).map_err(gpu)?;
            self.stream.download_blocking(bytes, view).map_err(gpu)?;
        }
        Ok(())
    }

    /// Runs `collective` on the first `n` elements of every buffer (`k` per
    /// rank, for an all-gather or a reduce-scatter), all in flight at once,
    /// ordered on the stream, and waits for them on the host. Broadcasts come
    /// from rank 0.
    #[expect(clippy::too_many_arguments, reason = "one iteration's parameters")]
    pub(crate) fn run(
        &mut self,
        comm: &Communicator,
        collective: Timed,
        n: u64,
        k: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> fairring::Result<()> {
        let stream = self.stream.raw();
        let mut works = Vec::with_capacity(self.bufs.len());
        for (b, p) in self.bufs.iter().zip(&self.parts) {
            let (b, p) = (b.raw(), p.raw());
            // The buffers are this value's, untouched until the works are
            // waited on below (works are waited on, or dropped, which waits,
            // before this returns); the stream lives in `self`; every buffer
            // holds `n` elements and every part `k`. That makes each call
            // below sound.
            let call = match collective {
                Timed::AllReduce => Call::all_reduce(b as *mut u8, n, dtype, op),
                Timed::Broadcast => Call::broadcast(b as *mut u8, n, dtype, 0),
                Timed::AllGather => Call::all_gather(p as *const u8, b as *mut u8, k, dtype),
                Timed::ReduceScatter => {
                    Call::reduce_scatter(b as *mut u8, p as *mut u8, k, dtype, op)
                }
                // Refused with `--device cuda` (options); in place, valid.
                Timed::Reduce => Call::reduce(b as *const u8, b as *mut u8, n, dtype, op, 0),
                Timed::Gather => Call::gather(p as *const u8, b as *mut u8, k, dtype, 0),
                Timed::Scatter => Call::scatter(b as *mut u8, p as *mut u8, k, dtype, 0),
                // Refused with `--device cuda` (options): messages are host-only.
                Timed::SendRecv | Timed::AllToAll => {
                    return Err(fairring::Error::InvalidArgument {
                        argument: "--collective",
                        reason: "messages run on host tensors only".into(),
                    });
                }
            };
            // SAFETY: as above.
            let work = unsafe { comm.start(&call.on_stream(stream).with(algorithm)) };
            works.push(work?);
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
