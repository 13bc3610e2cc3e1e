//! The two-level reduction of one slot (`plan/two_level.rs`) run end to end
//! on every machine, with the core's staging words deciding every step, in
//! a random order of completions and arrivals.
//!
//! Each machine has one staging buffer in the core's `TwoLevelLayout`, one
//! value per unit: its slot first, holding its own values, then the areas
//! contributions land in. A send reads its
//! units from the sender's slot when it lands, not when it starts (a send
//! reads its source until it completes), so a step that overwrote a range
//! still being sent would show as a wrong value. At the end every word must
//! have released and every machine's slot must hold the sum over all
//! machines, unit by unit; a schedule that stops with work left is a hang.

use std::collections::HashSet;
use std::ops::Range;

use fairring_core::plan::{
    ALIGN_BYTES, Across, MachineGroups, Span, TwoLevelLayout, TwoLevelRoles,
};
use fairring_core::staging::{Actions, Event, Word};
use proptest::prelude::*;

/// Which of a machine's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Level {
    Within,
    /// The word across for the machine's `k`-th interval.
    Across(usize),
}

/// Where a send lands at its receiver.
#[derive(Clone, Copy, Debug)]
enum Into {
    /// Over the same units of its slot (a result).
    Slot,
    /// In its area for the sender at this level (a contribution).
    Area(Level),
}

#[derive(Debug)]
enum Pending {
    /// A completion on `machine`, reported to its word at `level`.
    Local {
        machine: u32,
        level: Level,
        event: Event,
    },
    /// A send in flight.
    Send {
        from: u32,
        from_level: Level,
        to: u32,
        to_level: Level,
        units: Range<u64>,
        into: Into,
        /// What the sender's word hears once it has landed.
        sent: Event,
        /// What the receiver's word hears.
        received: Event,
        /// The units as they were when the send started: they must not
        /// change before it lands.
        snapshot: Vec<u64>,
    },
    /// A reduction in progress: it reads its contributions and its units
    /// when it ends, then its word hears `Reduced`.
    Reduce { machine: u32, level: Level },
}

struct Machine {
    roles: TwoLevelRoles,
    /// The staging buffer, one value per unit: the slot, then the areas.
    buffer: Vec<u64>,
    /// Contributions landed and not yet reduced: by level and sender.
    landed: HashSet<(Level, u32)>,
    within: Word,
    across: Vec<Word>,
    across_final: usize,
    across_released: usize,
    released: bool,
}

struct Exchange {
    groups: MachineGroups,
    layout: TwoLevelLayout,
    units: u64,
    machines: Vec<Machine>,
    pending: Vec<Pending>,
}

fn value(machine: u32, unit: u64) -> u64 {
    let mut x = (u64::from(machine) << 40) ^ unit ^ 0x9e37_79b9_7f4a_7c15;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn span(units: &Range<u64>) -> Range<usize> {
    usize::try_from(units.start).unwrap()..usize::try_from(units.end).unwrap()
}

/// The units of a buffer's area.
fn area_units(area: Span) -> Range<u64> {
    assert_eq!(
        area.byte_offset() % ALIGN_BYTES,
        0,
        "an area starts on a unit"
    );
    area.byte_offset() / ALIGN_BYTES..area.byte_end() / ALIGN_BYTES
}

impl Exchange {
    fn new(groups: MachineGroups, units: u64) -> Exchange {
        let layout = TwoLevelLayout::new(groups, units, units).unwrap();
        let total = usize::try_from(layout.total_bytes() / ALIGN_BYTES).unwrap();
        let mut machines = Vec::new();
        let mut pending = Vec::new();
        for m in 0..groups.machines() {
            let roles = groups.roles(units, m).unwrap();
            let within = Word::FREE.acquire(0, roles.within()).unwrap();
            let across = roles
                .across()
                .map(|a| Word::FREE.acquire(0, a.role).unwrap())
                .collect();
            let mut buffer: Vec<u64> = (0..units).map(|u| value(m, u)).collect();
            buffer.resize(total, 0);
            machines.push(Machine {
                roles,
                buffer,
                landed: HashSet::new(),
                within,
                across,
                across_final: 0,
                across_released: 0,
                released: false,
            });
            pending.push(Pending::Local {
                machine: m,
                level: Level::Within,
                event: Event::ReduceScatterDone,
            });
        }
        Exchange {
            groups,
            layout,
            units,
            machines,
            pending,
        }
    }

    /// The holder of the interval starting at `start` in `group`, and the
    /// level of its word for that interval.
    fn holder(&self, group: u32, start: u64) -> (u32, Level) {
        let member = self.groups.holder(self.units, group, start).unwrap();
        let machine = self.groups.machine(group, member).unwrap();
        let (k, _) = self.machines[machine as usize]
            .roles
            .across_at(start)
            .unwrap_or_else(|| panic!("machine {machine} holds no interval at {start}"));
        (machine, Level::Across(k))
    }

    /// Queues `pending`, a send taking its snapshot now.
    fn queue(&mut self, mut pending: Pending) {
        if let Pending::Send {
            from,
            ref units,
            ref mut snapshot,
            ..
        } = pending
        {
            *snapshot = self.machines[from as usize].buffer[span(units)].to_vec();
        }
        self.pending.push(pending);
    }

    /// The reduction of `level` on machine `m` ends: every contribution it
    /// waited for is added over its units, as they stand now.
    fn finish_reduce(&mut self, m: u32, level: Level) -> Result<(), String> {
        let (units, from): (Range<u64>, Vec<u32>) = match level {
            Level::Within => (
                self.machines[m as usize].roles.range(),
                self.group_mates(m).into_iter().map(|(j, _)| j).collect(),
            ),
            Level::Across(k) => {
                let (across, holders) = self.holders(m, k);
                (
                    across.piece,
                    holders.into_iter().map(|(h, _, _)| h).collect(),
                )
            }
        };
        for sender in from {
            self.reduce(m, level, sender, &units);
        }
        self.feed(m, level, Event::Reduced)
    }

    fn step(&mut self, index: usize) -> Result<(), String> {
        match self.pending.swap_remove(index) {
            Pending::Reduce { machine, level } => self.finish_reduce(machine, level),
            Pending::Local {
                machine,
                level,
                event,
            } => self.feed(machine, level, event),
            Pending::Send {
                from,
                from_level,
                to,
                to_level,
                units,
                into,
                sent,
                received,
                snapshot,
            } => {
                let bytes = self.machines[from as usize].buffer[span(&units)].to_vec();
                if bytes != snapshot {
                    return Err(format!(
                        "{from}'s units {units:?} changed while its send to {to} was in flight"
                    ));
                }
                let at = match into {
                    Into::Slot => units.clone(),
                    Into::Area(level) => {
                        let area = area_units(self.area(level, from, to));
                        if bytes.len() > span(&area).len() {
                            return Err(format!("{from}'s contribution overflows {to}'s area"));
                        }
                        if !self.machines[to as usize].landed.insert((level, from)) {
                            return Err(format!("{from} sent {to} two contributions at {level:?}"));
                        }
                        area.start..area.start + units.end - units.start
                    }
                };
                self.machines[to as usize].buffer[span(&at)].copy_from_slice(&bytes);
                self.pending.push(Pending::Local {
                    machine: from,
                    level: from_level,
                    event: sent,
                });
                self.feed(to, to_level, received)
            }
        }
    }

    fn feed(&mut self, m: u32, level: Level, event: Event) -> Result<(), String> {
        let machine = &mut self.machines[m as usize];
        let word = match level {
            Level::Within => &mut machine.within,
            Level::Across(k) => &mut machine.across[k],
        };
        let (next, actions) = word
            .on_event(event, 0)
            .map_err(|e| format!("machine {m}, {level:?}: {event:?} refused: {e}"))?;
        *word = next;
        match level {
            Level::Within => self.act_within(m, actions),
            Level::Across(k) => {
                self.act_across(m, k, actions);
                Ok(())
            }
        }
    }

    /// The other members of `m`'s group, and their ranges.
    fn group_mates(&self, m: u32) -> Vec<(u32, Range<u64>)> {
        let at = self.machines[m as usize].roles.membership();
        (0..self.groups.size(at.group).unwrap())
            .filter(|&j| j != at.member)
            .map(|j| {
                (
                    self.groups.machine(at.group, j).unwrap(),
                    self.groups.range(self.units, at.group, j).unwrap(),
                )
            })
            .collect()
    }

    /// `m`'s `k`-th interval, and its holders in the other groups: each
    /// with its word's level and its piece.
    fn holders(&self, m: u32, k: usize) -> (Across, Vec<(u32, Level, Range<u64>)>) {
        let roles = &self.machines[m as usize].roles;
        let group = roles.membership().group;
        let across = roles.across().nth(k).unwrap().clone();
        let others = (0..self.groups.groups())
            .filter(|&h| h != group)
            .map(|h| {
                let (holder, at) = self.holder(h, across.interval.start);
                (holder, at, self.groups.piece(&across.interval, h).unwrap())
            })
            .collect();
        (across, others)
    }

    fn act_within(&mut self, m: u32, actions: Actions) -> Result<(), String> {
        let roles = self.machines[m as usize].roles.clone();
        let others = self.group_mates(m);
        let local = |event| Pending::Local {
            machine: m,
            level: Level::Within,
            event,
        };
        if actions.contains(Actions::START_CONTRIBUTIONS) {
            for (to, units) in others.iter().filter(|(_, r)| !r.is_empty()) {
                self.queue(Pending::Send {
                    from: m,
                    from_level: Level::Within,
                    to: *to,
                    to_level: Level::Within,
                    units: units.clone(),
                    into: Into::Area(Level::Within),
                    sent: Event::ContributionSent,
                    received: Event::ContributionReceived,
                    snapshot: Vec::new(),
                });
            }
        }
        if actions.contains(Actions::START_REDUCE) {
            self.pending.push(Pending::Reduce {
                machine: m,
                level: Level::Within,
            });
        }
        if actions.contains(Actions::START_SEND_UP) {
            for k in 0..self.machines[m as usize].across.len() {
                self.pending.push(Pending::Local {
                    machine: m,
                    level: Level::Across(k),
                    event: Event::ReduceScatterDone,
                });
            }
        }
        if actions.contains(Actions::START_SEND_BACK) {
            for (to, _) in &others {
                self.queue(Pending::Send {
                    from: m,
                    from_level: Level::Within,
                    to: *to,
                    to_level: Level::Within,
                    units: roles.range(),
                    into: Into::Slot,
                    sent: Event::ResultSent,
                    received: Event::ResultReceived,
                    snapshot: Vec::new(),
                });
            }
        }
        if actions.contains(Actions::START_ALL_GATHER) {
            self.pending.push(local(Event::AllGatherDone));
        }
        if actions.contains(Actions::RELEASE) {
            // Free for the next slice: nothing may still read or write it.
            let in_flight = self
                .pending
                .iter()
                .any(|p| matches!(p, Pending::Send { from, to, .. } if *from == m || *to == m));
            let across_busy = self.machines[m as usize].across.iter().any(|w| w.in_use());
            if in_flight || across_busy {
                return Err(format!(
                    "machine {m} released its buffer with sends in flight ({in_flight}) \
                     or a word across in use ({across_busy})"
                ));
            }
            self.machines[m as usize].released = true;
        }
        Ok(())
    }

    fn act_across(&mut self, m: u32, k: usize, actions: Actions) {
        let level = Level::Across(k);
        let (across, others) = self.holders(m, k);
        if actions.contains(Actions::START_CONTRIBUTIONS) {
            for (to, to_level, piece) in others.iter().filter(|(_, _, p)| !p.is_empty()) {
                self.queue(Pending::Send {
                    from: m,
                    from_level: level,
                    to: *to,
                    to_level: *to_level,
                    units: piece.clone(),
                    into: Into::Area(*to_level),
                    sent: Event::ContributionSent,
                    received: Event::ContributionReceived,
                    snapshot: Vec::new(),
                });
            }
        }
        if actions.contains(Actions::START_REDUCE) {
            self.pending.push(Pending::Reduce { machine: m, level });
        }
        if actions.contains(Actions::START_SEND_BACK) {
            for (to, to_level, _) in &others {
                self.queue(Pending::Send {
                    from: m,
                    from_level: level,
                    to: *to,
                    to_level: *to_level,
                    units: across.piece.clone(),
                    into: Into::Slot,
                    sent: Event::ResultSent,
                    received: Event::ResultReceived,
                    snapshot: Vec::new(),
                });
            }
        }
        let machine = &mut self.machines[m as usize];
        let words = machine.across.len();
        if actions.contains(Actions::START_ALL_GATHER) {
            // Nothing to gather at this level: done at once. Once every
            // piece of the range is final, the range is the group's result.
            self.pending.push(Pending::Local {
                machine: m,
                level,
                event: Event::AllGatherDone,
            });
            machine.across_final += 1;
            if machine.across_final == words {
                self.pending.push(Pending::Local {
                    machine: m,
                    level: Level::Within,
                    event: Event::ParentResultReceived,
                });
            }
        }
        if actions.contains(Actions::RELEASE) {
            machine.across_released += 1;
            if machine.across_released == words {
                self.pending.push(Pending::Local {
                    machine: m,
                    level: Level::Within,
                    event: Event::PartialSent,
                });
            }
        }
    }

    /// Adds the contribution `from` landed at `level` over `units` of the slot.
    fn reduce(&mut self, m: u32, level: Level, from: u32, units: &Range<u64>) {
        let area = area_units(self.area(level, from, m));
        let machine = &mut self.machines[m as usize];
        assert!(
            machine.landed.remove(&(level, from)),
            "machine {m} reduces {level:?} without {from}'s contribution"
        );
        let from_area = span(&area).start;
        for (i, u) in span(units).enumerate() {
            machine.buffer[u] = machine.buffer[u].wrapping_add(machine.buffer[from_area + i]);
        }
    }

    /// The area of machine `to`'s buffer that `from`'s contribution at
    /// `level` lands in.
    fn area(&self, level: Level, from: u32, to: u32) -> Span {
        match level {
            Level::Within => self.layout.within(from, to),
            Level::Across(k) => self.layout.across(u32::try_from(k).unwrap(), from, to),
        }
        .unwrap_or_else(|e| panic!("{from}'s area at {to}, {level:?}: {e}"))
    }
}

/// Runs `m` machines in groups of about `size` over a slot of `units`, in
/// the order `seed` draws.
fn run(m: u32, size: u32, units: u64, seed: u64) -> Result<(), TestCaseError> {
    let Ok(groups) = MachineGroups::new(m, size) else {
        return Ok(());
    };
    let what = format!("M {m}, size {size}, {units} units, seed {seed}");
    let mut exchange = Exchange::new(groups, units);
    let mut rng = seed | 1;
    while !exchange.pending.is_empty() {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let index = usize::try_from(rng % exchange.pending.len() as u64).unwrap();
        exchange
            .step(index)
            .map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    }
    let expected: Vec<u64> = (0..units)
        .map(|u| (0..m).fold(0u64, |sum, machine| sum.wrapping_add(value(machine, u))))
        .collect();
    for (i, machine) in exchange.machines.iter().enumerate() {
        prop_assert!(
            machine.released && machine.across.iter().all(|w| !w.in_use()),
            "{}: machine {} stopped with work left: within {:?}, across {:?}",
            what,
            i,
            machine.within,
            machine.across
        );
        prop_assert!(
            machine.landed.is_empty(),
            "{}: machine {} left contributions",
            what,
            i
        );
        if let Some(u) = (0..expected.len()).find(|&u| machine.buffer[u] != expected[u]) {
            prop_assert!(false, "{}: machine {} unit {} is not the sum", what, i, u);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_machine_ends_with_the_sum_and_every_word_released(
        m in 4u32..=40,
        size_draw in any::<u32>(),
        units in 1u64..=400,
        seed in any::<u64>(),
    ) {
        let size = 2 + size_draw % (m / 2 - 1);
        run(m, size, units, seed)?;
    }
}

/// Equal and unequal groups, slots with fewer units than a group has
/// members or than an interval has pieces, each in several orders.
#[test]
fn chosen_cases_end_with_the_sum() {
    for (m, size, units) in [
        (4, 2, 1),
        (4, 2, 2),
        (6, 2, 5),
        (7, 3, 7),
        (9, 4, 3),
        (10, 4, 64),
        (16, 4, 100),
        (17, 4, 101),
        (31, 6, 29),
        (40, 20, 7),
    ] {
        for seed in 1..=20 {
            run(m, size, units, seed).unwrap();
        }
    }
}
