//! [`Server`]: a dedicated reduction server (Herring's design), the process that
//! takes the inter-machine step of every hierarchical all-reduce of a job started
//! with `FAIRRING_SERVERS=K`.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::bootstrap::{self, start_progress, stop_progress};
use crate::config::{Config, Role};
use crate::engine::Engine;
use crate::engine::links::Traffic;
use crate::error::{Error, Result};
use crate::memory::Host;
use crate::store::Store;
use fairring_rdma::any::AnyFabric;

/// How often [`Server::run`] looks whether the job is over.
const LOOK: Duration = Duration::from_millis(5);

/// One dedicated reduction server of a job.
///
/// A server holds no tensors and issues no calls: it learns each operation from
/// the workers' descriptors, receives the cells of the shards it serves from
/// every worker of its rail group (the devices `d` with `d mod R` equal to its
/// index mod `R`, `R = gcd(FAIRRING_SERVERS, D)`), folds them into each slot's
/// sum in machine order, up to 16 cells a pass, as they land, and sends the sums
/// back. It runs until every worker of its group has left the
/// job ([`Server::run`]).
///
/// ```no_run
/// // FAIRRING_ROLE=server FAIRRING_SERVER_RANK=0 FAIRRING_SERVERS=2 WORLD_SIZE=8
/// // MASTER_ADDR=... MASTER_PORT=...
/// let server = fairring::Server::from_env()?;
/// let traffic = server.run()?;
/// println!("received {} bytes", traffic.received_bytes);
/// # Ok::<(), fairring::Error>(())
/// ```
pub struct Server {
    engine: Arc<Engine<AnyFabric, Host>>,
    progress: Option<JoinHandle<()>>,
    index: u32,
    // Dropped last, as a communicator's.
    _store: Arc<dyn Store>,
}

impl Server {
    /// Joins the job the environment describes as the server `FAIRRING_SERVER_RANK`
    /// (see [`Config`]).
    pub fn from_env() -> Result<Server> {
        Server::new(Config::from_env()?)
    }

    /// Joins the job of `config` (a [`Role::Server`] configuration), meeting
    /// through the store rank 0 serves, or torchrun's agent store as the
    /// workers do (see [`Communicator::new`](crate::Communicator::new)).
    pub fn new(config: Config) -> Result<Server> {
        let (store, _) = bootstrap::job_store(&config)?;
        Server::with_store(config, store)
    }

    /// Joins the job of `config` through `store`.
    pub fn with_store(config: Config, store: Arc<dyn Store>) -> Result<Server> {
        let Role::Server(index) = config.role else {
            return Err(Error::config(
                "FAIRRING_ROLE",
                "worker",
                "a server's configuration has the `server` role (Config::server_builder)",
            ));
        };
        let scoped = bootstrap::scoped(&config, &store);
        let engine = Arc::new(bootstrap::build_server(&config, &scoped, index)?);
        let progress = start_progress(&engine, format!("fairring-server-{index}"))?;
        Ok(Server {
            engine,
            progress: Some(progress),
            index,
            _store: store,
        })
    }

    /// Its index among the job's servers.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Its rank on the fabric: the workers' count plus its index.
    pub fn rank(&self) -> u32 {
        self.engine.rank()
    }

    /// The data bytes this server's fabric has moved so far.
    pub fn traffic(&self) -> Traffic {
        self.engine.links.traffic()
    }

    /// Serves until every worker of its rail group has left the job, and
    /// returns the data bytes this server moved; the job's first error if it
    /// failed (a worker died, or issued a different operation than another).
    pub fn run(mut self) -> Result<Traffic> {
        let outcome = loop {
            if let Some(e) = self.engine.failure() {
                break Err(e);
            }
            if self.engine.served_everyone() {
                break Ok(self.traffic());
            }
            std::thread::sleep(LOOK);
        };
        self.stop();
        outcome
    }

    /// Fails the job: every worker's operations in flight and later fail.
    pub fn abort(&self) {
        self.engine.fail(Error::Aborted);
    }

    fn stop(&mut self) {
        stop_progress(&self.engine, &mut self.progress);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        let operations = self.engine.accepted_operations();
        self.engine.say_goodbye(operations);
    }
}
