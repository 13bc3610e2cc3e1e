//! A study of a two-level plan: machines in groups, reduction servers within
//! a group and then across groups, along rails.
//!
//! This row answered whether the plan should change past the machines the
//! flat plan serves, trying group sizes ([`group_sizes`]) in the study's own
//! slices (below). The engine now runs the plan there by default, in groups
//! of `PlanConfig::default_group_size` (`Routing::Groups`), and
//! `hierarchical` predicts that with this module's schedule over the
//! engine's own slices, buffers and groups (`predict_engine`).
//!
//! The `M` machines form `Q = ceil(M / G)` groups of consecutive machines,
//! of `ceil(M / Q)` or `floor(M / Q)` machines each (fairring-core's
//! `MachineGroups`, whose arithmetic this walks): `G` from 2 to `M / 2`, the
//! one of [`group_sizes`] whose prediction is shortest, or the one the job
//! asks for ([`Job::group`]). Per slice, on rail 0 of every machine (rails
//! are symmetric, as in [`super::hierarchical`]), with the slot of `S` bytes
//! each rail holds after the reduce-scatter within the machine:
//!
//! 1. **reduce-scatter** within the machine, as the engine does it;
//! 2. **within the group**: a group of `s` members cuts the slot into `s`
//!    ranges as even as whole units (64 bytes) allow, member `i` holding
//!    range `i`; each member sends every other member that member's range,
//!    and reduces what it receives in its own (the many-source kernel:
//!    `s + 1` passes);
//! 3. **across the groups**: the ranges of all groups cut the slot into
//!    intervals, each held by one member of every group; each interval is
//!    cut into `Q` pieces (an empty one is not sent), piece `g` reduced by
//!    its holder in group `g`, which receives it from the other `Q - 1`
//!    holders and sends the sum back to them (`Q + 1` passes over a piece);
//! 4. **back within the group**: each member sends its final range to
//!    every other member of its group;
//! 5. **all-gather** within the machine.
//!
//! With `G` dividing `M` (groups of `G`, `H = M / G` of them) the intervals
//! are the `G` ranges, `S / G` each, in `H` pieces of `S / M`, and a rail
//! sends `2(G - 1) + 2(H - 1)` messages a slice, against `2(M - 1)` flat,
//! and the same bytes: `S (1 - 1/M)` each way. Every
//! message occupies its sender for `max(o, bytes / rate)` and lands one
//! latency later, as everywhere in the model. A receive side takes a level's
//! bytes from its first sender's send on; a reduction waits for the last
//! sender plus one latency. Staging is charged as the flat plan's with one
//! shard per machine (its slot and `M - 1` cells of `S / M` hold about as
//! many bytes as the slot and what a member receives): the buffer count is
//! the engine's for that geometry under the job's budget; the slices are
//! the wide flat ones (32 MiB) for a tensor of at least four of them, else
//! the default ones and their cut, neither rounded to a whole number of
//! cells per machine.

use fairring_core::plan::{Geometry, MachineGroups, Plan, PlanConfig, PlanError, Slice};
use fairring_core::topology::{RankLayout, Topology};

use super::events::{ResourceId, Schedule, TaskId};
use super::hierarchical::{Machine, report};
use super::stages::{Stages, f};
use super::{Algo, Hardware, Job, Link, ModelError, Prediction, Traffic};

/// The group sizes the study tries for `machines` machines: `requested`
/// alone (0: the powers of two, three times them and five times them, the
/// sizes nearest `sqrt(M)`, and the sizes that make 2 to 16 groups), each
/// kept only where it splits the machines in two levels
/// ([`MachineGroups::new`]). Empty where none does (fewer than 4 machines).
pub fn group_sizes(machines: u32, requested: u32) -> Vec<u32> {
    let splits = |g: &u32| MachineGroups::new(machines, *g).is_ok();
    if requested != 0 {
        return [requested].into_iter().filter(splits).collect();
    }
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "the root of a u32, below 2^16"
    )]
    let root = f64::from(machines).sqrt() as u32;
    let mut sizes: Vec<u32> = [1u32, 3, 5]
        .into_iter()
        .flat_map(|base| (0..13).map(move |p| base << p))
        .chain([root, root + 1])
        .chain((2..=16).map(|groups| machines.div_ceil(groups)))
        .filter(splits)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// The groups as lists of machines, from fairring-core's arithmetic.
struct Members {
    plan: MachineGroups,
    /// Per group, its machines.
    of_group: Vec<Vec<usize>>,
    /// Per machine, its group.
    group_of: Vec<usize>,
}

impl Members {
    fn new(machines: u32, size: u32) -> Result<Members, ModelError> {
        let groups = MachineGroups::new(machines, size)?;
        let mut of_group = Vec::new();
        let mut group_of = vec![0; machines as usize];
        for group in 0..groups.groups() {
            let mut ms = Vec::new();
            for member in 0..groups.size(group)? {
                let m = groups.machine(group, member)? as usize;
                group_of[m] = group as usize;
                ms.push(m);
            }
            of_group.push(ms);
        }
        Ok(Members {
            plan: groups,
            of_group,
            group_of,
        })
    }
}

/// The predicted time of `job`'s all-reduces under the two-level plan, in
/// the group size of [`group_sizes`] that gives the shortest.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    let mut best: Option<Prediction> = None;
    let mut tried = Vec::new();
    for g in group_sizes(job.machines, job.group) {
        // Sizes that make as many groups make the same groups.
        let count = job.machines.div_ceil(g);
        if tried.contains(&count) {
            continue;
        }
        tried.push(count);
        let p = predict_with(hw, job, g)?;
        if best.is_none_or(|b| p.seconds < b.seconds) {
            best = Some(p);
        }
    }
    best.ok_or(ModelError::NotApplicable {
        algo: Algo::Groups,
        reason: "needs a group size from 2 to half the machines that leaves no group of one \
                 (so 4 machines or more)",
    })
}

/// The predicted time of `job`'s all-reduces under the two-level plan in
/// `ceil(M / g)` groups (`2 <= g <= M / 2`).
pub fn predict_with(hw: &Hardware, job: &Job, g: u32) -> Result<Prediction, ModelError> {
    // The engine's slices and staging for one shard per machine of any size
    // (the floor as minimum shard keeps the plan flat, `k = M`): by default
    // the wide flat slices (32 MiB) for a tensor of at least
    // `MIN_SLICES_PER_TENSOR` of them, else the default slices and their cut.
    let mut flat = *job;
    // The study's own groups, whatever the engine's grouping says.
    flat.grouping = fairring::Grouping::OneLevel;
    let wide = PlanConfig::WIDE_FLAT_SLICE_BYTES;
    flat.slicing = if !job.slicing.slice_by_routing() {
        PlanConfig::new(job.slicing.slice_bytes(), PlanConfig::MIN_SHARD_FLOOR)
    } else if job.bytes >= PlanConfig::MIN_SLICES_PER_TENSOR * wide {
        PlanConfig::new(wide, PlanConfig::MIN_SHARD_FLOOR)
    } else {
        PlanConfig::with_default_slices(PlanConfig::MIN_SHARD_FLOOR)
    }
    .map_err(|e: PlanError| ModelError::Plan(e))?;
    flat.min_shard_given = true;
    let staging = flat.staging(0)?;
    let stages = Stages::new(hw, job);
    let slices = slices(job, flat.slicing, &stages)?;
    run(
        hw,
        job,
        Algo::Groups,
        stages,
        &slices,
        staging.buffers,
        Members::new(job.machines, g)?,
    )
}

/// The engine's own plan where its geometry reduces the slots in groups
/// (`Routing::Groups`): the schedule of [`predict_with`] over the engine's
/// slices, buffers and groups (`staging`, as the engine sizes them),
/// reported as [`Algo::Hierarchical`].
pub(super) fn predict_engine(
    hw: &Hardware,
    job: &Job,
    staging: &fairring::Staging,
) -> Result<Prediction, ModelError> {
    let geometry = staging.geometry;
    let groups = geometry
        .machine_groups()
        .ok_or_else(|| ModelError::InvalidJob("the engine's geometry forms no groups".into()))?;
    let stages = Stages::new(hw, job);
    let slices = super::stages::slices(&geometry, job, &stages)?;
    let members = Members::new(job.machines, groups.largest())?;
    if members.plan != groups {
        return Err(ModelError::InvalidJob(format!(
            "groups of at most {} are not the engine's {groups:?}",
            groups.largest()
        )));
    }
    run(
        hw,
        job,
        Algo::Hierarchical,
        stages,
        &slices,
        staging.buffers,
        members,
    )
}

/// `slices` (each with the time its tensor was submitted) in two levels over
/// `groups`, with `buffers` staging buffers, reported as `algo`.
fn run(
    hw: &Hardware,
    job: &Job,
    algo: Algo,
    stages: Stages,
    slices: &[(Slice, f64)],
    buffers: u32,
    groups: Members,
) -> Result<Prediction, ModelError> {
    let rail = hw.rail(job.devices);
    let post = hw.post_seconds();
    let costs = Costs {
        stages,
        rail,
        post,
        buffers: buffers.max(1) as usize,
        groups,
    };
    let mut schedule = Schedule::default();
    let mut machines = Machine::many(&mut schedule, job.machines, job.comms_per_direction);
    for (slice, submitted) in slices {
        add(&costs, &mut schedule, &mut machines, slice, *submitted)?;
    }
    schedule.run();
    let traffic = Traffic {
        slices: slices.len() as u64,
        shards_per_full_slice: costs.groups.plan.largest(),
        staging_buffers: buffers,
        in_groups: true,
        ..Traffic::default()
    };
    report(algo, job, &schedule, &machines, costs.rail, traffic)
}

/// The slices of `job`'s tensors under `slicing`, each with the time its
/// tensor was submitted, cut as the flat plan cuts them on one machine of
/// the job's GPUs: a slot needs no whole number of cells per machine here,
/// so no slice is rounded down to one (at 255 machines the flat plan's 32
/// MiB slice would be, by 512 bytes, leaving 256 MiB a ninth slice of 4
/// KiB, whose messages cost their posts).
fn slices(
    job: &Job,
    slicing: PlanConfig,
    stages: &Stages,
) -> Result<Vec<(Slice, f64)>, ModelError> {
    let topology = Topology::new(1, job.devices, RankLayout::Contiguous)?;
    let geometry = Geometry::new(topology, slicing)?;
    let mut out = Vec::new();
    let mut submitted = 0.0;
    for _ in 0..job.tensors {
        submitted += stages.submit();
        let plan = Plan::new(&geometry, job.dtype, job.elements(), 0)?;
        out.extend(plan.slices().map(|s| (s, submitted)));
    }
    Ok(out)
}

struct Costs {
    stages: Stages,
    rail: Link,
    post: f64,
    buffers: usize,
    groups: Members,
}

/// A batch of messages a machine sends back to back, one of each length in
/// `messages`, once `ready` has ended: the task that ends with the last on
/// its sender.
fn send_batch(
    costs: &Costs,
    sched: &mut Schedule,
    machine: &mut Machine,
    messages: &[u64],
    ready: TaskId,
) -> TaskId {
    machine.messages_sent += messages.len() as u64;
    machine.bytes_sent += messages.iter().sum::<u64>();
    send_on(sched, machine.send, costs.rail, costs.post, messages, ready)
}

/// Messages of the lengths in `messages`, back to back on `send` over `link`
/// (each post costing `post`) once `ready` has ended: the task that ends with
/// the last.
pub(super) fn send_on(
    sched: &mut Schedule,
    send: ResourceId,
    link: Link,
    post: f64,
    messages: &[u64],
    ready: TaskId,
) -> TaskId {
    let seconds = messages.iter().map(|&b| link.occupies(post, f(b))).sum();
    let task = sched.task(Some(send), seconds, 0.0);
    sched.after(task, ready, 0.0);
    task
}

/// `bytes` landing on `machine` from `senders` (per sender, the task after
/// which it starts sending, and the one that ends with its batch): the
/// receive side takes them from the first sender's start on, into the
/// buffer taken at `take`; returns the task after which the last has landed
/// (its sender done, plus a latency).
fn land(
    costs: &Costs,
    sched: &mut Schedule,
    machine: &mut Machine,
    bytes: u64,
    senders: &[(TaskId, TaskId)],
    take: TaskId,
) -> TaskId {
    machine.bytes_received += bytes;
    let hop = costs.rail.hop();
    land_on(
        sched,
        machine.receive,
        costs.rail,
        hop,
        bytes,
        senders,
        Some(take),
    )
}

/// `bytes` landing on `receive` (at `link`'s rate) from `senders` (per
/// sender, the task after which it starts sending and the one that ends its
/// batch, whose messages cross `hop`): taken from the first sender's start
/// on (and not before `into`, where the receiver takes a buffer); returns the
/// task after which the last has landed.
pub(super) fn land_on(
    sched: &mut Schedule,
    receive: ResourceId,
    link: Link,
    hop: f64,
    bytes: u64,
    senders: &[(TaskId, TaskId)],
    into: Option<TaskId>,
) -> TaskId {
    let first = sched.first_of(0.0);
    for &(ready, _) in senders {
        sched.after(first, ready, 0.0);
    }
    let paced = sched.task(Some(receive), link.wire(f(bytes)), 0.0);
    sched.after(paced, first, 0.0);
    if let Some(into) = into {
        sched.after(paced, into, 0.0);
    }
    let landed = sched.task(None, 0.0, 0.0);
    sched.after(landed, paced, 0.0);
    for &(_, sent) in senders {
        sched.after(landed, sent, hop);
    }
    landed
}

/// Who exchanges which piece across the groups, per participant of `plan`
/// (a machine, or a server of a rail group) for a slot of `units`: piece `g`
/// of each interval to its holder in group `g`, and the sum back.
pub(super) struct Pieces {
    /// The partial sums it sends, in bytes.
    pub(super) out: Vec<Vec<u64>>,
    /// Bytes of the pieces it reduces.
    pub(super) reduces: Vec<u64>,
    /// Whose partial sums it receives, and their bytes.
    pub(super) from: Vec<Vec<(usize, u64)>>,
    /// Those it receives partial sums from, once each, in order.
    pub(super) senders: Vec<Vec<usize>>,
    /// Those whose sums come back to it, once each, in order.
    pub(super) back: Vec<Vec<usize>>,
}

/// The [`Pieces`] of `count` participants, `piece_bytes` the bytes of a
/// range of a slot's units (an empty piece is not sent).
pub(super) fn pieces(
    plan: &MachineGroups,
    units: u64,
    count: usize,
    mut piece_bytes: impl FnMut(std::ops::Range<u64>) -> Result<u64, ModelError>,
) -> Result<Pieces, ModelError> {
    let mut out: Vec<Vec<u64>> = vec![Vec::new(); count];
    let mut reduces: Vec<u64> = vec![0; count];
    let mut from: Vec<Vec<(usize, u64)>> = vec![Vec::new(); count];
    let q = plan.groups() as usize;
    for interval in plan.intervals(units) {
        let mut holders = Vec::with_capacity(q);
        for group in 0..plan.groups() {
            let member = plan.holder(units, group, interval.start)?;
            holders.push((group, plan.machine(group, member)? as usize));
        }
        for &(group, reducer) in &holders {
            let piece = piece_bytes(plan.piece(&interval, group)?)?;
            if piece == 0 {
                continue;
            }
            reduces[reducer] += piece;
            for &(_, holder) in holders.iter().filter(|&&(_, h)| h != reducer) {
                out[holder].push(piece);
                from[reducer].push((holder, piece));
            }
        }
    }
    let mut senders: Vec<Vec<usize>> = from
        .iter()
        .map(|list| list.iter().map(|&(h, _)| h).collect())
        .collect();
    let mut back: Vec<Vec<usize>> = vec![Vec::new(); count];
    for (r, list) in from.iter().enumerate() {
        for &(h, _) in list {
            back[h].push(r);
        }
    }
    for list in senders.iter_mut().chain(back.iter_mut()) {
        list.sort_unstable();
        list.dedup();
    }
    Ok(Pieces {
        out,
        reduces,
        from,
        senders,
        back,
    })
}

/// Adds `slice`'s stages on every machine to the schedule (steps 1 to 5 of
/// the module docs).
fn add(
    costs: &Costs,
    sched: &mut Schedule,
    machines: &mut [Machine],
    slice: &Slice,
    submitted: f64,
) -> Result<(), ModelError> {
    let m_count = machines.len();
    let groups = &costs.groups;
    let plan = &groups.plan;
    let q = groups.of_group.len();
    let group_of = &groups.group_of;
    // The plan cuts a slot in units of `ALIGN_BYTES`, a last part of a unit
    // counted whole, as the engine does (`Slice::group_units`).
    let slot_span = slice.slot(0)?;
    let units = slice.group_units(0)?;
    let bytes_of = |r: std::ops::Range<u64>| -> Result<std::ops::Range<u64>, ModelError> {
        let span = slice.slot_units_span(0, r)?;
        let start = span.byte_offset() - slot_span.byte_offset();
        Ok(start..start + span.byte_len())
    };
    let mut range = vec![0..0; m_count];
    for group in 0..plan.groups() {
        for member in 0..plan.size(group)? {
            let m = plan.machine(group, member)? as usize;
            range[m] = bytes_of(plan.range(units, group, member)?)?;
        }
    }
    let len = |r: &std::ops::Range<u64>| r.end - r.start;
    // Each machine's buffer, once the slice `buffers` before it released it.
    let mut take = Vec::with_capacity(m_count);
    for machine in machines.iter() {
        let t = sched.task(None, 0.0, submitted);
        let n = machine.released.len();
        if n >= costs.buffers {
            sched.after(t, machine.released[n - costs.buffers], 0.0);
        }
        take.push(t);
    }
    let local = costs.stages.intra_reduce(slice)?;
    let gather = costs.stages.intra_gather(f(slice.span().byte_len()))?;
    let step = costs.stages.step();
    let scattered: Vec<TaskId> = machines
        .iter_mut()
        .enumerate()
        .map(|(m, machine)| {
            let slice = machine.released.len();
            machine
                .reduce
                .call(slice, sched, machine.nvlink, local, take[m], step)
        })
        .collect();
    let mut sends: Vec<Vec<TaskId>> = vec![Vec::new(); m_count];
    let mut messages = Vec::new();
    let mut peers = Vec::new();
    // 2. Within each group: every member sends each other member that
    // member's range, and reduces its own. An empty range (a slot of fewer
    // units than the group has members) is neither sent nor reduced.
    let holds = |k: usize| !range[k].is_empty();
    let mut up = vec![(scattered[0], scattered[0]); m_count];
    for (m, machine) in machines.iter_mut().enumerate() {
        messages.clear();
        let group = &groups.of_group[group_of[m]];
        messages.extend(
            group
                .iter()
                .filter(|&&k| k != m && holds(k))
                .map(|&k| len(&range[k])),
        );
        let sent = send_batch(costs, sched, machine, &messages, scattered[m]);
        up[m] = (scattered[m], sent);
        sends[m].push(sent);
    }
    let mut group_reduced = vec![scattered[0]; m_count];
    for (m, machine) in machines.iter_mut().enumerate() {
        if !holds(m) {
            group_reduced[m] = scattered[m];
            continue;
        }
        let group = &groups.of_group[group_of[m]];
        peers.clear();
        peers.extend(group.iter().filter(|&&k| k != m).map(|&k| up[k]));
        let others = peers.len() as u64;
        let bytes = len(&range[m]);
        let landed = land(costs, sched, machine, others * bytes, &peers, take[m]);
        let reduced = sched.task(
            Some(machine.gpu),
            costs.stages.memory(f(others + 2) * f(bytes)) + step,
            0.0,
        );
        sched.after(reduced, landed, 0.0);
        sched.after(reduced, scattered[m], 0.0);
        group_reduced[m] = reduced;
    }
    // 3. Across the groups, interval by interval: piece `g` of an interval
    // to its holder in group `g`, and the sum back.
    let Pieces {
        out,
        reduces,
        from,
        senders,
        back,
    } = pieces(plan, units, m_count, |r| Ok(len(&bytes_of(r)?)))?;
    let mut across = vec![(scattered[0], scattered[0]); m_count];
    for (m, machine) in machines.iter_mut().enumerate() {
        let sent = send_batch(costs, sched, machine, &out[m], group_reduced[m]);
        across[m] = (group_reduced[m], sent);
        sends[m].push(sent);
    }
    let mut owned = vec![(scattered[0], scattered[0]); m_count];
    for (r, machine) in machines.iter_mut().enumerate() {
        let bytes: u64 = from[r].iter().map(|&(_, b)| b).sum();
        peers.clear();
        peers.extend(senders[r].iter().map(|&h| across[h]));
        let landed = land(costs, sched, machine, bytes, &peers, take[r]);
        let reduced = sched.task(
            Some(machine.gpu),
            costs.stages.memory(f(q as u64 + 1) * f(reduces[r])) + step,
            0.0,
        );
        sched.after(reduced, landed, 0.0);
        sched.after(reduced, group_reduced[r], 0.0);
        messages.clear();
        messages.extend(from[r].iter().map(|&(_, b)| b));
        let sent = send_batch(costs, sched, machine, &messages, reduced);
        owned[r] = (reduced, sent);
        sends[r].push(sent);
    }
    // The sums back to the holders: a holder's range is final once every
    // piece it sent has come back and it reduced its own.
    let mut range_final = vec![scattered[0]; m_count];
    for (m, machine) in machines.iter_mut().enumerate() {
        let bytes: u64 = out[m].iter().sum();
        peers.clear();
        peers.extend(back[m].iter().map(|&r| owned[r]));
        let landed = land(costs, sched, machine, bytes, &peers, take[m]);
        sched.after(landed, owned[m].0, 0.0);
        range_final[m] = landed;
    }
    // 4. Back within each group; 5. the all-gather; the buffer is released.
    let mut down = vec![(scattered[0], scattered[0]); m_count];
    for (m, machine) in machines.iter_mut().enumerate() {
        messages.clear();
        let group = &groups.of_group[group_of[m]];
        if holds(m) {
            messages.extend(group.iter().filter(|&&k| k != m).map(|_| len(&range[m])));
        }
        let sent = send_batch(costs, sched, machine, &messages, range_final[m]);
        down[m] = (range_final[m], sent);
        sends[m].push(sent);
    }
    for (m, machine) in machines.iter_mut().enumerate() {
        let group = &groups.of_group[group_of[m]];
        peers.clear();
        peers.extend(
            group
                .iter()
                .filter(|&&k| k != m && holds(k))
                .map(|&k| down[k]),
        );
        let bytes = group
            .iter()
            .filter(|&&k| k != m)
            .map(|&k| len(&range[k]))
            .sum();
        let landed = land(costs, sched, machine, bytes, &peers, take[m]);
        sched.after(landed, range_final[m], 0.0);
        let slice = machine.released.len();
        let gathered = machine
            .gather
            .call(slice, sched, machine.nvlink, gather, landed, step);
        let released = sched.task(None, 0.0, 0.0);
        sched.after(released, gathered, 0.0);
        for &sent in &sends[m] {
            sched.after(released, sent, 0.0);
        }
        machine.released.push(released);
    }
    Ok(())
}
