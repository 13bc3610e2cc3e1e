//! [`Work`] and [`OwnedWork`]: operations in flight, waited on, tested and
//! released.

use super::point_to_point::Message;
use super::*;

/// One operation (or a coalesced group of them) in flight.
///
/// Dropping it waits for it to finish; if it has not finished within the
/// communicator's timeout, the communicator is failed (every peer's operations
/// then fail too) so that the drop returns and nothing more touches the memory.
#[must_use = "an operation runs until waited on or dropped"]
pub struct Work<'a> {
    pub(super) engine: &'a WorkerEngine,
    /// The operations covered: `first..=last`, or none if `first > last`.
    pub(super) first: u64,
    pub(super) last: u64,
    /// The messages of gathers, scatters and reduces that move as messages
    /// (see `point_to_point::rooted`), which finish after their checks.
    pub(super) messages: Option<Message>,
    pub(super) _data: PhantomData<&'a mut [u8]>,
}

impl<'a> Work<'a> {
    pub(super) fn new(engine: &'a WorkerEngine, first: u64, last: u64) -> Work<'a> {
        Work {
            engine,
            first,
            last,
            messages: None,
            _data: PhantomData,
        }
    }

    pub(super) fn empty(engine: &'a WorkerEngine) -> Work<'a> {
        Work::new(engine, 1, 0)
    }

    /// Waits for the operation to finish.
    pub fn wait(self) -> Result<()> {
        let timeout = self.engine.timeout;
        self.wait_timeout(timeout)
    }

    /// Waits up to `timeout`: an error if it failed or is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        wait_range(self.engine, self.first, self.last, timeout)?;
        wait_messages(
            self.engine,
            &self.messages,
            timeout.saturating_sub(start.elapsed()),
        )
    }

    /// Whether the operation has finished, without waiting or driving it (the
    /// progress thread does); its error if it failed.
    pub fn test(&self) -> Result<bool> {
        Ok(test_range(self.engine, self.first, self.last)?
            && test_messages(self.engine, &self.messages)?)
    }

    /// The operation's sequence number (the same on every rank); the first one
    /// of a coalesced group.
    pub fn sequence(&self) -> u64 {
        self.first
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        // The messages first: they wait for their checks, whose entries the
        // release gives back.
        drop(self.messages.take());
        release_range(self.engine, self.first, self.last);
    }
}

/// An operation (or a coalesced group) in flight that owns a reference to its
/// communicator: made by [`Communicator::own`] from a [`Work`] of a raw form.
///
/// The communicator lives at least as long as its owned works. Dropping one
/// waits for it as dropping a [`Work`] does.
#[must_use = "an operation runs until waited on or dropped"]
pub struct OwnedWork {
    pub(super) comm: Arc<Communicator>,
    pub(super) first: u64,
    pub(super) last: u64,
    /// As [`Work`]'s.
    pub(super) messages: Option<Message>,
}

impl OwnedWork {
    /// Waits up to `timeout`: an error if it failed or is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        wait_range(&self.comm.engine, self.first, self.last, timeout)?;
        let left = timeout.saturating_sub(start.elapsed());
        wait_messages(&self.comm.engine, &self.messages, left)
    }

    /// Waits up to the communicator's timeout.
    pub fn wait(&self) -> Result<()> {
        self.wait_timeout(self.comm.timeout)
    }

    /// Whether the operation has finished; its error if it failed.
    pub fn test(&self) -> Result<bool> {
        Ok(test_range(&self.comm.engine, self.first, self.last)?
            && test_messages(&self.comm.engine, &self.messages)?)
    }

    /// The operation's sequence number; the first one of a coalesced group.
    pub fn sequence(&self) -> u64 {
        self.first
    }

    /// The communicator that runs it.
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.comm
    }
}

impl Drop for OwnedWork {
    fn drop(&mut self) {
        drop(self.messages.take());
        release_range(&self.comm.engine, self.first, self.last);
    }
}

/// Waits up to `timeout` for the messages of a work, if it has any.
///
/// The messages are a collective's (a gather's, a scatter's, a reduce's), so
/// their failure fails the communicator, as a failed collective of the engine
/// does: its ranks no longer agree on what the group has done (some sent their
/// parts, others did not), and a later collective would meet another rank's
/// earlier one. Failing the engine also tells every peer, naming the rank the
/// failure is about (a lost peer, as its message saw it). A wait that merely ran
/// out of time fails nothing.
pub(super) fn wait_messages(
    engine: &WorkerEngine,
    messages: &Option<Message>,
    timeout: Duration,
) -> Result<()> {
    let waited = messages
        .as_ref()
        .map_or(Ok(()), |m| m.wait_timeout(timeout));
    fail_group_on(engine, waited)
}

/// Whether the messages of a work, if it has any, have finished; a failure
/// fails the communicator (see [`wait_messages`]).
fn test_messages(engine: &WorkerEngine, messages: &Option<Message>) -> Result<bool> {
    fail_group_on(engine, messages.as_ref().map_or(Ok(true), Message::test))
}

/// `outcome`, having failed `engine` with its error, unless that is a wait's
/// own timeout.
fn fail_group_on<T>(engine: &WorkerEngine, outcome: Result<T>) -> Result<T> {
    if let Err(e) = &outcome
        && !matches!(e, Error::Timeout { .. })
    {
        engine.fail(e.clone());
    }
    outcome
}

/// Waits for operations `first..=last`, up to `timeout` in all.
pub(crate) fn wait_range(
    engine: &WorkerEngine,
    first: u64,
    last: u64,
    timeout: Duration,
) -> Result<()> {
    let start = Instant::now();
    for seq in first..=last {
        let left = timeout.saturating_sub(start.elapsed());
        if !engine.wait(seq, Some(left))? {
            return Err(Error::timeout(format!("operation #{seq}"), timeout));
        }
    }
    Ok(())
}

/// Whether operations `first..=last` have all finished.
pub(super) fn test_range(engine: &WorkerEngine, first: u64, last: u64) -> Result<bool> {
    for seq in first..=last {
        if !engine.test(seq)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Waits for operations `first..=last` and gives their table entries back; one
/// still running after the timeout fails the communicator, so that nothing
/// touches its memory after this returns.
pub(super) fn release_range(engine: &WorkerEngine, first: u64, last: u64) {
    for seq in first..=last {
        if !matches!(engine.wait(seq, Some(engine.timeout)), Ok(true) | Err(_)) {
            engine.fail(Error::timeout(
                format!("operation #{seq} (dropped while running)"),
                engine.timeout,
            ));
        }
        engine.works.give_back(seq);
    }
}
