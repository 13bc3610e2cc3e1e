//! [`Communicator::start`]: a described [`Call`] lowered (`lowering::lower`),
//! its memory checked, and queued.

use super::lowering::{self, Lowered, byte_len, elements_in_all, lower, runs_on_device};
use super::work::wait_range;
use super::*;

impl Communicator {
    /// Starts `call` and returns its [`Work`]. A refused call (a bad
    /// argument, named; a failed engine) has no effect: its memory is
    /// untouched, nothing is enqueued on its stream, and no operation is
    /// numbered, so the ranks still agree.
    ///
    /// # Safety
    ///
    /// `call.output` must be valid for reads and writes of its elements
    /// (`count`, or `world_size * count` for an all-gather), aligned for
    /// `dtype`, and nothing else may access it until the [`Work`] reports
    /// completion (or is dropped, which waits). `call.input`, where it is
    /// not the output, as much for a reduce-scatter (`world_size * count`
    /// elements, apart from the output), and valid for reads of `count`
    /// elements until this returns for an all-gather. On device memory the
    /// same holds for every stream of the GPU, and `stream` must stay alive
    /// until the work reports completion (work ordered after
    /// `Work::enqueue_wait` may use the memory after it).
    pub unsafe fn start(&self, call: &Call) -> Result<Work<'_>> {
        let (lowered, device) = self.lower(call)?;
        let by_messages = lowered.descriptor.by_messages;
        // SAFETY: the caller's contract, as documented.
        let seq = unsafe { self.submit(lowered, device) }?;
        let mut work = Work::new(&self.engine, seq, seq);
        if by_messages {
            // SAFETY: as above; the work's messages cover the call's memory.
            work.messages = Some(unsafe { self.queue_rooted([(call, seq)]) });
        }
        Ok(work)
    }

    /// Starts every call of `calls`, in order and all in flight at once, and
    /// returns one [`Work`] covering them all (a coalesced group). Every call
    /// is checked before any starts; a refusal names the `calls` argument
    /// and the call's index.
    ///
    /// # Safety
    ///
    /// As [`Communicator::start`], for every call; no two calls' memory may
    /// overlap.
    pub unsafe fn start_group(&self, calls: &[Call]) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.start_list(calls, "calls") }
    }

    /// [`Communicator::start_group`], naming `argument` in a refusal.
    ///
    /// # Safety
    ///
    /// As [`Communicator::start_group`].
    pub(super) unsafe fn start_list(
        &self,
        calls: &[Call],
        argument: &'static str,
    ) -> Result<Work<'_>> {
        let requests = calls
            .iter()
            .enumerate()
            .map(|(i, c)| self.lower(c).map_err(|e| in_list(argument, i, e)))
            .collect::<Result<Vec<_>>>()?;
        let mut range: Option<(u64, u64)> = None;
        let mut by_messages = Vec::new();
        for (call, (lowered, device)) in calls.iter().zip(requests) {
            let moves = lowered.descriptor.by_messages;
            // SAFETY: forwarded from the caller, per call.
            match unsafe { self.submit(lowered, device) } {
                Ok(seq) => {
                    range = Some(range.map_or((seq, seq), |(a, _)| (a, seq)));
                    if moves {
                        by_messages.push((call, seq));
                    }
                }
                Err(e) => {
                    // Only a failed engine refuses here; the group started
                    // so far is waited for and its entries given back.
                    if let Some((first, last)) = range {
                        let mut work = Work::new(&self.engine, first, last);
                        // SAFETY: forwarded; dropping the work waits for them.
                        work.messages = (!by_messages.is_empty())
                            .then(|| unsafe { self.queue_rooted(by_messages) });
                        drop(work);
                    }
                    return Err(e);
                }
            }
        }
        let mut work = match range {
            Some((first, last)) => Work::new(&self.engine, first, last),
            None => Work::empty(&self.engine),
        };
        if !by_messages.is_empty() {
            // SAFETY: forwarded from the caller, per call.
            work.messages = Some(unsafe { self.queue_rooted(by_messages) });
        }
        Ok(work)
    }

    /// Lowers `call` and checks its memory (with no side effect when it is
    /// refused, but readying the device side of its GPU); where its data
    /// moves as messages, readies the gate they wait at.
    fn lower(&self, call: &Call) -> Result<(Lowered, Option<DeviceCall>)> {
        let job = lowering::Job {
            choice: self.job(),
            rank: self.rank(),
        };
        let lowered = lower(call, &job)?;
        let total = elements_in_all(call.collective, call.count, self.world_size())?;
        let device = self.check_memory(call, total)?;
        if lowered.descriptor.by_messages {
            let (engine, timeout) = (Arc::clone(&self.engine), self.timeout);
            self.ready_rooted(|| Box::new(move |seq| wait_range(&engine, seq, seq, timeout)))?;
        }
        Ok((lowered, device))
    }

    /// Checks the memory of `call` (whose total is `total` elements): host
    /// pointers not null and aligned; device pointers on one GPU, whose
    /// device side it readies, and not overlapping where the call forbids.
    /// Returns where a device call runs; `None`: on the host (a device call
    /// of no elements runs there too, having nothing to order).
    fn check_memory(&self, call: &Call, total: u64) -> Result<Option<DeviceCall>> {
        let (input_len, output_len) = match call.collective {
            Collective::AllGather | Collective::Gather => (call.count, total),
            Collective::ReduceScatter | Collective::Scatter => (total, call.count),
            Collective::Barrier => return Ok(None),
            _ => (call.count, call.count),
        };
        match call.memory {
            Memory::Host => {
                check_pointer(call.input.cast_mut(), input_len, call.dtype)?;
                check_pointer(call.output, output_len, call.dtype)?;
                let (input, output) = (call.input as usize as u64, call.output as usize as u64);
                match call.collective {
                    Collective::Reduce => {
                        check_reduce_overlap(input, output, byte_len(output_len, call.dtype)?)?;
                    }
                    Collective::Scatter => {
                        let n = byte_len(output_len, call.dtype)?;
                        let bytes = byte_len(input_len, call.dtype)?;
                        if n > 0 && overlaps(output, n, input, bytes) {
                            return Err(Error::invalid(
                                "output",
                                format!(
                                    "{output:#x} overlaps the input ({input:#x}, {bytes} bytes)"
                                ),
                            ));
                        }
                    }
                    _ => {}
                }
                Ok(None)
            }
            #[cfg(feature = "cuda")]
            Memory::Device { .. } if !runs_on_device(call, total) => Ok(None),
            #[cfg(feature = "cuda")]
            Memory::Device { stream } => self
                .check_device_memory(call, stream, input_len, output_len)
                .map(Some),
        }
    }
}

/// Refuses a reduce whose `input` overlaps its `output` (`bytes` bytes) other
/// than exactly (in place).
pub(super) fn check_reduce_overlap(input: u64, output: u64, bytes: usize) -> Result<()> {
    if input != output && bytes > 0 && overlaps(input, bytes, output, bytes) {
        return Err(Error::invalid(
            "input",
            format!(
                "{input:#x} overlaps the output ({output:#x}, {bytes} bytes) other than in place"
            ),
        ));
    }
    Ok(())
}

/// Whether `a_len` bytes at `a` and `b_len` bytes at `b` share a byte.
pub(super) fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b.saturating_add(b_len as u64) && b < a.saturating_add(a_len as u64)
}
