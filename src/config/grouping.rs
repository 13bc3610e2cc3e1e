//! How a job's machines are grouped for the hierarchical all-reduce
//! (`FAIRRING_GROUP_SIZE`).

use fairring_core::plan::PlanConfig;

/// How the machines of a job are grouped for the hierarchical all-reduce:
/// in one level (flat, or through the trees), or in two levels, within
/// groups of machines and then across them (`Routing::Groups` of
/// fairring-core).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Grouping {
    /// The default: in the default slices, where they would leave some
    /// machine without a shard of the minimum size but the wide flat slices
    /// would not (51 to 64 machines of 8 GPUs at the 64 KiB minimum), equal
    /// groups of [`PlanConfig::equal_group_size`] where the machines make
    /// some (but flat where `FAIRRING_WIRE` compresses, which only the flat
    /// plan carries); where even the wide flat slices would (past 64 machines of 8
    /// GPUs), groups of [`PlanConfig::default_group_size`]: equal groups of
    /// 32, 40, 48, 56 or 64 machines at most where one of those sizes makes
    /// them, else equal groups of the largest size from 20 to 48 (half the
    /// machines, where fewer) that divides the machines, else of at most
    /// that; one level
    /// elsewhere, and in slices given
    /// (`FAIRRING_SLICE_SIZE`). With dedicated servers, where a full slot
    /// cannot give each server of a rail group a cell of the minimum shard
    /// (past 200 server machines of 8 NICs at the 16 KiB minimum), the
    /// servers of each rail group in groups of at most
    /// [`PlanConfig::DEFAULT_SERVER_GROUP_SIZE`] or half of them
    /// ([`PlanConfig::default_server_group_size`]; but flat where
    /// `FAIRRING_WIRE` compresses). `FAIRRING_GROUP_SIZE=auto`, or unset.
    #[default]
    Auto,
    /// One level always: where the default slices would form groups, the
    /// cells stay flat in the wide slices, or past them go through the
    /// trees. `FAIRRING_GROUP_SIZE=off`.
    OneLevel,
    /// Groups of at most this many machines, as even as can be, whatever
    /// the slices: from 2 to half the machines, leaving no group of one.
    /// With dedicated servers, groups of at most this many servers of each
    /// rail group, the workers in as many groups (fairring-core's
    /// `ServerGroups`): from 2 to half a rail group's servers, the servers a
    /// multiple of the devices a machine has, and at least as many machines
    /// as groups. `FAIRRING_GROUP_SIZE=N`.
    AtMost(u32),
}

impl Grouping {
    /// The configuration a geometry of this grouping is made from, where
    /// it forms no groups itself ([`Grouping::AtMost`] does).
    pub(crate) fn plan_config(self, config: PlanConfig) -> PlanConfig {
        match self {
            Grouping::OneLevel => config.in_one_level(),
            Grouping::Auto | Grouping::AtMost(_) => config,
        }
    }
}
