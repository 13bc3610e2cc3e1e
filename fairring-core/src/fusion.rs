//! Balanced fusion buffers, placed without negotiation (Herring, section III).
//!
//! A training step produces hundreds of gradients of very different sizes. Reducing
//! each on its own wastes the network on small messages, and giving whole tensors to
//! servers leaves most servers idle while the largest gradient is reduced. Herring
//! instead concatenates the gradients, in the order they were produced in the first
//! iteration (on rank 0, which broadcasts the order), into **fusion buffers of one
//! fixed size**, and reduces each buffer as soon as every gradient in it is ready.
//! Every buffer but the last is exactly full, so every buffer is sharded over every
//! server equally; a gradient that does not fit the rest of a buffer continues in
//! the next one.
//!
//! [`plan_fusion`] computes that placement: a pure function of the sizes in order,
//! the buffer size and the alignment, so every rank computes the same placement from
//! the same order and nothing needs to be negotiated. Output goes to a slice the
//! caller provides; nothing allocates.
//!
//! Each tensor starts at the next multiple of `align` bytes after the previous
//! tensor's end (counting across buffers as if they were one long buffer), so with
//! `align` at least the element size no element is ever split. Empty tensors take no
//! bytes and sit at the aligned position where the next tensor starts.

use core::fmt;
use core::ops::Range;

/// Where a tensor starts: `offset` bytes into fusion buffer `buffer`. A tensor longer
/// than the rest of its buffer continues at offset 0 of the next ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Position {
    /// Index of the buffer it starts in.
    pub buffer: u64,
    /// Byte offset in that buffer.
    pub offset: u64,
}

/// The shape of a fusion placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusionPlan {
    buffer_bytes: u64,
    end: u64,
}

/// One contiguous run of a tensor inside one fusion buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    /// The buffer.
    pub buffer: u64,
    /// Byte offset in the buffer.
    pub offset: u64,
    /// Byte offset in the tensor.
    pub tensor_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Why a fusion placement was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FusionError {
    /// The alignment is zero or not a power of two.
    BadAlignment {
        /// The alignment given.
        align: u64,
    },
    /// The buffer size is zero or not a multiple of the alignment.
    BadBufferSize {
        /// The buffer size given.
        buffer_bytes: u64,
        /// The alignment.
        align: u64,
    },
    /// The output slice is shorter than the list of sizes.
    OutputTooShort {
        /// Positions needed.
        needed: usize,
        /// Positions provided.
        provided: usize,
    },
    /// The tensors' total size overflows 64 bits.
    TooLarge {
        /// The tensor at which it overflowed.
        tensor: usize,
    },
}

impl fmt::Display for FusionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            FusionError::BadAlignment { align } => {
                write!(f, "fusion alignment {align} is not a power of two")
            }
            FusionError::BadBufferSize {
                buffer_bytes,
                align,
            } => write!(
                f,
                "fusion buffer size {buffer_bytes} is not a positive multiple of the alignment {align}"
            ),
            FusionError::OutputTooShort { needed, provided } => write!(
                f,
                "fusion output holds {provided} positions, {needed} tensors were given"
            ),
            FusionError::TooLarge { tensor } => {
                write!(f, "fused size overflows 64 bits at tensor {tensor}")
            }
        }
    }
}

impl core::error::Error for FusionError {}

/// Places tensors of `sizes` bytes, in that order, into fusion buffers of
/// `buffer_bytes` each, writing tensor `i`'s position to `out[i]`.
pub fn plan_fusion(
    sizes: &[u64],
    buffer_bytes: u64,
    align: u64,
    out: &mut [Position],
) -> Result<FusionPlan, FusionError> {
    if !align.is_power_of_two() {
        return Err(FusionError::BadAlignment { align });
    }
    if buffer_bytes == 0 || !buffer_bytes.is_multiple_of(align) {
        return Err(FusionError::BadBufferSize {
            buffer_bytes,
            align,
        });
    }
    let provided = out.len();
    let out = out
        .get_mut(..sizes.len())
        .ok_or(FusionError::OutputTooShort {
            needed: sizes.len(),
            provided,
        })?;
    let mut cursor = 0u64;
    let mut end = 0u64;
    for (tensor, (&size, position)) in sizes.iter().zip(out.iter_mut()).enumerate() {
        let start = cursor
            .checked_next_multiple_of(align)
            .ok_or(FusionError::TooLarge { tensor })?;
        *position = Position {
            buffer: start / buffer_bytes,
            offset: start % buffer_bytes,
        };
        cursor = start
            .checked_add(size)
            .ok_or(FusionError::TooLarge { tensor })?;
        if size > 0 {
            end = cursor;
        }
    }
    Ok(FusionPlan { buffer_bytes, end })
}

impl FusionPlan {
    /// Bytes of every buffer but the last.
    pub const fn buffer_bytes(&self) -> u64 {
        self.buffer_bytes
    }

    /// Number of buffers: enough to hold every byte of every tensor.
    pub const fn buffers(&self) -> u64 {
        self.end.div_ceil(self.buffer_bytes)
    }

    /// Bytes used in buffer `buffer`: `buffer_bytes` for all but the last.
    pub const fn buffer_len(&self, buffer: u64) -> u64 {
        let start = buffer.saturating_mul(self.buffer_bytes);
        if start >= self.end {
            0
        } else if self.end - start < self.buffer_bytes {
            self.end - start
        } else {
            self.buffer_bytes
        }
    }

    /// The pieces of a tensor of `size` bytes placed at `position`, one per buffer it
    /// touches, in order.
    pub const fn pieces(&self, position: Position, size: u64) -> Pieces {
        Pieces {
            buffer_bytes: self.buffer_bytes,
            global: position
                .buffer
                .saturating_mul(self.buffer_bytes)
                .saturating_add(position.offset),
            done: 0,
            size,
        }
    }

    /// The tensors (indices into `positions`, as [`plan_fusion`] wrote them for
    /// `sizes`) that have bytes in buffer `buffer`: the buffer can be reduced once
    /// these are all ready.
    pub fn tensors_in(&self, buffer: u64, sizes: &[u64], positions: &[Position]) -> Range<usize> {
        let global = |p: &Position| {
            p.buffer
                .saturating_mul(self.buffer_bytes)
                .saturating_add(p.offset)
        };
        let begin = buffer.saturating_mul(self.buffer_bytes);
        let end = begin.saturating_add(self.buffer_bytes);
        let n = sizes.len().min(positions.len());
        // Tensors are in placement order: the first one ending after `begin`...
        let first = positions[..n]
            .iter()
            .zip(sizes)
            .position(|(p, &s)| s > 0 && global(p).saturating_add(s) > begin)
            .unwrap_or(n);
        // ...through the last one starting before `end`.
        let last = positions[..n].partition_point(|p| global(p) < end);
        let last = (first..last)
            .rev()
            .find(|&i| sizes[i] > 0)
            .map_or(first, |i| i + 1);
        first..last.max(first)
    }
}

/// The pieces of one tensor, from [`FusionPlan::pieces`].
#[derive(Clone, Debug)]
pub struct Pieces {
    buffer_bytes: u64,
    global: u64,
    done: u64,
    size: u64,
}

impl Iterator for Pieces {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.done >= self.size {
            return None;
        }
        let at = self.global + self.done;
        let offset = at % self.buffer_bytes;
        let len = (self.buffer_bytes - offset).min(self.size - self.done);
        let piece = Piece {
            buffer: at / self.buffer_bytes,
            offset,
            tensor_offset: self.done,
            len,
        };
        self.done += len;
        Some(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn herring_figure_4() {
        // Five gradients in first-iteration order into 100-byte buffers.
        let sizes = [40, 30, 50, 10, 70];
        let mut pos = [Position::default(); 5];
        let plan = plan_fusion(&sizes, 100, 1, &mut pos).unwrap();
        let expected = [(0, 0), (0, 40), (0, 70), (1, 20), (1, 30)];
        for (p, (b, o)) in pos.iter().zip(expected) {
            assert_eq!((p.buffer, p.offset), (b, o));
        }
        assert_eq!(plan.buffers(), 2);
        assert_eq!(plan.buffer_len(0), 100);
        assert_eq!(plan.buffer_len(1), 100);
        // The third gradient spans both buffers.
        let pieces: [Piece; 2] = {
            let mut it = plan.pieces(pos[2], 50);
            [it.next().unwrap(), it.next().unwrap()]
        };
        assert_eq!(
            (pieces[0].buffer, pieces[0].offset, pieces[0].len),
            (0, 70, 30)
        );
        assert_eq!(
            (pieces[1].buffer, pieces[1].offset, pieces[1].len),
            (1, 0, 20)
        );
        assert_eq!(plan.tensors_in(0, &sizes, &pos), 0..3);
        assert_eq!(plan.tensors_in(1, &sizes, &pos), 2..5);
    }

    #[test]
    fn refuses_bad_parameters() {
        let mut pos = [Position::default(); 1];
        assert_eq!(
            plan_fusion(&[1], 100, 3, &mut pos),
            Err(FusionError::BadAlignment { align: 3 })
        );
        assert_eq!(
            plan_fusion(&[1], 100, 64, &mut pos),
            Err(FusionError::BadBufferSize {
                buffer_bytes: 100,
                align: 64
            })
        );
        assert_eq!(
            plan_fusion(&[1, 2], 128, 64, &mut pos),
            Err(FusionError::OutputTooShort {
                needed: 2,
                provided: 1
            })
        );
        assert_eq!(
            plan_fusion(&[u64::MAX, 1], 128, 64, &mut [Position::default(); 2]),
            Err(FusionError::TooLarge { tensor: 1 })
        );
    }
}
