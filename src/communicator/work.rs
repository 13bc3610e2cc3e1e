//! [`Work`] and [`OwnedWork`]: what a started call is until it finishes
//! (collective operations, sends and receives alike), waited on, tested and
//! released.

use super::point_to_point::Message;
use super::*;

/// One call (or a group of them) in flight: collective operations, sends and
/// receives alike.
///
/// A failed send or receive fails alone (the communicator goes on); a failed
/// collective fails the communicator, as its ranks no longer agree on what
/// it did.
///
/// Dropping it waits for it to finish; if it has not finished within the
/// communicator's timeout, the communicator is failed (every peer's operations
/// then fail too) so that the drop returns and nothing more touches the memory.
#[must_use = "an operation runs until waited on or dropped"]
pub struct Work<'a> {
    pub(super) engine: &'a WorkerEngine,
    pub(super) covers: Covers,
    pub(super) _data: PhantomData<&'a mut [u8]>,
}

impl<'a> Work<'a> {
    pub(super) fn new(engine: &'a WorkerEngine, covers: Covers) -> Work<'a> {
        Work {
            engine,
            covers,
            _data: PhantomData,
        }
    }

    /// Waits for the operation to finish.
    pub fn wait(self) -> Result<()> {
        let timeout = self.engine.timeout;
        self.wait_timeout(timeout)
    }

    /// Waits up to `timeout`: an error if it failed or is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        self.covers.wait(self.engine, timeout)
    }

    /// Whether the operation has finished, without waiting or driving it (the
    /// progress thread does); its error if it failed.
    pub fn test(&self) -> Result<bool> {
        self.covers.test(self.engine)
    }

    /// The operation's sequence number (the same on every rank); the first one
    /// of a coalesced group. `None` for sends and receives alone, which are
    /// not numbered.
    pub fn sequence(&self) -> Option<u64> {
        self.covers.sequence()
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        self.covers.release(self.engine);
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
    pub(super) covers: Covers,
}

impl OwnedWork {
    /// Waits up to `timeout`: an error if it failed or is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        self.covers.wait(&self.comm.engine, timeout)
    }

    /// Waits up to the communicator's timeout.
    pub fn wait(&self) -> Result<()> {
        self.wait_timeout(self.comm.timeout)
    }

    /// Whether the operation has finished; its error if it failed.
    pub fn test(&self) -> Result<bool> {
        self.covers.test(&self.comm.engine)
    }

    /// As [`Work::sequence`].
    pub fn sequence(&self) -> Option<u64> {
        self.covers.sequence()
    }

    /// The communicator that runs it.
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.comm
    }
}

impl Drop for OwnedWork {
    fn drop(&mut self) {
        self.covers.release(&self.comm.engine);
    }
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.covers.fmt(f)
    }
}

impl std::fmt::Debug for OwnedWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.covers.fmt(f)
    }
}

/// What a work covers: operations `first..=last` (none if `first > last`),
/// the messages of its collectives that move as messages, and its sends and
/// receives.
pub(super) struct Covers {
    pub(super) first: u64,
    pub(super) last: u64,
    /// The messages of gathers, scatters and reduces that move as messages
    /// (see `point_to_point::rooted`), which finish after their checks.
    pub(super) rooted: Option<Message>,
    /// Sends and receives.
    pub(super) messages: Option<Message>,
}

impl Covers {
    /// Nothing.
    pub(super) fn nothing() -> Covers {
        Covers::operations(1, 0)
    }

    /// Operations `first..=last`.
    pub(super) fn operations(first: u64, last: u64) -> Covers {
        Covers {
            first,
            last,
            rooted: None,
            messages: None,
        }
    }

    fn sequence(&self) -> Option<u64> {
        (self.first <= self.last).then_some(self.first)
    }

    /// Waits up to `timeout` in all for everything covered: the first error,
    /// after every part has been waited for (so that a failed send does not
    /// hide a collective still running).
    fn wait(&self, engine: &WorkerEngine, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let operations = wait_range(engine, self.first, self.last, timeout);
        let messages = self.wait_messages(engine, start, timeout);
        operations.and(messages)
    }

    /// Waits until `timeout` after `start` for the messages covered: the
    /// sends and receives, and the collectives' (which wait for their checks,
    /// operations covered too).
    fn wait_messages(
        &self,
        engine: &WorkerEngine,
        start: Instant,
        timeout: Duration,
    ) -> Result<()> {
        let left = || timeout.saturating_sub(start.elapsed());
        let rooted = wait_messages(engine, self.rooted.as_ref(), left());
        let messages = self
            .messages
            .as_ref()
            .map_or(Ok(()), |m| m.wait_timeout(left()));
        rooted.and(messages)
    }

    /// Waits up to the communicator's timeout for the messages covered,
    /// which live on the host: a device stream cannot wait for them.
    #[cfg(feature = "cuda")]
    pub(super) fn wait_on_host(&self, engine: &WorkerEngine) -> Result<()> {
        self.wait_messages(engine, Instant::now(), engine.timeout)
    }

    /// Whether everything covered has finished; the first error.
    fn test(&self, engine: &WorkerEngine) -> Result<bool> {
        let messages = self.messages.as_ref().map_or(Ok(true), Message::test)?;
        Ok(test_range(engine, self.first, self.last)?
            && test_messages(engine, self.rooted.as_ref())?
            && messages)
    }

    /// Waits for everything covered and lets go of it: the messages first (a
    /// gather's wait for its check, whose entry the release gives back).
    fn release(&mut self, engine: &WorkerEngine) {
        drop(self.messages.take());
        drop(self.rooted.take());
        release_range(engine, self.first, self.last);
        (self.first, self.last) = (1, 0);
    }
}

impl std::fmt::Debug for Covers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let operations = (self.first <= self.last).then_some(self.first..=self.last);
        f.debug_struct("Work")
            .field("operations", &operations)
            .field("messages", &self.messages)
            .field("rooted", &self.rooted)
            .finish()
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
    messages: Option<&Message>,
    timeout: Duration,
) -> Result<()> {
    let waited = messages.map_or(Ok(()), |m| m.wait_timeout(timeout));
    fail_group_on(engine, waited)
}

/// Whether the messages of a work, if it has any, have finished; a failure
/// fails the communicator (see [`wait_messages`]).
fn test_messages(engine: &WorkerEngine, messages: Option<&Message>) -> Result<bool> {
    fail_group_on(engine, messages.map_or(Ok(true), Message::test))
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
