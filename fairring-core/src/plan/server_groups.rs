//! Dedicated servers in groups, for a reduction in two levels: the servers of
//! a rail group in groups, each group serving a group of worker machines, and
//! then the groups' partial sums reduced across the groups, server to server.
//!
//! A flat server of a slice receives one cell from each of the `M` machines
//! and sends each the sum: `2M` messages, each `1/k` of a slot. Past a few
//! hundred machines the cells shrink to the minimum shard and the server's
//! posts, not its bytes, set its pace. In groups a server hears from its
//! group's workers only, in cells of a `G`-th of the slot, and exchanges
//! `2(Q - 1)` pieces (or `4(Q - 1)`, where its range meets two intervals)
//! with the other groups.
//!
//! **The groups.** The `S` servers of a rail group form `Q = ceil(S / G)`
//! groups exactly as [`MachineGroups`] forms machines ([`ServerGroups::servers`]:
//! consecutive servers, as even as can be, at least two each, `G` from 2 to
//! `S / 2`). The `M` worker machines form as many groups of consecutive
//! machines, as even as can be: the first `M mod Q` hold `floor(M / Q) + 1`
//! machines, the rest `floor(M / Q)`, each at least one, so `M >= Q`
//! ([`ServerGroups::workers`]). Worker group `g` is served by server group
//! `g`.
//!
//! **The cells.** A worker of group `g` cuts each slot of `U` units as
//! [`MachineGroups::range`] cuts it for the `s` servers of that group, and
//! sends server `i` of the group range `i` ([`ServerGroups::cell`]): `s`
//! cells of about `U / s` units, within one unit of each other. Every worker
//! of a group cuts a slot the same way, so server `i` receives the same units
//! from each of its `W` workers, reduces them into its range's partial sum,
//! and then reduces the range's pieces across the groups as a machine of the
//! co-located two levels does ([`MachineGroups::roles`]: the ranges of all
//! groups cut the slot into intervals, each held by one server a group and
//! cut into `Q` pieces). It sends the final range back to its `W` workers.
//!
//! Where `G` divides `S` and `Q` divides `M`, a worker sends `G` cells a
//! slot and receives `G` results, each a `G`-th of it; a server receives `M /
//! Q` cells and sends `M / Q` results a slot, and `2(Q - 1)` pieces each way,
//! each an `S`-th of the slot. A worker moves its slot once each way, as with
//! flat servers.
//!
//! A geometry routes the slots this way ([`Routing::Groups`](super::Routing::Groups)
//! with servers) where it is made
//! [`Geometry::with_servers_in_groups`](super::Geometry::with_servers_in_groups),
//! or made `with_servers` where a full slot cannot give every server of a
//! rail group a cell of the minimum shard (in groups of at most
//! [`PlanConfig::default_server_group_size`](super::PlanConfig::default_server_group_size));
//! its servers keep what lands in a
//! [`ServerGroupLayout`](super::ServerGroupLayout). The engine runs it
//! (`engine/algorithm/serve_in_groups.rs`), and the scale model walks it.
//! Every query is a few integer operations; nothing allocates or panics.

use core::ops::Range;

use super::{MachineGroups, Membership, PlanError};

/// `M` worker machines and the `S` servers of one rail group, in as many
/// groups each (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServerGroups {
    machines: u32,
    servers: MachineGroups,
}

impl ServerGroups {
    /// `machines` worker machines and `servers` servers of a rail group, the
    /// servers in groups of at most `size`. Refused as
    /// [`MachineGroups::new`] refuses `servers` machines in groups of `size`,
    /// and with [`PlanError::TooFewWorkers`] where fewer machines than groups
    /// would leave a group of servers without a worker; no machine is
    /// [`PlanError::MachineOutOfRange`].
    pub const fn new(machines: u32, servers: u32, size: u32) -> Result<ServerGroups, PlanError> {
        let servers = match MachineGroups::new(servers, size) {
            Ok(groups) => groups,
            Err(e) => return Err(e),
        };
        if machines == 0 {
            return Err(PlanError::MachineOutOfRange {
                machine: 0,
                machines: 0,
            });
        }
        if machines < servers.groups() {
            return Err(PlanError::TooFewWorkers {
                machines,
                groups: servers.groups(),
            });
        }
        Ok(ServerGroups { machines, servers })
    }

    /// `M`, the worker machines.
    pub const fn machines(&self) -> u32 {
        self.machines
    }

    /// `Q`, the number of groups.
    pub const fn groups(&self) -> u32 {
        self.servers.groups()
    }

    /// The servers in their groups: [`MachineGroups`] with servers in the
    /// machines' place (server `p` of the rail group as machine `p`).
    pub const fn servers(&self) -> MachineGroups {
        self.servers
    }

    /// The worker machines of group `group`: consecutive, the first `M mod
    /// Q` groups one machine larger.
    pub const fn workers(&self, group: u32) -> Result<Range<u32>, PlanError> {
        let groups = self.groups();
        if group >= groups {
            return Err(PlanError::GroupOutOfRange { group, groups });
        }
        let (small, larger) = (self.machines / groups, self.machines % groups);
        let start = group * small + if group < larger { group } else { larger };
        let len = small + (group < larger) as u32;
        Ok(start..start + len)
    }

    /// Workers of the largest group, `ceil(M / Q)`.
    pub const fn most_workers(&self) -> u32 {
        self.machines.div_ceil(self.groups())
    }

    /// The group of worker machine `machine`, and its index among the
    /// group's workers.
    pub const fn locate_worker(&self, machine: u32) -> Result<Membership, PlanError> {
        if machine >= self.machines {
            return Err(PlanError::MachineOutOfRange {
                machine,
                machines: self.machines,
            });
        }
        let groups = self.groups();
        let (small, larger) = (self.machines / groups, self.machines % groups);
        let in_larger = larger * (small + 1);
        let (group, member) = if machine < in_larger {
            (machine / (small + 1), machine % (small + 1))
        } else {
            let rest = machine - in_larger;
            (larger + rest / small, rest % small)
        };
        Ok(Membership { group, member })
    }

    /// The servers (of the rail group) that serve worker machine `machine`:
    /// its group's, consecutive.
    pub const fn servers_of(&self, machine: u32) -> Result<Range<u32>, PlanError> {
        let group = match self.locate_worker(machine) {
            Ok(m) => m.group,
            Err(e) => return Err(e),
        };
        let first = match self.servers.first(group) {
            Ok(first) => first,
            Err(e) => return Err(e),
        };
        match self.servers.size(group) {
            Ok(len) => Ok(first..first + len),
            Err(e) => Err(e),
        }
    }

    /// The servers of group `group` (by member index, as
    /// [`MachineGroups::machine`] numbers them) that server `server` of the
    /// rail group may exchange pieces with across the groups, whatever the
    /// slot: those whose ranges can meet its own. Groups differ by at most
    /// one server, so a range of member `i` only ever meets the ranges of
    /// members `i - 1` to `i + 1` of another group (the property tests check
    /// every slot of up to 600 units); none of its own group.
    pub const fn across_partners(&self, server: u32, group: u32) -> Result<Range<u32>, PlanError> {
        let own = match self.servers.locate(server) {
            Ok(m) => m,
            Err(e) => return Err(e),
        };
        let size = match self.servers.size(group) {
            Ok(size) => size,
            Err(e) => return Err(e),
        };
        if own.group == group {
            return Ok(0..0);
        }
        let first = own.member.saturating_sub(1);
        let end = if own.member + 2 < size {
            own.member + 2
        } else {
            size
        };
        Ok(first..end)
    }

    /// The units of a slot of `slot_units` that worker machine `machine`
    /// sends to server `member` of its group: that server's range.
    pub const fn cell(
        &self,
        slot_units: u64,
        machine: u32,
        member: u32,
    ) -> Result<Range<u64>, PlanError> {
        match self.locate_worker(machine) {
            Ok(m) => self.servers.range(slot_units, m.group, member),
            Err(e) => Err(e),
        }
    }
}
