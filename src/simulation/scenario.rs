//! What a seed draws (the layout, the operations, the schedule's random
//! numbers, a kill) and what every rank's results must then be.

use super::*;

pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub(super) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[usize::try_from(self.below(items.len() as u64)).unwrap_or(0)]
    }

    /// A second stream seeded from this one's state and `salt`, which leaves
    /// this one where it is: a draw added to a scenario from it changes no
    /// other draw of a seed, nor its schedule.
    pub(super) fn side(&self, salt: u64) -> Rng {
        Rng::new(self.0 ^ salt)
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Op {
    pub(super) elements: u64,
    pub(super) dtype: DataType,
    pub(super) op: ReduceOp,
    pub(super) algorithm: Resolved,
    pub(super) wire: WireFormat,
    /// A relayed broadcast's or all-gather's origins (`u8` elements, every rank
    /// starting from its own values everywhere).
    pub(super) origins: Option<Origins>,
    /// A reduce-scatter's elements per rank (`elements` is the whole input).
    pub(super) share: Option<u64>,
    /// Called as its rooted form: an all-reduce as a reduce, an all-gather as
    /// a gather, a broadcast of equal parts as a scatter (whose input,
    /// workspace on every rank, is what is checked).
    pub(super) rooted: Option<Rooted>,
}

/// How an operation is called as its rooted form.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rooted {
    /// A reduce's or a gather's root (a scatter's is its broadcast's).
    pub(super) root: u32,
    /// Ranks in the job: a scatter's descriptor counts one rank's part.
    pub(super) world: u32,
}

impl Op {
    /// The descriptor the communicator would make for it.
    pub(super) fn descriptor(&self) -> Descriptor {
        let (collective, root, elements) = match (self.origins, self.share, self.rooted) {
            (None, Some(share), _) => (Collective::ReduceScatter, 0, share),
            (None, None, None) => (Collective::AllReduce, 0, self.elements),
            (None, None, Some(r)) => (Collective::Reduce, r.root, self.elements),
            (Some(Origins::Rank(root)), _, None) => (Collective::Broadcast, root, self.elements),
            (Some(Origins::Rank(root)), _, Some(r)) => (
                Collective::Scatter,
                root,
                self.elements / u64::from(r.world.max(1)),
            ),
            (Some(Origins::Blocks(block)), _, None) => (Collective::AllGather, 0, block),
            (Some(Origins::Blocks(block)), _, Some(r)) => (Collective::Gather, r.root, block),
        };
        Descriptor {
            collective,
            dtype: self.dtype,
            op: self.op,
            algorithm: self.algorithm,
            wire: self.wire,
            memory: crate::memory::MemoryKind::Host,
            by_messages: false,
            root,
            elements,
        }
    }

    /// The elements the engine plans: a reduce-scatter under the scatter
    /// algorithm plans one share.
    pub(super) fn planned(&self) -> u64 {
        match self.share {
            Some(share) if self.algorithm == Resolved::Scatter => share,
            _ => self.elements,
        }
    }

    /// Whether rank `r`'s element `i` has a defined result: every element of an
    /// all-reduce, broadcast or all-gather; the rank's own share of a
    /// reduce-scatter.
    pub(super) fn defined(&self, r: usize, i: u64) -> bool {
        self.share.is_none_or(|share| i / share.max(1) == r as u64)
    }

    /// The rank whose input element `i` of the result is, for a relay.
    pub(super) fn origin_of(&self, i: u64) -> Option<u32> {
        match self.origins? {
            Origins::Rank(root) => Some(root),
            Origins::Blocks(block) => u32::try_from(i / block.max(1)).ok(),
        }
    }
}

/// Rank `rank`'s element `i` of operation `k` as it is written into a tensor of
/// `dtype`: for `f32`, small integers, whose sums over every rank every wire
/// format carries exactly, so that a compressed wire's result is checked bit for
/// bit like the others'.
pub(super) fn input(dtype: DataType, rank: u32, k: usize, i: u64) -> i64 {
    match dtype {
        DataType::F32 => value(rank, k, i).rem_euclid(16) - 8,
        _ => value(rank, k, i),
    }
}

/// Rank `rank`'s element `i` of operation `k`, before truncation to the type.
pub(super) fn value(rank: u32, k: usize, i: u64) -> i64 {
    let x = (u64::from(rank) + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ (k as u64) << 32 ^ i;
    (x.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as i64 - (1 << 23)
}

pub(super) fn fold(op: ReduceOp, a: i64, b: i64) -> i64 {
    match op {
        ReduceOp::Product => a.wrapping_mul(b),
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        ReduceOp::BitAnd => a & b,
        ReduceOp::BitOr => a | b,
        ReduceOp::BitXor => a ^ b,
        _ => a.wrapping_add(b),
    }
}

/// Element `i` of a tensor of `dtype`, as an i64.
pub(super) fn read(dtype: DataType, bytes: &[u8], i: usize) -> i64 {
    match dtype {
        DataType::U8 => i64::from(bytes[i]),
        DataType::I16 => i64::from(i16::from_le_bytes(
            bytes[i * 2..i * 2 + 2].try_into().unwrap_or([0; 2]),
        )),
        DataType::I32 => i64::from(i32::from_le_bytes(
            bytes[i * 4..i * 4 + 4].try_into().unwrap_or([0; 4]),
        )),
        DataType::F32 => {
            let x = f32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap_or([0; 4]));
            // Only whole numbers are expected; anything else reads as a value no
            // input sums to.
            if x.fract() == 0.0 { x as i64 } else { i64::MIN }
        }
        _ => i64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8])),
    }
}

/// The bytes of `v` as one element of `dtype` (truncated, as the type wraps).
pub(super) fn write(dtype: DataType, bytes: &mut [u8], i: usize, v: i64) {
    match dtype {
        DataType::U8 => bytes[i] = v as u8,
        DataType::I16 => bytes[i * 2..i * 2 + 2].copy_from_slice(&(v as i16).to_le_bytes()),
        DataType::I32 => bytes[i * 4..i * 4 + 4].copy_from_slice(&(v as i32).to_le_bytes()),
        DataType::F32 => bytes[i * 4..i * 4 + 4].copy_from_slice(&(v as f32).to_le_bytes()),
        _ => bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes()),
    }
}

/// `v` as the type holds it (u8, i16 and i32 wrap; min and max compare within the type).
pub(super) fn narrow(dtype: DataType, v: i64) -> i64 {
    match dtype {
        DataType::U8 => i64::from(v as u8),
        DataType::I16 => i64::from(v as i16),
        DataType::I32 => i64::from(v as i32),
        _ => v,
    }
}

/// What one seed runs: the job, and what its ranks do.
#[derive(Clone, Debug)]
pub(super) struct Scenario {
    pub(super) machines: u32,
    pub(super) devices: u32,
    /// How ranks are numbered.
    pub(super) layout: RankLayout,
    pub(super) servers: u32,
    pub(super) buffers: u32,
    pub(super) slice_bytes: u64,
    /// The smallest shard: where a slot holds fewer of them than there are
    /// machines, the hierarchical all-reduce goes through the trees.
    pub(super) min_shard_bytes: u64,
    pub(super) ops: Vec<Op>,
    /// Operations a rank may have outstanding.
    pub(super) window: usize,
    /// The step at which a process is killed, and which.
    pub(super) kill: Option<(u64, u32)>,
    /// Whether, and from which size, all-reduces send from their tensors
    /// where they may, and how many registrations each rank keeps.
    pub(super) direct: DirectSettings,
    /// Per operation: whether its tensors are device memory, on the
    /// simulated GPU (one rank per machine, as the communicator takes them).
    pub(super) device: Vec<bool>,
    /// Whether several ranks per machine reduce device tensors through the
    /// machine's collectives (as through NCCL) rather than the host.
    pub(super) collectives: bool,
    /// In a job of one machine without servers, the most bytes a rank reads
    /// from the others' buffers for a host slice it reduces whole
    /// ([`ShmStep::reducing_whole`]): never, small slices only, or all.
    pub(super) whole_up_to: usize,
    /// Where the machine's collectives serve: the smallest slice of equal
    /// slots they reduce-scatter in one call (else one reduce per slot):
    /// every such slice, those of a kilobyte and more, or none.
    pub(super) one_reduce_scatter_from: u64,
    /// Whether one NCCL all-reduce over the workers can run (three seeds in
    /// four of several ranks a machine, through their collectives: on
    /// several machines, with or without servers, the job's communicator is
    /// made; on one machine beside servers, the machine's communicators take
    /// it): then
    /// about three in four of its device all-reduces that NCCL reduces run
    /// as that ([`Resolved::Nccl`]), and a server plans them and serves
    /// nothing.
    pub(super) across_job: bool,
    /// Machines (or, with servers, the servers of each rail) in groups of
    /// at most this many, where the hierarchical all-reduce runs in two
    /// levels (`Routing::Groups`): four machines in pairs, for half the
    /// seeds of four machines without servers; 4, 6 or 7 servers a rail in
    /// groups of 2 or 3, for one seed in six of two machines or more and at
    /// most two devices (where the machines are at least the groups).
    pub(super) group_size: Option<u32>,
    /// On the flat plan, the job's second geometry in groups of at most this
    /// many, which its small tensors plan with (`Resolved::Grouped`): four
    /// machines in pairs, for half the seeds of four flat machines without
    /// servers; then about half the exact all-reduces run in them.
    pub(super) grouped: Option<u32>,
}

impl Scenario {
    /// A scenario drawn from `rng` (see the module docs).
    pub(super) fn draw(rng: &mut Rng) -> Scenario {
        let (m, d) = (1 + rng.below(4) as u32, 1 + rng.below(3) as u32);
        let world = m * d;
        // Servers in groups, drawn from a side stream so that the other
        // seeds draw as before: for one in six seeds of two machines or more
        // and at most two devices, one of 4 servers a rail in groups of 2, 6
        // in groups of 3 or of 2, and 7 in groups of 3 (unequal: 3, 2, 2),
        // kept where the machines are at least the groups (on two machines,
        // two draws in four).
        let mut grouping = rng.side(0x7365_7276);
        let server_groups = (m >= 2 && d <= 2 && grouping.below(6) == 0)
            .then(|| grouping.pick(&[(4u32, 2u32), (6, 3), (6, 2), (7, 3)]))
            .filter(|&(per_rail, size)| per_rail.div_ceil(size) <= m);
        let servers = match server_groups {
            Some((per_rail, _)) => per_rail * d,
            None => rng.pick(&[0, 0, 0, 0, 1, 2, 3]),
        };
        let processes = world + servers;
        let buffers = 1 + rng.below(4) as u32;
        let slice_bytes = rng.pick(&[1024, 4096, 16_384]);
        let mut ops: Vec<Op> = (0..2 + rng.below(7))
            .map(|_| {
                let elements = match rng.below(5) {
                    0 => 0,
                    1 => 1 + rng.below(8),
                    2 => rng.below(300),
                    _ => rng.below(6000),
                };
                let dtype = rng.pick(&[
                    DataType::I32,
                    DataType::I64,
                    DataType::U8,
                    DataType::F32,
                    DataType::I16,
                ]);
                let op = rng.pick(&[
                    ReduceOp::Sum,
                    ReduceOp::Product,
                    ReduceOp::Min,
                    ReduceOp::Max,
                    ReduceOp::BitXor,
                    ReduceOp::BitAnd,
                    ReduceOp::BitOr,
                ]);
                let algorithm = rng.pick(&[
                    Resolved::Hierarchical,
                    Resolved::Ring,
                    Resolved::Relay,
                    Resolved::Doubling,
                    Resolved::Scatter,
                ]);
                if algorithm == Resolved::Relay {
                    // A broadcast from any root, or an all-gather of whole blocks.
                    let origins = if rng.below(2) == 0 {
                        Origins::Rank(rng.below(u64::from(world)) as u32)
                    } else {
                        Origins::Blocks(elements / u64::from(world))
                    };
                    let elements = match origins {
                        Origins::Blocks(block) => block * u64::from(world),
                        Origins::Rank(_) => elements,
                    };
                    return Op {
                        elements,
                        dtype: DataType::U8,
                        op: ReduceOp::Sum,
                        algorithm,
                        wire: WireFormat::Exact,
                        origins: Some(origins),
                        share: None,
                        rooted: None,
                    };
                }
                // A reduce-scatter of whole shares (the others run as
                // all-reduces; the scatter algorithm reduces each share on its
                // way to its rank).
                let share = (algorithm == Resolved::Scatter || rng.below(8) == 0)
                    .then(|| elements / u64::from(world));
                let elements = share.map_or(elements, |s| s * u64::from(world));
                // As the communicator submits them: compressed only where f32 values
                // cross between machines, or to dedicated servers.
                let wire = if dtype == DataType::F32
                    && algorithm == Resolved::Hierarchical
                    && (m > 1 || servers > 0)
                {
                    rng.pick(&[WireFormat::Exact, WireFormat::Bf16, WireFormat::F16])
                } else {
                    WireFormat::Exact
                };
                Op {
                    elements,
                    dtype,
                    // Products of whole f32 numbers outgrow what f32 holds
                    // exactly; floats have no bitwise operators.
                    op: if dtype == DataType::F32 && (op == ReduceOp::Product || op.is_bitwise()) {
                        ReduceOp::Sum
                    } else {
                        op
                    },
                    algorithm,
                    wire,
                    origins: None,
                    share,
                    rooted: None,
                }
            })
            .collect();
        let window = 1 + rng.below(4) as usize;
        let kill = (processes > 1 && rng.below(2) == 1)
            .then(|| (1 + rng.below(4000), rng.below(u64::from(processes)) as u32));
        // Drawn last, so that every other draw of a seed stays as it was.
        let layout = if rng.below(4) == 0 {
            RankLayout::Interleaved
        } else {
            RankLayout::Contiguous
        };
        let direct = DirectSettings {
            from_bytes: rng.pick(&[None, None, Some(0), Some(4096)]),
            cached: rng.pick(&[1, 2, 64]),
        };
        // No device operations, every one, or about half (a host barrier
        // among device all-reduces): drawn last, as above.
        let device = match rng.below(3) {
            1 => vec![true; ops.len()],
            2 => ops.iter().map(|_| rng.below(2) == 0).collect(),
            _ => vec![false; ops.len()],
        };
        // Drawn last, as above.
        let collectives = rng.below(2) == 0;
        // For one seed in three a minimum shard of half a slice or a whole
        // one, so that slots hold fewer shards than there are machines and
        // the hierarchical all-reduce goes through the trees: drawn from a
        // side stream, so that every other draw and the schedule stay as
        // they were.
        let min_shard_bytes = match rng.side(0x7472_6565).below(6) {
            0 => slice_bytes / 2,
            1 => slice_bytes,
            _ => 64,
        };
        // Slices reduced whole, on one machine: drawn from a side stream, as
        // above.
        let whole_up_to = if m == 1 && servers == 0 {
            rng.side(0x7768_6f6c).pick(&[0, 4096, usize::MAX])
        } else {
            0
        };
        // Slices reduce-scattered in one call: drawn from a side stream, as
        // above.
        let one_reduce_scatter_from = rng.side(0x7273_6f6e).pick(&[0, 1024, u64::MAX]);
        // About one operation in four as its rooted form, where it has one
        // (a scatter's input divides among the ranks): drawn last, as above.
        for op in &mut ops {
            let root = rng.below(u64::from(world)) as u32;
            if rng.below(4) != 0 || op.share.is_some() {
                continue;
            }
            let divides = op.elements.is_multiple_of(u64::from(world));
            if op.origins.is_none() || matches!(op.origins, Some(Origins::Blocks(_))) || divides {
                op.rooted = Some(Rooted { root, world });
            }
        }
        // The job's NCCL communicator, and the all-reduces that run on it:
        // drawn from a side stream, as above.
        let mut job = rng.side(0x6e63_636c);
        // On one machine beside servers, the machine's communicators reduce
        // the workers' all-reduce: no job communicator to make.
        let over_workers = m > 1 || servers > 0;
        let across_job = collectives && d > 1 && over_workers && job.below(4) != 0;
        for (op, &on_device) in ops.iter_mut().zip(&device) {
            let plain_all_reduce = op.origins.is_none()
                && op.share.is_none()
                && op.rooted.is_none()
                && op.wire == WireFormat::Exact;
            if across_job
                && on_device
                && plain_all_reduce
                && crate::local::takes(op.dtype, op.op)
                && job.below(4) != 0
            {
                op.algorithm = Resolved::Nccl;
            }
        }
        // Beside dedicated servers, the machines serving their own shards
        // (`FAIRRING_MACHINES_SERVE`): for half the seeds with servers, about
        // half the exact all-reduces the servers would take run as the same
        // job without servers would, which a server plans and serves none
        // of. Drawn from a side stream, as above.
        let mut colocated = rng.side(0x636f_6c6f);
        if servers > 0 && colocated.below(2) == 0 {
            for op in &mut ops {
                let plain_all_reduce = op.origins.is_none()
                    && op.share.is_none()
                    && op.rooted.is_none()
                    && op.wire == WireFormat::Exact;
                if plain_all_reduce
                    && op.algorithm == Resolved::Hierarchical
                    && colocated.below(2) == 0
                {
                    op.algorithm = Resolved::Colocated;
                }
            }
        }
        // Machines in groups: drawn from a side stream, as above.
        let group_size = match server_groups {
            Some((_, size)) => Some(size),
            None => (m == 4 && servers == 0 && rng.side(0x6772_6f75).below(2) == 0).then_some(2),
        };
        // A flat job's small tensors in groups: drawn from a side stream, as
        // above.
        let mut small = rng.side(0x736d_616c);
        // Only where the job's own plan is flat, as in production.
        let flat = Topology::new(m, d, layout)
            .ok()
            .zip(PlanConfig::new(slice_bytes, min_shard_bytes).ok())
            .and_then(|(t, c)| Geometry::new(t, c).ok())
            .is_some_and(|g| g.routing() == fairring_core::plan::Routing::Flat);
        let grouped =
            (m == 4 && servers == 0 && group_size.is_none() && flat && small.below(2) == 0)
                .then_some(2);
        if grouped.is_some() {
            for op in &mut ops {
                let plain_all_reduce = op.origins.is_none()
                    && op.share.is_none()
                    && op.rooted.is_none()
                    && op.wire == WireFormat::Exact;
                if plain_all_reduce && op.algorithm == Resolved::Hierarchical && small.below(2) == 0
                {
                    op.algorithm = Resolved::Grouped;
                }
            }
        }
        if group_size.is_some() {
            // As the communicator submits them: exact in groups.
            for op in &mut ops {
                op.wire = WireFormat::Exact;
            }
        }
        Scenario {
            machines: m,
            devices: d,
            layout,
            servers,
            buffers,
            slice_bytes,
            min_shard_bytes,
            ops,
            window,
            kill,
            direct,
            device,
            collectives,
            whole_up_to,
            one_reduce_scatter_from,
            across_job,
            group_size,
            grouped,
        }
    }

    /// Operations called as a reduce, a gather and a scatter.
    pub(super) fn rooted_counts(&self) -> [usize; 3] {
        let mut counts = [0; 3];
        for op in self.ops.iter().filter(|op| op.rooted.is_some()) {
            let form = match op.origins {
                None => 0,
                Some(Origins::Blocks(_)) => 1,
                Some(Origins::Rank(_)) => 2,
            };
            counts[form] += 1;
        }
        counts
    }

    /// The descriptor of operation `k`.
    pub(super) fn descriptor(&self, k: usize) -> Descriptor {
        let memory = if self.device[k] {
            MemoryKind::Device
        } else {
            MemoryKind::Host
        };
        Descriptor {
            memory,
            ..self.ops[k].descriptor()
        }
    }
}

/// The bytes of 8-byte words.
pub(super) fn bytemuck_bytes(words: &mut [u64]) -> &mut [u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: `u64` has no padding and any byte pattern is valid for `u8`; the
    // slice covers exactly the words' memory, borrowed mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

/// The bytes of 8-byte words, read-only.
pub(super) fn word_bytes(words: &[u64]) -> &[u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: as in `bytemuck_bytes`, borrowed shared.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) }
}

/// Checks rank `r`'s result of operation `k` element by element.
pub(super) fn check(op: &Op, k: usize, world: u32, r: usize, words: &[u64]) -> Result<(), String> {
    let bytes = word_bytes(words);
    for i in 0..usize::try_from(op.elements).unwrap_or(0) {
        if !op.defined(r, i as u64) {
            continue;
        }
        if let Some(origin) = op.origin_of(i as u64) {
            let want = narrow(op.dtype, input(op.dtype, origin, k, i as u64));
            let got = read(op.dtype, bytes, i);
            if got != want {
                return Err(format!(
                    "rank {r}, operation {k} ({op:?}): element {i} is {got}, expected rank \
                     {origin}'s {want}"
                ));
            }
            continue;
        }
        let want = (1..world).fold(
            narrow(op.dtype, input(op.dtype, 0, k, i as u64)),
            |acc, q| {
                narrow(
                    op.dtype,
                    fold(
                        op.op,
                        acc,
                        narrow(op.dtype, input(op.dtype, q, k, i as u64)),
                    ),
                )
            },
        );
        let got = read(op.dtype, bytes, i);
        if got != want {
            return Err(format!(
                "rank {r}, operation {k} ({op:?}): element {i} is {got}, expected {want}"
            ));
        }
    }
    Ok(())
}
