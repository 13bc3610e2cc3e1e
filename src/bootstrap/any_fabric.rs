//! The fabric a communicator uses, chosen at run time (`FAIRRING_FABRIC`): the
//! engine is generic over [`Fabric`], and [`AnyFabric`] is the one fabric type it
//! is built with, holding whichever provider was chosen.
//!
//! `auto` takes verbs where this build has the `verbs` feature and the host an
//! RDMA device, tcp otherwise; `verbs` without either is an error naming
//! `FAIRRING_FABRIC`. Every rank of a job must choose the same provider (a mixed
//! job fails to connect, naming the peer).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::ptr::NonNull;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};

use fairring_rdma::fabric::{
    Completion, CompletionEvent, CompletionNotifier, Endpoint, Fabric, FabricError, LocalRegion,
    RegionKey, RemoteRegion, WriteRequest,
};
use fairring_rdma::tcp::{BindTo, TcpConfig, TcpFabric, TcpRegion};
#[cfg(feature = "verbs")]
use fairring_rdma::verbs::{VerbsConfig, VerbsFabric, VerbsRegion};

use crate::config::{Config, FabricChoice};
use crate::engine::tags;
use crate::error::{Error, Result};

/// The provider a communicator runs on, and the bytes it has moved.
pub(crate) struct AnyFabric {
    provider: Provider,
    traffic: Counters,
}

/// Data bytes a process's fabric has moved: the payloads of the one-sided
/// writes it posted and of the writes that landed in its memory. Control
/// messages (descriptors, credits, goodbyes) and the providers' frame headers are
/// not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes this process wrote into its peers.
    pub sent_bytes: u64,
    /// Bytes its peers wrote into this process.
    pub received_bytes: u64,
    /// Of those, bytes written straight into its callers' tensors, which it
    /// then did not copy out of staging (a message's, where the fabric lets
    /// a receiver open its tensor to its peer: see the README).
    pub received_in_place_bytes: u64,
}

impl Traffic {
    /// Both counts of `self` and `other` added.
    pub(crate) fn plus(self, other: Traffic) -> Traffic {
        Traffic {
            sent_bytes: self.sent_bytes + other.sent_bytes,
            received_bytes: self.received_bytes + other.received_bytes,
            received_in_place_bytes: self.received_in_place_bytes + other.received_in_place_bytes,
        }
    }
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    in_place: AtomicU64,
}

/// The provider.
enum Provider {
    /// Sockets.
    Tcp(TcpFabric),
    /// RC queue pairs on an RDMA device.
    #[cfg(feature = "verbs")]
    Verbs(VerbsFabric),
}

/// Memory registered with an [`AnyFabric`].
pub(crate) enum AnyRegion {
    /// With the tcp provider.
    Tcp(TcpRegion),
    /// With the verbs provider.
    #[cfg(feature = "verbs")]
    Verbs(VerbsRegion),
}

impl AnyFabric {
    fn new(provider: Provider) -> AnyFabric {
        AnyFabric {
            provider,
            traffic: Counters::default(),
        }
    }

    /// The data bytes moved so far.
    pub(crate) fn traffic(&self) -> Traffic {
        Traffic {
            sent_bytes: self.traffic.sent.load(Ordering::Relaxed),
            received_bytes: self.traffic.received.load(Ordering::Relaxed),
            received_in_place_bytes: self.traffic.in_place.load(Ordering::Relaxed),
        }
    }

    /// Counts the landings among `completions`.
    fn count_landed(&self, completions: &[Completion]) {
        let (mut landed, mut in_place) = (0, 0);
        for c in completions {
            if let CompletionEvent::Landed { len, immediate } = c.event {
                landed += len;
                if tags::lands_in_tensor(immediate) {
                    in_place += len;
                }
            }
        }
        if landed > 0 {
            self.traffic.received.fetch_add(landed, Ordering::Relaxed);
        }
        if in_place > 0 {
            self.traffic.in_place.fetch_add(in_place, Ordering::Relaxed);
        }
    }

    /// The fabric `config` asks for, for its rank.
    pub(crate) fn build(config: &Config) -> Result<AnyFabric> {
        match resolve(config.fabric, &verbs_devices())? {
            FabricChoice::Verbs => verbs(config),
            _ => tcp(config),
        }
    }

    /// The provider: [`FabricChoice::Tcp`] or [`FabricChoice::Verbs`].
    pub(crate) fn choice(&self) -> FabricChoice {
        match &self.provider {
            Provider::Tcp(_) => FabricChoice::Tcp,
            #[cfg(feature = "verbs")]
            Provider::Verbs(_) => FabricChoice::Verbs,
        }
    }
}

/// This host's RDMA devices, as far as this build can see.
fn verbs_devices() -> Vec<String> {
    #[cfg(feature = "verbs")]
    return fairring_rdma::verbs::devices();
    #[cfg(not(feature = "verbs"))]
    Vec::new()
}

/// The provider `choice` comes to on a host with `devices`: `Tcp` or `Verbs`.
fn resolve(choice: FabricChoice, devices: &[String]) -> Result<FabricChoice> {
    let built = cfg!(feature = "verbs");
    match choice {
        FabricChoice::Tcp => Ok(FabricChoice::Tcp),
        FabricChoice::Auto if built && !devices.is_empty() => Ok(FabricChoice::Verbs),
        FabricChoice::Auto => Ok(FabricChoice::Tcp),
        FabricChoice::Verbs if !built => Err(crate::config::verbs_not_built()),
        FabricChoice::Verbs if devices.is_empty() => Err(Error::config(
            "FAIRRING_FABRIC",
            "verbs",
            "this host has no RDMA device (ibv_get_device_list found none)",
        )),
        FabricChoice::Verbs => Ok(FabricChoice::Verbs),
    }
}

fn tcp(config: &Config) -> Result<AnyFabric> {
    let mut tcp = TcpConfig::new(
        config.process(),
        config.processes(),
        config.job_tag,
        config.secret.clone(),
        bind_address(config)?,
    )
    // Half the timeout: a peer that stops (SIGSTOP, a hung host) is reported by
    // name through its silence before the engine's own stall timeout fires.
    .with_silence_timeout(config.timeout / 2);
    tcp.connect_timeout = config.timeout;
    Ok(AnyFabric::new(Provider::Tcp(TcpFabric::new(tcp)?)))
}

#[cfg(feature = "verbs")]
fn verbs(config: &Config) -> Result<AnyFabric> {
    let mut v = VerbsConfig::new(
        config.process(),
        config.processes(),
        config.job_tag,
        config.secret.clone(),
    );
    v.device.clone_from(&config.verbs.device);
    v.port = config.verbs.port;
    v.gid_index = config.verbs.gid_index;
    let fabric = VerbsFabric::new(v).map_err(|e| {
        Error::config(
            "FAIRRING_FABRIC",
            config.fabric,
            format!("the verbs provider cannot open its device: {e}"),
        )
    })?;
    Ok(AnyFabric::new(Provider::Verbs(fabric)))
}

#[cfg(not(feature = "verbs"))]
fn verbs(_config: &Config) -> Result<AnyFabric> {
    Err(crate::config::verbs_not_built())
}

/// The address this rank's tcp fabric listens on.
fn bind_address(config: &Config) -> Result<BindTo> {
    if let Some(name) = &config.socket_ifname {
        return Ok(BindTo::Interface(name.clone()));
    }
    let master = crate::store::tcp::resolve_master(&config.master_addr, config.master_port)?;
    if master.ip().is_loopback() {
        return Ok(BindTo::loopback());
    }
    // The local address of the route to the rendezvous host (no packet is sent).
    let any = SocketAddr::new(
        match master.ip() {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        },
        0,
    );
    let probe = UdpSocket::bind(any)
        .and_then(|s| s.connect(master).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| {
            Error::io(
                format!("finding the local address that reaches {master}"),
                e,
            )
        })?;
    Ok(BindTo::Address(SocketAddr::new(probe.ip(), 0)))
}

#[cfg(feature = "verbs")]
fn mismatched() -> FabricError {
    FabricError::InvalidArgument {
        argument: "source",
        reason: "a region registered with another provider".into(),
    }
}

impl LocalRegion for AnyRegion {
    fn key(&self) -> RegionKey {
        match self {
            AnyRegion::Tcp(r) => r.key(),
            #[cfg(feature = "verbs")]
            AnyRegion::Verbs(r) => r.key(),
        }
    }

    fn len(&self) -> usize {
        match self {
            AnyRegion::Tcp(r) => r.len(),
            #[cfg(feature = "verbs")]
            AnyRegion::Verbs(r) => r.len(),
        }
    }

    fn remote(&self) -> RemoteRegion {
        match self {
            AnyRegion::Tcp(r) => r.remote(),
            #[cfg(feature = "verbs")]
            AnyRegion::Verbs(r) => r.remote(),
        }
    }

    fn as_ptr(&self) -> *mut u8 {
        match self {
            AnyRegion::Tcp(r) => r.as_ptr(),
            #[cfg(feature = "verbs")]
            AnyRegion::Verbs(r) => r.as_ptr(),
        }
    }
}

/// `request` with its source narrowed to the provider's own region type.
fn narrowed<'a, R>(request: &WriteRequest<'a, AnyRegion>, source: &'a R) -> WriteRequest<'a, R> {
    WriteRequest {
        source,
        source_offset: request.source_offset,
        len: request.len,
        target: request.target,
        target_offset: request.target_offset,
        immediate: request.immediate,
        token: request.token,
    }
}

impl Fabric for AnyFabric {
    type Region = AnyRegion;

    fn rank(&self) -> u32 {
        match &self.provider {
            Provider::Tcp(f) => f.rank(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.rank(),
        }
    }

    fn world_size(&self) -> u32 {
        match &self.provider {
            Provider::Tcp(f) => f.world_size(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.world_size(),
        }
    }

    fn endpoint(&self, peer: u32) -> Result<Endpoint, FabricError> {
        match &self.provider {
            Provider::Tcp(f) => f.endpoint(peer),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.endpoint(peer),
        }
    }

    fn connect(&self, peer: u32, endpoint: &Endpoint) -> Result<(), FabricError> {
        match &self.provider {
            Provider::Tcp(f) => f.connect(peer, endpoint),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.connect(peer, endpoint),
        }
    }

    unsafe fn register(&self, memory: NonNull<u8>, len: usize) -> Result<AnyRegion, FabricError> {
        match &self.provider {
            // SAFETY: forwarded: the caller's contract is the provider's.
            Provider::Tcp(f) => unsafe { f.register(memory, len) }.map(AnyRegion::Tcp),
            #[cfg(feature = "verbs")]
            // SAFETY: as above.
            Provider::Verbs(f) => unsafe { f.register(memory, len) }.map(AnyRegion::Verbs),
        }
    }

    fn registers_sources(&self) -> bool {
        match &self.provider {
            Provider::Tcp(f) => f.registers_sources(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.registers_sources(),
        }
    }

    fn registers_windows(&self) -> bool {
        match &self.provider {
            Provider::Tcp(f) => f.registers_windows(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.registers_windows(),
        }
    }

    fn register_window(&self, memory: NonNull<u8>, len: usize) -> Result<AnyRegion, FabricError> {
        match &self.provider {
            Provider::Tcp(f) => f.register_window(memory, len).map(AnyRegion::Tcp),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.register_window(memory, len).map(AnyRegion::Verbs),
        }
    }

    unsafe fn open_window(&self, window: &AnyRegion) -> Result<(), FabricError> {
        match (&self.provider, window) {
            // SAFETY: forwarded: the caller's contract is the provider's.
            (Provider::Tcp(f), AnyRegion::Tcp(w)) => unsafe { f.open_window(w) },
            #[cfg(feature = "verbs")]
            // SAFETY: as above.
            (Provider::Verbs(f), AnyRegion::Verbs(w)) => unsafe { f.open_window(w) },
            #[cfg(feature = "verbs")]
            _ => Err(mismatched()),
        }
    }

    fn close_window(&self, window: &AnyRegion) {
        match (&self.provider, window) {
            (Provider::Tcp(f), AnyRegion::Tcp(w)) => f.close_window(w),
            #[cfg(feature = "verbs")]
            (Provider::Verbs(f), AnyRegion::Verbs(w)) => f.close_window(w),
            #[cfg(feature = "verbs")]
            _ => {}
        }
    }

    unsafe fn register_source(
        &self,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<AnyRegion, FabricError> {
        match &self.provider {
            // SAFETY: forwarded: the caller's contract is the provider's.
            Provider::Tcp(f) => unsafe { f.register_source(memory, len) }.map(AnyRegion::Tcp),
            #[cfg(feature = "verbs")]
            // SAFETY: as above.
            Provider::Verbs(f) => unsafe { f.register_source(memory, len) }.map(AnyRegion::Verbs),
        }
    }

    fn write(&self, peer: u32, request: WriteRequest<'_, AnyRegion>) -> Result<(), FabricError> {
        let len = request.len as u64;
        let posted = match (&self.provider, request.source) {
            (Provider::Tcp(f), AnyRegion::Tcp(r)) => f.write(peer, narrowed(&request, r)),
            #[cfg(feature = "verbs")]
            (Provider::Verbs(f), AnyRegion::Verbs(r)) => f.write(peer, narrowed(&request, r)),
            #[cfg(feature = "verbs")]
            _ => Err(mismatched()),
        };
        if posted.is_ok() {
            self.traffic.sent.fetch_add(len, Ordering::Relaxed);
        }
        posted
    }

    fn send_message(
        &self,
        peer: u32,
        immediate: u32,
        payload: &[u8],
        token: u64,
    ) -> Result<(), FabricError> {
        match &self.provider {
            Provider::Tcp(f) => f.send_message(peer, immediate, payload, token),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.send_message(peer, immediate, payload, token),
        }
    }

    fn poll(&self, out: &mut [Completion]) -> usize {
        let n = match &self.provider {
            Provider::Tcp(f) => f.poll(out),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.poll(out),
        };
        self.count_landed(&out[..n]);
        n
    }

    fn wait(&self, out: &mut [Completion], timeout: Duration) -> usize {
        let n = match &self.provider {
            Provider::Tcp(f) => f.wait(out, timeout),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.wait(out, timeout),
        };
        self.count_landed(&out[..n]);
        n
    }

    fn notify_completions(&self, notify: CompletionNotifier) -> bool {
        match &self.provider {
            Provider::Tcp(f) => f.notify_completions(notify),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.notify_completions(notify),
        }
    }

    fn progress(&self) -> bool {
        match &self.provider {
            Provider::Tcp(f) => f.progress(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => Fabric::progress(f),
        }
    }

    fn spin_ends(&self) {
        match &self.provider {
            Provider::Tcp(f) => f.spin_ends(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.spin_ends(),
        }
    }

    fn begin_batch(&self) {
        match &self.provider {
            Provider::Tcp(f) => f.begin_batch(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.begin_batch(),
        }
    }

    fn end_batch(&self) {
        match &self.provider {
            Provider::Tcp(f) => f.end_batch(),
            #[cfg(feature = "verbs")]
            Provider::Verbs(f) => f.end_batch(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_resolves_by_build_and_devices() {
        let none: Vec<String> = Vec::new();
        let one = vec!["mlx5_0".to_owned()];
        assert_eq!(resolve(FabricChoice::Tcp, &one).unwrap(), FabricChoice::Tcp);
        assert_eq!(
            resolve(FabricChoice::Auto, &none).unwrap(),
            FabricChoice::Tcp
        );
        let verbs_none = resolve(FabricChoice::Verbs, &none).unwrap_err().to_string();
        assert!(verbs_none.contains("FAIRRING_FABRIC"), "{verbs_none}");
        if cfg!(feature = "verbs") {
            assert_eq!(
                resolve(FabricChoice::Auto, &one).unwrap(),
                FabricChoice::Verbs
            );
            assert_eq!(
                resolve(FabricChoice::Verbs, &one).unwrap(),
                FabricChoice::Verbs
            );
            assert!(verbs_none.contains("no RDMA device"), "{verbs_none}");
        } else {
            assert_eq!(
                resolve(FabricChoice::Auto, &one).unwrap(),
                FabricChoice::Tcp
            );
            assert!(resolve(FabricChoice::Verbs, &one).is_err());
            assert!(verbs_none.contains("`verbs` feature"), "{verbs_none}");
        }
    }
}
