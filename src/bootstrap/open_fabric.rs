//! The fabric a communicator uses, built from its configuration
//! (`FAIRRING_FABRIC`, the verbs knobs, the address that reaches the
//! rendezvous host). Which provider `auto` comes to, and the one fabric type
//! over either, are the fabric's own (`fairring_rdma::any`); what the engine
//! counts of its traffic is the engine's (`engine::links`).

use std::net::{IpAddr, SocketAddr, UdpSocket};

use fairring_rdma::any::{AnyFabric, Provider, Unavailable, Wanted, rdma_devices, resolve};
use fairring_rdma::tcp::{BindTo, TcpConfig, TcpFabric};
#[cfg(feature = "verbs")]
use fairring_rdma::verbs::{VerbsConfig, VerbsFabric};

use crate::config::{Config, FabricChoice};
use crate::error::{Error, Result};

/// The fabric `config` asks for, for its rank.
pub(crate) fn build(config: &Config) -> Result<AnyFabric> {
    match provider(config.fabric, &rdma_devices())? {
        Provider::Verbs => verbs(config),
        Provider::Tcp => tcp(config),
    }
}

/// The provider `choice` comes to on a host with `devices`, or an error naming
/// `FAIRRING_FABRIC`.
fn provider(choice: FabricChoice, devices: &[String]) -> Result<Provider> {
    let wanted = match choice {
        FabricChoice::Auto => Wanted::Auto,
        FabricChoice::Tcp => Wanted::Only(Provider::Tcp),
        FabricChoice::Verbs => Wanted::Only(Provider::Verbs),
    };
    resolve(wanted, devices).map_err(|why| match why {
        Unavailable::VerbsNotBuilt => crate::config::verbs_not_built(),
        Unavailable::NoRdmaDevice => Error::config("FAIRRING_FABRIC", choice, why.to_string()),
    })
}

/// The provider of `fabric`, as `FAIRRING_FABRIC` names it.
pub(crate) fn choice_of(fabric: &AnyFabric) -> FabricChoice {
    match fabric.provider() {
        Provider::Tcp => FabricChoice::Tcp,
        Provider::Verbs => FabricChoice::Verbs,
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
    // At most `i32::MAX`: checked when the configuration was built.
    tcp.receive_buffer = usize::try_from(config.tcp_receive_buffer).unwrap_or(0);
    Ok(AnyFabric::Tcp(TcpFabric::new(tcp)?))
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
    Ok(AnyFabric::Verbs(fabric))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_resolves_by_build_and_devices_and_names_its_variable() {
        let none: Vec<String> = Vec::new();
        let one = vec!["mlx5_0".to_owned()];
        assert_eq!(provider(FabricChoice::Tcp, &one).unwrap(), Provider::Tcp);
        assert_eq!(provider(FabricChoice::Auto, &none).unwrap(), Provider::Tcp);
        let verbs_none = provider(FabricChoice::Verbs, &none)
            .unwrap_err()
            .to_string();
        assert!(verbs_none.contains("FAIRRING_FABRIC"), "{verbs_none}");
        if cfg!(feature = "verbs") {
            assert_eq!(provider(FabricChoice::Auto, &one).unwrap(), Provider::Verbs);
            assert_eq!(
                provider(FabricChoice::Verbs, &one).unwrap(),
                Provider::Verbs
            );
            assert!(verbs_none.contains("no RDMA device"), "{verbs_none}");
        } else {
            assert_eq!(provider(FabricChoice::Auto, &one).unwrap(), Provider::Tcp);
            let not_built = provider(FabricChoice::Verbs, &one).unwrap_err().to_string();
            assert!(not_built.contains("FAIRRING_FABRIC"), "{not_built}");
            assert!(verbs_none.contains("`verbs` feature"), "{verbs_none}");
        }
    }
}
