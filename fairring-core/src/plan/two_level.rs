//! What one machine does in a reduction of a slot in two levels
//! ([`MachineGroups`]), as the staging state machine runs it: one word
//! within the group, and one word across the groups for each interval of the
//! machine's range.
//!
//! **Within the group** the machine is a flat plan's server of its range over
//! its group's `s` members, whose reduced range is a partial sum that goes on
//! ([`Role::forwards`]):
//!
//! 1. `START_CONTRIBUTIONS`: each other member's range of the slot goes to that
//!    member, into its area for this one;
//! 2. `START_REDUCE` (the `s - 1` contributions in): the range is reduced in
//!    place: the group's partial sum;
//! 3. `START_SEND_UP`: the words across begin (their `ReduceScatterDone`);
//! 4. `PartialSent` once every word across has released (every send of theirs
//!    has completed), and `ParentResultReceived` once every word across has
//!    handed out `START_ALL_GATHER` (every piece of the range is final);
//! 5. `START_SEND_BACK`: the final range goes to every other member, into the
//!    same units of its slot, and their ranges land here the same way;
//! 6. `START_ALL_GATHER` and `RELEASE` as in a flat plan.
//!
//! **Across the groups**, for each interval of the range, the machine is a
//! flat plan's server of its piece among the interval's `Q` holders, one per
//! group: it sends each nonempty piece of another group to that group's
//! holder, reduces its own piece in place over the `Q - 1` partial sums the
//! other holders send it, sends the result back to them, and the other
//! pieces' results land over its range. Such a word takes its
//! `AllGatherDone` as soon as it hands out `START_ALL_GATHER`: nothing is
//! gathered at that level.
//!
//! A member whose range is empty (a slot of fewer units than its group has
//! members) only sends its contributions and receives the results, and has
//! no word across. Every word of a slice is acquired when the slice starts,
//! so that a partial sum from another group may land before this machine's
//! own level is done (it lands in an area of its own).

use core::ops::Range;

use super::{MachineGroups, Membership, PlanError};
use crate::staging::Role;

/// Most intervals one range meets: groups differ by at most one member, so
/// the other size's boundaries fall at most once strictly inside a range.
pub const MOST_INTERVALS: u32 = 2;

/// One machine's roles in the two-level reduction of one slot
/// ([`MachineGroups::roles`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TwoLevelRoles {
    membership: Membership,
    range: Range<u64>,
    within: Role,
    across: [Option<Across>; MOST_INTERVALS as usize],
}

/// One interval of a machine's range, and the machine's role across the
/// groups for it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Across {
    /// The interval, in units of the slot.
    pub interval: Range<u64>,
    /// The machine's piece of it, which it reduces over the other groups
    /// (empty where the interval has fewer units than there are groups).
    pub piece: Range<u64>,
    /// The counts of its word.
    pub role: Role,
}

impl TwoLevelRoles {
    /// The machine's group and index in it.
    pub const fn membership(&self) -> Membership {
        self.membership
    }

    /// The units the machine reduces over its group.
    pub const fn range(&self) -> Range<u64> {
        self.range.start..self.range.end
    }

    /// The counts of its word within the group.
    pub const fn within(&self) -> Role {
        self.within
    }

    /// Its words across the groups, in slot order: one per interval of its
    /// range (none where the range is empty).
    pub fn across(&self) -> impl Iterator<Item = &Across> {
        self.across.iter().flatten()
    }

    /// The word across for the interval that starts at unit `start`, and its
    /// index among [`TwoLevelRoles::across`]: where another group's holder
    /// of that interval sends its partial sums and results.
    pub fn across_at(&self, start: u64) -> Option<(usize, &Across)> {
        self.across()
            .enumerate()
            .find(|(_, a)| a.interval.start == start)
    }
}

impl MachineGroups {
    /// What machine `machine` does in the two-level reduction of a slot of
    /// `slot_units` units: its range, the counts of its word within its group
    /// and of its words across the groups: within the group, a flat plan's
    /// server of its range whose sum goes on; across, for each interval of
    /// its range, a flat plan's server of its piece among the interval's
    /// holders (the module `plan/two_level.rs` says how the words meet).
    pub fn roles(&self, slot_units: u64, machine: u32) -> Result<TwoLevelRoles, PlanError> {
        let membership = self.locate(machine)?;
        let Membership { group, member } = membership;
        let members = self.size(group)?;
        let range = self.range(slot_units, group, member)?;
        let mut others = 0u16;
        for j in (0..members).filter(|&j| j != member) {
            if !self.range(slot_units, group, j)?.is_empty() {
                others += 1;
            }
        }
        let reduces = !range.is_empty();
        let within = Role {
            forwards: reduces,
            ..server_role(others, members, reduces)
        };
        let mut across = [None, None];
        for (k, interval) in self
            .intervals_of(slot_units, &range)
            .into_iter()
            .enumerate()
        {
            let Some(interval) = interval else { continue };
            across[k] = Some(self.across(&interval, group)?);
        }
        Ok(TwoLevelRoles {
            membership,
            range,
            within,
            across,
        })
    }

    /// The intervals a range of a slot of `slot_units` is cut into: itself,
    /// or two where a boundary of the other group size falls inside it.
    fn intervals_of(
        &self,
        slot_units: u64,
        range: &Range<u64>,
    ) -> [Option<Range<u64>>; MOST_INTERVALS as usize] {
        if range.is_empty() {
            return [None, None];
        }
        let small = u64::from(self.small_size());
        let cuts = [small, small + u64::from(self.larger_groups() > 0)];
        // The first boundary of each size past the range's start; a range of
        // one size holds no boundary of its own strictly inside it.
        let mut inside = None;
        for parts in cuts {
            let k = ((u128::from(range.start) + 1) * u128::from(parts))
                .div_ceil(u128::from(slot_units));
            if k <= u128::from(parts) {
                #[expect(clippy::cast_possible_truncation, reason = "at most the slot's units")]
                let boundary = (u128::from(slot_units) * k / u128::from(parts)) as u64;
                if boundary < range.end {
                    inside = Some(boundary);
                }
            }
        }
        match inside {
            Some(at) => [Some(range.start..at), Some(at..range.end)],
            None => [Some(range.clone()), None],
        }
    }

    /// The word across for `interval`, held by a member of `group`.
    fn across(&self, interval: &Range<u64>, group: u32) -> Result<Across, PlanError> {
        let mut others = 0u16;
        for h in (0..self.groups()).filter(|&h| h != group) {
            if !self.piece(interval, h)?.is_empty() {
                others += 1;
            }
        }
        let piece = self.piece(interval, group)?;
        let role = server_role(others, self.groups(), !piece.is_empty());
        Ok(Across {
            interval: interval.clone(),
            piece,
            role,
        })
    }
}

/// A flat plan's role among `parties` (a group's members, or an interval's
/// holders): it sends its `others` nonempty cells of the other parties and
/// gets their results back, and where it `reduces` its own, receives the
/// other parties' contributions and sends them the result.
#[expect(
    clippy::cast_possible_truncation,
    reason = "parties are at most MAX_MACHINES / 2"
)]
const fn server_role(others: u16, parties: u32, reduces: bool) -> Role {
    let peers = if reduces { (parties - 1) as u16 } else { 0 };
    Role {
        contributions_to_send: others,
        contributions_to_receive: peers,
        results_to_send: peers,
        results_to_receive: others,
        reduces,
        forwards: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec;
    use std::vec::Vec;

    /// Four machines in two groups of two, a slot of 8 units: machine 0
    /// reduces units 0..4 with machine 1, and then units 0..2 of them with
    /// machine 2, which holds 0..4 in the other group.
    #[test]
    fn four_machines_in_pairs_worked_by_hand() {
        let groups = MachineGroups::new(4, 2).unwrap();
        let roles = groups.roles(8, 0).unwrap();
        assert_eq!(
            roles.membership(),
            Membership {
                group: 0,
                member: 0
            }
        );
        assert_eq!(roles.range(), 0..4);
        let pair = Role {
            contributions_to_send: 1,
            contributions_to_receive: 1,
            results_to_send: 1,
            results_to_receive: 1,
            reduces: true,
            forwards: false,
        };
        assert_eq!(
            roles.within(),
            Role {
                forwards: true,
                ..pair
            }
        );
        let across: Vec<_> = roles.across().cloned().collect();
        assert_eq!(
            across,
            [Across {
                interval: 0..4,
                piece: 0..2,
                role: pair
            }]
        );
        let other = groups.roles(8, 2).unwrap();
        assert_eq!(other.across_at(0).unwrap().1.piece, 2..4);
        assert!(other.across_at(1).is_none());
    }

    /// Eleven machines in groups of four, four and three over 24 units:
    /// the groups of four end their ranges at 6, 12 and 18, the group of
    /// three at 8 and 16. Machine 0 holds 0..6, which no boundary of the
    /// group of three cuts; machine 1 holds 6..12, cut at 8.
    #[test]
    fn a_range_of_unequal_groups_meets_two_intervals() {
        let groups = MachineGroups::new(11, 4).unwrap();
        assert_eq!((groups.groups(), groups.size(2).unwrap()), (3, 3));
        let first = groups.roles(24, 0).unwrap();
        let intervals: Vec<_> = first.across().map(|a| a.interval.clone()).collect();
        assert_eq!(intervals, vec![0..6]);
        let second = groups.roles(24, 1).unwrap();
        let intervals: Vec<_> = second.across().map(|a| a.interval.clone()).collect();
        assert_eq!(intervals, [6..8, 8..12]);
        // 6..8 in three pieces: 6..6, 6..7, 7..8; 8..12: 8..9, 9..10, 10..12.
        let pieces: Vec<_> = second.across().map(|a| a.piece.clone()).collect();
        assert_eq!(pieces, [6..6, 8..9]);
        let reduces: Vec<_> = second.across().map(|a| a.role.reduces).collect();
        assert_eq!(reduces, [false, true]);
        let sends: Vec<_> = second
            .across()
            .map(|a| a.role.contributions_to_send)
            .collect();
        assert_eq!(sends, [2, 2]);
        assert_eq!(second.within().contributions_to_send, 3);
        // Machine 8, the first of the group of three, holds 0..8, cut at 6.
        let other = groups.roles(24, 8).unwrap();
        let intervals: Vec<_> = other.across().map(|a| a.interval.clone()).collect();
        assert_eq!(intervals, [0..6, 6..8]);
        assert_eq!(other.across_at(6).unwrap().0, 1);
    }

    /// The buffer of four machines in pairs over slots of 8 units: the
    /// largest range is 4 units (5 lines, odd), the largest piece 2 (3
    /// lines); one area within, and one across per interval.
    #[test]
    fn four_machines_in_pairs_lay_out_their_areas() {
        use crate::plan::{Span, TwoLevelLayout};
        let groups = MachineGroups::new(4, 2).unwrap();
        let layout = TwoLevelLayout::new(groups, 8, 8).unwrap();
        assert_eq!((layout.within_areas(), layout.across_areas()), (1, 2));
        assert_eq!(layout.within(1, 0), Ok(Span::bytes(512, 320)));
        assert_eq!(layout.across(0, 2, 0), Ok(Span::bytes(832, 192)));
        assert_eq!(layout.across(1, 3, 0), Ok(Span::bytes(1024, 192)));
        assert_eq!(layout.total_bytes(), 1216);
        assert_eq!(
            TwoLevelLayout::new(groups, 1 << 24, (1 << 24) + 1),
            Err(PlanError::InvalidSliceBytes {
                slice_bytes: ((1 << 24) + 1) * 64
            })
        );
        let wrong = |from, within| PlanError::WrongGroup {
            from,
            to: 0,
            within,
        };
        assert_eq!(layout.within(2, 0), Err(wrong(2, true)));
        assert_eq!(layout.across(0, 1, 0), Err(wrong(1, false)));
        assert_eq!(
            layout.across(2, 2, 0),
            Err(PlanError::IntervalOutOfRange { interval: 2 })
        );
        assert_eq!(
            layout.within(0, 0),
            Err(PlanError::OwnContribution { machine: 0 })
        );
        assert_eq!(
            layout.within(4, 0),
            Err(PlanError::MachineOutOfRange {
                machine: 4,
                machines: 4
            })
        );
    }

    /// A slot of fewer units than a group has members: an empty range only
    /// sends and receives, with no word across; a machine past `M` is named.
    #[test]
    fn an_empty_range_only_sends_and_receives() {
        let groups = MachineGroups::new(8, 4).unwrap();
        let roles = groups.roles(2, 0).unwrap();
        assert!(roles.range().is_empty());
        assert!(!roles.within().reduces);
        assert_eq!(roles.within().contributions_to_send, 2);
        assert_eq!(roles.across().count(), 0);
        assert_eq!(
            groups.roles(2, 8).unwrap_err(),
            PlanError::MachineOutOfRange {
                machine: 8,
                machines: 8
            }
        );
    }
}
