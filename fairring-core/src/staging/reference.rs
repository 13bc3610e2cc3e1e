//! The sequential specification of a staging buffer.
//!
//! [`ReferenceModel`] says what a staging buffer does in the plainest terms: named
//! fields, counts that go up, a set of the actions already handed out, and the full
//! 64-bit generation. It shares no code with the packed [`Word`](super::Word); the
//! property tests and the fuzz target drive both with the same event sequences and
//! require the same actions and the same refusals. It is public so that users of the
//! state machine can read, and run, what it promises.

use super::{Actions, Event, Role, StagingErrorKind};

/// A staging buffer, specified sequentially.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReferenceModel {
    generation: u64,
    acquired: bool,
    role: Role,
    reduce_scatter_done: bool,
    contributions_sent: u16,
    contributions_received: u16,
    reduced: bool,
    results_sent: u16,
    results_received: u16,
    all_gather_done: bool,
    partial_sent: bool,
    parent_result_received: bool,
    handed_out: Actions,
}

impl Default for ReferenceModel {
    fn default() -> Self {
        ReferenceModel::new()
    }
}

impl ReferenceModel {
    /// A free buffer at generation 0.
    pub const fn new() -> ReferenceModel {
        ReferenceModel {
            generation: 0,
            acquired: false,
            role: Role::IDLE,
            reduce_scatter_done: false,
            contributions_sent: 0,
            contributions_received: 0,
            reduced: false,
            results_sent: 0,
            results_received: 0,
            all_gather_done: false,
            partial_sent: false,
            parent_result_received: false,
            handed_out: Actions::empty(),
        }
    }

    /// The generation the buffer is in (acquired) or waits for (free).
    pub const fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether the buffer is acquired.
    pub const fn is_acquired(&self) -> bool {
        self.acquired
    }

    /// Acquires the buffer for `generation` with `role`.
    pub fn acquire(&mut self, generation: u64, role: Role) -> Result<(), StagingErrorKind> {
        if self.acquired {
            return Err(StagingErrorKind::Busy);
        }
        if generation != self.generation {
            return Err(StagingErrorKind::WrongGeneration);
        }
        let fits = |n: u16| n < 4096;
        let counts_fit = fits(role.contributions_to_send)
            && fits(role.contributions_to_receive)
            && fits(role.results_to_send)
            && fits(role.results_to_receive);
        let server_counts = role.contributions_to_receive > 0 && role.results_to_send > 0;
        let client_counts = role.contributions_to_receive == 0 && role.results_to_send == 0;
        let consistent = if role.reduces {
            server_counts
        } else {
            client_counts
        };
        if !counts_fit || !consistent || (role.forwards && !role.reduces) {
            return Err(StagingErrorKind::InvalidRole);
        }
        *self = ReferenceModel {
            generation,
            acquired: true,
            role,
            ..ReferenceModel::new()
        };
        Ok(())
    }

    /// Records `event` for `generation`; returns the actions handed out.
    pub fn on_event(&mut self, event: Event, generation: u64) -> Result<Actions, StagingErrorKind> {
        if generation != self.generation {
            return Err(StagingErrorKind::WrongGeneration);
        }
        if !self.acquired {
            return Err(StagingErrorKind::NotAcquired);
        }
        let role = self.role;
        let reducer_only = matches!(
            event,
            Event::ContributionReceived | Event::Reduced | Event::ResultSent
        );
        if reducer_only && !role.reduces {
            return Err(StagingErrorKind::NotInRole);
        }
        let forwarder_only = matches!(event, Event::PartialSent | Event::ParentResultReceived);
        if forwarder_only && !role.forwards {
            return Err(StagingErrorKind::NotInRole);
        }
        // The stage an event completes must have begun. The contribution stage begins
        // with the reduce-scatter even when it has nothing to send.
        let stage_begun = match event {
            Event::ReduceScatterDone | Event::ContributionReceived => true,
            Event::ContributionSent | Event::ResultReceived => self.reduce_scatter_done,
            Event::Reduced => self.handed_out.contains(Actions::START_REDUCE),
            Event::ResultSent => self.handed_out.contains(Actions::START_SEND_BACK),
            Event::AllGatherDone => self.handed_out.contains(Actions::START_ALL_GATHER),
            Event::PartialSent | Event::ParentResultReceived => {
                self.handed_out.contains(Actions::START_SEND_UP)
            }
        };
        if !stage_begun {
            return Err(StagingErrorKind::OutOfOrder);
        }
        match event {
            Event::ReduceScatterDone => once(&mut self.reduce_scatter_done)?,
            Event::ContributionSent => {
                count(&mut self.contributions_sent, role.contributions_to_send)?;
            }
            Event::ContributionReceived => {
                count(
                    &mut self.contributions_received,
                    role.contributions_to_receive,
                )?;
            }
            Event::Reduced => once(&mut self.reduced)?,
            Event::ResultSent => count(&mut self.results_sent, role.results_to_send)?,
            Event::ResultReceived => {
                count(&mut self.results_received, role.results_to_receive)?;
            }
            Event::AllGatherDone => once(&mut self.all_gather_done)?,
            Event::PartialSent => once(&mut self.partial_sent)?,
            Event::ParentResultReceived => once(&mut self.parent_result_received)?,
        }
        // The served shard is final when reduced here with no parent above, or when
        // the parent's result came back; a device that reduces nothing has none.
        let shard_final = if role.forwards {
            self.parent_result_received
        } else {
            self.reduced || !role.reduces
        };
        let mut now = Actions::empty();
        if self.reduce_scatter_done && role.contributions_to_send > 0 {
            now |= Actions::START_CONTRIBUTIONS;
        }
        if role.reduces
            && self.reduce_scatter_done
            && self.contributions_received == role.contributions_to_receive
        {
            now |= Actions::START_REDUCE;
        }
        if role.forwards && self.reduced {
            now |= Actions::START_SEND_UP;
        }
        if self.reduced && shard_final {
            now |= Actions::START_SEND_BACK;
        }
        if self.reduce_scatter_done
            && self.results_received == role.results_to_receive
            && shard_final
        {
            now |= Actions::START_ALL_GATHER;
        }
        if self.all_gather_done
            && self.contributions_sent == role.contributions_to_send
            && self.results_sent == role.results_to_send
            && (self.partial_sent || !role.forwards)
        {
            now |= Actions::RELEASE;
        }
        let new = now.difference(self.handed_out);
        self.handed_out |= new;
        if new.contains(Actions::RELEASE) {
            *self = ReferenceModel {
                generation: self.generation + 1,
                ..ReferenceModel::new()
            };
        }
        Ok(new)
    }
}

fn once(flag: &mut bool) -> Result<(), StagingErrorKind> {
    if *flag {
        return Err(StagingErrorKind::Duplicate);
    }
    *flag = true;
    Ok(())
}

fn count(seen: &mut u16, expected: u16) -> Result<(), StagingErrorKind> {
    if *seen >= expected {
        return Err(StagingErrorKind::Duplicate);
    }
    *seen += 1;
    Ok(())
}
