//! The machines and links a prediction is made for: presets read from a TOML file.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use super::ModelError;
use super::nccl::NcclTopology;

/// The presets shipped with the model (`benches/presets/hardware.toml`).
pub const BUILTIN_PRESETS: &str = include_str!("../../presets/hardware.toml");

/// One class of link: a message's latency, and the rate of its bytes.
///
/// The model charges messages as LogGP does: a message occupies its sender for
/// the post's overhead or for its bytes on the wire, whichever is longer
/// ([`Link::occupies`]: the NIC sends earlier messages while the next is
/// posted), and arrives one latency later, paid once per dependent hop.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Microseconds from a message's post to its arrival (LogGP's `L`).
    pub latency_us: f64,
    /// One over beta: GB/s (10^9 bytes per second).
    pub gbps: f64,
}

impl Link {
    /// Seconds `bytes` take on the wire.
    pub fn wire(&self, bytes: f64) -> f64 {
        bytes / (self.gbps * 1e9)
    }

    /// Seconds one message of `bytes` occupies its sender, whose posts cost
    /// `post` seconds each: `max(post, bytes / rate)` (LogGP's `o` and `G`).
    pub fn occupies(&self, post: f64, bytes: f64) -> f64 {
        post.max(self.wire(bytes))
    }

    /// Seconds from a message's post to its arrival, past its time on the
    /// sender: one latency per dependent hop.
    pub fn hop(&self) -> f64 {
        self.latency_us * 1e-6
    }
}

/// The NICs of a GPU machine.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Nics {
    /// From a message's post to its arrival (LogGP's `L`), microseconds.
    pub latency_us: f64,
    /// Rate of one NIC, GB/s.
    pub gbps: f64,
    /// NICs per machine.
    pub count: u32,
}

/// Device memory, as a reduction kernel sees it.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    /// Bytes read plus bytes written per second, GB/s.
    pub gbps: f64,
}

/// A CPU-only reduction server machine.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Server {
    /// NICs per server machine.
    pub nic_count: u32,
    /// Rate of one NIC, GB/s.
    pub nic_gbps: f64,
    /// From a message's post to its arrival (LogGP's `L`), microseconds.
    pub latency_us: f64,
    /// Host memory bandwidth the reduction gets, GB/s.
    pub memory_gbps: f64,
}

/// Fixed software costs.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Software {
    /// One stage of fairring's pipeline handing a slice to the next, microseconds.
    pub fairring_step_us: f64,
    /// Submitting one fairring operation, microseconds.
    pub fairring_op_us: f64,
}

/// One preset: a GPU machine, its links, and the servers that go with it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// The preset's name (its table's key), filled in when read.
    #[serde(skip)]
    pub name: String,
    /// What the preset describes.
    pub description: String,
    /// GPUs per machine, `D`.
    pub devices_per_machine: u32,
    /// Within a machine, per GPU: the rate the model's checks hold its stages
    /// within a machine to. Predictions time NCCL's calls there by its tuner
    /// (`nccl`); NVLink's latency is not used.
    pub nvlink: Link,
    /// Between host and device.
    pub pcie: Link,
    /// Between machines.
    pub nic: Nics,
    /// Device memory.
    pub memory: Memory,
    /// Dedicated reduction servers.
    pub server: Server,
    /// Fixed software costs.
    pub software: Software,
    /// What NCCL's tuner reads of these machines.
    pub nccl: NcclTopology,
}

impl Hardware {
    /// The link one rail (device `d` of every machine) has to other machines: the
    /// machine's NICs shared evenly by its `devices` GPUs.
    pub fn rail(&self, devices: u32) -> Link {
        Link {
            latency_us: self.nic.latency_us,
            gbps: self.machine_nic_gbps() / f64::from(devices.max(1)),
        }
    }

    /// One NIC, used whole by one flow.
    pub fn one_nic(&self) -> Link {
        Link {
            latency_us: self.nic.latency_us,
            gbps: self.nic.gbps,
        }
    }

    /// What posting one message between machines costs its sender, seconds:
    /// NCCL's `NET_OVERHEAD` for the preset's CPU (`getNetOverhead`,
    /// `src/graph/tuning.cc` of NVIDIA/nccl at 5067397c: 1 us on Intel x86, 2
    /// on AMD), without the factor of 3 NCCL's tuner applies to a ring step's
    /// latency under its Simple protocol (that is a step's cost, not a post's).
    pub fn post_seconds(&self) -> f64 {
        super::nccl::post_overhead_us(self.nccl.cpu) * 1e-6
    }

    /// Every NIC of a GPU machine together, GB/s.
    pub fn machine_nic_gbps(&self) -> f64 {
        self.nic.gbps * f64::from(self.nic.count)
    }

    /// One NIC of a server machine: what one server process sends and
    /// receives on.
    pub fn server_nic(&self) -> Link {
        Link {
            latency_us: self.server.latency_us,
            gbps: self.server.nic_gbps,
        }
    }

    fn check(&self) -> Result<(), String> {
        let rates = [
            ("nvlink.gbps", self.nvlink.gbps),
            ("pcie.gbps", self.pcie.gbps),
            ("nic.gbps", self.nic.gbps),
            ("memory.gbps", self.memory.gbps),
            ("server.nic_gbps", self.server.nic_gbps),
            ("server.memory_gbps", self.server.memory_gbps),
        ];
        for (field, v) in rates {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!(
                    "{field} must be a positive number of GB/s, got {v}"
                ));
            }
        }
        let latencies = [
            ("nvlink.latency_us", self.nvlink.latency_us),
            ("pcie.latency_us", self.pcie.latency_us),
            ("nic.latency_us", self.nic.latency_us),
            ("server.latency_us", self.server.latency_us),
            ("software.fairring_step_us", self.software.fairring_step_us),
            ("software.fairring_op_us", self.software.fairring_op_us),
        ];
        for (field, v) in latencies {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "{field} must be zero or more microseconds, got {v}"
                ));
            }
        }
        self.nccl.check()?;
        if self.devices_per_machine == 0 || self.nic.count == 0 || self.server.nic_count == 0 {
            return Err(
                "devices_per_machine, nic.count and server.nic_count must be positive".into(),
            );
        }
        Ok(())
    }
}

impl fmt::Display for Hardware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.description)
    }
}

/// Every preset of a presets file, by name, checked.
pub fn parse_presets(text: &str, source: &str) -> Result<BTreeMap<String, Hardware>, ModelError> {
    let table: BTreeMap<String, Hardware> =
        toml::from_str(text).map_err(|e| ModelError::Presets {
            source: source.to_owned(),
            detail: e.to_string(),
        })?;
    let mut out = BTreeMap::new();
    for (name, mut hw) in table {
        hw.check().map_err(|detail| ModelError::Presets {
            source: source.to_owned(),
            detail: format!("preset {name:?}: {detail}"),
        })?;
        hw.name.clone_from(&name);
        out.insert(name, hw);
    }
    Ok(out)
}

/// The preset `name` of `presets` (from [`parse_presets`]).
pub fn preset(presets: &BTreeMap<String, Hardware>, name: &str) -> Result<Hardware, ModelError> {
    presets
        .get(name)
        .cloned()
        .ok_or_else(|| ModelError::UnknownPreset {
            name: name.to_owned(),
            known: presets.keys().cloned().collect(),
        })
}
