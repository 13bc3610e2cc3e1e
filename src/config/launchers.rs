//! The job as the launcher that started this process describes it:
//! torchrun's variables, or those of OpenMPI's `mpirun`, of an MPICH-style
//! `mpiexec` (PMI) or of Slurm's `srun`, read as torchrun's.
//!
//! | launcher | rank, ranks | on this machine | where to meet |
//! |---|---|---|---|
//! | torchrun | `RANK`, `WORLD_SIZE` | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | `MASTER_ADDR`, `MASTER_PORT` |
//! | OpenMPI | `OMPI_COMM_WORLD_RANK`, `_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `_LOCAL_SIZE` | `mpirun`'s host (`OMPI_MCA_orte_hnp_uri`), or loopback where every rank shares one machine; a port from the job id (`OMPI_MCA_ess_base_jobid`) |
//! | PMI (MPICH, Intel MPI) | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | loopback where every rank shares one machine, else `mpiexec`'s PMI host (`PMI_PORT`); a port from `PMI_PORT`, or on one machine from the Hydra proxy the ranks share |
//! | Slurm (`srun`) | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID`, and this node's entry of `SLURM_STEP_TASKS_PER_NODE` | the first node of `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`); a port from `SLURM_JOB_ID` and `SLURM_STEP_ID` |
//!
//! They are tried in that order: a process `mpirun` starts inside a Slurm
//! allocation sees Slurm's variables of the allocation too, and is
//! `mpirun`'s. Slurm counts only where `srun` started the process (a step:
//! `SLURM_STEP_ID` is set), not in a batch script. `MASTER_ADDR` and
//! `MASTER_PORT`, where set, override the meeting point of every launcher.
//! The derived port lies in `15000..25000`, below Linux's ephemeral ports;
//! rank 0 serves the rendezvous there, so it must be on the meeting host
//! (every launcher above places rank 0 on its first node by default).

use std::collections::HashMap;

use super::parse::parse_u32;
use crate::error::{Error, Result};

fairring_core::named_enum! {
    /// Which launcher's variables describe the job (see
    /// [`Launcher::from_env`]).
    pub enum Launcher {
        /// torchrun (`RANK`, `WORLD_SIZE`, ...).
        Torchrun = 1 => "torchrun",
        /// OpenMPI's `mpirun` (`OMPI_COMM_WORLD_*`).
        OpenMpi = 2 => "openmpi",
        /// An MPICH-style `mpiexec` (`PMI_RANK`, `PMI_SIZE`, ...).
        Pmi = 3 => "pmi",
        /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, ...).
        Slurm = 4 => "slurm",
    }
}

impl Launcher {
    /// The launcher whose variables this process's environment holds, tried
    /// in the order of the module docs; `None` where none does. A launcher's
    /// variable that is set but malformed is refused, naming it.
    pub fn from_env() -> Result<Option<Launcher>> {
        let env = |name: &str| std::env::var(name).ok();
        Ok(LaunchedJob::find(&env)?.map(|job| job.launcher))
    }
}

/// What a launcher's variables name, in torchrun's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaunchedJob {
    pub(crate) launcher: Launcher,
    /// torchrun's variable, and its value from the launcher's.
    values: HashMap<&'static str, String>,
}

/// The variables each launcher is recognised by, in the order they are
/// tried, for an error that names them.
pub(crate) const RECOGNISED_BY: &str = "torchrun's RANK and WORLD_SIZE, OpenMPI's \
     OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE, PMI's PMI_RANK and PMI_SIZE, or Slurm's \
     SLURM_PROCID, SLURM_NTASKS and SLURM_STEP_ID (a process srun started)";

/// The first and last ports a launcher's job id maps to, and how many.
const DERIVED_PORTS_FROM: u32 = 15_000;
const DERIVED_PORTS: u32 = 10_000;

impl LaunchedJob {
    /// The job `lookup`'s variables describe, by the first launcher whose
    /// variables are set; `None` where none is. A launcher's variable that is
    /// set but malformed is refused, naming it.
    pub(crate) fn find(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchedJob>> {
        if lookup("RANK").is_some() && lookup("WORLD_SIZE").is_some() {
            return Ok(Some(LaunchedJob {
                launcher: Launcher::Torchrun,
                values: HashMap::new(),
            }));
        }
        let found = if let (Some(rank), Some(size)) = (
            lookup("OMPI_COMM_WORLD_RANK"),
            lookup("OMPI_COMM_WORLD_SIZE"),
        ) {
            open_mpi(lookup, &rank, &size)?
        } else if let (Some(rank), Some(size)) = (lookup("PMI_RANK"), lookup("PMI_SIZE")) {
            pmi(lookup, &rank, &size)?
        } else if let (Some(rank), Some(size), Some(_)) = (
            lookup("SLURM_PROCID"),
            lookup("SLURM_NTASKS"),
            lookup("SLURM_STEP_ID"),
        ) {
            slurm(lookup, &rank, &size)?
        } else {
            return Ok(None);
        };
        Ok(Some(found))
    }

    /// `name`, torchrun's, as this job answers it: the environment's own
    /// value where the launcher is torchrun or the variable is set
    /// (`MASTER_ADDR` and `MASTER_PORT` override a derived meeting point),
    /// else the launcher's.
    pub(crate) fn lookup(
        &self,
        name: &str,
        environment: &dyn Fn(&str) -> Option<String>,
    ) -> Option<String> {
        environment(name).or_else(|| self.values.get(name).cloned())
    }
}

fn open_mpi(
    lookup: &dyn Fn(&str) -> Option<String>,
    rank: &str,
    size: &str,
) -> Result<LaunchedJob> {
    let mut job = Shape::new(
        Launcher::OpenMpi,
        ("OMPI_COMM_WORLD_RANK", rank),
        ("OMPI_COMM_WORLD_SIZE", size),
    )?;
    job.local(
        lookup,
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    )?;
    let id = lookup("OMPI_MCA_ess_base_jobid").or_else(|| lookup("PMIX_NAMESPACE"));
    let host = if job.one_machine() {
        Some("127.0.0.1".to_string())
    } else {
        lookup("OMPI_MCA_orte_hnp_uri").and_then(|uri| hnp_address(&uri))
    };
    Ok(job.meet(host, id))
}

fn pmi(lookup: &dyn Fn(&str) -> Option<String>, rank: &str, size: &str) -> Result<LaunchedJob> {
    let mut job = Shape::new(Launcher::Pmi, ("PMI_RANK", rank), ("PMI_SIZE", size))?;
    job.local(lookup, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")?;
    // `PMI_PORT`, where mpiexec sets it, is `host:port` of its PMI server.
    let server = lookup("PMI_PORT");
    if job.one_machine() {
        // Hydra's default mode sets no PMI_PORT: the ranks of one machine
        // share its proxy, whose process names the job.
        let id = server.or_else(hydra_proxy);
        return Ok(job.meet(Some("127.0.0.1".to_string()), id));
    }
    let host = server
        .as_deref()
        .and_then(|s| s.rsplit_once(':'))
        .map(|(host, _)| host.to_string());
    Ok(job.meet(host, server))
}

fn slurm(lookup: &dyn Fn(&str) -> Option<String>, rank: &str, size: &str) -> Result<LaunchedJob> {
    let mut job = Shape::new(
        Launcher::Slurm,
        ("SLURM_PROCID", rank),
        ("SLURM_NTASKS", size),
    )?;
    if let Some(local) = lookup("SLURM_LOCALID") {
        let node = match lookup("SLURM_NODEID") {
            Some(n) => parse_u32("SLURM_NODEID", &n)?,
            None => 0,
        };
        let here = match first_set(
            lookup,
            ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"],
        ) {
            Some((variable, spec)) => Some(tasks_on_node(variable, &spec, node)?),
            None => None,
        };
        job.set(
            "LOCAL_RANK",
            parse_u32("SLURM_LOCALID", &local)?.to_string(),
        );
        if let Some(here) = here {
            job.set("LOCAL_WORLD_SIZE", here.to_string());
        }
    }
    let host = match first_set(lookup, ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]) {
        Some((variable, list)) => Some(first_node(variable, &list)?),
        None => None,
    };
    let id = lookup("SLURM_JOB_ID")
        .map(|job_id| format!("{job_id}.{}", lookup("SLURM_STEP_ID").unwrap_or_default()));
    Ok(job.meet(host, id))
}

/// The MPICH Hydra proxy this process descends from (`hydra_pmi_proxy`,
/// which starts a machine's ranks), as `hydra:PID`; else this process's
/// parent, as `parent:PID`. Read from `/proc`.
fn hydra_proxy() -> Option<String> {
    let parent = std::os::unix::process::parent_id();
    let mut pid = parent;
    for _ in 0..16 {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        if comm.trim() == "hydra_pmi_proxy" {
            return Some(format!("hydra:{pid}"));
        }
        // The parent is the field after the name, which ends at the last ')'.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let after = stat.rsplit_once(')')?.1;
        pid = after.split_whitespace().nth(1)?.parse().ok()?;
        if pid <= 1 {
            break;
        }
    }
    Some(format!("parent:{parent}"))
}

/// The first of `names` that is set, and its value.
fn first_set<const N: usize>(
    lookup: &dyn Fn(&str) -> Option<String>,
    names: [&'static str; N],
) -> Option<(&'static str, String)> {
    names.into_iter().find_map(|n| lookup(n).map(|v| (n, v)))
}

/// A job being read: its launcher and torchrun's variables so far.
struct Shape {
    launcher: Launcher,
    values: HashMap<&'static str, String>,
    world: u32,
}

impl Shape {
    fn new(
        launcher: Launcher,
        (rank_var, rank): (&'static str, &str),
        (size_var, size): (&'static str, &str),
    ) -> Result<Shape> {
        let rank_n = parse_u32(rank_var, rank)?;
        let world = parse_u32(size_var, size)?;
        if rank_n >= world {
            return Err(Error::config(
                rank_var,
                rank,
                format!("not a rank of {world} ({size_var})"),
            ));
        }
        let mut values = HashMap::new();
        values.insert("RANK", rank_n.to_string());
        values.insert("WORLD_SIZE", world.to_string());
        Ok(Shape {
            launcher,
            values,
            world,
        })
    }

    fn set(&mut self, name: &'static str, value: String) {
        self.values.insert(name, value);
    }

    /// The local rank and size from `rank_var` and `size_var`, where set.
    fn local(
        &mut self,
        lookup: &dyn Fn(&str) -> Option<String>,
        rank_var: &'static str,
        size_var: &'static str,
    ) -> Result<()> {
        if let Some(r) = lookup(rank_var) {
            self.set("LOCAL_RANK", parse_u32(rank_var, &r)?.to_string());
        }
        if let Some(s) = lookup(size_var) {
            self.set("LOCAL_WORLD_SIZE", parse_u32(size_var, &s)?.to_string());
        }
        Ok(())
    }

    /// Whether every rank is on this machine.
    fn one_machine(&self) -> bool {
        self.values
            .get("LOCAL_WORLD_SIZE")
            .is_some_and(|s| *s == self.world.to_string())
    }

    /// The job, meeting at `host` and at a port derived from the job's `id`
    /// where the launcher names them (`MASTER_ADDR` and `MASTER_PORT`
    /// otherwise: their absence is named when the configuration is read).
    /// The id also names the run, so that the secret derived for the job
    /// tells it from another job on the same meeting point.
    fn meet(mut self, host: Option<String>, id: Option<String>) -> LaunchedJob {
        if let Some(host) = host {
            self.set("MASTER_ADDR", host);
        }
        if let Some(id) = id {
            self.set("MASTER_PORT", derived_port(&id).to_string());
            self.set("TORCHELASTIC_RUN_ID", format!("{}:{id}", self.launcher));
        }
        LaunchedJob {
            launcher: self.launcher,
            values: self.values,
        }
    }
}

/// A port in `15000..25000` for the job named `id`: the same on every rank,
/// and unlikely to be another job's.
fn derived_port(id: &str) -> u16 {
    // FNV-1a: stable across builds and platforms.
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let offset = u32::try_from(hash % u64::from(DERIVED_PORTS)).unwrap_or(0);
    u16::try_from(DERIVED_PORTS_FROM + offset).unwrap_or(29_500)
}

/// The first IPv4 address of `mpirun`'s URI
/// (`jobid.0;tcp://10.0.0.5,172.17.0.1:41835;tcp6://[fd00::2]:39961`).
fn hnp_address(uri: &str) -> Option<String> {
    let tcp = uri
        .split(';')
        .find_map(|part| part.strip_prefix("tcp://"))?;
    let (addresses, _port) = tcp.rsplit_once(':')?;
    addresses
        .split(',')
        .next()
        .filter(|a| !a.is_empty())
        .map(str::to_string)
}

/// How many tasks Slurm runs on node `node` of a step, from its
/// `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`: 2 on each of the first three
/// nodes, 1 on the fourth).
/// Refused naming `variable`.
fn tasks_on_node(variable: &'static str, spec: &str, node: u32) -> Result<u32> {
    let bad = |why: &str| Error::config(variable, spec, why.to_string());
    let mut first = 0u32;
    for group in spec.split(',') {
        let (tasks, repeat) = match group.split_once("(x") {
            Some((tasks, rest)) => {
                let repeat = rest
                    .strip_suffix(')')
                    .ok_or_else(|| bad("expected `N(xK)`"))?;
                (tasks, parse_u32(variable, repeat)?)
            }
            None => (group, 1),
        };
        let tasks = parse_u32(variable, tasks)?;
        if node < first.saturating_add(repeat) {
            return Ok(tasks);
        }
        first = first.saturating_add(repeat);
    }
    Err(bad(&format!(
        "names {first} nodes, and this is node {node}"
    )))
}

/// The first host of a Slurm node list (`gpu[07-09,12],login1`: `gpu07`);
/// refused naming `variable`.
fn first_node(variable: &'static str, list: &str) -> Result<String> {
    let bad = || Error::config(variable, list, "expected a Slurm node list");
    let list = list.trim();
    let open = list.find('[');
    let comma = list.find(',');
    match open {
        Some(at) if comma.is_none_or(|c| at < c) => {
            let close = list[at..].find(']').map(|c| at + c).ok_or_else(bad)?;
            let first = list[at + 1..close]
                .split([',', '-'])
                .next()
                .filter(|f| !f.is_empty())
                .ok_or_else(bad)?;
            let suffix: String = list[close + 1..]
                .chars()
                .take_while(|&c| c != ',')
                .collect();
            Ok(format!("{}{first}{suffix}", &list[..at]))
        }
        _ => {
            let first = list
                .split(',')
                .next()
                .filter(|f| !f.is_empty())
                .ok_or_else(bad)?;
            Ok(first.to_string())
        }
    }
}

#[cfg(test)]
mod tests;
