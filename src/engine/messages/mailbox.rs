//! The lines of a mailbox in the machine's segment
//! ([`Segment::mailbox`](crate::shm::Segment::mailbox)), through which one
//! local rank offers another its messages.
//!
//! The sender numbers its offers to each local peer `k = 0, 1, ...` and puts
//! offer `k` in line `k % MAILBOX_SLOTS`, once that line's previous offer
//! (`k - MAILBOX_SLOTS`) has been settled: its tag, type, size and tensor
//! address, then the state word `k << 2 | OFFERED` with release. The
//! receiver reads its next expected offer's state with acquire; seeing
//! `OFFERED` for that `k`, it reads the rest, matches the offer with a
//! receive, copies the message into its tensor (from the sender's bounce
//! slot the line names, or from the sender's tensor with `process_vm_readv`
//! under the tensor-copy words' handshake), and settles the line: `DONE`,
//! or `REFUSED` with its own size and type written first, each with
//! release. The sender reads the settlement with acquire and finishes its
//! send.
//!
//! Each word has one writer at a time, and every hand-over is a
//! release/acquire pair on the state word: the sender writes the line only
//! while it is free (settled, or never used), the receiver only while it is
//! offered.

use fairring_core::DataType;

use crate::shm::segment::MAILBOX_SLOTS;
use crate::sync::unmodelled::{AtomicU64, Ordering};

const OFFERED: u64 = 1;
const DONE: u64 = 2;
const REFUSED: u64 = 3;
const FLAGS: u64 = 3;

/// An offer: what a sender tells the receiver of one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    /// Its number among the sender's offers to this receiver.
    pub(crate) k: u64,
    pub(crate) tag: u32,
    pub(crate) dtype: DataType,
    pub(crate) bytes: u64,
    /// The sender's tensor, in the sender's process.
    pub(crate) address: u64,
    /// The sender's bounce slot holding the bytes, if they were copied
    /// through one.
    pub(crate) bounce: Option<usize>,
}

/// How a receiver settled an offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    Done,
    /// The receive it met holds `bytes` of `dtype`.
    Refused {
        bytes: u64,
        dtype: DataType,
    },
}

/// The line offer `k` goes in.
pub(crate) fn slot(k: u64) -> usize {
    #[expect(clippy::cast_possible_truncation, reason = "below MAILBOX_SLOTS")]
    let i = (k % MAILBOX_SLOTS as u64) as usize;
    i
}

/// Whether `line` may take offer `k`: unused, or its previous offer settled.
pub(crate) fn is_free(line: &[AtomicU64; 8], k: u64) -> bool {
    let state = line[0].load(Ordering::Acquire);
    if state == 0 {
        return k < MAILBOX_SLOTS as u64;
    }
    (state >> 2) + MAILBOX_SLOTS as u64 == k && state & FLAGS != OFFERED
}

/// Puts `offer` in `line` (which [`is_free`] for it).
pub(crate) fn offer(line: &[AtomicU64; 8], offer: &Offer) {
    line[1].store(
        u64::from(offer.tag) | u64::from(offer.dtype as u8) << 32,
        Ordering::Relaxed,
    );
    line[2].store(offer.bytes, Ordering::Relaxed);
    line[3].store(offer.address, Ordering::Relaxed);
    line[6].store(offer.bounce.map_or(0, |b| b as u64 + 1), Ordering::Relaxed);
    // Release: the words above are written before the receiver sees them.
    line[0].store(offer.k << 2 | OFFERED, Ordering::Release);
}

/// Offer `k`, if `line` holds it; `Err(())` if it holds one this receiver
/// cannot read (an element type it does not know: the sender broke the
/// protocol).
pub(crate) fn take(line: &[AtomicU64; 8], k: u64) -> Option<Result<Offer, ()>> {
    if line[0].load(Ordering::Acquire) != k << 2 | OFFERED {
        return None;
    }
    let word = line[1].load(Ordering::Relaxed);
    #[expect(clippy::cast_possible_truncation, reason = "the tag's bits")]
    let tag = word as u32;
    #[expect(clippy::cast_possible_truncation, reason = "the type's byte")]
    let Some(dtype) = DataType::from_u8((word >> 32) as u8) else {
        return Some(Err(()));
    };
    Some(Ok(Offer {
        k,
        tag,
        dtype,
        bytes: line[2].load(Ordering::Relaxed),
        address: line[3].load(Ordering::Relaxed),
        bounce: usize::try_from(line[6].load(Ordering::Relaxed))
            .ok()
            .and_then(|b| b.checked_sub(1)),
    }))
}

/// Settles offer `k` in `line`.
pub(crate) fn settle(line: &[AtomicU64; 8], k: u64, how: Settled) {
    let flag = match how {
        Settled::Done => DONE,
        Settled::Refused { bytes, dtype } => {
            line[4].store(bytes, Ordering::Relaxed);
            line[5].store(u64::from(dtype as u8), Ordering::Relaxed);
            REFUSED
        }
    };
    // Release: the sender's tensor is read, and the refusal's words written,
    // before the sender sees the settlement.
    line[0].store(k << 2 | flag, Ordering::Release);
}

/// How offer `k` was settled, once it has been.
pub(crate) fn settled(line: &[AtomicU64; 8], k: u64) -> Option<Settled> {
    let state = line[0].load(Ordering::Acquire);
    if state >> 2 != k {
        return None;
    }
    match state & FLAGS {
        DONE => Some(Settled::Done),
        REFUSED => Some(Settled::Refused {
            bytes: line[4].load(Ordering::Relaxed),
            #[expect(clippy::cast_possible_truncation, reason = "a type's byte")]
            dtype: DataType::from_u8(line[5].load(Ordering::Relaxed) as u8).unwrap_or(DataType::U8),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line() -> [AtomicU64; 8] {
        std::array::from_fn(|_| AtomicU64::new(0))
    }

    #[test]
    fn an_offer_goes_round_its_line_and_the_line_comes_free_once_settled() {
        let l = line();
        let n = MAILBOX_SLOTS as u64;
        assert!(
            is_free(&l, 0) && !is_free(&l, n),
            "an unused line takes the first round"
        );
        let o = Offer {
            k: 0,
            tag: 7,
            dtype: DataType::BF16,
            bytes: 4096,
            address: 0x7f00_1000,
            bounce: Some(3),
        };
        offer(&l, &o);
        assert!(!is_free(&l, n), "offered: not free");
        assert_eq!(take(&l, 1), None, "not offer 1");
        assert_eq!(take(&l, 0), Some(Ok(o)));
        assert_eq!(settled(&l, 0), None, "not settled yet");
        settle(
            &l,
            0,
            Settled::Refused {
                bytes: 17,
                dtype: DataType::F32,
            },
        );
        assert_eq!(
            settled(&l, 0),
            Some(Settled::Refused {
                bytes: 17,
                dtype: DataType::F32
            })
        );
        assert!(is_free(&l, n) && !is_free(&l, 2 * n));
        offer(
            &l,
            &Offer {
                k: n,
                bounce: None,
                ..o
            },
        );
        assert_eq!(
            take(&l, n).map(|r| r.map(|o| (o.k, o.bounce))),
            Some(Ok((n, None)))
        );
        settle(&l, n, Settled::Done);
        assert_eq!(settled(&l, n), Some(Settled::Done));
        assert_eq!(
            settled(&l, 0),
            None,
            "a later round's settlement is not an earlier's"
        );
        assert_eq!(slot(n + 3), 3);
    }
}
