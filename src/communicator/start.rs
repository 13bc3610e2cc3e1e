//! [`Communicator::start`]: a described [`Call`] checked, turned into the
//! all-reduce the engine runs (a [`Request`]) with what it enqueues before it
//! starts (a [`Prelude`]), and queued.

use super::prelude::Fill;
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
        let r = self.request(call)?;
        let by_messages = r.by_messages;
        // SAFETY: the caller's contract, as documented.
        let seq = unsafe { self.submit(r) }?;
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
            .map(|(i, c)| self.request(c).map_err(|e| in_list(argument, i, e)))
            .collect::<Result<Vec<Request>>>()?;
        let mut range: Option<(u64, u64)> = None;
        let mut by_messages = Vec::new();
        for (call, r) in calls.iter().zip(requests) {
            let moves = r.by_messages;
            // SAFETY: forwarded from the caller, per call.
            match unsafe { self.submit(r) } {
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

    /// Checks `call` (with no side effect when it is refused, but readying
    /// the device side of its GPU) and describes the all-reduce it runs as.
    fn request(&self, call: &Call) -> Result<Request> {
        let Call {
            collective,
            count,
            dtype,
            op,
            root,
            ..
        } = *call;
        // A reduce runs as an all-reduce; a gather and a scatter on device
        // memory as an all-gather and a broadcast (`Collective::engine_form`).
        let form = collective.engine_form();
        if matches!(form, Collective::AllReduce | Collective::ReduceScatter) {
            check_op(op, dtype)?;
        }
        if collective.has_root() {
            self.check_root(root)?;
        }
        let per_rank = matches!(
            collective,
            Collective::AllGather
                | Collective::ReduceScatter
                | Collective::Gather
                | Collective::Scatter
        );
        let total = if per_rank {
            self.times_world(count)?
        } else {
            count
        };
        let n = byte_len(count, dtype)?;
        let bytes = byte_len(total, dtype)?;
        let (input, output) = (call.input.cast_mut(), call.output);
        let place = self.check_memory(call, total)?;
        // A gather, a scatter or a reduce on host memory (of 2 MiB or more, in
        // a job of up to 32 ranks: `choice::rooted_by_messages`) moves as
        // messages (`point_to_point::rooted`, `point_to_point::chain`), after
        // a check the engine runs as a barrier: the check compares the call
        // across ranks, and its messages start only once it has passed.
        let memory = if place.is_none() {
            MemoryKind::Host
        } else {
            MemoryKind::Device
        };
        let wire = call.options.wire.unwrap_or(self.wire);
        let by_messages = choice::rooted_by_messages(
            collective,
            dtype,
            memory,
            wire,
            self.topology,
            bytes as u64,
        );
        let form = if by_messages {
            choice::check_moves_exactly(collective, call.options.wire)?;
            let (engine, timeout) = (Arc::clone(&self.engine), self.timeout);
            self.ready_rooted(|| Box::new(move |seq| wait_range(&engine, seq, seq, timeout)))?;
            Collective::Barrier
        } else {
            form
        };
        // What the engine runs: a byte-wise all-reduce for the collectives
        // that spread bytes, one byte for a barrier or a check.
        let runs_as = match form {
            Collective::Broadcast | Collective::AllGather => (DataType::U8, bytes),
            Collective::Barrier => (DataType::U8, 1),
            _ => (dtype, bytes),
        };
        let chosen = choice::choose(
            choice::Call {
                collective: if by_messages { form } else { collective },
                dtype: runs_as.0,
                bytes: runs_as.1 as u64,
                algorithm: call.options.algorithm,
                wire: call.options.wire,
            },
            &self.job(),
        )?;
        // Where a share of the tensor is delivered (a reduce-scatter's, a
        // scatter's part).
        let placed = |at: *mut u8| match place {
            #[cfg(feature = "cuda")]
            // The operation's entry is filled in when it is queued.
            Some(_) => PlacedTensor::Device(DeviceTensor::new(at as u64, n, 0)),
            _ => PlacedTensor::Host(HostTensor::new(at, n)),
        };
        let mut r = match collective {
            // Only a reduce's operator is its own (others ignore theirs).
            Collective::Reduce if by_messages => Request::check(dtype, count, op, chosen),
            _ if by_messages => Request::check(dtype, count, ReduceOp::Sum, chosen),
            Collective::AllReduce | Collective::Reduce => {
                Request::all_reduce(output, count, dtype, op, chosen)
            }
            Collective::Broadcast => Request::broadcast(output, bytes, dtype, count, root, chosen),
            Collective::Scatter => {
                let mut r = Request::broadcast(input, bytes, dtype, count, root, chosen);
                r.deliver = Some(Delivery {
                    to: placed(output),
                    range: self.share(n),
                });
                r
            }
            Collective::AllGather | Collective::Gather => {
                Request::all_gather(output, bytes, dtype, count, chosen)
            }
            Collective::ReduceScatter => {
                let share = self.share(n);
                Request::reduce_scatter(
                    input,
                    total,
                    dtype,
                    op,
                    count,
                    placed(output),
                    share,
                    chosen,
                )
            }
            Collective::Barrier => Request::barrier(chosen),
        };
        r.collective = collective;
        r.root = if collective.has_root() { root } else { 0 };
        // The all-reduce a broadcast or an all-gather otherwise runs as sums
        // the other ranks' zeros into each rank's bytes, as does a relay over
        // the machines inside each; the relay over the ranks overwrites them.
        // Device calls zero in any case: on the caller's stream, the zeros
        // cost the host nothing.
        let zeros = r.chosen.zero_fill || place.is_some();
        let address = |p: *const u8| p as usize as u64;
        // This rank's own part, copied with the check (a gather's to its
        // place in the output, from where a rank other than the root sends
        // it; a scatter's from the root's input).
        let own = self.rank() as usize * n;
        match collective {
            Collective::Gather if by_messages && address(input) != address(output) + own as u64 => {
                r.prelude.push(Fill::Copy {
                    to: address(output) + own as u64,
                    from: address(input),
                    bytes: n,
                });
            }
            // A chained reduce reduces into its output, which holds its input.
            Collective::Reduce if by_messages && input != output => {
                r.prelude.push(Fill::Copy {
                    to: address(output),
                    from: address(input),
                    bytes: n,
                });
            }
            Collective::Scatter if by_messages && root == self.rank() => {
                r.prelude.push(Fill::Copy {
                    to: address(output),
                    from: address(input) + own as u64,
                    bytes: n,
                });
            }
            _ => {}
        }
        match form {
            Collective::Broadcast if root != self.rank() && zeros => {
                r.prelude.push(Fill::Zero {
                    at: address(r.data),
                    bytes,
                });
            }
            Collective::AllGather => {
                let at = self.rank() as usize * n;
                let place = address(output) + at as u64;
                if address(input) != place {
                    r.prelude.push(Fill::Copy {
                        to: place,
                        from: address(input),
                        bytes: n,
                    });
                }
                if zeros {
                    r.prelude.push(Fill::Zero {
                        at: address(output),
                        bytes: at,
                    });
                    r.prelude.push(Fill::Zero {
                        at: place + n as u64,
                        bytes: bytes - at - n,
                    });
                }
            }
            // A reduce's input, unless in place, is copied into the output
            // it reduces in.
            Collective::AllReduce if input != output => {
                r.prelude.push(Fill::Copy {
                    to: address(output),
                    from: address(input),
                    bytes: n,
                });
            }
            _ => {}
        }
        #[cfg(feature = "cuda")]
        {
            r.device = place;
        }
        Ok(r)
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
            Memory::Device { .. } if total == 0 => Ok(None),
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
