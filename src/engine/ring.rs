//! The ring all-reduce of one slice on one rank: the Horovod/Gloo/NCCL baseline.
//!
//! The slice is cut into `N` chunks (element counts differing by at most one).
//! Rank `r` sends to `r + 1` and receives from `r - 1`, over the fabric, whatever
//! machine they are on:
//!
//! - **reduce-scatter**, steps `k = 0..N-1`: step `k` sends chunk `r - k` into the
//!   next rank's receive slot `k`; receiving step `k` (chunk `r - k - 1`) reduces it
//!   into the buffer and sends it on as step `k + 1`. After `N - 1` steps chunk
//!   `r + 1` is fully reduced here.
//! - **all-gather**, steps `k = 0..N-1`: step 0 sends chunk `r + 1` into the same
//!   range of the next rank's buffer; receiving step `k` (chunk `r - k`, final)
//!   forwards it as step `k + 1`.
//!
//! Receive slots (`[inbox + k * ring_slot, ...)`) are used once per slice, so a
//! slice needs credit only for its first write into a rank. All-gather chunks
//! overwrite a chunk the receiver finished with before the chunk's reduction could
//! end (its own reduce-scatter send of it is a cause of the final value).
//! Landings carry no step: one peer's writes arrive in order, so the `k`-th
//! reduce-scatter landing is step `k`. Empty chunks (a slice of fewer than `N`
//! elements) are skipped by both sides alike.

use fairring_core::ReduceOp;
use fairring_core::reduce::finish_avg_bytes;
use fairring_core::staging::Event;
use fairring_rdma::fabric::Fabric;

use super::tags::{self, Kind};
use super::{Driver, Engine, PendingWrite};
use crate::error::{Error, Result};
use crate::local::reduce_into;

/// How far the ring of one slice has come.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RingProgress {
    /// Reduce-scatter steps received and processed.
    reduced: u32,
    /// All-gather steps received and processed.
    gathered: u32,
    /// Reduce-scatter and all-gather landings not processed yet.
    reduce_arrived: u32,
    gather_arrived: u32,
    /// Writes posted and not yet completed.
    sends: u32,
}

impl RingProgress {
    /// Counts reduce-scatter chunks that landed before the slice started here.
    pub(crate) fn arrived_early(&mut self, count: u32) {
        self.reduce_arrived += count;
    }
}

impl<F: Fabric> Engine<F> {
    /// Bytes of chunk `c` of the slice in `b`, from the start of the slice.
    fn chunk(&self, d: &Driver, b: u32, c: u32) -> std::ops::Range<usize> {
        let Some(a) = d.slots[b as usize].active else {
            return 0..0;
        };
        let n = u64::from(self.world);
        let elements = a.slice.span().len();
        let esize = a.slice.span().byte_len() / elements.max(1);
        let (q, rem) = (elements / n, elements % n);
        let c = u64::from(c);
        let start = c * q + c.min(rem);
        let len = q + u64::from(c < rem);
        let to = |e: u64| usize::try_from(e * esize).unwrap_or(usize::MAX);
        to(start)..to(start + len)
    }

    fn ring_index(&self, offset: i64) -> u32 {
        let n = i64::from(self.world);
        #[expect(clippy::cast_possible_truncation, reason = "reduced mod N <= u32::MAX")]
        let i = (i64::from(self.rank) + offset).rem_euclid(n) as u32;
        i
    }

    pub(super) fn ring_start(&self, d: &mut Driver, b: u32) -> Result<()> {
        if self.world > 1 {
            let c = self.ring_index(0);
            self.ring_send(d, b, Kind::RingReduce, 0, c)?;
        }
        self.ring_pump(d, b)
    }

    fn ring_send(&self, d: &mut Driver, b: u32, kind: Kind, step: u32, c: u32) -> Result<()> {
        let range = self.chunk(d, b, c);
        let Some(a) = d.slots[b as usize].active else {
            return Ok(());
        };
        if range.is_empty() {
            return Ok(());
        }
        let base = self.buffer_offset(b);
        let (target, credit_for) = if kind == Kind::RingReduce {
            (
                base + self.layout.inbox + step as usize * self.layout.ring_slot,
                Some(a.number),
            )
        } else {
            (base + range.start, None)
        };
        let w = PendingWrite {
            peer: self.ring_index(1),
            source: base + range.start,
            len: range.len(),
            target: target as u64,
            immediate: tags::immediate(kind, b, a.generation),
            token: tags::token(kind, b, a.generation),
            credit_for,
        };
        if let Some(x) = d.slots[b as usize].active.as_mut() {
            x.ring.sends += 1;
        }
        self.post(d, b, w)
    }

    pub(super) fn ring_landed(&self, d: &mut Driver, b: u32, gather: bool) -> Result<()> {
        if let Some(a) = d.slots[b as usize].active.as_mut() {
            if gather {
                a.ring.gather_arrived += 1;
            } else {
                a.ring.reduce_arrived += 1;
            }
        }
        self.ring_pump(d, b)
    }

    pub(super) fn ring_sent(&self, d: &mut Driver, b: u32) -> Result<()> {
        if let Some(a) = d.slots[b as usize].active.as_mut() {
            a.ring.sends = a.ring.sends.saturating_sub(1);
        }
        self.ring_pump(d, b)
    }

    pub(super) fn ring_advance(&self, d: &mut Driver, b: u32) -> Result<bool> {
        let before = d.slots[b as usize].active.map(|a| a.number);
        self.ring_pump(d, b)?;
        Ok(d.slots[b as usize].active.map(|a| a.number) != before)
    }

    /// Processes every step that can be processed, then finishes the slice if done.
    fn ring_pump(&self, d: &mut Driver, b: u32) -> Result<()> {
        let steps = self.world - 1;
        loop {
            let Some(a) = d.slots[b as usize].active else {
                return Ok(());
            };
            let p = a.ring;
            if p.reduced < steps {
                let k = p.reduced;
                let c = self.ring_index(-i64::from(k) - 1);
                let range = self.chunk(d, b, c);
                if !range.is_empty() {
                    if p.reduce_arrived == 0 {
                        // Wait for the landing; all-gather steps cannot come first.
                    } else {
                        self.ring_reduce(d, b, k, range)?;
                        self.bump(d, b, |r| {
                            r.reduce_arrived -= 1;
                            r.reduced += 1;
                        });
                        self.ring_after_reduce(d, b, k, c)?;
                        continue;
                    }
                } else {
                    self.bump(d, b, |r| r.reduced += 1);
                    self.ring_after_reduce(d, b, k, c)?;
                    continue;
                }
            }
            if p.gathered < steps {
                let k = p.gathered;
                let c = self.ring_index(-i64::from(k));
                let empty = self.chunk(d, b, c).is_empty();
                if empty || p.gather_arrived > 0 {
                    self.bump(d, b, |r| {
                        if !empty {
                            r.gather_arrived -= 1;
                        }
                        r.gathered += 1;
                    });
                    if k + 1 < steps {
                        self.ring_send(d, b, Kind::RingGather, k + 1, c)?;
                    }
                    continue;
                }
            }
            if p.reduced == steps && p.gathered == steps && p.sends == 0 {
                return self.ring_finish(d, b);
            }
            return Ok(());
        }
    }

    fn bump(&self, d: &mut Driver, b: u32, f: impl FnOnce(&mut RingProgress)) {
        if let Some(a) = d.slots[b as usize].active.as_mut() {
            f(&mut a.ring);
        }
    }

    fn ring_reduce(
        &self,
        d: &mut Driver,
        b: u32,
        k: u32,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let (_, rec) = self.active_record(d, b)?;
        let slot = self.layout.inbox + k as usize * self.layout.ring_slot;
        let len = range.len();
        let dst = self.staging(b, range);
        let src = &*self.staging(b, slot..slot + len);
        reduce_into(rec.sub.dtype, rec.sub.op, dst, &mut std::iter::once(src))
    }

    /// After reduce-scatter step `k` (chunk `c`): pass it on, or, at the last step,
    /// finish chunk `c` and start the all-gather.
    fn ring_after_reduce(&self, d: &mut Driver, b: u32, k: u32, c: u32) -> Result<()> {
        let steps = self.world - 1;
        if k + 1 < steps {
            return self.ring_send(d, b, Kind::RingReduce, k + 1, c);
        }
        let (_, rec) = self.active_record(d, b)?;
        if rec.sub.op == ReduceOp::Avg {
            let range = self.chunk(d, b, c);
            finish_avg_bytes(rec.sub.dtype, self.staging(b, range), self.world)
                .map_err(|e| Error::invalid("reduction", e.to_string()))?;
        }
        self.ring_send(d, b, Kind::RingGather, 0, c)
    }

    fn ring_finish(&self, d: &mut Driver, b: u32) -> Result<()> {
        let a = d.slots[b as usize]
            .active
            .ok_or_else(|| Error::invalid("staging buffer", "ring finish on an idle buffer"))?;
        if let Some(out) = self.output(d, b) {
            let len = out.len();
            out.copy_from_slice(self.staging(b, 0..len));
        }
        self.local.finish(b, a.number);
        let slot = &d.slots[b as usize];
        slot.state
            .on_event(Event::ReduceScatterDone, a.generation)
            .and_then(|_| slot.state.on_event(Event::AllGatherDone, a.generation))
            .map_err(|e| Error::invalid("staging buffer", e.to_string()))?;
        self.release(d, b)
    }
}
