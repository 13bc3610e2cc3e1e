//! Two binary trees over a job's machines, each machine an inner node of at
//! most one of them (the double binary tree of NCCL's tree all-reduce): a shape
//! in which no machine receives more than two contributions of a cell, and
//! every machine sends and receives the same bytes, however many machines
//! there are.
//!
//! **Tree 0** is the in-order binary tree over positions `1..=M`, machine `m`
//! at position `m + 1`. Position `p`, whose lowest set bit is `b`, has the
//! children `p - b/2` and `p + b/2` where `b > 1`, and none where `b = 1`; the
//! root is the largest power of two at most `M`. Positions past `M` do not
//! exist: a right child past `M` is replaced by its own left child (again, as
//! long as it is past `M`), and a parent past `M` by its own parent. Odd
//! positions are the leaves, even ones the inner nodes, and every position is
//! at most `floor(log2 M)` levels below the root.
//!
//! **Tree 1** places machine `m` at position `M - m` where `M` is even (the
//! mirror of tree 0) and at `((m + 1) mod M) + 1` where `M` is odd (a shift by
//! one). Either way a machine that is an inner node of tree 0 is a leaf of
//! tree 1; where `M` is odd, machine `M - 1` is a leaf of both.
//!
//! So where each tree carries half of every slot, up to its root and back
//! down, an inner node receives two halves from its children, sends one up,
//! receives one from its parent and sends two down, and a leaf sends one up
//! and receives one: every machine sends and receives two halves of each
//! tree's cells, and the staging it needs for its children's contributions is
//! one slot, whatever `M`.
//!
//! A [`Plan`](super::Plan) routes its cells through these trees where the
//! machines are too many for every one to serve a shard
//! ([`Routing::Trees`](super::Routing::Trees)). Queries are a few integer
//! operations and a walk of at most `log2 M` levels (12 at
//! [`MAX_MACHINES`]); nothing allocates or panics.

use super::PlanError;
use crate::topology::MAX_MACHINES;

/// The number of trees of a [`DoubleTree`].
pub const TREES: u32 = 2;

/// The most parts a cell travels through a tree in ([`Cell::part`](super::Cell::part));
/// a slice's cells take as many parts of at least the minimum shard as its
/// smallest cell holds, up to this ([`Slice::parts`](super::Slice::parts)).
///
/// An inner node forwards a cell's first part up (and a result's first part
/// down) while the next is still on its way, so a cell's trip through the
/// `2 log2 M` levels of its tree pipelines instead of being stored and
/// forwarded whole at each: the more parts, the shorter the pipeline's fill,
/// while each part is one more message a level, a post of its own. At 2048
/// H100s and 256 MiB (cells of 1.6 MiB) the scale model predicts 244 GB/s with
/// at most two parts, 276 with four, 287 with eight, 292 with sixteen and 282
/// with 32 (docs/scale-model.md). At most 256: a frame carries the part in a
/// byte.
pub const TREE_PARTS: u32 = 16;

/// The two binary trees over `M` machines (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DoubleTree {
    machines: u32,
}

impl DoubleTree {
    /// The trees over `machines` machines (`1..=MAX_MACHINES`).
    pub const fn new(machines: u32) -> Result<DoubleTree, PlanError> {
        if machines == 0 || machines > MAX_MACHINES {
            return Err(PlanError::MachineOutOfRange {
                machine: machines,
                machines: MAX_MACHINES,
            });
        }
        Ok(DoubleTree { machines })
    }

    /// `M`.
    pub const fn machines(&self) -> u32 {
        self.machines
    }

    /// The machine at the root of tree `tree`.
    pub const fn root(&self, tree: u32) -> Result<u32, PlanError> {
        if tree >= TREES {
            return Err(PlanError::TreeOutOfRange { tree });
        }
        Ok(self.machine_at(tree, self.root_position()))
    }

    /// Machine `machine`'s parent in tree `tree`; `None` at the root.
    pub const fn parent(&self, tree: u32, machine: u32) -> Result<Option<u32>, PlanError> {
        let p = match self.position(tree, machine) {
            Ok(p) => p,
            Err(e) => return Err(e),
        };
        if p == self.root_position() {
            return Ok(None);
        }
        let mut up = parent_in_full_tree(p);
        // A parent past `M` does not exist: the next one up stands for it. The
        // root, at most `M`, is an ancestor of every position below `2 * root`.
        while up > self.machines {
            up = parent_in_full_tree(up);
        }
        Ok(Some(self.machine_at(tree, up)))
    }

    /// Machine `machine`'s children in tree `tree`: the left one, then the
    /// right one, each `None` where it has none.
    pub const fn children(&self, tree: u32, machine: u32) -> Result<[Option<u32>; 2], PlanError> {
        let p = match self.position(tree, machine) {
            Ok(p) => p,
            Err(e) => return Err(e),
        };
        let b = lowest_bit(p);
        if b == 1 {
            return Ok([None, None]);
        }
        let left = Some(self.machine_at(tree, p - b / 2));
        // A right child past `M`: its left child stands for it, and so on
        // down, until one exists or a leaf past `M` ends the walk.
        let mut right = p + b / 2;
        while right > self.machines {
            let rb = lowest_bit(right);
            if rb == 1 {
                return Ok([left, None]);
            }
            right -= rb / 2;
        }
        Ok([left, Some(self.machine_at(tree, right))])
    }

    /// Whether machine `machine` is an inner node of tree `tree` (has a child).
    pub const fn is_inner(&self, tree: u32, machine: u32) -> Result<bool, PlanError> {
        match self.position(tree, machine) {
            // Even positions have a left child; odd ones none.
            Ok(p) => Ok(p.is_multiple_of(2)),
            Err(e) => Err(e),
        }
    }

    /// The root's position: the largest power of two at most `M`.
    const fn root_position(&self) -> u32 {
        1 << (31 - self.machines.leading_zeros())
    }

    /// Machine `machine`'s position in tree `tree`, in `1..=M`.
    const fn position(&self, tree: u32, machine: u32) -> Result<u32, PlanError> {
        if tree >= TREES {
            return Err(PlanError::TreeOutOfRange { tree });
        }
        let m = self.machines;
        if machine >= m {
            return Err(PlanError::MachineOutOfRange {
                machine,
                machines: m,
            });
        }
        Ok(match tree {
            0 => machine + 1,
            _ if m.is_multiple_of(2) => m - machine,
            _ => (machine + 1) % m + 1,
        })
    }

    /// The machine at position `p` (in `1..=M`) of tree `tree` (below [`TREES`]).
    const fn machine_at(&self, tree: u32, p: u32) -> u32 {
        let m = self.machines;
        match tree {
            0 => p - 1,
            _ if m.is_multiple_of(2) => m - p,
            _ => (p + m - 2) % m,
        }
    }
}

/// The lowest set bit of `p` (which is positive).
const fn lowest_bit(p: u32) -> u32 {
    p & p.wrapping_neg()
}

/// The parent of position `p` in the in-order binary tree over all positive
/// integers: `p - b` where `p` is a right child (bit `2b` set), `p + b`
/// where it is a left one, `b` its lowest set bit.
const fn parent_in_full_tree(p: u32) -> u32 {
    let b = lowest_bit(p);
    if p & (2 * b) != 0 { p - b } else { p + b }
}
