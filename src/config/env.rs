//! A configuration from the environment torchrun sets and the `FAIRRING_*`
//! knobs (the table in the module docs of [`crate::config`]).

use std::time::Duration;

use fairring_core::WireFormat;

use super::launchers::{LaunchedJob, RECOGNISED_BY};
use super::parse::{parse_bytes, parse_duration, parse_u32};
use super::{Config, Grouping, JobSecret, Role, VerbsKnobs, parse_flag};
use crate::error::{Error, Result};

/// The process's `LOCAL_RANK` as a group's configuration sees it, which
/// `FAIRRING_DEVICE=local` reads even where the group's own is not the job's.
const LOCAL_RANK_OF_PROCESS: &str = "LOCAL_RANK (of the process)";

impl Config {
    /// The configuration the environment describes: torchrun's, or that of
    /// OpenMPI's `mpirun`, of an MPICH-style `mpiexec` (PMI) or of Slurm's
    /// `srun` (see `config::launchers`), with the `FAIRRING_*` knobs (see the
    /// module docs). Where no launcher's variables are set, the error names
    /// the ones it looked for.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// The configuration of rank `rank` of `world_size` in a runtime that
    /// rendezvouses through a store of its own (see
    /// [`Communicator::with_store`](crate::Communicator::with_store)): every
    /// other knob from the environment, as [`Config::from_env`] reads it.
    ///
    /// `MASTER_ADDR` and `MASTER_PORT` are optional here; they still choose the
    /// interface the fabric listens on (the one that reaches `MASTER_ADDR`, or
    /// `FAIRRING_SOCKET_IFNAME`). With neither, the fabric listens on loopback,
    /// which serves one machine only. A `timeout`, when given (the runtime's
    /// own), replaces `FAIRRING_TIMEOUT`.
    pub fn from_env_with(rank: u32, world_size: u32, timeout: Option<Duration>) -> Result<Config> {
        Config::for_group(rank, world_size, timeout, |name| std::env::var(name).ok())
    }

    /// [`Config::from_env_with`], reading the environment through `env`.
    ///
    /// The job's own variables describe the job's own group only: where
    /// `rank` and `world_size` are not the job's `RANK` and `WORLD_SIZE` (a
    /// subgroup, or a group of another launcher's), `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, the dedicated servers (`FAIRRING_SERVERS`,
    /// `FAIRRING_ROLE`) and a group size (`FAIRRING_GROUP_SIZE=N`) are not
    /// this group's and are not read (`off` and `auto` are): the rendezvous
    /// finds the group's machines.
    pub(crate) fn for_group(
        rank: u32,
        world_size: u32,
        timeout: Option<Duration>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config> {
        let timeout = timeout.map(|t| format!("{}ms", t.as_millis().max(1)));
        let the_jobs = env("RANK").is_some_and(|r| r.trim() == rank.to_string())
            && env("WORLD_SIZE").is_some_and(|w| w.trim() == world_size.to_string());
        Config::from_lookup(|name| match name {
            "RANK" => Some(rank.to_string()),
            "WORLD_SIZE" => Some(world_size.to_string()),
            "MASTER_ADDR" => env(name).or_else(|| Some("127.0.0.1".into())),
            "MASTER_PORT" => env(name).or_else(|| Some("29500".into())),
            "FAIRRING_TIMEOUT" => timeout.clone().or_else(|| env(name)),
            // A subgroup takes the job's choice of one level or the default,
            // but not a group size made for the job's machines.
            "FAIRRING_GROUP_SIZE" if !the_jobs => {
                env(name).filter(|v| matches!(v.trim(), "off" | "auto"))
            }
            // The caller's store replaces torchrun's.
            "TORCHELASTIC_USE_AGENT_STORE" => None,
            "LOCAL_RANK" | "LOCAL_WORLD_SIZE" | "FAIRRING_SERVERS" | "FAIRRING_ROLE"
                if !the_jobs =>
            {
                None
            }
            // The process's GPU is every group's: `FAIRRING_DEVICE=local`
            // names it by the process's local rank.
            LOCAL_RANK_OF_PROCESS => env("LOCAL_RANK"),
            _ => env(name),
        })
    }

    /// Like [`Config::from_env`], reading variables through `lookup`.
    pub fn from_lookup(environment: impl Fn(&str) -> Option<String>) -> Result<Config> {
        // torchrun's variables, or a launcher's read as torchrun's.
        let job = LaunchedJob::find(&environment)?;
        let lookup = |name: &str| match &job {
            Some(job) => job.lookup(name, &environment),
            None => environment(name),
        };
        let required = |name: &'static str| {
            lookup(name).ok_or_else(|| match name {
                "RANK" | "WORLD_SIZE" => Error::config(
                    name,
                    "",
                    format!(
                        "not set, and no launcher's environment is: looked for {RECOGNISED_BY}"
                    ),
                ),
                _ => Error::config(name, "", "not set"),
            })
        };
        let role = match lookup("FAIRRING_ROLE").as_deref().map(str::trim) {
            None | Some("worker") => Role::Worker,
            Some("server") => Role::Server(parse_u32(
                "FAIRRING_SERVER_RANK",
                &required("FAIRRING_SERVER_RANK")?,
            )?),
            Some(other) => {
                return Err(Error::config(
                    "FAIRRING_ROLE",
                    other,
                    "expected `worker` or `server`",
                ));
            }
        };
        let rank = match role {
            Role::Worker => parse_u32("RANK", &required("RANK")?)?,
            Role::Server(_) => 0,
        };
        let world_size = parse_u32("WORLD_SIZE", &required("WORLD_SIZE")?)?;
        let master_addr = required("MASTER_ADDR")?;
        let port_text = required("MASTER_PORT")?;
        let port = parse_u32("MASTER_PORT", &port_text)?;
        let master_port = u16::try_from(port)
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| {
                Error::config("MASTER_PORT", &port_text, "expected a port in 1..=65535")
            })?;
        let mut b = Config::builder(rank, world_size, master_addr, master_port);
        b.config.role = role;
        if let Some(v) = lookup("FAIRRING_SERVERS") {
            b.config.servers = parse_u32("FAIRRING_SERVERS", &v)?;
        }
        if let Some(v) = lookup("LOCAL_RANK") {
            b.config.local_rank = Some(parse_u32("LOCAL_RANK", &v)?);
        }
        if let Some(v) = lookup("LOCAL_WORLD_SIZE") {
            b.config.local_world_size = Some(parse_u32("LOCAL_WORLD_SIZE", &v)?);
        }
        if let Some(v) = lookup("FAIRRING_TOTAL_MEMORY") {
            b.config.total_memory = Some(parse_bytes("FAIRRING_TOTAL_MEMORY", &v)?);
        }
        if let Some(v) = lookup("FAIRRING_SLICE_SIZE") {
            b.config.slice_bytes = Some(parse_bytes("FAIRRING_SLICE_SIZE", &v)?);
        }
        if let Some(v) = lookup("FAIRRING_MIN_SHARD_SIZE") {
            b.config.min_shard_bytes = Some(parse_bytes("FAIRRING_MIN_SHARD_SIZE", &v)?);
        }
        if let Some(v) = lookup("FAIRRING_GROUP_SIZE") {
            b.config.grouping = match v.trim() {
                "auto" => Grouping::Auto,
                "off" => Grouping::OneLevel,
                _ => Grouping::AtMost(parse_u32("FAIRRING_GROUP_SIZE", &v).map_err(|_| {
                    Error::config(
                        "FAIRRING_GROUP_SIZE",
                        &v,
                        "expected `auto`, `off` or a number of machines",
                    )
                })?),
            };
        }
        if let Some(v) = lookup("FAIRRING_DIRECT_FROM") {
            b.config.direct_from = match v.trim() {
                "never" => None,
                _ => Some(parse_bytes("FAIRRING_DIRECT_FROM", &v)?),
            };
        }
        if let Some(v) = lookup("FAIRRING_TCP_RECEIVE_BUFFER") {
            b.config.tcp_receive_buffer = parse_bytes("FAIRRING_TCP_RECEIVE_BUFFER", &v)?;
        }
        if let Some(v) = lookup("FAIRRING_SOCKET_IFNAME") {
            if v.trim().is_empty() {
                return Err(Error::config("FAIRRING_SOCKET_IFNAME", &v, "empty"));
            }
            b.config.socket_ifname = Some(v.trim().to_owned());
        }
        if let Some(v) = lookup("FAIRRING_TIMEOUT") {
            b.config.timeout = parse_duration("FAIRRING_TIMEOUT", &v)?;
        }
        if let Some(v) = lookup("FAIRRING_JOB_SECRET") {
            let secret = JobSecret::from_hex("FAIRRING_JOB_SECRET", &v)
                .map_err(|e| Error::config("FAIRRING_JOB_SECRET", "(hidden)", e.to_string()))?;
            b.secret = Some(secret);
        }
        if let Some(v) = lookup("FAIRRING_ALGO") {
            b.config.algorithm = v
                .parse()
                .map_err(|reason: String| Error::config("FAIRRING_ALGO", &v, reason))?;
        }
        if let Some(v) = lookup("FAIRRING_WIRE") {
            b.config.wire = WireFormat::from_name(v.trim())
                .ok_or_else(|| Error::config("FAIRRING_WIRE", &v, "expected exact, bf16 or f16"))?;
        }
        if let Some(v) = lookup("FAIRRING_HOST_ID") {
            if v.trim().is_empty() {
                return Err(Error::config("FAIRRING_HOST_ID", &v, "empty"));
            }
            b.config.host_id = Some(v);
        }
        if let Some(v) = lookup("FAIRRING_FABRIC") {
            b.config.fabric = v
                .parse()
                .map_err(|reason: String| Error::config("FAIRRING_FABRIC", &v, reason))?;
        }
        if let Some(v) = lookup("FAIRRING_DEVICE_LOCAL") {
            b.config.device_local = v
                .parse()
                .map_err(|reason: String| Error::config("FAIRRING_DEVICE_LOCAL", &v, reason))?;
        }
        if let Some(v) = lookup("FAIRRING_NCCL_ACROSS_MACHINES") {
            b.config.nccl_across_machines = v.parse().map_err(|reason: String| {
                Error::config("FAIRRING_NCCL_ACROSS_MACHINES", &v, reason)
            })?;
        }
        if let Some(v) = lookup("FAIRRING_MACHINES_SERVE") {
            b.config.machines_serve = v
                .parse()
                .map_err(|reason: String| Error::config("FAIRRING_MACHINES_SERVE", &v, reason))?;
        }
        if let Some(v) = lookup("FAIRRING_DEVICE") {
            b.config.device = Some(match v.trim() {
                "local" => {
                    let local = lookup(LOCAL_RANK_OF_PROCESS).or_else(|| lookup("LOCAL_RANK"));
                    let local = local.ok_or_else(|| {
                        Error::config("FAIRRING_DEVICE", &v, "`local` needs LOCAL_RANK, unset")
                    })?;
                    parse_u32("LOCAL_RANK", &local)?
                }
                ordinal => ordinal.parse().map_err(|_| {
                    Error::config(
                        "FAIRRING_DEVICE",
                        &v,
                        "expected a GPU ordinal, or `local` (the one LOCAL_RANK names)",
                    )
                })?,
            });
        }
        b.config.verbs = VerbsKnobs::from_lookup(&lookup)?;
        if let Some(v) = lookup("TORCHELASTIC_RUN_ID") {
            b.run_id = v;
        }
        let agent = lookup("TORCHELASTIC_USE_AGENT_STORE");
        if parse_flag("TORCHELASTIC_USE_AGENT_STORE", agent.as_deref())? {
            let attempt = match lookup("TORCHELASTIC_RESTART_COUNT") {
                Some(v) => parse_u32("TORCHELASTIC_RESTART_COUNT", &v)?,
                None => 0,
            };
            b.config.agent_store = Some(attempt);
        }
        b.build()
    }
}
