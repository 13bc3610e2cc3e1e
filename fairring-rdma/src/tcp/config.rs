//! The tcp provider's configuration.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use super::interface;
use crate::fabric::FabricError;
use crate::secret::JobSecret;

/// The environment variable naming the network interface to listen on.
pub const SOCKET_IFNAME_VAR: &str = "FAIRRING_SOCKET_IFNAME";

/// Where the fabric listens. There is no "all interfaces" default: the address is
/// always chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindTo {
    /// An explicit address; port 0 picks a free port.
    Address(SocketAddr),
    /// The first IPv4 address (else IPv6) of a named interface, on a free port.
    Interface(String),
}

impl BindTo {
    /// `127.0.0.1`, on a free port: for single-machine jobs and tests.
    pub fn loopback() -> BindTo {
        BindTo::Address(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
    }

    /// [`SOCKET_IFNAME_VAR`] if set, else `fallback` (the address this process
    /// used to reach the rendezvous, say), else an error naming the variable.
    pub fn from_env(fallback: Option<IpAddr>) -> Result<BindTo, FabricError> {
        match std::env::var(SOCKET_IFNAME_VAR) {
            Ok(name) if name.trim().is_empty() => Err(FabricError::Config {
                variable: SOCKET_IFNAME_VAR,
                reason: "empty interface name".into(),
            }),
            Ok(name) => Ok(BindTo::Interface(name.trim().to_owned())),
            Err(std::env::VarError::NotUnicode(_)) => Err(FabricError::Config {
                variable: SOCKET_IFNAME_VAR,
                reason: "not valid UTF-8".into(),
            }),
            Err(std::env::VarError::NotPresent) => match fallback {
                Some(ip) if !ip.is_unspecified() => Ok(BindTo::Address(SocketAddr::new(ip, 0))),
                _ => Err(FabricError::Config {
                    variable: SOCKET_IFNAME_VAR,
                    reason: "not set, and no address to fall back on: name the interface to \
                             listen on (fairring never listens on all interfaces)"
                        .into(),
                }),
            },
        }
    }

    /// The socket address to bind.
    pub(crate) fn resolve(&self) -> Result<SocketAddr, FabricError> {
        match self {
            BindTo::Address(address) if address.ip().is_unspecified() => Err(FabricError::Config {
                variable: "bind",
                reason: format!(
                    "{address} listens on all interfaces; name one address or interface"
                ),
            }),
            BindTo::Address(address) => Ok(*address),
            BindTo::Interface(name) => interface::address_of(name).map(|ip| SocketAddr::new(ip, 0)),
        }
    }
}

/// Everything a [`TcpFabric`](super::TcpFabric) needs to know.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// This process's rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world_size: u32,
    /// The job's tag, the same on every rank and different for every job.
    pub job_tag: u64,
    /// The job's incarnation: a restarted job increments it, so processes of an
    /// older incarnation are refused.
    pub epoch: u64,
    /// The job secret.
    pub secret: JobSecret,
    /// Where to listen.
    pub bind: BindTo,
    /// A peer from which nothing (not even a keep-alive) arrives for this long is
    /// failed. Default 30 s. Give every rank the same bound: a peer's keep-alives
    /// come at its own `keepalive_interval`, which must stay well under this.
    pub silence_timeout: Duration,
    /// How often an idle connection sends a keep-alive. Default 1 s; must be
    /// under half the silence bound.
    pub keepalive_interval: Duration,
    /// How long an incoming or outgoing handshake may take. Default 10 s.
    pub handshake_timeout: Duration,
    /// How long [`connect`](crate::fabric::Fabric::connect) keeps trying to dial,
    /// or waits to be dialed. Default 60 s.
    pub connect_timeout: Duration,
    /// Most connections that may be waiting for admission at once; more are
    /// refused. Default 128.
    pub max_pending_handshakes: usize,
    /// Most writes and messages outstanding to one peer. Default 1024.
    pub send_queue_depth: usize,
    /// Most completions waiting to be polled. Default 65536.
    pub completion_capacity: usize,
    /// Bytes of kernel receive buffer asked for each connection
    /// (`SO_RCVBUF`), where the kernel allows that much
    /// (`net.core.rmem_max`); 0, or a lower limit (a stock kernel's), leaves
    /// the buffer to the kernel's autotuning. A fixed buffer replaces
    /// autotuning, whose ceiling may be higher: give 0 for a link whose
    /// bandwidth-delay product exceeds it. Default 4 MiB.
    ///
    /// 2x1 tcp all-reduces on two cores, six alternating rounds of 40,
    /// median [slowest-fastest] busbw in GB/s, autotuning against 4 MiB:
    /// 1 MiB 4.26 [1.14-4.34] against 4.31 [4.08-4.63]; 4 MiB 2.39 against
    /// 2.44; 16 MiB 2.03 against 2.13. (A buffer of 1 MiB lost at 16 MiB:
    /// 1.58.)
    pub receive_buffer: usize,
}

impl TcpConfig {
    /// A configuration with the defaults above.
    pub fn new(
        rank: u32,
        world_size: u32,
        job_tag: u64,
        secret: JobSecret,
        bind: BindTo,
    ) -> TcpConfig {
        TcpConfig {
            rank,
            world_size,
            job_tag,
            epoch: 0,
            secret,
            bind,
            silence_timeout: Duration::from_secs(30),
            keepalive_interval: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(60),
            max_pending_handshakes: 128,
            send_queue_depth: 1024,
            completion_capacity: 1 << 16,
            receive_buffer: 4 << 20,
        }
    }

    /// Sets the silence bound, and the keep-alive interval to a tenth of it (at
    /// most 1 s).
    pub fn with_silence_timeout(mut self, silence: Duration) -> TcpConfig {
        self.silence_timeout = silence;
        self.keepalive_interval = (silence / 10).min(Duration::from_secs(1));
        self
    }

    pub(crate) fn validate(&self) -> Result<(), FabricError> {
        let bad =
            |variable: &'static str, reason: String| Err(FabricError::Config { variable, reason });
        if self.world_size == 0 {
            return bad("world_size", "must be at least 1".into());
        }
        if self.rank >= self.world_size {
            return bad(
                "rank",
                format!("{} is outside a world of {}", self.rank, self.world_size),
            );
        }
        if self.silence_timeout.is_zero() {
            return bad("silence_timeout", "must be positive".into());
        }
        if self.keepalive_interval.is_zero() || self.keepalive_interval * 2 > self.silence_timeout {
            return bad(
                "keepalive_interval",
                format!(
                    "{:?} must be positive and at most half the silence bound ({:?})",
                    self.keepalive_interval, self.silence_timeout
                ),
            );
        }
        if self.handshake_timeout.is_zero() {
            return bad("handshake_timeout", "must be positive".into());
        }
        for (name, value) in [
            ("max_pending_handshakes", self.max_pending_handshakes),
            ("send_queue_depth", self.send_queue_depth),
            ("completion_capacity", self.completion_capacity),
        ] {
            if value == 0 {
                return bad(name, "must be at least 1".into());
            }
        }
        Ok(())
    }
}
