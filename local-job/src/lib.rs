//! A local job: the `M x D` ranks (and any dedicated servers) of one program
//! started as processes on this host with the environment torchrun gives
//! its workers (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), each group of `D` ranks a machine of its own
//! (`FAIRRING_HOST_ID`), and watched until every rank has ended.
//!
//! The one launcher of `fairring-bench` and of the test harnesses that run
//! ranks as processes (the engine's process tests, the C program's, the C
//! ABI's device calls').
//!
//! ```no_run
//! use std::time::Duration;
//! use fairring_local_job::LocalJob;
//!
//! let job = LocalJob::new("example", 2, 1)?;
//! let program = std::env::current_exe()?;
//! let mut ranks = job.spawn(|rank| job.command(&program, rank))?;
//! ranks.wait(Some(Duration::from_secs(60))).map_err(std::io::Error::other)?;
//! # Ok::<(), std::io::Error>(())
//! ```

use std::io;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// An `M x D` job's shape and meeting point, from which each rank's
/// command is made.
#[derive(Clone, Debug)]
pub struct LocalJob {
    name: String,
    machines: u32,
    devices: u32,
    servers: u32,
    port: u16,
    secret: String,
}

impl LocalJob {
    /// A job named `name` (it names the machines' host identities) of
    /// `machines` machines of `devices` ranks each, meeting at a free port of
    /// this host, with a fresh job secret.
    pub fn new(name: &str, machines: u32, devices: u32) -> io::Result<LocalJob> {
        if machines == 0 || devices == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a job of {machines} x {devices} ranks has none"),
            ));
        }
        let port = free_port()?;
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(io::Error::other)?;
        Ok(LocalJob {
            name: name.to_owned(),
            machines,
            devices,
            servers: 0,
            port,
            secret: secret.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// This job with `servers` dedicated reduction servers, started after
    /// the ranks (as ranks `world_size..world_size + servers`).
    pub fn with_servers(self, servers: u32) -> LocalJob {
        LocalJob { servers, ..self }
    }

    /// The number of ranks, servers not counted.
    pub fn world_size(&self) -> u32 {
        self.machines * self.devices
    }

    /// The port rank 0 (or the store) serves the rendezvous at.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The environment of process `index`: rank `index` below
    /// [`world_size`](LocalJob::world_size), dedicated server
    /// `index - world_size` above.
    pub fn env(&self, index: u32) -> Vec<(&'static str, String)> {
        let world = self.world_size();
        let mut env = vec![
            ("RANK", index.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_RANK", (index % self.devices).to_string()),
            ("LOCAL_WORLD_SIZE", self.devices.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_owned()),
            ("MASTER_PORT", self.port.to_string()),
            (
                "FAIRRING_HOST_ID",
                format!("{}-machine-{}", self.name, index / self.devices),
            ),
            ("FAIRRING_JOB_SECRET", self.secret.clone()),
            ("FAIRRING_SERVERS", self.servers.to_string()),
        ];
        if index >= world {
            env.push(("FAIRRING_ROLE", "server".to_owned()));
            env.push(("FAIRRING_SERVER_RANK", (index - world).to_string()));
        }
        env
    }

    /// `program` as process `index` (see [`env`](LocalJob::env)), to be
    /// given arguments and started.
    pub fn command(&self, program: &Path, index: u32) -> Command {
        let mut command = Command::new(program);
        command.envs(self.env(index));
        command
    }

    /// Starts every process of the job, process `i` from `command(i)`. If one
    /// cannot start, those started are killed and the error names it.
    pub fn spawn(&self, mut command: impl FnMut(u32) -> Command) -> io::Result<Ranks> {
        let mut ranks = Ranks {
            children: Vec::new(),
        };
        for index in 0..self.world_size() + self.servers {
            match command(index).spawn() {
                Ok(child) => ranks.children.push(Some(child)),
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("starting process {index} of {}: {e}", self.name),
                    ));
                }
            }
        }
        Ok(ranks)
    }
}

/// A port of this host that was free a moment ago, for a job's rendezvous
/// store.
///
/// Chosen at random below the kernel's ephemeral range: a port the kernel
/// handed out (`bind` to port 0) and released can be handed out again at once
/// as the local port of some other process's outgoing connection, and the
/// store's `bind` then fails with "address already in use". Ports below the
/// range are never handed out that way. A port is never returned twice in one
/// process: two jobs started at once by one program (tests in parallel) that
/// drew the same port would meet at one store, which admits only one of them.
/// Falls back to the kernel's choice if none is free.
pub fn free_port() -> io::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            t.split_whitespace()
                .next()
                .and_then(|p| p.parse::<u16>().ok())
        })
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_low.max(10_001));
    for _ in 0..64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let port = low + u16::try_from(h.finish() % u64::from(high - low)).unwrap_or(0);
        if !handed_out.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.push(port);
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A job's running processes, killed when dropped.
#[derive(Debug)]
pub struct Ranks {
    /// `None` once a process has been killed and reaped.
    children: Vec<Option<Child>>,
}

impl Ranks {
    /// Process `index`, unless it was killed.
    pub fn child_mut(&mut self, index: u32) -> Option<&mut Child> {
        self.children.get_mut(index as usize)?.as_mut()
    }

    /// Kills process `index` at once (SIGKILL) and reaps it; waiting on the
    /// job leaves it out from then on.
    pub fn kill(&mut self, index: u32) -> io::Result<()> {
        let slot = self
            .children
            .get_mut(index as usize)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no such process"))?;
        if let Some(mut child) = slot.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Waits until every process not killed has ended. The first to fail (or,
    /// with `within`, the deadline passing) ends the others at once, since
    /// they would only wait for it until their own timeout; the error names
    /// each process that failed or still ran. The processes stay for their
    /// output to be read.
    pub fn wait(&mut self, within: Option<Duration>) -> Result<(), String> {
        let deadline = within.map(|w| Instant::now() + w);
        let mut failures = Vec::new();
        let mut running: Vec<u32> = (0u32..)
            .zip(&self.children)
            .filter(|(_, c)| c.is_some())
            .map(|(i, _)| i)
            .collect();
        while !running.is_empty() && failures.is_empty() {
            let late = deadline.is_some_and(|d| Instant::now() > d);
            let mut still = Vec::new();
            for index in running {
                let Some(child) = self.child_mut(index) else {
                    continue;
                };
                match child.try_wait() {
                    Ok(Some(status)) if status.success() => {}
                    Ok(Some(status)) => failures.push(failed(index, status)),
                    Ok(None) if late => {
                        let _ = child.kill();
                        failures.push(format!("process {index} still ran after {within:?}"));
                    }
                    Ok(None) => still.push(index),
                    Err(e) => failures.push(format!("process {index}: {e}")),
                }
            }
            running = still;
            if !running.is_empty() && failures.is_empty() {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if failures.is_empty() {
            return Ok(());
        }
        for index in running {
            if let Some(child) = self.child_mut(index) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        Err(failures.join("; "))
    }
}

fn failed(index: u32, status: ExitStatus) -> String {
    format!("process {index} failed ({status})")
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ports drawn in one process never repeat: 300 draws from the range
    /// below the ephemeral ports would repeat one more than eight times in ten.
    #[test]
    fn a_port_is_handed_out_once() {
        let ports: Vec<u16> = (0..300).map(|_| free_port().expect("a port")).collect();
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ports.len(), "{ports:?}");
    }

    #[test]
    fn each_rank_gets_its_place_and_servers_their_role() {
        let job = LocalJob::new("shape", 2, 3).unwrap().with_servers(1);
        let env = |i| {
            job.env(i)
                .into_iter()
                .collect::<std::collections::HashMap<_, _>>()
        };
        let rank4 = env(4);
        assert_eq!(rank4["RANK"], "4");
        assert_eq!(rank4["WORLD_SIZE"], "6");
        assert_eq!(rank4["LOCAL_RANK"], "1");
        assert_eq!(rank4["LOCAL_WORLD_SIZE"], "3");
        assert_eq!(rank4["FAIRRING_HOST_ID"], "shape-machine-1");
        assert!(!rank4.contains_key("FAIRRING_ROLE"));
        let server = env(6);
        assert_eq!(server["FAIRRING_ROLE"], "server");
        assert_eq!(server["FAIRRING_SERVER_RANK"], "0");
        assert_eq!(server["FAIRRING_JOB_SECRET"], rank4["FAIRRING_JOB_SECRET"]);
        assert_eq!(rank4["FAIRRING_JOB_SECRET"].len(), 64);
        assert!(LocalJob::new("empty", 0, 2).is_err());
    }

    #[test]
    fn a_failing_process_ends_the_others_and_is_named() {
        let job = LocalJob::new("fails", 1, 3).unwrap();
        let mut ranks = job
            .spawn(|index| {
                let mut c = Command::new("sh");
                let script = if index == 1 { "exit 3" } else { "sleep 30" };
                c.args(["-c", script]);
                c
            })
            .unwrap();
        let start = Instant::now();
        let e = ranks.wait(Some(Duration::from_secs(20))).unwrap_err();
        assert!(e.contains("process 1 failed"), "{e}");
        assert!(!e.contains("process 0"), "{e}");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the others were not ended"
        );
    }

    #[test]
    fn a_killed_process_is_left_out_and_the_deadline_is_kept() {
        let job = LocalJob::new("kills", 1, 2).unwrap();
        let mut ranks = job
            .spawn(|_| {
                let mut c = Command::new("sh");
                c.args(["-c", "sleep 30"]);
                c
            })
            .unwrap();
        ranks.kill(0).unwrap();
        assert!(ranks.child_mut(0).is_none());
        let e = ranks.wait(Some(Duration::from_millis(200))).unwrap_err();
        assert!(e.contains("process 1 still ran"), "{e}");
        assert!(!e.contains("process 0"), "{e}");
    }
}
