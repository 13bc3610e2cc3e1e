//! The hierarchical all-reduce through the core's double binary tree: each
//! rank's neighbours in a shard's tree, and the writes that go up it (a leaf's
//! contribution, an inner node's partial sum). The module docs of
//! `hierarchical` say how a slice walks the trees.

use fairring_core::plan::{DoubleTree, PlanError};

use super::super::{Context, SliceInfo, Step, Write};
use super::{cell_range, served_shard};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};

/// Through trees, the trees and the tree `shard` travels through.
pub(super) fn tree_of(s: &SliceInfo<'_>, shard: u32) -> Result<(DoubleTree, u32)> {
    match (s.slice.double_tree(), s.slice.tree_of(shard)) {
        (Some(trees), Ok(Some(tree))) => Ok((trees, tree)),
        _ => Err(Error::internal(
            "only a slice routed through trees asks for its trees",
            format!("shard {shard} of slice {}", s.number),
        )),
    }
}

/// Through trees, this machine's neighbours in the tree of `shard`: its parent
/// (`None` at the root) and its children.
pub(super) fn tree_neighbours(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    shard: u32,
) -> Result<(Option<u32>, [Option<u32>; 2])> {
    let (trees, tree) = tree_of(s, shard)?;
    let me = ctx.location.machine;
    let inside = |e: PlanError| Error::internal("this machine is in every tree", e.to_string());
    Ok((
        trees.parent(tree, me).map_err(inside)?,
        trees.children(tree, me).map_err(inside)?,
    ))
}

/// Through trees, the rank of this device's rail on the parent of its machine
/// in the tree of the shard it reduces; `None` at the root or where it
/// reduces none.
pub(super) fn parent_of_served(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<Option<u32>> {
    if s.slice.double_tree().is_none() {
        return Ok(None);
    }
    match s.slice.shard_served_by(ctx.location.machine) {
        Ok(Some(shard)) => tree_neighbours(ctx, s, shard)?
            .0
            .map(|parent| ctx.rail_peer(parent))
            .transpose(),
        _ => Ok(None),
    }
}

/// Through trees, the write of part `part` of this device's cell of `shard` to
/// its parent in that shard's tree, into the same place of the parent's area
/// for this child: a leaf's contribution, or (`Kind::Partial`) an inner node's
/// partial sum.
pub(super) fn to_parent(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    shard: u32,
    part: u32,
    kind: Kind,
) -> Result<Write> {
    let (trees, tree) = tree_of(s, shard)?;
    let me = ctx.location.machine;
    let missing = |why: &'static str| {
        Error::internal(
            why,
            format!("machine {me}, shard {shard} of slice {}", s.number),
        )
    };
    let parent = trees
        .parent(tree, me)
        .map_err(|e| Error::internal("this machine is in every tree", e.to_string()))?
        .ok_or_else(|| missing("only a machine below a tree's root sends up"))?;
    let siblings = trees
        .children(tree, parent)
        .map_err(|e| Error::internal("a parent is in the tree", e.to_string()))?;
    let child = match siblings {
        [Some(left), _] if left == me => 0,
        [_, Some(right)] if right == me => 1,
        _ => return Err(missing("a machine is a child of its parent")),
    };
    let cell = cell_range(ctx, s, shard)?;
    let source = s.part_range(ctx.location.device, shard, part)?;
    Ok(Write {
        kind,
        peer: ctx.rail_peer(parent)?,
        target: ctx.layout.child(child)?.start + (source.start - cell.start),
        source,
        needs_credit: true,
        part,
    })
}

/// Through trees, part `part` of every shard of the slot whose tree has this
/// machine as a leaf, to the parent in that tree.
pub(super) fn tree_contributions(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    part: u32,
    steps: &mut Vec<Step>,
) -> Result<()> {
    for shard in 0..s.slice.shards() {
        let (trees, tree) = tree_of(s, shard)?;
        let inner = trees
            .is_inner(tree, ctx.location.machine)
            .map_err(|e| Error::internal("this machine is in every tree", e.to_string()))?;
        if !inner {
            steps.push(Step::Write(to_parent(
                ctx,
                s,
                shard,
                part,
                Kind::Contribution,
            )?));
        }
    }
    Ok(())
}

/// Through trees, below the root: part `part` of the reduced shard, a partial
/// sum, to the parent.
pub(super) fn send_up(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    part: u32,
    steps: &mut Vec<Step>,
) -> Result<()> {
    let shard = served_shard(ctx, s)?;
    steps.push(Step::Write(to_parent(ctx, s, shard, part, Kind::Partial)?));
    Ok(())
}
