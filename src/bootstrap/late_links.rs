//! The linker: the thread that connects this rank's fabric to a peer first
//! named by a message, through the job's store (see `engine::messages::peer_links`
//! for the states and why it cannot wait in a circle). One per communicator,
//! started the first time a message names a peer the communicator has no
//! connection to; it stops when the communicator closes.

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fairring_rdma::fabric::{Endpoint, Fabric};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::store::Store;

/// How long the linker sleeps between looks at the store while a peer's
/// endpoint is awaited, and while nothing is.
const POLL: Duration = Duration::from_millis(1);
const IDLE: Duration = Duration::from_millis(100);

/// Starts the linker of `engine`, meeting peers through `store` (scoped to
/// the communicator), giving up on a peer after `timeout`.
pub(crate) fn start_linker<F, M>(
    engine: &Arc<Engine<F, M>>,
    store: Arc<dyn Store>,
    timeout: Duration,
) -> Result<JoinHandle<()>>
where
    F: Fabric + 'static,
    M: MemorySpace + 'static,
    Engine<F, M>: Send + Sync,
{
    let weak = Arc::downgrade(engine);
    let rank = engine.rank();
    std::thread::Builder::new()
        .name(format!("fairring-links-{rank}"))
        .spawn(move || run(&weak, store.as_ref(), timeout))
        .map_err(|e| Error::io("starting the thread that links message peers", e))
}

/// The key under which `from` publishes its endpoint for `to`.
fn key(from: u32, to: u32) -> String {
    format!("late-link/{from}/{to}")
}

fn run<F: Fabric, M: MemorySpace>(
    engine: &Weak<Engine<F, M>>,
    store: &dyn Store,
    timeout: Duration,
) {
    let mut wanted = Vec::new();
    // Peers whose endpoint this rank awaits, with when it gives up.
    let mut awaiting: Vec<(u32, Instant)> = Vec::new();
    loop {
        let Some(e) = engine.upgrade() else {
            return;
        };
        let nap = if awaiting.is_empty() { IDLE } else { POLL };
        if !e.late_links.take_wanted(&mut wanted, nap) {
            for (peer, _) in awaiting.drain(..) {
                e.late_links.settle(
                    peer,
                    Err(Error::invalid("comm", "the communicator was closed")),
                );
            }
            e.ring();
            return;
        }
        let me = e.rank();
        for peer in wanted.drain(..) {
            match publish(&e, store, me, peer) {
                Ok(()) => awaiting.push((peer, Instant::now() + timeout)),
                Err(error) => {
                    e.late_links.settle(peer, Err(error));
                    e.ring();
                }
            }
        }
        let mut settled = false;
        awaiting.retain(|&(peer, deadline)| {
            let outcome = match store.check(&[&key(peer, me)]) {
                Ok(true) => connect(&e, store, me, peer, timeout),
                Ok(false) if Instant::now() < deadline => return true,
                Ok(false) => Err(Error::peer(
                    peer,
                    format!(
                        "never named rank {me} in a message within {timeout:?}, so no \
                         connection was made for this rank's messages with it"
                    ),
                )),
                Err(error) => Err(error),
            };
            e.late_links.settle(peer, outcome);
            settled = true;
            false
        });
        if settled {
            e.ring();
        }
    }
}

/// Publishes this rank's endpoint for `peer`.
fn publish<F: Fabric, M: MemorySpace>(
    e: &Engine<F, M>,
    store: &dyn Store,
    me: u32,
    peer: u32,
) -> Result<()> {
    let ep = e
        .links
        .fabric
        .endpoint(peer)
        .map_err(|f| Error::peer(peer, format!("making an endpoint for messages: {f}")))?;
    store.set(&key(me, peer), ep.as_bytes())
}

/// Connects to `peer`, whose endpoint for this rank is in the store.
fn connect<F: Fabric, M: MemorySpace>(
    e: &Engine<F, M>,
    store: &dyn Store,
    me: u32,
    peer: u32,
    timeout: Duration,
) -> Result<()> {
    let bytes = store.get(&key(peer, me), timeout)?;
    let ep = Endpoint::from_bytes(&bytes)
        .ok_or_else(|| Error::peer(peer, "published a malformed endpoint for messages"))?;
    e.links
        .fabric
        .connect(peer, &ep)
        .map_err(|f| Error::peer(peer, format!("connecting for messages: {f}")))
}
