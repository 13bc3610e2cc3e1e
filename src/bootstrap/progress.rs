//! An engine's progress thread: started once its engine is built, stopped
//! (and joined) when the communicator or server that owns it goes.

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use fairring_rdma::any::AnyFabric;

/// Starts `engine`'s progress thread, named `name`.
pub(crate) fn start_progress<M: MemorySpace>(
    engine: &Arc<Engine<AnyFabric, M>>,
    name: String,
) -> Result<JoinHandle<()>> {
    let engine = Arc::clone(engine);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || engine.run())
        .map_err(|e| Error::io("starting the progress thread", e))
}

/// Stops `engine`'s progress thread and waits for it (once).
pub(crate) fn stop_progress<M: MemorySpace>(
    engine: &Engine<AnyFabric, M>,
    thread: &mut Option<JoinHandle<()>>,
) {
    engine.stop_progress();
    if let Some(t) = thread.take()
        && t.join().is_err()
    {
        log::error!(
            "fairring: the progress thread of rank {} panicked",
            engine.rank()
        );
    }
}
