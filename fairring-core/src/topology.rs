//! Machines, devices, ranks and rails.
//!
//! A job runs on `M` machines with `D` devices each (the same `D` everywhere: the
//! algorithm is symmetric, and a machine with fewer devices would leave a rail without
//! a member). Each device runs one rank. Two rank layouts are supported, the two that
//! launchers produce:
//!
//! - [`RankLayout::Contiguous`]: `rank = m * D + d` (torchrun, one machine after the
//!   other);
//! - [`RankLayout::Interleaved`]: `rank = d * M + m` (one device index after the other).
//!
//! The *rail* of a rank is its device index `d`: in the inter-machine step device `d`
//! only ever talks to device `d` of the other machines.

use core::fmt;

/// The most machines a topology may have.
///
/// The staging state machine keeps per-peer countdowns in 12-bit fields (see
/// [`crate::staging`]), so a device can wait on at most 4095 other machines.
pub const MAX_MACHINES: u32 = 4096;

/// The most devices per machine a topology may have.
pub const MAX_DEVICES_PER_MACHINE: u32 = 1024;

/// How ranks are numbered across machines and devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RankLayout {
    /// `rank = machine * D + device`.
    Contiguous,
    /// `rank = device * M + machine`.
    Interleaved,
}

/// Where a rank runs: machine `m`, device `d` of that machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Location {
    /// Machine index, `0..M`.
    pub machine: u32,
    /// Device index on that machine, `0..D`; also the rank's rail.
    pub device: u32,
}

/// A validated job topology: `M` machines of `D` devices and a rank layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Topology {
    machines: u32,
    devices: u32,
    layout: RankLayout,
}

/// Why a topology or a rank query was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TopologyError {
    /// The machine count was zero.
    ZeroMachines,
    /// The devices-per-machine count was zero.
    ZeroDevices,
    /// More machines than [`MAX_MACHINES`].
    TooManyMachines {
        /// The count given.
        machines: u32,
    },
    /// More devices per machine than [`MAX_DEVICES_PER_MACHINE`].
    TooManyDevices {
        /// The count given.
        devices: u32,
    },
    /// `machines * devices` does not fit in a `u32` rank.
    WorldSizeOverflow {
        /// Machine count.
        machines: u32,
        /// Devices per machine.
        devices: u32,
    },
    /// The machines do not all have the same number of devices.
    NonUniformDevices {
        /// The first machine whose count differs from machine 0's.
        machine: u32,
        /// Its device count.
        devices: u32,
        /// Machine 0's device count.
        expected: u32,
    },
    /// A rank list gave no ranks at all.
    EmptyJob,
    /// In a rank -> machine list, a machine index appeared before all smaller ones
    /// had (indices must be numbered in order of first appearance).
    MachineOutOfOrder {
        /// The rank where it appeared.
        rank: u32,
        /// The machine index given for it.
        machine: u32,
    },
    /// The ranks are spread over machines in neither the contiguous nor the
    /// interleaved layout.
    IrregularLayout {
        /// The first rank that fits neither layout.
        rank: u32,
        /// The machine it is on.
        machine: u32,
    },
    /// A rank at or past the world size.
    RankOutOfRange {
        /// The rank given.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// A machine index at or past `M`.
    MachineOutOfRange {
        /// The machine given.
        machine: u32,
        /// `M`.
        machines: u32,
    },
    /// A device index at or past `D`.
    DeviceOutOfRange {
        /// The device given.
        device: u32,
        /// `D`.
        devices: u32,
    },
}

impl fmt::Display for TopologyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TopologyError::ZeroMachines => f.write_str("a topology needs at least one machine"),
            TopologyError::ZeroDevices => {
                f.write_str("a topology needs at least one device per machine")
            }
            TopologyError::TooManyMachines { machines } => {
                write!(
                    f,
                    "{machines} machines is more than the {MAX_MACHINES} supported"
                )
            }
            TopologyError::TooManyDevices { devices } => write!(
                f,
                "{devices} devices per machine is more than the {MAX_DEVICES_PER_MACHINE} supported"
            ),
            TopologyError::WorldSizeOverflow { machines, devices } => write!(
                f,
                "{machines} machines x {devices} devices overflows a 32-bit rank"
            ),
            TopologyError::NonUniformDevices {
                machine,
                devices,
                expected,
            } => write!(
                f,
                "machine {machine} has {devices} devices but machine 0 has {expected}; \
                 every machine must have the same number"
            ),
            TopologyError::EmptyJob => f.write_str("the job has no ranks"),
            TopologyError::MachineOutOfOrder { rank, machine } => write!(
                f,
                "rank {rank} is on machine {machine}, which appears before a smaller machine index; \
                 number machines in order of first appearance"
            ),
            TopologyError::IrregularLayout { rank, machine } => write!(
                f,
                "rank {rank} on machine {machine} fits neither the contiguous (m*D+d) \
                 nor the interleaved (d*M+m) rank layout"
            ),
            TopologyError::RankOutOfRange { rank, world_size } => {
                write!(f, "rank {rank} is out of range for world size {world_size}")
            }
            TopologyError::MachineOutOfRange { machine, machines } => {
                write!(
                    f,
                    "machine {machine} is out of range for {machines} machines"
                )
            }
            TopologyError::DeviceOutOfRange { device, devices } => {
                write!(
                    f,
                    "device {device} is out of range for {devices} devices per machine"
                )
            }
        }
    }
}

impl core::error::Error for TopologyError {}

impl Topology {
    /// A topology of `machines` machines with `devices` devices each.
    pub const fn new(
        machines: u32,
        devices: u32,
        layout: RankLayout,
    ) -> Result<Topology, TopologyError> {
        if machines == 0 {
            return Err(TopologyError::ZeroMachines);
        }
        if devices == 0 {
            return Err(TopologyError::ZeroDevices);
        }
        if machines > MAX_MACHINES {
            return Err(TopologyError::TooManyMachines { machines });
        }
        if devices > MAX_DEVICES_PER_MACHINE {
            return Err(TopologyError::TooManyDevices { devices });
        }
        if machines.checked_mul(devices).is_none() {
            return Err(TopologyError::WorldSizeOverflow { machines, devices });
        }
        Ok(Topology {
            machines,
            devices,
            layout,
        })
    }

    /// A topology from the device count of each machine, refused unless all counts
    /// are equal.
    pub fn from_device_counts(
        counts: &[u32],
        layout: RankLayout,
    ) -> Result<Topology, TopologyError> {
        let Some(&expected) = counts.first() else {
            return Err(TopologyError::ZeroMachines);
        };
        if let Some((machine, &devices)) = counts.iter().enumerate().find(|(_, c)| **c != expected)
        {
            return Err(TopologyError::NonUniformDevices {
                machine: u32::try_from(machine).unwrap_or(u32::MAX),
                devices,
                expected,
            });
        }
        let machines = u32::try_from(counts.len())
            .map_err(|_| TopologyError::TooManyMachines { machines: u32::MAX })?;
        Topology::new(machines, expected, layout)
    }

    /// Detects the topology from the machine of every rank.
    ///
    /// `machine_of_rank[r]` is the machine rank `r` runs on, with machines numbered
    /// `0, 1, 2, ...` in order of first appearance (as a rendezvous assigns them from
    /// host identities). The layout is contiguous or interleaved, whichever the ranks
    /// follow (contiguous when both fit, i.e. `M == 1` or `D == 1`).
    pub fn detect(machine_of_rank: &[u32]) -> Result<Topology, TopologyError> {
        if machine_of_rank.is_empty() {
            return Err(TopologyError::EmptyJob);
        }
        let world =
            u32::try_from(machine_of_rank.len()).map_err(|_| TopologyError::WorldSizeOverflow {
                machines: u32::MAX,
                devices: u32::MAX,
            })?;
        let mut next_new = 0u32;
        for (rank, &machine) in (0u32..).zip(machine_of_rank) {
            if machine > next_new {
                return Err(TopologyError::MachineOutOfOrder { rank, machine });
            }
            if machine == next_new {
                next_new += 1;
            }
        }
        let machines = next_new;
        if world % machines != 0 {
            return Err(non_uniform(machine_of_rank, machines, world));
        }
        let devices = world / machines;
        let contiguous = (0u32..)
            .zip(machine_of_rank)
            .all(|(r, &m)| m == r / devices);
        let layout = if contiguous {
            RankLayout::Contiguous
        } else if (0u32..)
            .zip(machine_of_rank)
            .all(|(r, &m)| m == r % machines)
        {
            RankLayout::Interleaved
        } else {
            let err = non_uniform(machine_of_rank, machines, world);
            if matches!(err, TopologyError::NonUniformDevices { .. }) {
                return Err(err);
            }
            // Uniform counts in an order neither layout produces: report the first
            // rank that breaks the contiguous layout.
            let (rank, &machine) = (0u32..)
                .zip(machine_of_rank)
                .find(|(r, m)| **m != r / devices)
                .unwrap_or((0, &0));
            return Err(TopologyError::IrregularLayout { rank, machine });
        };
        Topology::new(machines, devices, layout)
    }

    /// Number of machines, `M`.
    pub const fn machines(&self) -> u32 {
        self.machines
    }

    /// Devices per machine, `D`.
    pub const fn devices_per_machine(&self) -> u32 {
        self.devices
    }

    /// The rank layout.
    pub const fn layout(&self) -> RankLayout {
        self.layout
    }

    /// Total number of ranks, `M * D` (checked at construction).
    pub const fn world_size(&self) -> u32 {
        self.machines * self.devices
    }

    /// The rank of device `location.device` on machine `location.machine`.
    pub const fn rank(&self, location: Location) -> Result<u32, TopologyError> {
        if location.machine >= self.machines {
            return Err(TopologyError::MachineOutOfRange {
                machine: location.machine,
                machines: self.machines,
            });
        }
        if location.device >= self.devices {
            return Err(TopologyError::DeviceOutOfRange {
                device: location.device,
                devices: self.devices,
            });
        }
        // Both products are below M * D, which fits a u32 (checked in `new`).
        Ok(match self.layout {
            RankLayout::Contiguous => location.machine * self.devices + location.device,
            RankLayout::Interleaved => location.device * self.machines + location.machine,
        })
    }

    /// Where `rank` runs.
    pub const fn locate(&self, rank: u32) -> Result<Location, TopologyError> {
        if rank >= self.world_size() {
            return Err(TopologyError::RankOutOfRange {
                rank,
                world_size: self.world_size(),
            });
        }
        Ok(match self.layout {
            RankLayout::Contiguous => Location {
                machine: rank / self.devices,
                device: rank % self.devices,
            },
            RankLayout::Interleaved => Location {
                machine: rank % self.machines,
                device: rank / self.machines,
            },
        })
    }

    /// The rail of `rank`: its device index.
    pub const fn rail(&self, rank: u32) -> Result<u32, TopologyError> {
        match self.locate(rank) {
            Ok(location) => Ok(location.device),
            Err(e) => Err(e),
        }
    }

    /// The rank on machine `machine` that shares `rank`'s rail.
    pub const fn rail_peer(&self, rank: u32, machine: u32) -> Result<u32, TopologyError> {
        match self.locate(rank) {
            Ok(location) => self.rank(Location {
                machine,
                device: location.device,
            }),
            Err(e) => Err(e),
        }
    }
}

/// The error for ranks that are not spread evenly over `machines` machines: the first
/// machine whose device count differs from machine 0's. Error path only (it scans the
/// ranks once per machine), and it never allocates.
fn non_uniform(machine_of_rank: &[u32], machines: u32, world: u32) -> TopologyError {
    let count = |m: u32| {
        let n = machine_of_rank.iter().filter(|&&x| x == m).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    };
    let expected = count(0);
    for machine in 1..machines {
        let devices = count(machine);
        if devices != expected {
            return TopologyError::NonUniformDevices {
                machine,
                devices,
                expected,
            };
        }
    }
    // Every machine has `expected` devices: uniform after all.
    TopologyError::IrregularLayout {
        rank: world.saturating_sub(1),
        machine: machines.saturating_sub(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_and_interleaved_round_trip() {
        for layout in [RankLayout::Contiguous, RankLayout::Interleaved] {
            let t = Topology::new(3, 4, layout).unwrap();
            for rank in 0..12 {
                let loc = t.locate(rank).unwrap();
                assert_eq!(t.rank(loc).unwrap(), rank);
                assert_eq!(t.rail(rank).unwrap(), loc.device);
            }
        }
        let c = Topology::new(3, 4, RankLayout::Contiguous).unwrap();
        assert_eq!(
            c.locate(5).unwrap(),
            Location {
                machine: 1,
                device: 1
            }
        );
        let i = Topology::new(3, 4, RankLayout::Interleaved).unwrap();
        assert_eq!(
            i.locate(5).unwrap(),
            Location {
                machine: 2,
                device: 1
            }
        );
    }

    #[test]
    fn refuses_zero_and_overflow() {
        assert_eq!(
            Topology::new(0, 1, RankLayout::Contiguous),
            Err(TopologyError::ZeroMachines)
        );
        assert_eq!(
            Topology::new(1, 0, RankLayout::Contiguous),
            Err(TopologyError::ZeroDevices)
        );
        assert_eq!(
            Topology::new(MAX_MACHINES + 1, 1, RankLayout::Contiguous),
            Err(TopologyError::TooManyMachines {
                machines: MAX_MACHINES + 1
            })
        );
        assert!(
            Topology::new(
                MAX_MACHINES,
                MAX_DEVICES_PER_MACHINE,
                RankLayout::Contiguous
            )
            .is_ok()
        );
    }

    #[test]
    fn detects_layouts_and_non_uniform_machines() {
        let c = Topology::detect(&[0, 0, 1, 1, 2, 2]).unwrap();
        assert_eq!((c.machines(), c.devices_per_machine()), (3, 2));
        assert_eq!(c.layout(), RankLayout::Contiguous);
        let i = Topology::detect(&[0, 1, 2, 0, 1, 2]).unwrap();
        assert_eq!(i.layout(), RankLayout::Interleaved);
        assert_eq!(
            Topology::detect(&[0, 0, 1]),
            Err(TopologyError::NonUniformDevices {
                machine: 1,
                devices: 1,
                expected: 2
            })
        );
        assert_eq!(
            Topology::detect(&[0, 0, 0, 1, 1, 1, 1, 0]),
            Err(TopologyError::IrregularLayout {
                rank: 3,
                machine: 1
            })
        );
        assert_eq!(
            Topology::detect(&[1, 0]),
            Err(TopologyError::MachineOutOfOrder {
                rank: 0,
                machine: 1
            })
        );
        assert_eq!(Topology::detect(&[]), Err(TopologyError::EmptyJob));
    }

    #[test]
    fn device_counts_must_be_uniform() {
        assert_eq!(
            Topology::from_device_counts(&[8, 8, 4], RankLayout::Contiguous),
            Err(TopologyError::NonUniformDevices {
                machine: 2,
                devices: 4,
                expected: 8
            })
        );
        assert_eq!(
            Topology::from_device_counts(&[8, 8], RankLayout::Interleaved)
                .unwrap()
                .world_size(),
            16
        );
    }
}
