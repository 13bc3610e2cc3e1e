//! Finding a network interface's address (`getifaddrs`).

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::config::SOCKET_IFNAME_VAR;
use crate::fabric::FabricError;

/// The first IPv4 address of interface `name`, else its first IPv6 address.
pub(crate) fn address_of(name: &str) -> Result<IpAddr, FabricError> {
    let all = addresses()?;
    let mine = |v4: bool| {
        all.iter()
            .find(|(n, ip)| n == name && ip.is_ipv4() == v4)
            .map(|(_, ip)| *ip)
    };
    mine(true).or_else(|| mine(false)).ok_or_else(|| {
        let mut names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        names.dedup();
        FabricError::Config {
            variable: SOCKET_IFNAME_VAR,
            reason: format!(
                "no interface {name:?} with an IP address; interfaces with one: {}",
                names.join(", ")
            ),
        }
    })
}

/// The address other machines reach this one at, as a rendezvous point a
/// process offers: that of [`SOCKET_IFNAME_VAR`]'s interface where it is set,
/// else the first IPv4 address of an interface that is neither loopback nor a
/// container bridge (`docker*`, `virbr*`, `br-*`, `veth*`), else loopback
/// (which serves one machine only).
pub fn host_address() -> Result<IpAddr, FabricError> {
    if let Ok(name) = std::env::var(SOCKET_IFNAME_VAR) {
        return address_of(name.trim());
    }
    let bridge = |name: &str| {
        ["lo", "docker", "virbr", "br-", "veth"]
            .iter()
            .any(|p| name.starts_with(p))
    };
    Ok(addresses()?
        .into_iter()
        .find(|(name, ip)| ip.is_ipv4() && !ip.is_loopback() && !bridge(name))
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |(_, ip)| ip))
}

/// Every (interface name, IP address) pair of this machine.
fn addresses() -> Result<Vec<(String, IpAddr)>, FabricError> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `getifaddrs` writes a list head into `list`, which we free below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(FabricError::io(
            "listing network interfaces (getifaddrs)",
            std::io::Error::last_os_error(),
        ));
    }
    let mut out = Vec::new();
    let mut cursor = list;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list `getifaddrs` returned, not yet freed.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_addr.is_null() || entry.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null `ifa_name` is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(entry.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: a non-null `ifa_addr` points at a `sockaddr` whose family says
        // which larger structure it is.
        let family = i32::from(unsafe { (*entry.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: the family is AF_INET, so this is a `sockaddr_in`.
                let v4 = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in>() };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: the family is AF_INET6, so this is a `sockaddr_in6`.
                let v6 = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in6>() };
                IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        out.push((name, ip));
    }
    // SAFETY: `list` came from a successful `getifaddrs` and is freed once.
    unsafe { libc::freeifaddrs(list) };
    Ok(out)
}
