//! [`Communicator::start`]: a described [`Call`] lowered (`lowering::lower`),
//! its memory checked, and queued.

use super::lowering::{self, Lowered, byte_len, elements_in_all, lower};
use super::point_to_point::Posted;
use super::work::wait_range;
use super::*;

impl Communicator {
    /// Starts `call` (a collective, a send or a receive) and returns its
    /// [`Work`]. A refused call (a bad argument, named; a failed engine) has
    /// no effect: its memory is untouched, nothing is enqueued on its stream,
    /// and no operation is numbered, so the ranks still agree.
    ///
    /// # Safety
    ///
    /// `call.output` must be valid for reads and writes of its elements
    /// (`count`, or `world_size * count` for an all-gather), aligned for
    /// `dtype`, and nothing else may access it until the [`Work`] reports
    /// completion (or is dropped, which waits); a send's only for reads, and
    /// nothing else may write it. `call.input`, where it is not the output,
    /// as much for a reduce-scatter (`world_size * count` elements, apart
    /// from the output), and valid for reads of `count` elements until this
    /// returns for an all-gather. On device memory the same holds for every
    /// stream of the GPU, and `stream` must stay alive until the work reports
    /// completion (work ordered after `Work::enqueue_wait` may use the memory
    /// after it).
    pub unsafe fn start(&self, call: &Call) -> Result<Work<'_>> {
        let lowered = self.lower(call)?;
        let mut started = Started::new(self, 0);
        // SAFETY: the caller's contract, as documented.
        match unsafe { started.start(call, lowered) } {
            Ok(()) => Ok(started.into_work()),
            Err(e) => Err(e),
        }
    }

    /// Starts every call of `calls`, in order and all in flight at once, and
    /// returns one [`Work`] covering them all (a coalesced group: collectives,
    /// sends and receives alike). Every call is checked before any starts; a
    /// refusal names the `calls` argument and the call's index.
    ///
    /// # Safety
    ///
    /// As [`Communicator::start`], for every call; no two calls' memory may
    /// overlap (but for sends of the same memory).
    pub unsafe fn start_group(&self, calls: &[Call]) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.start_list(calls, |i| ("calls", i)) }
    }

    /// [`Communicator::start_group`], naming call `i` in a refusal as entry
    /// `name(i).1` of the list argument `name(i).0`.
    ///
    /// # Safety
    ///
    /// As [`Communicator::start_group`].
    pub(super) unsafe fn start_list(
        &self,
        calls: &[Call],
        name: impl Fn(usize) -> (&'static str, usize),
    ) -> Result<Work<'_>> {
        let lowered = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                self.lower(c).map_err(|e| {
                    let (argument, entry) = name(i);
                    in_list(argument, entry, e)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let messages = lowered
            .iter()
            .filter(|(l, _)| matches!(l, Lowered::Message(_)))
            .count();
        let mut started = Started::new(self, messages);
        for (call, lowered) in calls.iter().zip(lowered) {
            // SAFETY: forwarded from the caller, per call.
            if let Err(e) = unsafe { started.start(call, lowered) } {
                // Only a failed (or closing) communicator refuses here; what
                // the group started so far is waited for, and its entries
                // given back, as its work drops.
                drop(started.into_work());
                return Err(e);
            }
        }
        Ok(started.into_work())
    }

    /// Lowers `call` and checks its memory (with no side effect when it is
    /// refused, but readying the device side of its GPU); where its data
    /// moves as messages, readies the gate they wait at.
    fn lower(&self, call: &Call) -> Result<(Lowered, Option<DeviceCall>)> {
        let readied = self.ready_for_choice(call)?;
        let job = lowering::Job {
            choice: self.job(),
            rank: self.rank(),
        };
        let lowered = lower(call, &job)?;
        let Lowered::Operation(operation) = &lowered else {
            // A message's memory was checked with it (host memory only).
            return Ok((lowered, None));
        };
        let total = elements_in_all(call.collective, call.count, self.world_size())?;
        let device = match readied {
            Some(device) => device,
            None => self.check_memory(call, total)?,
        };
        if operation.descriptor.by_messages {
            let (engine, timeout) = (Arc::clone(&self.engine), self.timeout);
            self.ready_rooted(|| Box::new(move |seq| wait_range(&engine, seq, seq, timeout)))?;
        }
        Ok((lowered, device))
    }

    /// A device all-reduce that may run as one NCCL all-reduce over the
    /// workers (where the job's NCCL communicator may be made, or on one
    /// machine beside dedicated servers), or as the machines' own plan
    /// beside dedicated servers, where their GPUs decide (`auto`): its
    /// memory checked and its device side readied before the choice of
    /// what it runs, which depends on those communicators (so the first
    /// device operation chooses as the later ones, on every rank). `None`
    /// for every other call, checked after its lowering.
    fn ready_for_choice(&self, call: &Call) -> Result<Option<Option<DeviceCall>>> {
        #[cfg(feature = "cuda")]
        if matches!(call.memory, Memory::Device { .. })
            && call.collective == Collective::AllReduce
            && (self.nccl.across_job != crate::NcclAcrossMachines::Off
                || self.nccl.agree_on_switches
                || crate::engine::nccl_beside_servers(self.topology, self.servers))
        {
            let total = elements_in_all(call.collective, call.count, self.world_size())?;
            return self.check_memory(call, total).map(Some);
        }
        let _ = call;
        Ok(None)
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
            Memory::Device { .. } if !lowering::runs_on_device(call, total) => Ok(None),
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

/// What a start (of one call, or of a group) has started so far, to become
/// its [`Work`].
struct Started<'c> {
    comm: &'c Communicator,
    /// The operations numbered, `first..=last`.
    range: Option<(u64, u64)>,
    /// The collectives that move as messages once their checks (numbered)
    /// have passed: the first, then the others (one call's allocates
    /// nothing).
    rooted: Option<(Call, u64)>,
    more_rooted: Vec<(Call, u64)>,
    /// The sends and receives posted: the first, then the others (one
    /// message allocates nothing; several take a list from the pool).
    posted: Option<Arc<Posted>>,
    more_posted: Vec<Arc<Posted>>,
}

impl<'c> Started<'c> {
    /// Nothing started yet, with room for `messages` sends and receives.
    fn new(comm: &'c Communicator, messages: usize) -> Started<'c> {
        Started {
            comm,
            range: None,
            rooted: None,
            more_rooted: Vec::new(),
            posted: None,
            more_posted: if messages > 1 {
                comm.posted_list(messages - 1)
            } else {
                Vec::new()
            },
        }
    }

    /// Starts `call`, lowered as `lowered`.
    ///
    /// # Safety
    ///
    /// As [`Communicator::start`].
    unsafe fn start(&mut self, call: &Call, lowered: (Lowered, Option<DeviceCall>)) -> Result<()> {
        match lowered {
            (Lowered::Operation(operation), device) => {
                let by_messages = operation.descriptor.by_messages;
                // SAFETY: forwarded.
                let seq = unsafe { self.comm.submit(operation, device) }?;
                self.range = Some(self.range.map_or((seq, seq), |(first, _)| (first, seq)));
                if by_messages {
                    match self.rooted {
                        None => self.rooted = Some((*call, seq)),
                        Some(_) => self.more_rooted.push((*call, seq)),
                    }
                }
            }
            (Lowered::Message(m), _) => {
                // SAFETY: forwarded; lowering checked the peer and the
                // pointer.
                let posted = unsafe {
                    self.comm
                        .post_one(m.peer, m.sending, m.tag, m.data, m.count, m.dtype)
                }?;
                match self.posted {
                    None => self.posted = Some(posted),
                    Some(_) => self.more_posted.push(posted),
                }
            }
        }
        Ok(())
    }

    /// The work of everything started.
    fn into_work(self) -> Work<'c> {
        let Started {
            comm,
            range,
            rooted,
            more_rooted,
            posted,
            more_posted,
        } = self;
        let mut covers = match range {
            Some((first, last)) => Covers::operations(first, last),
            None => Covers::nothing(),
        };
        if rooted.is_some() {
            let calls = rooted.iter().chain(&more_rooted).map(|(c, s)| (c, *s));
            // SAFETY: `Communicator::start`'s contract covers each call's
            // memory until the work reports completion.
            covers.rooted = Some(unsafe { comm.queue_rooted(calls) });
        }
        if let Some(first) = posted {
            covers.messages = Some(comm.messages_of(first, more_posted));
        }
        Work::new(&comm.engine, covers)
    }
}
