//! Loom models of the counter protocol of the shared-memory step
//! (`protocol.rs`): local ranks as threads, running the shipped [`Protocol`] over
//! loom's atomics, with every slot of every buffer a loom-tracked cell; and of
//! the handshake that keeps reads between tensors from completing with bytes
//! a failed rank's caller wrote (`tensor_copies.rs`, at the end).
//!
//! Each rank does what `ShmStep` does around each counter: writes the slots the
//! others reduce (stage in), reduces its own slot from the others' buffers, reads
//! every final slot (all-gather), and takes its buffer for a later slice only once
//! it is free. A rank that must wait sleeps on its doorbell, which the others ring
//! when they publish, as in the engine. Loom reports any read of a cell not ordered
//! after its write, any write while another rank may still read it, and a wake-up
//! lost (as a deadlock); the all-gathered values are checked too.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p fairring --lib --release loom_models`

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use std::time::Duration;

use super::protocol::{Counter, Counters, Protocol};
use super::tensor_copies::{self, CopyWords};
use crate::shm::Doorbell;
use crate::sync::{AtomicU64, Ordering};

/// The machine's segment as the protocol sees it, in loom's memory.
struct Segment {
    ranks: u32,
    buffers: u32,
    /// Per (rank, buffer, counter).
    counters: Vec<AtomicU64>,
    /// Per (rank, buffer, slot): the slot's bytes, as one value.
    slots: Vec<UnsafeCell<u64>>,
    /// Per rank.
    bells: Vec<Doorbell>,
}

impl Segment {
    fn new(ranks: u32, buffers: u32) -> Segment {
        let n = (ranks * buffers) as usize;
        Segment {
            ranks,
            buffers,
            counters: (0..n * 3).map(|_| AtomicU64::new(0)).collect(),
            slots: (0..n * ranks as usize)
                .map(|_| UnsafeCell::new(0))
                .collect(),
            bells: (0..ranks).map(|_| Doorbell::new()).collect(),
        }
    }

    /// Rank `rank` waits, asleep on its doorbell, until `ready` holds.
    fn until(&self, rank: u32, mut ready: impl FnMut() -> bool) {
        let bell = &self.bells[rank as usize];
        loop {
            let seen = bell.seen();
            if ready() {
                return;
            }
            bell.sleep(seen, Duration::from_secs(1));
        }
    }

    fn cell(&self, rank: u32, buffer: u32, slot: u32) -> &UnsafeCell<u64> {
        &self.slots[((rank * self.buffers + buffer) * self.ranks + slot) as usize]
    }

    fn write(&self, rank: u32, buffer: u32, slot: u32, value: u64) {
        // SAFETY: loom tracks the cell; an access the protocol fails to order is
        // reported, not undefined.
        self.cell(rank, buffer, slot)
            .with_mut(|p| unsafe { *p = value });
    }

    fn read(&self, rank: u32, buffer: u32, slot: u32) -> u64 {
        // SAFETY: as in `write`.
        self.cell(rank, buffer, slot).with(|p| unsafe { *p })
    }
}

impl Counters for Segment {
    fn ranks(&self) -> u32 {
        self.ranks
    }

    fn store(&self, rank: u32, buffer: u32, which: Counter, value: u64, order: Ordering) {
        self.counters[((rank * self.buffers + buffer) * 3 + which as u32) as usize]
            .store(value, order);
    }

    fn load(&self, rank: u32, buffer: u32, which: Counter, order: Ordering) -> u64 {
        self.counters[((rank * self.buffers + buffer) * 3 + which as u32) as usize].load(order)
    }

    fn wake(&self, rank: u32) {
        self.bells[rank as usize].ring();
    }
}

/// Rank `rank`'s contribution to slot `slot` of slice `slice`.
fn input(rank: u32, slice: u64, slot: u32) -> u64 {
    1 + u64::from(rank) * 100 + slice * 10 + u64::from(slot)
}

/// How a slice uses the local step.
#[derive(Clone, Copy)]
enum Algo {
    /// Stage in, reduce-scatter, all-gather (the hierarchical slice).
    Local,
    /// Writes its whole buffer without the local step, then announces it is done
    /// (the ring slice).
    Alone,
    /// Stages every slot, then reduces every slot from every rank's buffer,
    /// with no all-gather (a small slice on one machine, reduced whole).
    Whole,
}

/// One rank's part in one slice per entry of `slices`, over the segment's
/// buffers.
fn rank_body(seg: &Segment, rank: u32, slices: &[Algo]) {
    let p = Protocol {
        rank,
        buffers: seg.buffers,
    };
    let others = || (0..seg.ranks).filter(move |&r| r != rank);
    for (n, algo) in (0u64..).zip(slices) {
        let b = u32::try_from(n % u64::from(seg.buffers)).unwrap_or(0);
        seg.until(rank, || p.buffer_free(seg, b, n));
        if let Algo::Alone = algo {
            for slot in 0..seg.ranks {
                seg.write(rank, b, slot, input(rank, n, slot));
            }
            p.finish(seg, b, n);
            continue;
        }
        if let Algo::Whole = algo {
            let staged: Result<(), ()> = p.stage_in(seg, b, n, || {
                for slot in 0..seg.ranks {
                    seg.write(rank, b, slot, input(rank, n, slot));
                }
                Ok(())
            });
            assert!(staged.is_ok());
            seg.until(rank, || {
                p.try_reduce_whole(seg, b, n, || -> Result<(), ()> {
                    for slot in 0..seg.ranks {
                        let sum: u64 = (0..seg.ranks).map(|q| seg.read(q, b, slot)).sum();
                        let want: u64 = (0..seg.ranks).map(|q| input(q, n, slot)).sum();
                        assert_eq!(sum, want, "slot {slot} of slice {n}, reduced whole");
                    }
                    Ok(())
                })
                .unwrap_or(false)
            });
            continue;
        }
        let staged: Result<(), ()> = p.stage_in(seg, b, n, || {
            for r in others() {
                seg.write(rank, b, r, input(rank, n, r));
            }
            Ok(())
        });
        assert!(staged.is_ok());
        seg.until(rank, || {
            p.try_reduce_scatter(seg, b, n, || -> Result<(), ()> {
                let sum =
                    input(rank, n, rank) + others().map(|r| seg.read(r, b, rank)).sum::<u64>();
                seg.write(rank, b, rank, sum);
                Ok(())
            })
            .unwrap_or(false)
        });
        p.publish_slot(seg, b, n);
        seg.until(rank, || {
            p.try_all_gather(seg, b, n, || -> Result<(), ()> {
                for r in 0..seg.ranks {
                    let want: u64 = (0..seg.ranks).map(|q| input(q, n, r)).sum();
                    assert_eq!(seg.read(r, b, r), want, "slot {r} of slice {n}");
                }
                Ok(())
            })
            .unwrap_or(false)
        });
    }
}

fn run(ranks: u32, buffers: u32, slices: &'static [Algo], preemptions: usize) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(preemptions);
    }

    builder.check(move || {
        let seg = Arc::new(Segment::new(ranks, buffers));
        let threads: Vec<_> = (1..ranks)
            .map(|r| {
                let seg = Arc::clone(&seg);
                thread::spawn(move || rank_body(&seg, r, slices))
            })
            .collect();
        rank_body(&seg, 0, slices);
        for t in threads {
            t.join().unwrap();
        }
    });
}

/// Two ranks, one buffer, two slices: the second slice reuses the buffer, so
/// `Done` must order every read of the first before the second's writes.
#[test]
fn two_ranks_reuse_one_buffer() {
    run(2, 1, &[Algo::Local; 2], 2);
}

/// Two ranks, two buffers, three slices: the third slice comes back to the first
/// buffer while the second may still be in flight on the other (one preemption:
/// two take over ten minutes).
#[test]
fn two_ranks_rotate_two_buffers() {
    run(2, 2, &[Algo::Local; 3], 1);
}

/// Three ranks, one slice: every rank reads from both others (one preemption:
/// three threads at two take minutes).
#[test]
fn three_ranks_one_slice() {
    run(3, 1, &[Algo::Local], 1);
}

/// Two ranks, one buffer: a slice that writes its whole buffer without the local
/// step (a ring slice) follows one that others read through the local step; only
/// `Done` keeps its writes from the others' last reads.
#[test]
fn a_slice_without_the_local_step_reuses_a_buffer() {
    run(2, 1, &[Algo::Local, Algo::Alone], 2);
}

/// Two ranks, one buffer, two slices reduced whole: with no all-gather,
/// only `Done`, announced with the reduction, keeps the second slice's
/// staging from the first's reads.
#[test]
fn two_ranks_reduce_whole_reuse_one_buffer() {
    run(2, 1, &[Algo::Whole; 2], 2);
}

/// Two ranks, one buffer: a slice reduced whole between two reduced in parts
/// (sizes change from one call to the next).
#[test]
fn slices_reduced_whole_and_in_parts_share_a_buffer() {
    run(2, 1, &[Algo::Local, Algo::Whole, Algo::Local], 1);
}

/// The tensor-copy handshake (`tensor_copies.rs`), in loom's memory: every
/// rank's word, and its tensor as one atomic value. A read by another process
/// (`process_vm_readv`) racing with the owner's caller is no data race in
/// either process, only a read of whatever is there: so the tensor is an
/// atomic here, and what the model checks is that no read that returns comes
/// back with a value the caller wrote after the close.
struct Copies {
    words: Vec<AtomicU64>,
    tensors: Vec<AtomicU64>,
    /// The owner's failure record: written before it closes its tensors.
    record: AtomicU64,
}

/// What every tensor holds while its operation runs.
const PUBLISHED: u64 = 7;

/// What a failed rank's caller writes into its tensor once the operation is
/// declared finished.
const REUSED: u64 = 999;

/// The failed rank's record.
const RECORDED: u64 = 5;

impl Copies {
    fn new(ranks: u32) -> Copies {
        Copies {
            words: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            tensors: (0..ranks).map(|_| AtomicU64::new(PUBLISHED)).collect(),
            record: AtomicU64::new(0),
        }
    }
}

impl CopyWords for Copies {
    fn fetch_or(&self, owner: u32, bits: u64, order: Ordering) -> u64 {
        self.words[owner as usize].fetch_or(bits, order)
    }

    fn fetch_and(&self, owner: u32, bits: u64, order: Ordering) -> u64 {
        self.words[owner as usize].fetch_and(bits, order)
    }
}

/// Rank 0 fails while ranks `1..=readers` each read its tensor `reads` times:
/// it closes its tensors and, waiting for nobody, its caller writes the
/// tensor. Every read that returns must hold what the tensor held before;
/// once one is refused, every later one is too, and the refused reader sees
/// the failure record the owner wrote before closing.
fn a_failing_owner(readers: u32, reads: u32, preemptions: usize) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(preemptions);
    }
    builder.check(move || {
        let c = Arc::new(Copies::new(readers + 1));
        let threads: Vec<_> = (1..=readers)
            .map(|me| {
                let c = Arc::clone(&c);
                thread::spawn(move || {
                    for _ in 0..reads {
                        let read = tensor_copies::read_with(&*c, me, 0, || {
                            c.tensors[0].load(Ordering::Relaxed)
                        });
                        match read {
                            Some(value) => assert_eq!(
                                value, PUBLISHED,
                                "a read returned bytes written after the owner let go"
                            ),
                            None => {
                                // A refused reader reports the owner's record.
                                assert_eq!(
                                    c.record.load(Ordering::Relaxed),
                                    RECORDED,
                                    "a refused read does not see the owner's failure record"
                                );
                                assert!(tensor_copies::read_with(&*c, me, 0, || ()).is_none());
                                return;
                            }
                        }
                    }
                })
            })
            .collect();
        // The machine's failure record, as the engine publishes it before
        // closing its tensors.
        c.record.store(RECORDED, Ordering::Relaxed);
        tensor_copies::close(&*c, 0);
        // The failed operation is declared finished: its caller reuses the
        // tensor.
        c.tensors[0].store(REUSED, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
    });
}

#[test]
fn a_read_racing_with_its_owners_failure_is_thrown_away() {
    a_failing_owner(1, 2, 3);
}

/// Two readers of the root's tensor (a broadcast on three ranks).
#[test]
fn two_reads_racing_with_their_owners_failure_are_thrown_away() {
    a_failing_owner(2, 1, 2);
}
