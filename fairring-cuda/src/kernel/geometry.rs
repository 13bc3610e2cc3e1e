//! How a reduction is cut for the kernel (scalar head, aligned 16-byte vectors,
//! scalar tail) and how many blocks it gets: host arithmetic, tested without a
//! device.

/// Bytes per vector load.
pub(crate) const VECTOR_BYTES: u64 = 16;

/// Threads per block; the kernels declare it in `__launch_bounds__`.
pub(crate) const THREADS: u32 = 256;

/// The three parts of a reduction over `head + vectors * lanes + tail` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Split {
    /// Scalar elements before the first aligned vector.
    pub(crate) head: u64,
    /// 16-byte vectors, aligned in every operand.
    pub(crate) vectors: u64,
    /// Scalar elements after the last vector.
    pub(crate) tail: u64,
}

impl Split {
    /// The split for `elements` elements of `elem_bytes` bytes at these
    /// addresses (each a multiple of `elem_bytes`). When the operands' offsets
    /// within 16 bytes differ, no vector is aligned in both, and every element is
    /// in the head.
    pub(crate) fn new(addresses: &[u64], elements: u64, elem_bytes: u64) -> Split {
        let lanes = VECTOR_BYTES / elem_bytes;
        let offset = addresses.first().map_or(0, |a| a % VECTOR_BYTES);
        if addresses.iter().any(|a| a % VECTOR_BYTES != offset) {
            return Split {
                head: elements,
                vectors: 0,
                tail: 0,
            };
        }
        let head = ((VECTOR_BYTES - offset) % VECTOR_BYTES / elem_bytes).min(elements);
        let vectors = (elements - head) / lanes;
        Split {
            head,
            vectors,
            tail: elements - head - vectors * lanes,
        }
    }

    /// Work items the widest part needs (vectors go two per thread per pass).
    pub(crate) fn work_items(&self, vectors_per_thread: u64) -> u64 {
        self.head
            .max(self.tail)
            .max(self.vectors.div_ceil(vectors_per_thread))
    }
}

/// Blocks to launch: enough to give each work item a thread, but no more than
/// the device keeps resident at once (`multiprocessors * blocks_per_sm`); the
/// kernels walk the rest grid-stride. At least one.
pub(crate) fn blocks(work_items: u64, multiprocessors: u32, blocks_per_sm: u32) -> u32 {
    let resident = u64::from(multiprocessors.max(1)) * u64::from(blocks_per_sm.max(1));
    let wanted = work_items.div_ceil(u64::from(THREADS)).max(1);
    u32::try_from(wanted.min(resident)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_operands_split_into_vectors_and_a_tail() {
        // f32 at 16-byte aligned addresses: 4 lanes.
        let s = Split::new(&[0x1000, 0x2000], 11, 4);
        assert_eq!(
            s,
            Split {
                head: 0,
                vectors: 2,
                tail: 3
            }
        );
    }

    #[test]
    fn a_shared_misalignment_becomes_a_head() {
        // f32 starting 8 bytes into a vector in both operands: 2 head elements.
        let s = Split::new(&[0x1008, 0x2008], 11, 4);
        assert_eq!(
            s,
            Split {
                head: 2,
                vectors: 2,
                tail: 1
            }
        );
        // u8, 15 bytes in: one head element, then vectors of 16.
        let s = Split::new(&[0x100F, 0x300F], 40, 1);
        assert_eq!(
            s,
            Split {
                head: 1,
                vectors: 2,
                tail: 7
            }
        );
    }

    #[test]
    fn different_misalignments_run_scalar() {
        let s = Split::new(&[0x1000, 0x2004], 1000, 4);
        assert_eq!(
            s,
            Split {
                head: 1000,
                vectors: 0,
                tail: 0
            }
        );
    }

    #[test]
    fn every_split_covers_each_element_once() {
        for elem in [1u64, 2, 4, 8] {
            for offset in (0..16).filter(|o| o % elem == 0) {
                for n in [0u64, 1, 3, 15, 16, 17, 1000] {
                    let s = Split::new(&[0x4000 + offset, 0x8000 + offset], n, elem);
                    assert_eq!(
                        s.head + s.vectors * (16 / elem) + s.tail,
                        n,
                        "{elem} {offset} {n}"
                    );
                    assert!(s.head < 16 / elem || n < 16 / elem, "{s:?}");
                    assert!(s.tail < 16 / elem, "{s:?}");
                    // The first vector starts aligned.
                    if s.vectors > 0 {
                        assert_eq!((0x4000 + offset + s.head * elem) % 16, 0, "{s:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn grids_cover_small_work_and_cap_at_residency() {
        assert_eq!(blocks(0, 132, 8), 1);
        assert_eq!(blocks(1, 132, 8), 1);
        assert_eq!(blocks(257, 132, 8), 2);
        // 256 MiB of f32 in pairs of vectors: 8M work items, capped at 132 * 8.
        assert_eq!(blocks(8 << 20, 132, 8), 1056);
        assert_eq!(blocks(u64::MAX, 0, 0), 1);
    }
}
