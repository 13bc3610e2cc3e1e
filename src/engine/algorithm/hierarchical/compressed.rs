//! The hierarchical all-reduce on a compressed wire: which slices cross
//! narrow, and the conversions of cells, contributions and results in place
//! in the staging buffer. The module docs of `hierarchical` say when each
//! runs.

use std::ops::Range;

use fairring_core::{DataType, WireFormat};

use super::super::{Context, Converted, SliceInfo, Step};
use super::{alone, cell_range, served_shard};
use crate::error::Result;
use crate::memory::{Conversion, Direction};

/// The format this slice's values cross between machines in, if compressed:
/// `f32` values, and more than one machine or dedicated servers, straight to
/// the servers (through trees values cross exact: see the module docs).
pub(super) fn compressed(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Option<WireFormat> {
    (s.wire != WireFormat::Exact
        && s.dtype == DataType::F32
        && !alone(ctx)
        && s.slice.double_tree().is_none())
    .then_some(s.wire)
}

/// The shards of this device's slot that others serve: other machines, or
/// every shard where dedicated servers serve them all.
pub(super) fn sent_shards<'a>(
    ctx: &'a Context<'_>,
    s: &'a SliceInfo<'_>,
) -> impl Iterator<Item = u32> + 'a {
    let me = ctx.location.machine;
    let dedicated = ctx.servers > 0;
    (0..s.slice.shards()).filter(move |&shard| {
        dedicated
            || s.slice
                .server(ctx.location.device, shard)
                .is_ok_and(|m| m != me)
    })
}

/// Pushes one conversion per shard that other machines serve, in place in its
/// cell, the last naming `then`; returns whether there was one.
pub(super) fn convert_cells(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    format: WireFormat,
    direction: Direction,
    then: Converted,
    steps: &mut Vec<Step>,
) -> Result<bool> {
    let first = steps.len();
    for shard in sent_shards(ctx, s) {
        let cell = cell_range(ctx, s, shard)?;
        let from = match direction {
            Direction::Narrow => cell.clone(),
            Direction::Widen => cell.start..cell.start + format.wire_bytes(cell.len()),
        };
        steps.push(Step::Convert {
            conversion: Conversion {
                format,
                direction,
                from,
                to: cell.start,
            },
            then: None,
        });
    }
    match steps[first..].last_mut() {
        Some(Step::Convert { then: last, .. }) => {
            *last = Some(then);
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Narrows every cell this rank contributes, where it lies; the writes follow
/// [`Converted::Contributions`]. Returns whether there was one.
pub(super) fn narrow_contributions(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    format: WireFormat,
    steps: &mut Vec<Step>,
) -> Result<bool> {
    convert_cells(
        ctx,
        s,
        format,
        Direction::Narrow,
        Converted::Contributions,
        steps,
    )
}

/// Widens every result that landed, where it lies; the slot's publication
/// follows [`Converted::Slot`]. Returns whether there was one.
pub(super) fn widen_results(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    format: WireFormat,
    steps: &mut Vec<Step>,
) -> Result<bool> {
    convert_cells(ctx, s, format, Direction::Widen, Converted::Slot, steps)
}

/// Narrows the reduced shard into the send area and widens it back over the
/// shard; the writes follow [`Converted::Results`].
pub(super) fn narrow_result(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    format: WireFormat,
    steps: &mut Vec<Step>,
) -> Result<()> {
    let shard = cell_range(ctx, s, served_shard(ctx, s)?)?;
    let area = result_area(ctx, &shard, format)?;
    steps.push(Step::Convert {
        conversion: Conversion {
            format,
            direction: Direction::Narrow,
            from: shard.clone(),
            to: area.start,
        },
        then: None,
    });
    steps.push(Step::Convert {
        conversion: Conversion {
            format,
            direction: Direction::Widen,
            from: area,
            to: shard.start,
        },
        then: Some(Converted::Results),
    });
    Ok(())
}

/// Where the served shard's narrow result waits to be sent: the start of the
/// first contribution area, which the reduction has consumed and which no
/// peer writes again before this slice releases the buffer (the next slice's
/// contributions need its credit).
pub(super) fn result_area(
    ctx: &Context<'_>,
    shard: &Range<usize>,
    format: WireFormat,
) -> Result<Range<usize>> {
    let len = format.wire_bytes(shard.len());
    let first = ctx
        .layout
        .contributions_to(ctx.location.machine, len)?
        .first;
    Ok(first..first + len)
}
