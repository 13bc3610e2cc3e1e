//! Checking a decoded header against the receiver's plan, before any payload byte
//! is written.

use super::{FrameHeader, FrameKind, WireError};
use crate::plan::{Cell, Geometry, Plan, Span, StagingLayout};
use crate::staging::Event;
use crate::topology::{Location, Topology};

/// Everything a receiving device knows about the frames it may accept: its job tag,
/// its rank, and the geometry its plans are made under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameCheck {
    job_tag: u64,
    rank: u32,
    me: Location,
    geometry: Geometry,
    layout: StagingLayout,
}

/// Where an accepted data frame's payload goes, and what it means once it is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The cell the payload carries.
    pub cell: Cell,
    /// The machine that sent it.
    pub from_machine: u32,
    /// The part of the cell it carries ([`Cell::part`]): the staging word of
    /// that part takes [`Placement::event`].
    pub part: u32,
    /// The bytes of the staging buffer it fills: exactly the payload length, inside
    /// the buffer ([`StagingLayout::total_bytes`]).
    pub target: Span,
    /// The event to report to the staging buffer once the payload has landed.
    pub event: Event,
}

impl FrameCheck {
    /// The check for device `rank` under `geometry`; refused with
    /// [`WireError::RoutedInGroups`] for a geometry that reduces its slots in
    /// groups.
    pub fn new(job_tag: u64, rank: u32, geometry: &Geometry) -> Result<FrameCheck, WireError> {
        if geometry.machine_groups().is_some() {
            return Err(WireError::RoutedInGroups);
        }
        let me = geometry
            .topology()
            .locate(rank)
            .map_err(|_| WireError::UnknownRank {
                rank,
                world_size: geometry.topology().world_size(),
            })?;
        Ok(FrameCheck {
            job_tag,
            rank,
            me,
            geometry: *geometry,
            layout: geometry.staging_layout(),
        })
    }

    /// The receiving rank.
    pub const fn rank(&self) -> u32 {
        self.rank
    }

    /// Checks a control frame (`Hello`, `Credit`, `Abort`, `Keepalive`): right job, a
    /// sender that is part of it and is not this rank.
    pub fn check_control(&self, header: &FrameHeader) -> Result<(), WireError> {
        if header.kind.is_data() || header.kind.has_region_address() {
            return Err(WireError::NotControlFrame { kind: header.kind });
        }
        self.check_job(header)?;
        self.sender(header).map(|_| ())
    }

    /// Checks a `Contribution` or `Result` frame against `plan`, the plan of
    /// operation `header.sequence` (the caller looks it up by that number).
    ///
    /// Accepted only if every field agrees with the plan: the sender is on this
    /// device's rail and on another machine; the slice and shard exist; a
    /// contribution is for the shard this machine serves, a result comes from the
    /// server of its shard (through trees: a contribution comes from a child in
    /// the shard's tree, a result from the parent); the part is one the cell
    /// travels in, and the payload length is exactly that part's. The returned
    /// [`Placement`] then says which bytes of the staging buffer receive it.
    pub fn check_data(&self, header: &FrameHeader, plan: &Plan) -> Result<Placement, WireError> {
        if !header.kind.is_data() {
            return Err(WireError::NotDataFrame { kind: header.kind });
        }
        if *plan.geometry() != self.geometry {
            return Err(WireError::GeometryMismatch);
        }
        self.check_job(header)?;
        let from = self.sender(header)?;
        if from.device != self.me.device {
            return Err(WireError::WrongRail {
                source_rank: header.source_rank,
                rail: from.device,
                expected: self.me.device,
            });
        }
        if from.machine == self.me.machine {
            return Err(WireError::FromOwnMachine {
                source_rank: header.source_rank,
            });
        }
        let slice = plan
            .slice(header.slice)
            .map_err(|_| WireError::SliceOutOfRange {
                slice: header.slice,
                slices: plan.slice_count(),
            })?;
        let cell =
            slice
                .cell(self.me.device, header.shard)
                .map_err(|_| WireError::ShardOutOfRange {
                    shard: header.shard,
                    shards: slice.shards(),
                })?;
        let part = u32::from(header.part);
        let part_span = cell.part(part).map_err(|_| WireError::PartOutOfRange {
            part,
            parts: cell.parts(),
        })?;
        // Where the part starts within its cell, wherever the cell lands.
        let within = part_span.byte_offset() - cell.span().byte_offset();
        let (target, event) = match (slice.double_tree(), slice.tree_of(header.shard)) {
            (Some(trees), Ok(Some(tree))) => {
                let refused = WireError::NotTreeNeighbour {
                    shard: header.shard,
                    tree,
                    from: from.machine,
                };
                let me = self.me.machine;
                match header.kind {
                    FrameKind::Contribution => {
                        let children = trees.children(tree, me).map_err(|_| refused)?;
                        let child = if children[0] == Some(from.machine) {
                            0
                        } else if children[1] == Some(from.machine) {
                            1
                        } else {
                            return Err(refused);
                        };
                        let area = self.layout.child(child).map_err(|_| refused)?;
                        (area.offset(), Event::ContributionReceived)
                    }
                    _ => {
                        if trees.parent(tree, me).map_err(|_| refused)? != Some(from.machine) {
                            return Err(refused);
                        }
                        let event = if trees.is_inner(tree, me).map_err(|_| refused)? {
                            Event::ParentResultReceived
                        } else {
                            Event::ResultReceived
                        };
                        (cell.slot_span().byte_offset(), event)
                    }
                }
            }
            _ => self.flat_target(header, &cell, from)?,
        };
        let len = u64::from(header.payload_len);
        if len != part_span.byte_len() {
            return Err(WireError::LengthMismatch {
                expected: part_span.byte_len(),
                found: header.payload_len,
            });
        }
        let target = target + within;
        let fits = match event {
            Event::ContributionReceived => within + len <= self.layout.shard_stride(),
            _ => target + len <= self.layout.slot().byte_len(),
        };
        if !fits {
            return Err(WireError::OutsideBuffer {
                offset: target,
                len,
                buffer: self.layout.total_bytes(),
            });
        }
        Ok(Placement {
            cell,
            part,
            from_machine: from.machine,
            target: Span::bytes(target, len),
            event,
        })
    }

    /// Where a flat plan's frame lands and what it means: a contribution for
    /// the shard this machine serves, or a result from its shard's server.
    fn flat_target(
        &self,
        header: &FrameHeader,
        cell: &Cell,
        from: Location,
    ) -> Result<(u64, Event), WireError> {
        let (expected_server, event) = match header.kind {
            FrameKind::Contribution => (self.me.machine, Event::ContributionReceived),
            _ => (from.machine, Event::ResultReceived),
        };
        if cell.server() != expected_server {
            return Err(WireError::NotServer {
                shard: header.shard,
                server: cell.server(),
            });
        }
        let target = match event {
            Event::ContributionReceived => self
                .layout
                .contribution(from.machine, self.me.machine)
                .map(|area| area.offset())
                // Unreachable: both machines are in range and differ (checked above).
                .map_err(|_| WireError::FromOwnMachine {
                    source_rank: header.source_rank,
                })?,
            _ => cell.slot_span().byte_offset(),
        };
        Ok((target, event))
    }

    fn check_job(&self, header: &FrameHeader) -> Result<(), WireError> {
        if header.job_tag != self.job_tag {
            return Err(WireError::WrongJob {
                expected: self.job_tag,
                found: header.job_tag,
            });
        }
        Ok(())
    }

    fn sender(&self, header: &FrameHeader) -> Result<Location, WireError> {
        let topology: Topology = self.geometry.topology();
        let from = topology
            .locate(header.source_rank)
            .map_err(|_| WireError::UnknownRank {
                rank: header.source_rank,
                world_size: topology.world_size(),
            })?;
        if header.source_rank == self.rank {
            return Err(WireError::FromSelf { rank: self.rank });
        }
        Ok(from)
    }
}
