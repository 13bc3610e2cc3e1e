//! The shared-memory segment of one machine.
//!
//! ```text
//! page 0      header: magic, geometry, `ready` (set by the creator last), the
//!             failure claim; line 1 holds the failure record (8 u64)
//! control     per local rank: a doorbell line, a line holding the rank's credit
//!             limit (a u64), a line holding the rank's tensor-copy word (a u64,
//!             see [`Segment::tensor_copies`]), a line holding the core its
//!             waiting thread last spun on (a u32, see [`Segment::core`]),
//!             then per staging buffer three lines holding the
//!             rank's progress counters (input ready, slot final, all-gather
//!             done), each a u64 on its own cache line, then the rank's
//!             operation table: `OPERATIONS` entries of 32 bytes (sequence + 1,
//!             then the operation's two descriptor words), then the rank's
//!             mailboxes: per local rank that sends it messages,
//!             `MAILBOX_SLOTS` lines (see [`Segment::mailbox`]), then its
//!             `BOUNCE_SLOTS` bounce slots of `BOUNCE_BYTES` (small messages
//!             it sends, copied through; see [`Segment::bounce`])
//! data        per local rank: B staging buffers of `buffer_bytes`, page aligned
//! ```
//!
//! Local rank 0 creates the segment (`shm_open` with `O_EXCL`, named after the job
//! tag and the machine), sizes it and sets `ready`; the others open it by name. Once
//! every local rank has mapped it, local rank 0 unlinks the name, so the segment
//! disappears from `/dev/shm` as soon as the job's processes exit, however they exit.

use std::ffi::CString;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use super::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::sync::unmodelled::{AtomicU32, AtomicU64, Ordering};

const MAGIC: u64 = 0x6661_6972_7269_6e67; // "fairring"
const PAGE: usize = 4096;
const LINE: usize = 64;
/// Lines at the head of a rank's control area: doorbell, credit, tensor
/// copies, core.
const HEAD_LINES: usize = 4;
/// Counter lines per (rank, buffer).
pub(crate) const COUNTERS: usize = 3;
/// Entries in a rank's operation table: operation `s` lives in entry
/// `s % OPERATIONS`. The engine keeps no more operations outstanding than this.
pub(crate) const OPERATIONS: usize = 1024;

/// The operation-table entry of operation `seq`.
pub(crate) fn operation_entry(seq: u64) -> usize {
    #[expect(clippy::cast_possible_truncation, reason = "below OPERATIONS")]
    let i = (seq % OPERATIONS as u64) as usize;
    i
}
/// Bytes of one operation-table entry.
const OPERATION_BYTES: usize = 32;
/// Words in the failure record.
pub(crate) const RECORD_WORDS: usize = 8;
/// Lines in the mailbox one local rank sends another messages through: the
/// sender's offers in flight to that rank, at most.
pub(crate) const MAILBOX_SLOTS: usize = 64;
/// A rank's bounce slots, and the bytes of each: its small messages to the
/// machine's ranks go through them, whatever the number of peers.
pub(crate) const BOUNCE_SLOTS: usize = 16;
pub(crate) const BOUNCE_BYTES: usize = 16 << 10;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    ready: AtomicU32,
    ranks: AtomicU32,
    buffers: AtomicU32,
    /// Local rank + 1 of the first rank that failed; 0 while none has.
    failed: AtomicU32,
    buffer_bytes: AtomicU64,
    /// 1 once the failed rank has written the failure record (release).
    record_ready: AtomicU32,
}

/// A mapped segment. Unmapped on drop.
pub(crate) struct Segment {
    base: NonNull<u8>,
    len: usize,
    ranks: u32,
    buffers: u32,
    buffer_bytes: usize,
    control: usize,
    data: usize,
    name: CString,
    creator: bool,
    unlinked: std::sync::Once,
}

// SAFETY: the segment is plain memory; every shared word in it is an atomic, and the
// data areas are accessed under the engine's protocol (see `local`).
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Segment {
    fn layout(ranks: u32, buffers: u32, buffer_bytes: usize) -> Option<(usize, usize, usize)> {
        let control = PAGE;
        let per_rank = Segment::per_rank(buffers, ranks);
        let data = round_up(control + per_rank * ranks as usize, PAGE);
        let len = (buffers as usize)
            .checked_mul(buffer_bytes)?
            .checked_mul(ranks as usize)?
            .checked_add(data)?;
        Some((control, data, len))
    }

    /// Bytes of one rank's control area, in a segment of `ranks` ranks.
    fn per_rank(buffers: u32, ranks: u32) -> usize {
        HEAD_LINES * LINE
            + buffers as usize * COUNTERS * LINE
            + OPERATIONS * OPERATION_BYTES
            + ranks as usize * MAILBOX_SLOTS * LINE
            + BOUNCE_SLOTS * BOUNCE_BYTES
    }

    /// Offset of local rank `rank`'s control area.
    fn control_of(&self, rank: u32) -> usize {
        assert!(rank < self.ranks, "local rank {rank} out of range");
        self.control + rank as usize * Segment::per_rank(self.buffers, self.ranks)
    }

    /// Creates (local rank 0) or opens (the others) the segment `name`.
    pub(crate) fn attach(
        name: &str,
        creator: bool,
        ranks: u32,
        buffers: u32,
        buffer_bytes: usize,
        timeout: Duration,
    ) -> Result<Segment> {
        let buffer_bytes = round_up(buffer_bytes, PAGE);
        let (control, data, len) = Segment::layout(ranks, buffers, buffer_bytes)
            .ok_or_else(|| Error::invalid("staging", "the shared segment's size overflows"))?;
        let cname = CString::new(name)
            .map_err(|_| Error::invalid("name", "shared-memory name contains a NUL"))?;
        let fd = if creator {
            create(&cname, len)?
        } else {
            open(&cname, len, timeout)?
        };
        let mapped = map_shared(len, Some(fd), name);
        // SAFETY: `fd` is ours; the mapping keeps the object alive without it.
        unsafe { libc::close(fd) };
        let base = mapped?;
        let segment = Segment {
            base,
            len,
            ranks,
            buffers,
            buffer_bytes,
            control,
            data,
            name: cname,
            creator,
            unlinked: std::sync::Once::new(),
        };
        let header = segment.header();
        if creator {
            // The object was created empty by ftruncate: everything is zero.
            header.magic.store(MAGIC, Ordering::Relaxed);
            header.ranks.store(ranks, Ordering::Relaxed);
            header.buffers.store(buffers, Ordering::Relaxed);
            header
                .buffer_bytes
                .store(buffer_bytes as u64, Ordering::Relaxed);
            header.ready.store(1, Ordering::Release);
        } else {
            let deadline = Instant::now() + timeout;
            while header.ready.load(Ordering::Acquire) == 0 {
                if Instant::now() > deadline {
                    return Err(Error::timeout(
                        format!("local rank 0 to initialise shared memory {name}"),
                        timeout,
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let found = (
                header.ranks.load(Ordering::Relaxed),
                header.buffers.load(Ordering::Relaxed),
                header.buffer_bytes.load(Ordering::Relaxed),
            );
            if header.magic.load(Ordering::Relaxed) != MAGIC
                || found != (ranks, buffers, buffer_bytes as u64)
            {
                return Err(Error::Topology {
                    reason: format!(
                        "shared memory {name} was made for {} ranks x {} buffers of {} bytes, \
                         this rank expects {ranks} x {buffers} of {buffer_bytes}: \
                         the local ranks disagree on their configuration",
                        found.0, found.1, found.2
                    ),
                });
            }
        }
        Ok(segment)
    }

    /// Bytes from one staging buffer to the next in a segment whose buffers hold
    /// `buffer_bytes`: rounded up to a page. A peer writing into this rank's
    /// buffers computes their addresses with it.
    pub(crate) fn buffer_stride(buffer_bytes: usize) -> usize {
        round_up(buffer_bytes, PAGE)
    }

    /// A segment in anonymous shared memory, for local ranks that are threads of
    /// one process (the engine's simulation), or a process with no local peers (a
    /// dedicated reduction server).
    pub(crate) fn anonymous(ranks: u32, buffers: u32, buffer_bytes: usize) -> Result<Segment> {
        let buffer_bytes = round_up(buffer_bytes, PAGE);
        let (control, data, len) = Segment::layout(ranks, buffers, buffer_bytes)
            .ok_or_else(|| Error::invalid("staging", "the shared segment's size overflows"))?;
        let base = map_shared(len, None, "anonymous memory")?;
        Ok(Segment {
            base,
            len,
            ranks,
            buffers,
            buffer_bytes,
            control,
            data,
            name: CString::default(),
            creator: false,
            unlinked: std::sync::Once::new(),
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: page 0 of the mapping holds the header: aligned, in bounds, and
        // only accessed through atomics.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }

    /// Removes the name; the memory lives on until every mapping is gone.
    pub(crate) fn unlink(&self) {
        if self.creator {
            self.unlinked.call_once(|| {
                // SAFETY: `name` is a valid C string.
                unsafe { libc::shm_unlink(self.name.as_ptr()) };
            });
        }
    }

    /// Local ranks sharing the segment.
    pub(crate) fn ranks(&self) -> u32 {
        self.ranks
    }

    /// Bytes of one staging buffer (rounded up to a page).
    pub(crate) fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// The doorbell of local rank `rank`.
    pub(crate) fn doorbell(&self, rank: u32) -> &Doorbell {
        let off = self.control_of(rank);
        // SAFETY: in bounds (the layout reserved it), 64-byte aligned, and only
        // used as atomics.
        unsafe { &*self.base.as_ptr().wrapping_add(off).cast::<Doorbell>() }
    }

    /// Local rank `rank`'s credit limit: slices below it may be written into
    /// its staging buffers (the engine's `credits`). Written by that rank only.
    pub(crate) fn credit(&self, rank: u32) -> &AtomicU64 {
        let off = self.control_of(rank) + LINE;
        // SAFETY: in bounds (the layout reserved the line), 64-byte aligned, only
        // used atomically.
        unsafe { &*self.base.as_ptr().wrapping_add(off).cast::<AtomicU64>() }
    }

    /// The core local rank `rank`'s waiting thread last spun on, plus one (0:
    /// none yet). Written by that rank only; a hint, with no ordering on it
    /// (`local::shared_core`).
    pub(crate) fn core(&self, rank: u32) -> &AtomicU32 {
        let off = self.control_of(rank) + 3 * LINE;
        // SAFETY: in bounds (the layout reserved the line), 64-byte aligned,
        // only used atomically.
        unsafe { &*self.base.as_ptr().wrapping_add(off).cast::<AtomicU32>() }
    }

    /// Local rank `rank`'s tensor-copy word: who reads that rank's tensors
    /// from another process (`process_vm_readv`; see the shared-memory
    /// step's copies between tensors), and whether the rank still allows it.
    ///
    /// ```text
    /// bit 63     closed: the rank's engine failed; no read may start, and
    ///            one still running throws its bytes away
    /// bit p      local rank p (below 63) is reading, or about to
    /// ```
    ///
    /// A reader sets its bit, reads only if the word it replaced was not
    /// closed, clears its bit when the read is over and keeps the bytes only
    /// if the word it replaced then was still not closed. The owner, once its
    /// engine failed, sets the closed bit and waits for nobody. All are
    /// read-modify-writes of one word, so either the reader's clear comes
    /// first in its modification order (and its read before the close) or
    /// the reader sees the word closed (see `local/tensor_copies.rs`).
    pub(crate) fn tensor_copies(&self, rank: u32) -> &AtomicU64 {
        let off = self.control_of(rank) + 2 * LINE;
        // SAFETY: in bounds (the layout reserved the line), 64-byte aligned,
        // only used atomically.
        unsafe { &*self.base.as_ptr().wrapping_add(off).cast::<AtomicU64>() }
    }

    /// Progress counter `index` (below [`COUNTERS`]) of local rank `rank` for
    /// buffer `buffer`.
    pub(crate) fn counter(&self, rank: u32, buffer: u32, index: usize) -> &AtomicU64 {
        assert!(
            rank < self.ranks && buffer < self.buffers && index < COUNTERS,
            "counter out of range"
        );
        let off =
            self.control_of(rank) + HEAD_LINES * LINE + (buffer as usize * COUNTERS + index) * LINE;
        // SAFETY: in bounds (asserted), 64-byte aligned, only used atomically.
        unsafe { &*self.base.as_ptr().wrapping_add(off).cast::<AtomicU64>() }
    }

    /// Entry `index` of local rank `rank`'s operation table: sequence + 1, then
    /// two descriptor words.
    pub(crate) fn operation(&self, rank: u32, index: usize) -> &[AtomicU64; 3] {
        assert!(index < OPERATIONS, "operation entry out of range");
        let off = self.control_of(rank)
            + HEAD_LINES * LINE
            + self.buffers as usize * COUNTERS * LINE
            + index * OPERATION_BYTES;
        // SAFETY: in bounds (the layout reserved it), 32-byte aligned, only used
        // atomically.
        unsafe {
            &*self
                .base
                .as_ptr()
                .wrapping_add(off)
                .cast::<[AtomicU64; 3]>()
        }
    }

    /// Line `slot` of the mailbox through which local rank `from` sends local
    /// rank `to` messages (see `engine/messages/mailbox.rs` for the protocol):
    ///
    /// ```text
    /// word 0   state: the offer's number k (its sender's count of offers
    ///          to `to`) << 2 | 1 offered (by `from`), 2 done, 3 refused
    ///          (by `to`); 0 before the first use
    /// word 1   the offer's tag (bits 0..32) and element type (bits 32..40)
    /// word 2   its bytes
    /// word 3   the address of the sender's tensor in its process
    /// word 4   refused: the receive's bytes
    /// word 5   refused: the receive's element type
    /// word 6   the sender's bounce slot holding the bytes, plus one (0: the
    ///          receiver reads the sender's tensor instead)
    /// ```
    ///
    /// The sender writes words 1 to 3 and 6, then word 0 with release; the
    /// receiver, having read word 0 with acquire, reads them, and on refusal
    /// writes words 4 and 5 before word 0, with release.
    pub(crate) fn mailbox(&self, to: u32, from: u32, slot: usize) -> &[AtomicU64; 8] {
        assert!(
            from < self.ranks && slot < MAILBOX_SLOTS,
            "mailbox line out of range"
        );
        let off = self.control_of(to)
            + HEAD_LINES * LINE
            + self.buffers as usize * COUNTERS * LINE
            + OPERATIONS * OPERATION_BYTES
            + (from as usize * MAILBOX_SLOTS + slot) * LINE;
        // SAFETY: in bounds (asserted, and the layout reserved the lines),
        // 64-byte aligned, only used atomically.
        unsafe {
            &*self
                .base
                .as_ptr()
                .wrapping_add(off)
                .cast::<[AtomicU64; 8]>()
        }
    }

    /// Bounce slot `slot` of local rank `rank`: [`BOUNCE_BYTES`] bytes that
    /// only `rank` writes (a small message it sends, copied in before it
    /// offers the message) and only the message's receiver reads, until the
    /// receiver settles the offer (`engine/messages/local.rs`).
    pub(crate) fn bounce(&self, rank: u32, slot: usize) -> NonNull<u8> {
        assert!(slot < BOUNCE_SLOTS, "bounce slot out of range");
        let off = self.control_of(rank)
            + HEAD_LINES * LINE
            + self.buffers as usize * COUNTERS * LINE
            + OPERATIONS * OPERATION_BYTES
            + self.ranks as usize * MAILBOX_SLOTS * LINE
            + slot * BOUNCE_BYTES;
        // SAFETY: in bounds (the layout reserved the slots), inside the mapping.
        unsafe { NonNull::new_unchecked(self.base.as_ptr().wrapping_add(off)) }
    }

    /// Claims the right to describe the machine's first failure for local rank
    /// `rank`; true for the first claimant only.
    pub(crate) fn claim_failure(&self, rank: u32) -> bool {
        self.header()
            .failed
            .compare_exchange(0, rank + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The failure record's words (written by the claimant, then published).
    fn record(&self) -> &[AtomicU64; RECORD_WORDS] {
        // SAFETY: line 1 of page 0 is reserved for the record: aligned, in bounds,
        // only used atomically.
        unsafe {
            &*self
                .base
                .as_ptr()
                .wrapping_add(LINE)
                .cast::<[AtomicU64; RECORD_WORDS]>()
        }
    }

    /// Writes and publishes the failure record (the claimant only).
    pub(crate) fn publish_failure(&self, words: [u64; RECORD_WORDS]) {
        for (slot, w) in self.record().iter().zip(words) {
            slot.store(w, Ordering::Relaxed);
        }
        self.header().record_ready.store(1, Ordering::Release);
    }

    /// The failed local rank and its record, once published.
    pub(crate) fn failure(&self) -> Option<(u32, [u64; RECORD_WORDS])> {
        let h = self.header();
        if h.record_ready.load(Ordering::Acquire) == 0 {
            return None;
        }
        let rank = h.failed.load(Ordering::Relaxed).checked_sub(1)?;
        let mut words = [0u64; RECORD_WORDS];
        for (w, slot) in words.iter_mut().zip(self.record()) {
            *w = slot.load(Ordering::Relaxed);
        }
        Some((rank, words))
    }

    /// The first byte of staging buffer `buffer` of local rank `rank`.
    /// Every rank's staging buffers, back to back: what a GPU's copies from
    /// the other local ranks' buffers read (first byte, length).
    #[cfg(feature = "cuda")]
    pub(crate) fn buffers_region(&self) -> (NonNull<u8>, usize) {
        let len = self.ranks as usize * self.buffers as usize * self.buffer_bytes;
        (self.buffer(0, 0), len)
    }

    pub(crate) fn buffer(&self, rank: u32, buffer: u32) -> NonNull<u8> {
        assert!(
            rank < self.ranks && buffer < self.buffers,
            "buffer out of range"
        );
        let off = self.data
            + (rank as usize * self.buffers as usize + buffer as usize) * self.buffer_bytes;
        // SAFETY: `off` is within the mapping (the layout reserved it).
        unsafe { self.base.add(off) }
    }

    /// The first byte of local rank `rank`'s buffers (one contiguous range of
    /// `buffers * buffer_bytes`).
    pub(crate) fn rank_area(&self, rank: u32) -> (NonNull<u8>, usize) {
        (
            self.buffer(rank, 0),
            self.buffers as usize * self.buffer_bytes,
        )
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: unmapping exactly the range mapped in `attach`; nothing borrowed
        // from the segment outlives it (accessors borrow `self`).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Maps `len` bytes shared: of the object `fd` (every page populated now), or
/// anonymous memory when `fd` is `None`.
fn map_shared(len: usize, fd: Option<i32>, what: &str) -> Result<NonNull<u8>> {
    let flags = match fd {
        Some(_) => libc::MAP_SHARED | libc::MAP_POPULATE,
        None => libc::MAP_SHARED | libc::MAP_ANONYMOUS,
    };
    // SAFETY: mapping a fresh range (null hint) of `len` bytes, of anonymous
    // memory or of the object `fd` refers to, which has at least `len` bytes
    // (created or checked by the caller).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd.unwrap_or(-1),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::io(
            format!("mapping {len} bytes of shared memory {what}"),
            std::io::Error::last_os_error(),
        ));
    }
    NonNull::new(p.cast::<u8>())
        .ok_or_else(|| Error::io("mmap", std::io::Error::other("null mapping")))
}

fn create(name: &std::ffi::CStr, len: usize) -> Result<i32> {
    for attempt in 0..2 {
        // SAFETY: `name` is a valid C string.
        let fd = unsafe {
            libc::shm_open(
                name.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd >= 0 {
            let size = libc::off_t::try_from(len)
                .map_err(|_| Error::invalid("staging", "shared segment too large"))?;
            // Allocate every page now: a /dev/shm too small for the segment is an
            // error here, not a SIGBUS at the first write to a missing page, and
            // no all-reduce pays for first-touch page allocation.
            // SAFETY: `fd` is a fresh shared-memory object we own.
            let sized = unsafe { libc::ftruncate(fd, size) } == 0;
            let allocated = if sized {
                // SAFETY: as above; posix_fallocate returns its error number.
                unsafe { libc::posix_fallocate(fd, 0, size) }
            } else {
                0
            };
            if !sized || allocated != 0 {
                let e = if sized {
                    std::io::Error::from_raw_os_error(allocated)
                } else {
                    std::io::Error::last_os_error()
                };
                // SAFETY: as above.
                unsafe { libc::close(fd) };
                // SAFETY: `name` is a valid C string.
                unsafe { libc::shm_unlink(name.as_ptr()) };
                return Err(Error::io(
                    format!(
                        "sizing shared memory {name:?} to {len} bytes (is /dev/shm large enough?)"
                    ),
                    e,
                ));
            }
            return Ok(fd);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EEXIST) && attempt == 0 {
            // A segment of a crashed run of the same job: ours now.
            log::warn!("fairring: removing stale shared memory {name:?}");
            // SAFETY: `name` is a valid C string.
            unsafe { libc::shm_unlink(name.as_ptr()) };
            continue;
        }
        return Err(Error::io(format!("creating shared memory {name:?}"), e));
    }
    Err(Error::io(
        format!("creating shared memory {name:?}"),
        std::io::Error::other("it keeps reappearing"),
    ))
}

fn open(name: &std::ffi::CStr, len: usize, timeout: Duration) -> Result<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        // SAFETY: `name` is a valid C string.
        let fd = unsafe { libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd >= 0 {
            // SAFETY: zeroed `stat` is a valid out-parameter.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `fd` is open and `st` is writable.
            let ok = unsafe { libc::fstat(fd, &raw mut st) } == 0;
            if ok && usize::try_from(st.st_size).is_ok_and(|s| s >= len) {
                return Ok(fd);
            }
            // SAFETY: `fd` is ours.
            unsafe { libc::close(fd) };
        }
        if Instant::now() > deadline {
            return Err(Error::timeout(
                format!("local rank 0 to create shared memory {name:?}"),
                timeout,
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
