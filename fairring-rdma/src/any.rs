//! One fabric type over whichever provider a process chose at run time.
//!
//! A runtime that is generic over [`Fabric`] is built with one fabric type, yet
//! which provider carries its traffic is known only once it runs (an
//! environment variable, or whether the host has an RDMA device). [`AnyFabric`]
//! is that type: it holds one provider and forwards every call to it, and
//! [`AnyRegion`] holds memory registered with it. [`resolve`] turns what the
//! caller asked for ([`Wanted`]) into the provider to build, given this build's
//! features and this host's devices.
//!
//! Every rank of a job must build the same provider: a tcp rank and a verbs
//! rank never admit each other (the connection fails, naming the peer).

use std::ptr::NonNull;
use std::time::Duration;

use crate::fabric::{
    Completion, CompletionNotifier, Endpoint, Fabric, FabricError, LocalRegion, RegionKey,
    RemoteRegion, WriteRequest,
};
use crate::tcp::{TcpFabric, TcpRegion};
#[cfg(feature = "verbs")]
use crate::verbs::{VerbsFabric, VerbsRegion};

/// A provider of the fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Provider {
    /// Sockets: any machine.
    Tcp,
    /// RC queue pairs on an InfiniBand or RoCE device.
    Verbs,
}

/// What a process asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wanted {
    /// Verbs where this build has the `verbs` feature and the host an RDMA
    /// device; tcp otherwise.
    Auto,
    /// That provider, or an error saying why it cannot be had.
    Only(Provider),
}

/// Why the provider asked for cannot be built here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// This build lacks the `verbs` feature.
    VerbsNotBuilt,
    /// This host has no RDMA device.
    NoRdmaDevice,
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unavailable::VerbsNotBuilt => {
                "this build has no verbs provider (build it with the `verbs` feature)"
            }
            Unavailable::NoRdmaDevice => {
                "this host has no RDMA device (ibv_get_device_list found none)"
            }
        })
    }
}

impl std::error::Error for Unavailable {}

/// This host's RDMA devices, as far as this build can see (none without the
/// `verbs` feature).
pub fn rdma_devices() -> Vec<String> {
    #[cfg(feature = "verbs")]
    return crate::verbs::devices();
    #[cfg(not(feature = "verbs"))]
    Vec::new()
}

/// The provider `wanted` comes to in this build on a host with `devices`
/// (usually [`rdma_devices`]).
pub fn resolve(wanted: Wanted, devices: &[String]) -> Result<Provider, Unavailable> {
    let built = cfg!(feature = "verbs");
    match wanted {
        Wanted::Only(Provider::Tcp) => Ok(Provider::Tcp),
        Wanted::Auto if built && !devices.is_empty() => Ok(Provider::Verbs),
        Wanted::Auto => Ok(Provider::Tcp),
        Wanted::Only(Provider::Verbs) if !built => Err(Unavailable::VerbsNotBuilt),
        Wanted::Only(Provider::Verbs) if devices.is_empty() => Err(Unavailable::NoRdmaDevice),
        Wanted::Only(Provider::Verbs) => Ok(Provider::Verbs),
    }
}

/// The fabric of whichever provider was built.
pub enum AnyFabric {
    /// Sockets.
    Tcp(TcpFabric),
    /// RC queue pairs on an RDMA device.
    #[cfg(feature = "verbs")]
    Verbs(VerbsFabric),
}

/// Memory registered with an [`AnyFabric`]: of the same provider.
pub enum AnyRegion {
    /// With the tcp provider.
    Tcp(TcpRegion),
    /// With the verbs provider.
    #[cfg(feature = "verbs")]
    Verbs(VerbsRegion),
}

impl AnyFabric {
    /// The provider it holds.
    pub fn provider(&self) -> Provider {
        match self {
            AnyFabric::Tcp(_) => Provider::Tcp,
            #[cfg(feature = "verbs")]
            AnyFabric::Verbs(_) => Provider::Verbs,
        }
    }
}

/// Forwards `$call` to the provider `$fabric` holds, as `$f`.
macro_rules! forward {
    ($fabric:expr, $f:ident => $call:expr) => {
        match $fabric {
            AnyFabric::Tcp($f) => $call,
            #[cfg(feature = "verbs")]
            AnyFabric::Verbs($f) => $call,
        }
    };
}

/// Forwards `$call` to the region `$region` holds, as `$r`.
macro_rules! forward_region {
    ($region:expr, $r:ident => $call:expr) => {
        match $region {
            AnyRegion::Tcp($r) => $call,
            #[cfg(feature = "verbs")]
            AnyRegion::Verbs($r) => $call,
        }
    };
}

/// The error of a region handed to a provider that did not register it.
#[cfg(feature = "verbs")]
fn mismatched() -> FabricError {
    FabricError::InvalidArgument {
        argument: "source",
        reason: "a region registered with another provider".into(),
    }
}

impl LocalRegion for AnyRegion {
    fn key(&self) -> RegionKey {
        forward_region!(self, r => r.key())
    }

    fn len(&self) -> usize {
        forward_region!(self, r => r.len())
    }

    fn remote(&self) -> RemoteRegion {
        forward_region!(self, r => r.remote())
    }

    fn as_ptr(&self) -> *mut u8 {
        forward_region!(self, r => r.as_ptr())
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
        forward!(self, f => f.rank())
    }

    fn world_size(&self) -> u32 {
        forward!(self, f => f.world_size())
    }

    fn endpoint(&self, peer: u32) -> Result<Endpoint, FabricError> {
        forward!(self, f => f.endpoint(peer))
    }

    fn connect(&self, peer: u32, endpoint: &Endpoint) -> Result<(), FabricError> {
        forward!(self, f => f.connect(peer, endpoint))
    }

    unsafe fn register(&self, memory: NonNull<u8>, len: usize) -> Result<AnyRegion, FabricError> {
        match self {
            // SAFETY: forwarded: the caller's contract is the provider's.
            AnyFabric::Tcp(f) => unsafe { f.register(memory, len) }.map(AnyRegion::Tcp),
            #[cfg(feature = "verbs")]
            // SAFETY: as above.
            AnyFabric::Verbs(f) => unsafe { f.register(memory, len) }.map(AnyRegion::Verbs),
        }
    }

    fn registers_sources(&self) -> bool {
        forward!(self, f => f.registers_sources())
    }

    unsafe fn register_source(
        &self,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<AnyRegion, FabricError> {
        match self {
            // SAFETY: forwarded: the caller's contract is the provider's.
            AnyFabric::Tcp(f) => unsafe { f.register_source(memory, len) }.map(AnyRegion::Tcp),
            #[cfg(feature = "verbs")]
            // SAFETY: as above.
            AnyFabric::Verbs(f) => {
                // SAFETY: as above.
                unsafe { f.register_source(memory, len) }.map(AnyRegion::Verbs)
            }
        }
    }

    fn registers_windows(&self) -> bool {
        forward!(self, f => f.registers_windows())
    }

    fn register_window(&self, memory: NonNull<u8>, len: usize) -> Result<AnyRegion, FabricError> {
        match self {
            AnyFabric::Tcp(f) => f.register_window(memory, len).map(AnyRegion::Tcp),
            #[cfg(feature = "verbs")]
            AnyFabric::Verbs(f) => f.register_window(memory, len).map(AnyRegion::Verbs),
        }
    }

    unsafe fn open_window(&self, window: &AnyRegion) -> Result<(), FabricError> {
        match (self, window) {
            // SAFETY: forwarded: the caller's contract is the provider's.
            (AnyFabric::Tcp(f), AnyRegion::Tcp(w)) => unsafe { f.open_window(w) },
            #[cfg(feature = "verbs")]
            // SAFETY: as above.
            (AnyFabric::Verbs(f), AnyRegion::Verbs(w)) => unsafe { f.open_window(w) },
            #[cfg(feature = "verbs")]
            _ => Err(mismatched()),
        }
    }

    fn close_window(&self, window: &AnyRegion) {
        match (self, window) {
            (AnyFabric::Tcp(f), AnyRegion::Tcp(w)) => f.close_window(w),
            #[cfg(feature = "verbs")]
            (AnyFabric::Verbs(f), AnyRegion::Verbs(w)) => f.close_window(w),
            #[cfg(feature = "verbs")]
            _ => {}
        }
    }

    fn write(&self, peer: u32, request: WriteRequest<'_, AnyRegion>) -> Result<(), FabricError> {
        match (self, request.source) {
            (AnyFabric::Tcp(f), AnyRegion::Tcp(r)) => f.write(peer, narrowed(&request, r)),
            #[cfg(feature = "verbs")]
            (AnyFabric::Verbs(f), AnyRegion::Verbs(r)) => f.write(peer, narrowed(&request, r)),
            #[cfg(feature = "verbs")]
            _ => Err(mismatched()),
        }
    }

    fn send_message(
        &self,
        peer: u32,
        immediate: u32,
        payload: &[u8],
        token: u64,
    ) -> Result<(), FabricError> {
        forward!(self, f => f.send_message(peer, immediate, payload, token))
    }

    fn poll(&self, out: &mut [Completion]) -> usize {
        forward!(self, f => f.poll(out))
    }

    fn wait(&self, out: &mut [Completion], timeout: Duration) -> usize {
        forward!(self, f => f.wait(out, timeout))
    }

    fn notify_completions(&self, notify: CompletionNotifier) -> bool {
        forward!(self, f => f.notify_completions(notify))
    }

    fn progress(&self) -> bool {
        forward!(self, f => Fabric::progress(f))
    }

    fn spin_ends(&self) {
        forward!(self, f => f.spin_ends())
    }

    fn spinner_leaves(&self) {
        forward!(self, f => f.spinner_leaves())
    }

    fn begin_batch(&self) {
        forward!(self, f => f.begin_batch())
    }

    fn end_batch(&self) {
        forward!(self, f => f.end_batch())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_was_wanted_resolves_by_build_and_devices() {
        let none: Vec<String> = Vec::new();
        let one = vec!["mlx5_0".to_owned()];
        let tcp = Wanted::Only(Provider::Tcp);
        let verbs = Wanted::Only(Provider::Verbs);
        assert_eq!(resolve(tcp, &one), Ok(Provider::Tcp));
        assert_eq!(resolve(tcp, &none), Ok(Provider::Tcp));
        assert_eq!(resolve(Wanted::Auto, &none), Ok(Provider::Tcp));
        if cfg!(feature = "verbs") {
            assert_eq!(resolve(Wanted::Auto, &one), Ok(Provider::Verbs));
            assert_eq!(resolve(verbs, &one), Ok(Provider::Verbs));
            assert_eq!(resolve(verbs, &none), Err(Unavailable::NoRdmaDevice));
        } else {
            assert_eq!(resolve(Wanted::Auto, &one), Ok(Provider::Tcp));
            assert_eq!(resolve(verbs, &one), Err(Unavailable::VerbsNotBuilt));
            assert_eq!(resolve(verbs, &none), Err(Unavailable::VerbsNotBuilt));
        }
        assert!(
            Unavailable::NoRdmaDevice
                .to_string()
                .contains("no RDMA device")
        );
        assert!(
            Unavailable::VerbsNotBuilt
                .to_string()
                .contains("`verbs` feature")
        );
    }
}
