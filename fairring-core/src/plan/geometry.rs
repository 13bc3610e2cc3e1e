//! What a communicator fixes once: slice size, shards per slice, staging layout.

use super::{
    ALIGN_BYTES, InputArea, MachineGroups, PlanError, ServerGroupLayout, ServerGroups,
    ServerLayout, StagingLayout, TREES, TwoLevelLayout,
};
use crate::topology::{MAX_MACHINES, Topology};

/// The knobs of slicing and sharding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanConfig {
    slice_bytes: u64,
    min_shard_bytes: u64,
    /// The slice size is the default's: a [`Geometry`] made from it takes
    /// [`PlanConfig::DEFAULT_TREE_SLICE_BYTES`] where it routes through the
    /// trees ([`PlanConfig::with_default_slices`]).
    slice_by_routing: bool,
    /// The default slices never reduce in groups ([`PlanConfig::in_one_level`]).
    one_level: bool,
}

impl PlanConfig {
    /// Default largest slice: 25 MiB, as the original Fairring used.
    pub const DEFAULT_SLICE_BYTES: u64 = 25 << 20;
    /// Default largest slice where the cells go through the trees: 20 MiB.
    ///
    /// A tree's cell travels in parts (at most [`TREE_PARTS`](super::TREE_PARTS))
    /// up and down `2 log2 M` levels, so a slice's fill and drain through the
    /// trees grows with its parts' size: smaller slices keep more of the trees'
    /// depth busy, larger ones hold NVLink for less where a machine's GPUs
    /// reduce-scatter them in one call (20 MiB and more, in `fairring`). The
    /// scale model (`docs/scale-model.md`) puts every multiple of 8 H100s from
    /// 520 to 2048 at 300 to 316 GB/s busbw for 256 MiB and 351 to 360 for
    /// 1 GiB in 20 MiB slices, against 299 to 309 and 348 to 351 in 16 MiB; a
    /// tensor of fewer than four of them is cut in four
    /// ([`PlanConfig::MIN_SLICES_PER_TENSOR`]), as on the flat plan.
    pub const DEFAULT_TREE_SLICE_BYTES: u64 = 20 << 20;
    /// The smallest slice a tensor of fewer than
    /// [`PlanConfig::MIN_SLICES_PER_TENSOR`] default slices is cut into: 16
    /// MiB ([`Geometry::slice_bytes_for`]).
    pub const SMALLEST_CUT_SLICE_BYTES: u64 = 16 << 20;
    /// Default largest slice where a slot of
    /// [`PlanConfig::DEFAULT_SLICE_BYTES`] is too small to give every machine a
    /// shard of the minimum but a slot of this size is not: 32 MiB, so the
    /// cells stay on the flat plan up to 64 machines of 8 devices at the 64 KiB
    /// minimum shard, unless the machines make equal groups
    /// ([`PlanConfig::equal_group_size`]), which reduce in two levels in
    /// slices of this size. Past that, the machines form groups
    /// ([`PlanConfig::default_group_size`]), in slices of this size too; in
    /// one level ([`PlanConfig::in_one_level`]) they stay flat, and then go
    /// through the trees.
    ///
    /// Flat, a slice crosses the network once each way; through the trees it
    /// fills and drains `2 log2 M` levels. The scale model (`docs/scale-model.md`)
    /// puts 408 to 512 H100s (51 to 64 machines) flat in 32 MiB slices (in
    /// one level) at 225 to 229, 333 to 335 and 379 to 386 GB/s busbw for
    /// 64 MiB, 256 MiB and 1 GiB, against 195, 315 and 359 through the trees
    /// (in 20 MiB slices) at 512.
    pub const WIDE_FLAT_SLICE_BYTES: u64 = 32 << 20;
    /// With the default slices (flat, in groups or through the trees, but not
    /// the wide flat ones) and no dedicated servers, a tensor of fewer full slices is
    /// cut into this many, in slices of no less than
    /// [`PlanConfig::SMALLEST_CUT_SLICE_BYTES`] and a shard of the minimum for
    /// each of a slot's shards ([`Geometry::slice_bytes_for`]).
    ///
    /// A slice's stages (reduce-scatter, contributions, reduction, results,
    /// all-gather) overlap only with other slices': a 64 MiB tensor cut 25,
    /// 25 and 14 MiB leaves the first and last stages idle longer than four
    /// slices of 16 MiB. The scale model puts 64 MiB on 64 H100s at 273 GB/s
    /// busbw this way, against 246 in 25 MiB slices, and leaves tensors of
    /// 100 MiB and more in 25 MiB slices, which suit them best.
    pub const MIN_SLICES_PER_TENSOR: u64 = 4;
    /// The largest group of machines where the default slices reduce in two
    /// levels ([`Routing::Groups`]) and no size of
    /// [`PlanConfig::EQUAL_GROUP_SIZES`] makes equal groups: 48 machines, the
    /// largest equal groups [`PlanConfig::default_group_size`] then looks
    /// for, and the bound of the unequal ones it takes where it finds none.
    pub const DEFAULT_GROUP_SIZE: u32 = 48;
    /// The largest group of dedicated servers (of one rail group) where a
    /// full slot cannot give every server a cell of the minimum shard, and
    /// the servers reduce in two levels instead ([`ServerGroups`],
    /// [`PlanConfig::default_server_group_size`]): 64 servers, so that 256
    /// server machines of 8 NICs make 4 groups a rail.
    ///
    /// The scale model's `server-groups` study (h100, a server machine per
    /// GPU machine) found groups of 64 best at 2048 GPUs at 64 MiB, 256 MiB
    /// and 1 GiB, of the sizes it tried.
    pub const DEFAULT_SERVER_GROUP_SIZE: u32 = 64;
    /// The largest group of `servers` dedicated servers of a rail group
    /// where they form groups themselves: [`PlanConfig::DEFAULT_SERVER_GROUP_SIZE`],
    /// or half of them where that is fewer (so that there are two levels).
    pub const fn default_server_group_size(servers: u32) -> u32 {
        let half = servers / 2;
        if half < Self::DEFAULT_SERVER_GROUP_SIZE {
            half
        } else {
            Self::DEFAULT_SERVER_GROUP_SIZE
        }
    }
    /// The group sizes tried, in order, for groups of equal size where the
    /// default slices reduce in two levels
    /// ([`PlanConfig::default_group_size`]).
    pub const EQUAL_GROUP_SIZES: [u32; 5] = [32, 40, 48, 56, 64];

    /// The smallest groups [`PlanConfig::default_group_size`] takes to make
    /// the machines' groups equal where no size of
    /// [`PlanConfig::EQUAL_GROUP_SIZES`] does: 20 machines.
    pub const SMALLEST_EQUAL_GROUP: u32 = 20;

    /// The largest group where the default slices of a job of `machines`
    /// machines reduce in two levels ([`Routing::Groups`]: where even the
    /// wide flat slices give some machine no shard of the minimum size, past
    /// 64 machines of 8 GPUs at the 64 KiB minimum): the first size of
    /// [`PlanConfig::EQUAL_GROUP_SIZES`] whose groups are of equal size (at
    /// most half the machines); else the largest size from
    /// [`PlanConfig::SMALLEST_EQUAL_GROUP`] to [`PlanConfig::DEFAULT_GROUP_SIZE`]
    /// (or half the machines, where that is fewer) that divides the
    /// machines; else that bound itself, in groups as even as can be.
    ///
    /// The scale model (`docs/scale-model.md`), at every multiple of 8
    /// H100s from 520 to 2048, at 64 MiB, 256 MiB and 1 GiB, puts this rule
    /// at least at NCCL's best as its tuner predicts it, everywhere (1.001
    /// times at worst, at 256 MiB; 1.007 at 64 MiB). Unequal groups cut a
    /// range of the larger groups into two intervals across the groups, so
    /// where the sizes of 32 to 64 make no equal groups, the equal ones of 22
    /// to 34 machines this finds (13 of the 192 counts) run 1.007 to 1.072
    /// times as fast as unequal groups of at most 48 (198 machines in 6
    /// groups of 33 rather than 5 of at most 40: 1.02, 1.05 and 1.05 times).
    /// Fixed sizes did worse: groups of at most 32 fell to
    /// 0.977 times NCCL's best at 256 MiB, of at most 64 to 0.961 times at
    /// 64 MiB, of at most 48 to 0.97 times the trees at 50 counts.
    pub const fn default_group_size(machines: u32) -> u32 {
        let half = machines / 2;
        let mut i = 0;
        while i < Self::EQUAL_GROUP_SIZES.len() {
            let size = Self::EQUAL_GROUP_SIZES[i];
            if size <= half && machines.is_multiple_of(machines.div_ceil(size)) {
                return size;
            }
            i += 1;
        }
        let bound = if half < Self::DEFAULT_GROUP_SIZE {
            half
        } else {
            Self::DEFAULT_GROUP_SIZE
        };
        let mut size = bound;
        while size >= Self::SMALLEST_EQUAL_GROUP {
            if machines.is_multiple_of(size) {
                return size;
            }
            size -= 1;
        }
        bound
    }
    /// The size of equal groups where the default slices would give some
    /// machine no shard of the minimum but the wide flat slices
    /// ([`PlanConfig::WIDE_FLAT_SLICE_BYTES`]) give each one (51 to 64
    /// machines of 8 GPUs at the 64 KiB minimum): the fewest equal groups of 8
    /// to 64 machines, at least four where there are such, else three, else
    /// two. `None` where no such groups exist (a prime count of machines,
    /// fewer than 16, or counts such as 49 and 134 that no number of groups
    /// divides into groups of 8 to 64): the wide flat slices stay.
    ///
    /// The scale model (`docs/scale-model.md`) puts these groups at 238.6 to
    /// 242.6 GB/s busbw for 64 MiB on 408 to 512 H100s (51 to 64 machines),
    /// against the wide flat slices' 224.7 to 228.8, and at 0.974 to 0.999
    /// times their busbw at 256 MiB (two groups cost most) and 0.992 to 1.009
    /// at 1 GiB; of four groups or more, at 0.983 times at worst.
    pub const fn equal_group_size(machines: u32) -> Option<u32> {
        let mut fewest = [None; 3];
        let mut groups = 2;
        while groups <= machines / 8 {
            if machines.is_multiple_of(groups) {
                let slot = if groups >= 4 { 0 } else { 4 - groups as usize };
                if fewest[slot].is_none() && machines / groups <= 64 {
                    fewest[slot] = Some(machines / groups);
                }
            }
            groups += 1;
        }
        match fewest {
            [Some(size), _, _] | [None, Some(size), _] | [None, None, Some(size)] => Some(size),
            [None, None, None] => None,
        }
    }
    /// The configuration of a geometry the default slices put in groups: the
    /// wide slices ([`PlanConfig::WIDE_FLAT_SLICE_BYTES`]), still the
    /// default's (cut for small tensors), in two levels.
    const fn wide_in_groups(min_shard_bytes: u64) -> PlanConfig {
        PlanConfig {
            slice_bytes: PlanConfig::WIDE_FLAT_SLICE_BYTES,
            min_shard_bytes,
            slice_by_routing: true,
            one_level: false,
        }
    }
    /// Default smallest shard: 64 KiB. Below this, the per-message cost of the
    /// inter-machine step outweighs spreading the load over more servers.
    pub const DEFAULT_MIN_SHARD_BYTES: u64 = 64 << 10;
    /// Default smallest shard with dedicated servers: 16 KiB. A slot's cells
    /// then reach more of a rail group's servers, each summing fewer bytes of
    /// every machine a slice: past 50 machines, 64 KiB cells leave most of a
    /// group's servers idle in each slice while the others' memory holds the
    /// slice up. The scale model (`docs/scale-model.md`, h100, one server
    /// machine per GPU machine) puts 2048 GPUs at 198 GB/s busbw at 256 MiB
    /// with 16 KiB cells against 175 with 64 KiB (192 with 32 KiB, 166 with
    /// 8 KiB, whose posts bound the workers). Up to 50 machines a full 25 MiB
    /// slice's slot has a cell for each server of its group either way; a
    /// tensor's shorter last slice gains from 30 machines.
    pub const DEFAULT_SERVER_MIN_SHARD_BYTES: u64 = 16 << 10;
    /// The smallest allowed minimum shard: 64 bytes (one alignment unit; some
    /// InfiniBand drivers misbehave on smaller messages).
    pub const MIN_SHARD_FLOOR: u64 = ALIGN_BYTES;
    /// The largest allowed slice: 1 GiB, so that any cell's length fits the 32-bit
    /// payload length of a [`crate::wire`] frame.
    pub const MAX_SLICE_BYTES: u64 = 1 << 30;
    /// The defaults.
    pub const DEFAULT: PlanConfig = PlanConfig {
        slice_bytes: Self::DEFAULT_SLICE_BYTES,
        min_shard_bytes: Self::DEFAULT_MIN_SHARD_BYTES,
        slice_by_routing: true,
        one_level: false,
    };

    /// A configuration with slices of at most `slice_bytes` and shards of at least
    /// `min_shard_bytes` (wherever a slice is split into more than one shard).
    ///
    /// `slice_bytes` is rounded down and `min_shard_bytes` up to a multiple of
    /// [`ALIGN_BYTES`] when a [`Geometry`] is made from them.
    pub const fn new(slice_bytes: u64, min_shard_bytes: u64) -> Result<PlanConfig, PlanError> {
        if slice_bytes < ALIGN_BYTES || slice_bytes > Self::MAX_SLICE_BYTES {
            return Err(PlanError::InvalidSliceBytes { slice_bytes });
        }
        if min_shard_bytes < Self::MIN_SHARD_FLOOR || min_shard_bytes > Self::MAX_SLICE_BYTES {
            return Err(PlanError::InvalidMinShardBytes { min_shard_bytes });
        }
        Ok(PlanConfig {
            slice_bytes,
            min_shard_bytes,
            slice_by_routing: false,
            one_level: false,
        })
    }

    /// A configuration with the default slices and shards of at least
    /// `min_shard_bytes`: slices of at most [`PlanConfig::DEFAULT_SLICE_BYTES`],
    /// or of [`PlanConfig::WIDE_FLAT_SLICE_BYTES`] where a [`Geometry`] made
    /// from it needs them to give every machine a shard (flat, or in equal
    /// groups: [`PlanConfig::equal_group_size`]) or forms groups past that
    /// ([`Routing::Groups`], [`PlanConfig::default_group_size`]), or of
    /// [`PlanConfig::DEFAULT_TREE_SLICE_BYTES`] where it routes the cells
    /// through the trees ([`Routing::Trees`]: a configuration
    /// [`PlanConfig::in_one_level`]). A slice size given with
    /// [`PlanConfig::new`] is kept whatever the routing, and never forms
    /// groups by itself.
    pub const fn with_default_slices(min_shard_bytes: u64) -> Result<PlanConfig, PlanError> {
        match PlanConfig::new(Self::DEFAULT_SLICE_BYTES, min_shard_bytes) {
            Ok(config) => Ok(PlanConfig {
                slice_by_routing: true,
                ..config
            }),
            Err(e) => Err(e),
        }
    }

    /// Whether the slice size is the default's, chosen by the routing.
    pub const fn slice_by_routing(&self) -> bool {
        self.slice_by_routing
    }

    /// The same configuration, whose default slices go through the trees
    /// where they would otherwise reduce in groups
    /// ([`PlanConfig::DEFAULT_GROUP_SIZE`]): one level always.
    pub const fn in_one_level(self) -> PlanConfig {
        PlanConfig {
            one_level: true,
            ..self
        }
    }

    /// The same slicing (slices as given or by routing, in one level or
    /// not) with shards of at least `min_shard_bytes`, refused as
    /// [`PlanConfig::new`] refuses it.
    pub const fn with_min_shard_bytes(self, min_shard_bytes: u64) -> Result<PlanConfig, PlanError> {
        match PlanConfig::new(self.slice_bytes, min_shard_bytes) {
            Ok(config) => Ok(PlanConfig {
                min_shard_bytes: config.min_shard_bytes,
                ..self
            }),
            Err(e) => Err(e),
        }
    }

    /// Whether it keeps one level ([`PlanConfig::in_one_level`]).
    pub const fn is_one_level(&self) -> bool {
        self.one_level
    }

    /// The largest slice, in bytes, as given.
    pub const fn slice_bytes(&self) -> u64 {
        self.slice_bytes
    }

    /// The smallest shard, in bytes, as given.
    pub const fn min_shard_bytes(&self) -> u64 {
        self.min_shard_bytes
    }
}

impl Default for PlanConfig {
    fn default() -> PlanConfig {
        PlanConfig::DEFAULT
    }
}

/// The slicing a communicator uses for every tensor: derived once from the
/// topology and the [`PlanConfig`], shared by every [`Plan`](super::Plan).
///
/// All sizes are counted in *units* of [`ALIGN_BYTES`], which is why they do not
/// depend on the element type. A full slice holds `D * slot_units` units, and each
/// slot of a full slice is cut into `shards_per_full_slice` equal shards, so every
/// full slice has identical cells (which is what makes the rotation of servers fair,
/// see [`Plan`](super::Plan)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    topology: Topology,
    config: PlanConfig,
    /// Units in one slot of a full slice: a multiple of `full_shards`.
    slot_units: u64,
    /// Smallest shard, in units (the configured minimum rounded up).
    min_shard_units: u64,
    /// Shards per slot of a full slice.
    full_shards: u32,
    /// Dedicated reduction servers; 0 when the machines serve (co-located).
    servers: u32,
    /// Rail groups the dedicated servers form ([`Geometry::server_rails`]); 1
    /// without servers.
    server_rails: u32,
    /// How cells travel between machines.
    routing: Routing,
    /// The machines' groups, where the slots are reduced in two levels
    /// ([`Routing::Groups`]).
    groups: Option<MachineGroups>,
    /// The dedicated servers' groups, where they reduce the slots in two
    /// levels ([`Routing::Groups`] with servers).
    server_groups: Option<ServerGroups>,
}

/// How a geometry's cells travel between machines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Routing {
    /// Straight to the machine (or dedicated server) serving them, and the
    /// result straight back: two hops, and a server receives one contribution
    /// from every other machine.
    Flat,
    /// Up and down the two trees of a [`DoubleTree`](super::DoubleTree): shard
    /// `j` of a slot through one tree, reduced on the way up by every inner
    /// node, and the root's result back down the same tree. Where a slot cannot
    /// give every machine a shard of at least the minimum size, this is what
    /// keeps every machine's messages and staging independent of `M`.
    Trees,
    /// In two levels ([`MachineGroups`]): each machine reduces a range of its
    /// slot over its group, and then pieces of that range over the groups
    /// (`plan/two_level.rs`). A slot is one cell; a machine sends and
    /// receives `O(G + M/G)` messages per slot, each of a `G`th or an
    /// `M`th of it, for groups of `G` ([`Geometry::with_groups`]).
    Groups,
}

impl Geometry {
    /// The geometry of `topology` under `config`, with co-located servers: every
    /// machine serves shards.
    pub const fn new(topology: Topology, config: PlanConfig) -> Result<Geometry, PlanError> {
        Geometry::build(topology, config, 0, None)
    }

    /// The geometry of `topology` under `config`, whose slots are reduced in
    /// two levels ([`Routing::Groups`]) over the machines in groups of at
    /// most `size` ([`MachineGroups::new`], which refuses a size that does
    /// not make two levels with [`PlanError::InvalidGroupSize`]). Every slot
    /// is one cell; the machines serve. The default slices are the wide
    /// ones ([`PlanConfig::WIDE_FLAT_SLICE_BYTES`], cut for small tensors),
    /// as where [`Geometry::new`] forms groups itself
    /// ([`PlanConfig::DEFAULT_GROUP_SIZE`]).
    pub const fn with_groups(
        topology: Topology,
        config: PlanConfig,
        size: u32,
    ) -> Result<Geometry, PlanError> {
        let config = if config.slice_by_routing {
            PlanConfig {
                slice_bytes: PlanConfig::WIDE_FLAT_SLICE_BYTES,
                ..config
            }
        } else {
            config
        };
        match MachineGroups::new(topology.machines(), size) {
            Ok(groups) => Geometry::build(topology, config, 0, Some(groups)),
            Err(e) => Err(e),
        }
    }

    /// The geometry of `topology` under `config` in groups of at most
    /// `size`, as [`Geometry::with_groups`] makes it, but in `config`'s own
    /// slices (the default ones still cut for small tensors), not the wide
    /// ones: so that a job's groups for small tensors fit its flat plan's
    /// buffers (on machines of several devices; a tenth larger with one).
    pub const fn with_groups_in_its_slices(
        topology: Topology,
        config: PlanConfig,
        size: u32,
    ) -> Result<Geometry, PlanError> {
        match MachineGroups::new(topology.machines(), size) {
            Ok(groups) => Geometry::build(topology, config, 0, Some(groups)),
            Err(e) => Err(e),
        }
    }

    /// The geometry of `topology` under `config` with `servers` dedicated
    /// reduction servers (Herring's design): the servers, not the machines, serve
    /// the shards, and the machines only send contributions and receive results.
    ///
    /// The servers form `R = gcd(servers, D)` rail groups
    /// ([`Geometry::server_rails`]): server `p` is in group `p mod R` and serves
    /// only the slots `d` with `d mod R = p mod R`, so each slot is cut into up
    /// to `servers / R` shards dealt round robin over its group. With one server
    /// process per NIC on machines of `D` NICs (`servers` a multiple of `D`),
    /// `R = D`: a server hears from one rail of each machine, `M` contributions
    /// a cell instead of `M * D`, in cells `D` times larger.
    pub const fn with_servers(
        topology: Topology,
        config: PlanConfig,
        servers: u32,
    ) -> Result<Geometry, PlanError> {
        if servers == 0 || servers > MAX_MACHINES {
            return Err(PlanError::InvalidServers { servers });
        }
        let flat = match Geometry::build(topology, config, servers, None) {
            Ok(flat) => flat,
            Err(e) => return Err(e),
        };
        // Where a full slot cannot give every server of a rail group a cell
        // of the minimum shard, the servers form groups, each serving its
        // own workers, if they can.
        let devices = topology.devices_per_machine();
        if !config.one_level
            && flat.full_shards < flat.serving()
            && servers.is_multiple_of(devices)
            && let Ok(groups) = ServerGroups::new(
                topology.machines(),
                servers / devices,
                PlanConfig::default_server_group_size(servers / devices),
            )
        {
            return flat.in_server_groups(groups);
        }
        Ok(flat)
    }

    /// [`Geometry::with_servers`], the servers of each rail group in groups
    /// of at most `size` ([`ServerGroups`], [`Routing::Groups`]): a worker
    /// sends each server of its group that server's range of its slot, the
    /// servers reduce their ranges over their group's workers and then across
    /// the groups, server to server. Every slot is one cell. Each server
    /// serves one rail, so `servers` must be a multiple of the devices a
    /// machine has ([`PlanError::ServersNotPerRail`]); the groups are refused
    /// as [`ServerGroups::new`] refuses them.
    pub const fn with_servers_in_groups(
        topology: Topology,
        config: PlanConfig,
        servers: u32,
        size: u32,
    ) -> Result<Geometry, PlanError> {
        if servers == 0 || servers > MAX_MACHINES {
            return Err(PlanError::InvalidServers { servers });
        }
        let devices = topology.devices_per_machine();
        if !servers.is_multiple_of(devices) {
            return Err(PlanError::ServersNotPerRail { servers, devices });
        }
        let groups = match ServerGroups::new(topology.machines(), servers / devices, size) {
            Ok(groups) => groups,
            Err(e) => return Err(e),
        };
        match Geometry::build(topology, config, servers, None) {
            Ok(flat) => flat.in_server_groups(groups),
            Err(e) => Err(e),
        }
    }

    /// This flat geometry with dedicated servers, its servers in `groups`:
    /// its slices, each slot one cell, whole (not rounded down to a multiple
    /// of any shard count).
    const fn in_server_groups(self, groups: ServerGroups) -> Result<Geometry, PlanError> {
        let slot_units =
            self.config.slice_bytes / ALIGN_BYTES / self.topology.devices_per_machine() as u64;
        // The servers' staging, checked once here so that
        // `server_group_layout` need not fail.
        if let Err(e) = ServerGroupLayout::new(groups, slot_units) {
            return Err(e);
        }
        Ok(Geometry {
            slot_units,
            full_shards: 1,
            routing: Routing::Groups,
            server_groups: Some(groups),
            ..self
        })
    }

    const fn build(
        topology: Topology,
        config: PlanConfig,
        servers: u32,
        groups: Option<MachineGroups>,
    ) -> Result<Geometry, PlanError> {
        let server_rails = server_rails(servers, topology.devices_per_machine());
        let serving = if servers > 0 {
            servers / server_rails
        } else {
            topology.machines()
        };
        let devices = topology.devices_per_machine() as u64;
        let slice_units = config.slice_bytes / ALIGN_BYTES;
        if slice_units < devices {
            return Err(PlanError::SliceTooSmall {
                slice_bytes: config.slice_bytes,
                devices: topology.devices_per_machine(),
            });
        }
        let min_shard_units = config.min_shard_bytes.div_ceil(ALIGN_BYTES);
        let raw_slot_units = slice_units / devices;
        let flat_shards = shards_for_slot(raw_slot_units, min_shard_units, serving as u64);
        // Machines that serve, and a full slot too small to give each a shard:
        // the cells go through the trees instead, one shard per tree.
        let routing = if groups.is_some() {
            Routing::Groups
        } else if servers == 0 && flat_shards < serving {
            Routing::Trees
        } else {
            Routing::Flat
        };
        if config.slice_by_routing && !config.one_level && servers == 0 && groups.is_none() {
            // The default slices, where their slot would give some machine no
            // shard of the minimum but the wide flat slices' gives each one:
            // equal groups in the wide slices, where the machines make some.
            // Decided on the two fixed sizes, so that the configuration of the
            // geometry made (the wide slices, still the default's) makes it
            // again.
            let default_slot_units = PlanConfig::DEFAULT_SLICE_BYTES / ALIGN_BYTES / devices;
            let wide_slot_units = PlanConfig::WIDE_FLAT_SLICE_BYTES / ALIGN_BYTES / devices;
            let machines = topology.machines();
            if shards_for_slot(default_slot_units, min_shard_units, serving as u64) < serving
                && shards_for_slot(wide_slot_units, min_shard_units, serving as u64) == serving
                && let Some(size) = PlanConfig::equal_group_size(machines)
                && let Ok(groups) = MachineGroups::new(machines, size)
            {
                let wide = PlanConfig::wide_in_groups(config.min_shard_bytes);
                return Geometry::build(topology, wide, servers, Some(groups));
            }
        }
        if let Routing::Trees = routing
            && config.slice_by_routing
        {
            // The default slices: the wide flat slices where their slot gives
            // every machine a shard of the minimum (and the machines make no
            // equal groups, above).
            let wide_slot_units = PlanConfig::WIDE_FLAT_SLICE_BYTES / ALIGN_BYTES / devices;
            if shards_for_slot(wide_slot_units, min_shard_units, serving as u64) == serving {
                let wide = PlanConfig {
                    slice_bytes: PlanConfig::WIDE_FLAT_SLICE_BYTES,
                    min_shard_bytes: config.min_shard_bytes,
                    slice_by_routing: false,
                    one_level: config.one_level,
                };
                return Geometry::build(topology, wide, servers, None);
            }
            // Past the wide flat slices: groups, in wide slices (cut for
            // small tensors), where the machines make two levels.
            let machines = topology.machines();
            let size = PlanConfig::default_group_size(machines);
            if !config.one_level
                && let Ok(groups) = MachineGroups::new(machines, size)
            {
                let wide = PlanConfig::wide_in_groups(config.min_shard_bytes);
                return Geometry::build(topology, wide, servers, Some(groups));
            }
        }
        if let Routing::Trees = routing
            && config.slice_by_routing
            && config.slice_bytes > PlanConfig::DEFAULT_TREE_SLICE_BYTES
        {
            // Fewer units a slot give no more shards (`shards_for_slot` grows
            // with the slot), so the smaller slices route through the trees too.
            // They stay the default's, so that small tensors are cut; made
            // again from this configuration, the same geometry comes out.
            let trees = PlanConfig {
                slice_bytes: PlanConfig::DEFAULT_TREE_SLICE_BYTES,
                min_shard_bytes: config.min_shard_bytes,
                slice_by_routing: true,
                one_level: config.one_level,
            };
            return Geometry::build(topology, trees, servers, None);
        }
        let full_shards = match routing {
            Routing::Trees => shards_for_slot(raw_slot_units, min_shard_units, TREES as u64),
            Routing::Flat => flat_shards,
            Routing::Groups => 1,
        };
        // Round the slot down to a multiple of its shard count so that every full
        // slice has equal cells. The shards stay at least the minimum: with k > 1,
        // k <= raw / min, so floor(raw / k) >= min.
        let slot_units = raw_slot_units / full_shards as u64 * full_shards as u64;
        if let Some(groups) = groups {
            // The two levels' staging, checked once here so that
            // `two_level_layout` need not fail.
            let slice_units = slot_units * devices;
            if let Err(e) = TwoLevelLayout::new(groups, slot_units, slice_units) {
                return Err(e);
            }
        }
        Ok(Geometry {
            topology,
            config,
            slot_units,
            min_shard_units,
            full_shards,
            servers,
            server_rails,
            routing,
            groups,
            server_groups: None,
        })
    }

    /// How the cells travel between machines: [`Routing::Groups`] where the
    /// geometry was made [`Geometry::with_groups`], or where the default
    /// slices would go through the trees and the machines make two levels
    /// ([`PlanConfig::equal_group_size`] where the wide flat slices would
    /// serve, else [`PlanConfig::default_group_size`]); else [`Routing::Trees`] where
    /// the machines serve and a full slot, cut into shards of at least the
    /// minimum size, has fewer shards than there are machines; else
    /// [`Routing::Flat`].
    pub const fn routing(&self) -> Routing {
        self.routing
    }

    /// The machines' groups, where the slots are reduced in two levels
    /// ([`Routing::Groups`]).
    pub const fn machine_groups(&self) -> Option<MachineGroups> {
        self.groups
    }

    /// The dedicated servers' groups, where they reduce the slots in two
    /// levels ([`Routing::Groups`] with servers).
    pub const fn server_groups(&self) -> Option<ServerGroups> {
        self.server_groups
    }

    /// The layout of a dedicated server's staging buffer where the servers
    /// are in groups: areas for a full slot's ranges and pieces.
    pub const fn server_group_layout(&self) -> Option<ServerGroupLayout> {
        let Some(groups) = self.server_groups else {
            return None;
        };
        match ServerGroupLayout::new(groups, self.slot_units) {
            Ok(layout) => Some(layout),
            // `in_server_groups` checked the slot's size.
            Err(_) => None,
        }
    }

    /// The staging of the two levels ([`Routing::Groups`]) with `input` as
    /// its input area: areas for a full slot's ranges and pieces.
    pub const fn two_level_layout(&self, input: InputArea) -> Option<TwoLevelLayout> {
        let Some(groups) = self.groups else {
            return None;
        };
        let input_units = match input {
            InputArea::Slot => self.slot_units,
            InputArea::Slice => self.slot_units * self.topology.devices_per_machine() as u64,
        };
        match TwoLevelLayout::new(groups, self.slot_units, input_units) {
            Ok(layout) => Some(layout),
            // `build` made the same layout for the larger input area.
            Err(_) => None,
        }
    }

    /// What shard indices rotate over: the trees, the dedicated servers or the
    /// machines (one shard, the whole slot, in groups); also the most shards a
    /// slot has.
    pub(crate) const fn rotation_period(&self) -> u32 {
        match self.routing {
            Routing::Trees => TREES,
            Routing::Flat => self.serving(),
            Routing::Groups => 1,
        }
    }

    /// The dedicated reduction servers, if the geometry has them.
    pub const fn servers(&self) -> Option<u32> {
        if self.servers > 0 {
            Some(self.servers)
        } else {
            None
        }
    }

    /// How many serve the shards of one slot: the dedicated servers of a rail
    /// group, or else the machines. Shard servers rotate over this many.
    pub const fn serving(&self) -> u32 {
        if self.servers > 0 {
            self.servers / self.server_rails
        } else {
            self.topology.machines()
        }
    }

    /// The rail groups of the dedicated servers, `R = gcd(K, D)` for `K`
    /// servers ([`Geometry::with_servers`]); 1 without servers.
    pub const fn server_rails(&self) -> u32 {
        self.server_rails
    }

    /// Whether dedicated server `server` serves shards of slot `device`: both in
    /// the same rail group. False without servers, or out of range.
    pub const fn server_serves_slot(&self, server: u32, device: u32) -> bool {
        self.servers > 0
            && server < self.servers
            && device < self.topology.devices_per_machine()
            && serves_rail(self.server_rails, server, device)
    }

    /// The topology.
    pub const fn topology(&self) -> Topology {
        self.topology
    }

    /// The configuration it was made from; where the default slices were
    /// chosen by the routing, the configuration of the slices chosen (the wide
    /// flat ones with [`PlanConfig::slice_by_routing`] false, the trees' still
    /// the default's, so that small tensors are cut), from which the same
    /// geometry is made again.
    pub const fn config(&self) -> PlanConfig {
        self.config
    }

    /// Bytes in a full slice (every slice of a tensor but the last):
    /// at most [`PlanConfig::slice_bytes`], a multiple of `D * ALIGN_BYTES`.
    pub const fn full_slice_bytes(&self) -> u64 {
        self.slot_units * self.topology.devices_per_machine() as u64 * ALIGN_BYTES
    }

    /// Bytes in each slice but the last of a tensor of `tensor_bytes` bytes:
    /// [`Geometry::full_slice_bytes`], or, where the slices are the default's
    /// ([`PlanConfig::slice_by_routing`]: 25 MiB on the flat plan, 20 MiB
    /// through the trees) without dedicated servers, less where the tensor
    /// would otherwise have fewer than [`PlanConfig::MIN_SLICES_PER_TENSOR`]
    /// slices: a quarter of it, rounded up to a multiple of `D * ALIGN_BYTES`,
    /// and no less than [`PlanConfig::SMALLEST_CUT_SLICE_BYTES`] or than a
    /// slice whose slot holds a shard of the minimum for each of its shards
    /// (every machine, on the flat plan), so that its shards stay
    /// [`Geometry::shards_per_full_slice`].
    pub const fn slice_bytes_for(&self, tensor_bytes: u64) -> u64 {
        let full = self.full_slice_bytes();
        if !self.config.slice_by_routing || self.servers > 0 {
            return full;
        }
        let step = self.topology.devices_per_machine() as u64 * ALIGN_BYTES;
        let every_shard = self.min_shard_units * self.full_shards as u64 * step;
        let mut want = tensor_bytes.div_ceil(PlanConfig::MIN_SLICES_PER_TENSOR);
        if want < PlanConfig::SMALLEST_CUT_SLICE_BYTES {
            want = PlanConfig::SMALLEST_CUT_SLICE_BYTES;
        }
        if want < every_shard {
            want = every_shard;
        }
        let bytes = want.div_ceil(step).saturating_mul(step);
        if bytes < full { bytes } else { full }
    }

    /// Bytes in one slot of a full slice.
    pub const fn full_slot_bytes(&self) -> u64 {
        self.slot_units * ALIGN_BYTES
    }

    /// Shards per slot in a full slice: `M` (or the dedicated servers of a rail
    /// group, or through trees [`TREES`]) when the slot is large enough, fewer so
    /// that no shard is smaller than the minimum, and at least one.
    pub const fn shards_per_full_slice(&self) -> u32 {
        self.full_shards
    }

    /// The smallest shard, in units.
    pub(crate) const fn min_shard_units(&self) -> u64 {
        self.min_shard_units
    }

    /// The smallest shard, in bytes, after rounding up to [`ALIGN_BYTES`].
    pub const fn min_shard_bytes(&self) -> u64 {
        self.min_shard_units * ALIGN_BYTES
    }

    /// Shards per slot for a slice of `units` units (the adaptive-sharding rule).
    pub(crate) const fn shards_for_slice(&self, units: u64) -> u32 {
        let slot = units / self.topology.devices_per_machine() as u64;
        shards_for_slot(slot, self.min_shard_units, self.rotation_period() as u64)
    }

    /// The layout of one staging buffer, large enough for any slice of any tensor,
    /// whose input area is one slot ([`InputArea::Slot`]).
    pub const fn staging_layout(&self) -> StagingLayout {
        StagingLayout::for_geometry(self, InputArea::Slot)
    }

    /// The layout of one staging buffer whose input area is `input`.
    pub const fn staging_layout_with(&self, input: InputArea) -> StagingLayout {
        StagingLayout::for_geometry(self, input)
    }

    /// Upper bound on any cell of any slice, in units (see [`StagingLayout`]).
    pub(crate) const fn max_shard_units(&self) -> u64 {
        let even = self.slot_units / self.full_shards as u64;
        let adaptive = 2 * self.min_shard_units;
        let bound = if even > adaptive { even } else { adaptive };
        if bound < self.slot_units {
            bound
        } else {
            self.slot_units
        }
    }

    /// The layout of a dedicated server's staging buffer; `None` without
    /// servers, or where they are in groups
    /// ([`Geometry::server_group_layout`]).
    pub const fn server_layout(&self) -> Option<ServerLayout> {
        if self.servers == 0 || self.server_groups.is_some() {
            return None;
        }
        Some(ServerLayout::for_geometry(self))
    }

    /// How many staging buffers fit in `budget_bytes`: at least one, or an error.
    ///
    /// The number of staging buffers bounds how many slices are in flight at once.
    pub const fn staging_buffers(&self, budget_bytes: u64) -> Result<u32, PlanError> {
        let buffer_bytes = match self.two_level_layout(InputArea::Slot) {
            Some(layout) => layout.total_bytes(),
            None => self.staging_layout().total_bytes(),
        };
        let n = budget_bytes / buffer_bytes;
        if n == 0 {
            return Err(PlanError::BudgetTooSmall {
                budget_bytes,
                buffer_bytes,
            });
        }
        #[expect(clippy::cast_possible_truncation, reason = "clamped to u32::MAX first")]
        Ok(if n > u32::MAX as u64 {
            u32::MAX
        } else {
            n as u32
        })
    }
}

/// The rail groups `servers` dedicated servers form beside machines of
/// `devices` devices: `gcd(servers, devices)`, 1 without servers
/// ([`Geometry::with_servers`]). Server `p` is in group `p mod R`, as is slot
/// (device) `d` in group `d mod R`.
pub const fn server_rails(servers: u32, devices: u32) -> u32 {
    if servers == 0 || devices == 0 {
        1
    } else {
        gcd(servers, devices)
    }
}

/// Whether, among servers in `rails` rail groups, server `server` serves the
/// slot of device `device`: both in the same group (`server mod rails = device
/// mod rails`). The one rule every part of a job deals and links by.
pub const fn serves_rail(rails: u32, server: u32, device: u32) -> bool {
    server % rails == device % rails
}

/// The greatest common divisor of two positive counts.
const fn gcd(a: u32, b: u32) -> u32 {
    let (mut a, mut b) = (a, b);
    while b != 0 {
        let r = a % b;
        a = b;
        b = r;
    }
    a
}

/// Shards for a slot of `slot_units` units: as many as fit at the minimum size, at
/// most one per serving machine (or server), at least one. The result is at most
/// `machines <= 4096`.
const fn shards_for_slot(slot_units: u64, min_shard_units: u64, machines: u64) -> u32 {
    let fit = slot_units / min_shard_units;
    let k = if fit < machines { fit } else { machines };
    #[expect(clippy::cast_possible_truncation, reason = "k <= machines <= 4096")]
    if k == 0 { 1 } else { k as u32 }
}
