//! The control messages of point-to-point transfers over the fabric, each a
//! fabric message of kind `MessageControl` (`engine/tags.rs`):
//!
//! ```text
//! Ready    [1][tag u32][ordinal u64][receive u64][bytes u64][dtype u8][landing: RemoteRegion]
//! Failed   [6][tag u32][ordinal u64][receive u64][bytes u64][dtype u8]
//! Refused  [2][receive u64][bytes u64][dtype u8]
//! Empty    [3][receive u64]
//! Slots    [4][landing: RemoteRegion]
//! Freed    [5][slots u32]
//! Request  [7][tag u32][ordinal u64]
//! ```
//!
//! `Failed` is a `Ready` of a receive that failed before it could open its
//! tensor: its send fails too, and the pair's counts of posts stay in step.
//! `Slots` opens the sender's eager slots on the receiver (`eager`), once
//! per pair and way; `Freed` gives back the slots whose messages the
//! receiver has taken (a bit each). `Request` asks the receiver to announce
//! the receive of a send that waits (`eager`: a small receive waits for its
//! eager send unannounced).
//!
//! Integers are little-endian; `receive` is the receiver's message id, which
//! the sender echoes (and writes in its data's immediates) so that the
//! receiver finds the message without a lookup by peer and tag.

use fairring_core::DataType;
use fairring_rdma::fabric::RemoteRegion;

/// A receive, announced to its sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ready {
    pub(crate) tag: u32,
    /// Its place among the receives of its tag from its sender (`eager`).
    pub(crate) ordinal: u64,
    /// The receiver's message id.
    pub(crate) receive: u64,
    pub(crate) bytes: u64,
    pub(crate) dtype: DataType,
    /// Where the sender writes: the receiver's tensor, open to it.
    pub(crate) landing: RemoteRegion,
    /// The receive failed before it could open its tensor (`landing` is
    /// empty): its send fails.
    pub(crate) failed: bool,
}

/// What a sender tells a receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The receive met a send of `bytes` of `dtype`, which it does not match.
    Refused {
        receive: u64,
        bytes: u64,
        dtype: DataType,
    },
    /// The receive met a send of no bytes, which it matches: it is done.
    Empty { receive: u64 },
}

/// One decoded control message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Control {
    Ready(Ready),
    Reply(Reply),
    /// The sender's eager slots: where the receiver of this control message
    /// may write small sends.
    Slots(RemoteRegion),
    /// Eager slots taken and free again, a bit each.
    Freed(u32),
    /// The sender's send `ordinal` of `tag` waits for its receive's
    /// announcement.
    Request {
        tag: u32,
        ordinal: u64,
    },
}

const READY: u8 = 1;
const REFUSED: u8 = 2;
const EMPTY: u8 = 3;
const SLOTS: u8 = 4;
const FREED: u8 = 5;
const FAILED: u8 = 6;
const REQUEST: u8 = 7;

/// The landing of a receive that has none.
pub(crate) const NOWHERE: RemoteRegion = RemoteRegion {
    key: 0,
    address: 0,
    len: 0,
};

/// Bytes of the longest control message.
pub(crate) const MOST_BYTES: usize = 1 + 4 + 8 + 8 + 8 + 1 + RemoteRegion::BYTES;

/// The bytes of `c` in `out`; returns how many.
pub(crate) fn encode(c: &Control, out: &mut [u8; MOST_BYTES]) -> usize {
    let mut w = Writer { out, at: 0 };
    match c {
        Control::Ready(r) => {
            w.put(&[if r.failed { FAILED } else { READY }]);
            w.put(&r.tag.to_le_bytes());
            w.put(&r.ordinal.to_le_bytes());
            w.put(&r.receive.to_le_bytes());
            w.put(&r.bytes.to_le_bytes());
            w.put(&[r.dtype as u8]);
            if !r.failed {
                w.put(&r.landing.to_bytes());
            }
        }
        Control::Reply(Reply::Refused {
            receive,
            bytes,
            dtype,
        }) => {
            w.put(&[REFUSED]);
            w.put(&receive.to_le_bytes());
            w.put(&bytes.to_le_bytes());
            w.put(&[*dtype as u8]);
        }
        Control::Reply(Reply::Empty { receive }) => {
            w.put(&[EMPTY]);
            w.put(&receive.to_le_bytes());
        }
        Control::Slots(landing) => {
            w.put(&[SLOTS]);
            w.put(&landing.to_bytes());
        }
        Control::Freed(slots) => {
            w.put(&[FREED]);
            w.put(&slots.to_le_bytes());
        }
        Control::Request { tag, ordinal } => {
            w.put(&[REQUEST]);
            w.put(&tag.to_le_bytes());
            w.put(&ordinal.to_le_bytes());
        }
    }
    w.at
}

/// `payload` decoded, or `None` if it is not a control message.
pub(crate) fn decode(payload: &[u8]) -> Option<Control> {
    let mut r = Reader { bytes: payload };
    let c = match r.u8()? {
        kind @ (READY | FAILED) => {
            let mut ready = Ready {
                tag: u32::from_le_bytes(r.take()?),
                ordinal: u64::from_le_bytes(r.take()?),
                receive: u64::from_le_bytes(r.take()?),
                bytes: u64::from_le_bytes(r.take()?),
                dtype: DataType::from_u8(r.u8()?)?,
                landing: NOWHERE,
                failed: kind == FAILED,
            };
            if !ready.failed {
                ready.landing = RemoteRegion::from_bytes(r.rest(RemoteRegion::BYTES)?)?;
            }
            Control::Ready(ready)
        }
        REFUSED => Control::Reply(Reply::Refused {
            receive: u64::from_le_bytes(r.take()?),
            bytes: u64::from_le_bytes(r.take()?),
            dtype: DataType::from_u8(r.u8()?)?,
        }),
        EMPTY => Control::Reply(Reply::Empty {
            receive: u64::from_le_bytes(r.take()?),
        }),
        SLOTS => Control::Slots(RemoteRegion::from_bytes(r.rest(RemoteRegion::BYTES)?)?),
        FREED => Control::Freed(u32::from_le_bytes(r.take()?)),
        REQUEST => Control::Request {
            tag: u32::from_le_bytes(r.take()?),
            ordinal: u64::from_le_bytes(r.take()?),
        },
        _ => return None,
    };
    r.bytes.is_empty().then_some(c)
}

struct Writer<'a> {
    out: &'a mut [u8; MOST_BYTES],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        self.out[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn rest(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.bytes.split_at_checked(n)?;
        self.bytes = tail;
        Some(head)
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.rest(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take::<1>()?[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_messages_round_trip_and_fit_a_fabric_message() {
        let landing = RemoteRegion {
            key: 9,
            address: 0x7f00_0000_1000,
            len: 4096,
        };
        let all = [
            Control::Ready(Ready {
                tag: u32::MAX,
                ordinal: (1 << 63) + 5,
                receive: 1 << 40,
                bytes: 4096,
                dtype: DataType::BF16,
                landing,
                failed: false,
            }),
            Control::Ready(Ready {
                tag: 7,
                ordinal: 3,
                receive: 9,
                bytes: 40,
                dtype: DataType::F32,
                landing: NOWHERE,
                failed: true,
            }),
            Control::Reply(Reply::Refused {
                receive: 3,
                bytes: 17,
                dtype: DataType::U8,
            }),
            Control::Reply(Reply::Empty { receive: 0 }),
            Control::Slots(landing),
            Control::Freed(0b1010_0001),
            Control::Request {
                tag: 3,
                ordinal: u64::MAX - 1,
            },
        ];
        for c in all {
            let mut out = [0; MOST_BYTES];
            let n = encode(&c, &mut out);
            assert!(n <= fairring_rdma::fabric::MESSAGE_CAPACITY);
            assert_eq!(decode(&out[..n]), Some(c));
            // Cut short, or with a byte to spare, it is not a control message.
            assert_eq!(decode(&out[..n - 1]), None);
            let mut longer = out.to_vec();
            longer.truncate(n);
            longer.push(0);
            assert_eq!(decode(&longer), None);
        }
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[9]), None);
    }
}
