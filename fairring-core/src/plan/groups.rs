//! Machines in groups, for a reduction in two levels: within each group, and
//! then across the groups.
//!
//! `M` machines form `Q = ceil(M / G)` groups of consecutive machines, as even
//! as can be: the first `M mod Q` groups hold `floor(M / Q) + 1` machines, the
//! rest `floor(M / Q)`, and every group at least two. A slot of `U` units is cut in each group of `s`
//! members into `s` **ranges**, member `i` holding units
//! `floor(U i / s) .. floor(U (i + 1) / s)`: within one unit of each other.
//! Each member reduces its range over its group, and sends the sum back to
//! the group at the end.
//!
//! Between the levels, the ranges of every group together cut the slot into
//! **intervals**: the units between two consecutive range boundaries of any
//! group. Each interval lies within one range of every group, so it has one
//! **holder** per group, and it is cut into `Q` **pieces** as even as can be,
//! piece `g` reduced by its holder in group `g` over the partial sums the
//! other `Q - 1` holders send it, and sent back to them. Where `G` divides
//! `M` the intervals are the ranges, each in `M / G` pieces of about `U / M`
//! units: a machine sends `2(G - 1) + 2(M / G - 1)` messages a slot instead
//! of `2(M - 1)`, and the same bytes. Where groups differ by one member, a
//! range crosses at most two intervals, each held once per group.
//!
//! A geometry in groups (`Routing::Groups`, `plan/two_level.rs`) runs them
//! in the engine, and the scale model (`docs/scale-model.md`) walks them.
//! Every query is a few
//! integer operations (the intervals are the merge of at most two
//! arithmetic sequences of boundaries); nothing allocates or panics.

use core::ops::Range;

use super::PlanError;
use crate::topology::MAX_MACHINES;

/// `M` machines in groups (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MachineGroups {
    machines: u32,
    groups: u32,
}

/// Where a machine sits: its group, and its index among the group's members.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Membership {
    /// The group.
    pub group: u32,
    /// The machine's index in the group (`0..len`).
    pub member: u32,
}

impl MachineGroups {
    /// `machines` machines (`4..=MAX_MACHINES`) in `ceil(machines / size)`
    /// groups as even as can be. Refused with
    /// [`PlanError::InvalidGroupSize`] unless there are two levels: `size`
    /// from 2 to `machines / 2`, and no group of one (5 machines in groups of
    /// 2 would leave one); more machines than [`MAX_MACHINES`] are
    /// [`PlanError::MachineOutOfRange`], as for [`DoubleTree`](super::DoubleTree).
    pub const fn new(machines: u32, size: u32) -> Result<MachineGroups, PlanError> {
        if machines > MAX_MACHINES {
            return Err(PlanError::MachineOutOfRange {
                machine: machines,
                machines: MAX_MACHINES,
            });
        }
        if size < 2 || size > machines / 2 || machines / machines.div_ceil(size) < 2 {
            return Err(PlanError::InvalidGroupSize { size, machines });
        }
        Ok(MachineGroups {
            machines,
            groups: machines.div_ceil(size),
        })
    }

    /// `M`.
    pub const fn machines(&self) -> u32 {
        self.machines
    }

    /// `Q`, the number of groups.
    pub const fn groups(&self) -> u32 {
        self.groups
    }

    /// Members of the smaller groups, `floor(M / Q)`.
    pub(super) const fn small_size(&self) -> u32 {
        self.machines / self.groups
    }

    /// How many groups hold `floor(M / Q) + 1` members: the first ones.
    pub(super) const fn larger_groups(&self) -> u32 {
        self.machines % self.groups
    }

    /// Members of group `group`.
    pub const fn size(&self, group: u32) -> Result<u32, PlanError> {
        if group >= self.groups {
            return Err(PlanError::GroupOutOfRange {
                group,
                groups: self.groups,
            });
        }
        Ok(self.small_size() + (group < self.larger_groups()) as u32)
    }

    /// Members of group `group`, which must have a member `member`.
    const fn size_holding(&self, group: u32, member: u32) -> Result<u32, PlanError> {
        match self.size(group) {
            Ok(len) if member < len => Ok(len),
            Ok(len) => Err(PlanError::MemberOutOfRange {
                member,
                members: len,
            }),
            Err(e) => Err(e),
        }
    }

    /// Members of the largest group.
    pub const fn largest(&self) -> u32 {
        self.small_size() + (self.larger_groups() > 0) as u32
    }

    /// The first machine of group `group`.
    pub const fn first(&self, group: u32) -> Result<u32, PlanError> {
        if group >= self.groups {
            return Err(PlanError::GroupOutOfRange {
                group,
                groups: self.groups,
            });
        }
        let larger = if group < self.larger_groups() {
            group
        } else {
            self.larger_groups()
        };
        Ok(group * self.small_size() + larger)
    }

    /// The machine that is member `member` of group `group`.
    pub const fn machine(&self, group: u32, member: u32) -> Result<u32, PlanError> {
        if let Err(e) = self.size_holding(group, member) {
            return Err(e);
        }
        match self.first(group) {
            Ok(first) => Ok(first + member),
            Err(e) => Err(e),
        }
    }

    /// Machine `machine`'s group and index in it.
    pub const fn locate(&self, machine: u32) -> Result<Membership, PlanError> {
        if machine >= self.machines {
            return Err(PlanError::MachineOutOfRange {
                machine,
                machines: self.machines,
            });
        }
        let big = self.small_size() + 1;
        let in_larger = self.larger_groups() * big;
        let (group, member) = if machine < in_larger {
            (machine / big, machine % big)
        } else {
            let rest = machine - in_larger;
            (
                self.larger_groups() + rest / self.small_size(),
                rest % self.small_size(),
            )
        };
        Ok(Membership { group, member })
    }

    /// The units of a slot of `slot_units` that member `member` of group
    /// `group` holds.
    pub const fn range(
        &self,
        slot_units: u64,
        group: u32,
        member: u32,
    ) -> Result<Range<u64>, PlanError> {
        let len = match self.size_holding(group, member) {
            Ok(len) => len,
            Err(e) => return Err(e),
        };
        Ok(cut(slot_units, len as u64, member as u64)
            ..cut(slot_units, len as u64, member as u64 + 1))
    }

    /// The member of group `group` whose range of a slot of `slot_units`
    /// holds unit `unit`.
    pub const fn holder(&self, slot_units: u64, group: u32, unit: u64) -> Result<u32, PlanError> {
        let len = match self.size(group) {
            Ok(len) => len as u64,
            Err(e) => return Err(e),
        };
        if unit >= slot_units {
            return Err(PlanError::UnitOutOfRange {
                unit,
                units: slot_units,
            });
        }
        // The largest `i` with `floor(U i / s) <= unit`: `U i < (unit + 1) s`,
        // below `s`; in 128 bits, which no product of two 64-bit values
        // overflows.
        let i = ((unit as u128 + 1) * len as u128).div_ceil(slot_units as u128) - 1;
        #[expect(
            clippy::cast_possible_truncation,
            reason = "below the group's length, a u32"
        )]
        Ok(i as u32)
    }

    /// The intervals the groups' ranges cut a slot of `slot_units` into, in
    /// order (none for an empty slot).
    pub const fn intervals(&self, slot_units: u64) -> Intervals {
        let small = self.small_size() as u64;
        let big = if self.larger_groups() > 0 {
            small + 1
        } else {
            small
        };
        Intervals {
            units: slot_units,
            sizes: [small, big],
            next: [1, 1],
            at: 0,
        }
    }

    /// Piece `group` of `interval`: the units its holder in group `group`
    /// reduces. A reversed range is taken as empty.
    pub const fn piece(&self, interval: &Range<u64>, group: u32) -> Result<Range<u64>, PlanError> {
        if group >= self.groups {
            return Err(PlanError::GroupOutOfRange {
                group,
                groups: self.groups,
            });
        }
        let len = interval.end.saturating_sub(interval.start);
        let q = self.groups as u64;
        Ok(interval.start + cut(len, q, group as u64)
            ..interval.start + cut(len, q, group as u64 + 1))
    }
}

/// The `i`-th of the `parts + 1` boundaries that cut `units` into `parts`
/// ranges within one unit of each other.
/// At most `units` (`i <= parts`); in 128 bits, which no product of two
/// 64-bit values overflows.
#[expect(clippy::cast_possible_truncation, reason = "at most `units`, a u64")]
const fn cut(units: u64, parts: u64, i: u64) -> u64 {
    (units as u128 * i as u128 / parts as u128) as u64
}

/// The intervals of a slot, in order ([`MachineGroups::intervals`]): the
/// merge of the boundaries of the two group sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intervals {
    units: u64,
    /// The two group sizes (equal where every group is).
    sizes: [u64; 2],
    /// The next boundary index of each size.
    next: [u64; 2],
    /// The start of the next interval.
    at: u64,
}

impl Iterator for Intervals {
    type Item = Range<u64>;

    fn next(&mut self) -> Option<Range<u64>> {
        while self.at < self.units {
            // The next boundary past `at` of either size.
            let mut end = self.units;
            for k in 0..2 {
                let size = self.sizes[k];
                while self.next[k] <= size && cut(self.units, size, self.next[k]) <= self.at {
                    self.next[k] += 1;
                }
                if self.next[k] <= size {
                    let boundary = cut(self.units, size, self.next[k]);
                    if boundary < end {
                        end = boundary;
                    }
                }
            }
            let start = self.at;
            self.at = end;
            if end > start {
                return Some(start..end);
            }
        }
        None
    }
}
