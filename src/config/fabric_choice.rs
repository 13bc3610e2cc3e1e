//! Which fabric a communicator uses (`FAIRRING_FABRIC`), and the verbs knobs.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `FAIRRING_FABRIC` | `tcp`, `verbs` or `auto` (verbs where an RDMA device is present and the `verbs` feature is built, tcp otherwise) | `auto` |
//! | `FAIRRING_VERBS_DEVICE` | the RDMA device (`mlx5_0`) | the first one |
//! | `FAIRRING_VERBS_PORT` | its port | 1 |
//! | `FAIRRING_VERBS_GID_INDEX` | the GID index (RoCE v2 usually needs its IPv4-mapped GID's) | 0 |

use super::parse::parse_u32;
use crate::error::{Error, Result};

/// Which fabric carries the traffic between machines (and the ring).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FabricChoice {
    /// Verbs where this build has the `verbs` feature and the host an RDMA device;
    /// tcp otherwise. The default.
    Auto,
    /// The tcp provider: real sockets, on any machine.
    Tcp,
    /// The verbs provider: RC queue pairs on an InfiniBand or RoCE device. An
    /// error when the build lacks the `verbs` feature or the host a device.
    Verbs,
}

impl FabricChoice {
    /// The choice's name, as `FAIRRING_FABRIC` spells it.
    pub const fn name(self) -> &'static str {
        match self {
            FabricChoice::Auto => "auto",
            FabricChoice::Tcp => "tcp",
            FabricChoice::Verbs => "verbs",
        }
    }
}

impl std::fmt::Display for FabricChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FabricChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<FabricChoice, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(FabricChoice::Auto),
            "tcp" => Ok(FabricChoice::Tcp),
            "verbs" | "ib" | "rdma" => Ok(FabricChoice::Verbs),
            _ => Err("expected auto, tcp or verbs".into()),
        }
    }
}

/// Where the verbs provider finds its device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VerbsKnobs {
    pub(crate) device: Option<String>,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
}

impl Default for VerbsKnobs {
    fn default() -> VerbsKnobs {
        VerbsKnobs {
            device: None,
            port: 1,
            gid_index: 0,
        }
    }
}

impl VerbsKnobs {
    /// The knobs `lookup` sets.
    pub(crate) fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<VerbsKnobs> {
        let mut k = VerbsKnobs::default();
        if let Some(v) = lookup("FAIRRING_VERBS_DEVICE") {
            if v.trim().is_empty() {
                return Err(Error::config("FAIRRING_VERBS_DEVICE", &v, "empty"));
            }
            k.device = Some(v.trim().to_owned());
        }
        let small = |name: &'static str, v: &str, min: u32| -> Result<u8> {
            let n = parse_u32(name, v)?;
            u8::try_from(n)
                .ok()
                .filter(|&n| u32::from(n) >= min)
                .ok_or_else(|| Error::config(name, v, format!("expected {min} to 255")))
        };
        if let Some(v) = lookup("FAIRRING_VERBS_PORT") {
            k.port = small("FAIRRING_VERBS_PORT", &v, 1)?;
        }
        if let Some(v) = lookup("FAIRRING_VERBS_GID_INDEX") {
            k.gid_index = small("FAIRRING_VERBS_GID_INDEX", &v, 0)?;
        }
        Ok(k)
    }
}

/// The refusal of `verbs` on a build without the provider.
pub(crate) fn verbs_not_built() -> Error {
    Error::config(
        "FAIRRING_FABRIC",
        "verbs",
        "this build of fairring has no verbs provider (build it with the `verbs` feature)",
    )
}
