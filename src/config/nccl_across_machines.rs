//! Whether a device all-reduce on few machines may run as one NCCL
//! all-reduce across the whole job (`FAIRRING_NCCL_ACROSS_MACHINES`).

/// Where `auto` may hand a device all-reduce to one NCCL all-reduce over
/// every rank of the job instead of the reduction-server plan
/// (`engine/choice.rs` says at which sizes and machine counts). It needs
/// the machines' NCCL communicators (`FAIRRING_DEVICE_LOCAL`), and every
/// rank settles it alike when its device side is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NcclAcrossMachines {
    /// Where every GPU of the job reduces in its NVSwitch (multicast
    /// objects, NCCL's NVLS: `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`, the
    /// attribute NCCL reads): NCCL's NVLSTree then moves half the bytes
    /// over NVLink that the plan's reduce-scatter and all-gather do. The
    /// default.
    Auto,
    /// On any GPUs (tests, or a site that measured NCCL ahead on its own).
    On,
    /// Never: every device all-reduce takes the plan.
    Off,
}

impl NcclAcrossMachines {
    /// The choice's name, as `FAIRRING_NCCL_ACROSS_MACHINES` spells it.
    pub const fn name(self) -> &'static str {
        match self {
            NcclAcrossMachines::Auto => "auto",
            NcclAcrossMachines::On => "on",
            NcclAcrossMachines::Off => "off",
        }
    }
}

impl std::fmt::Display for NcclAcrossMachines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for NcclAcrossMachines {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<NcclAcrossMachines, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(NcclAcrossMachines::Auto),
            "on" => Ok(NcclAcrossMachines::On),
            "off" => Ok(NcclAcrossMachines::Off),
            _ => Err("expected auto, on or off".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_others_are_refused() {
        for choice in [
            NcclAcrossMachines::Auto,
            NcclAcrossMachines::On,
            NcclAcrossMachines::Off,
        ] {
            assert_eq!(choice.name().parse::<NcclAcrossMachines>(), Ok(choice));
        }
        assert_eq!(
            " OFF ".parse::<NcclAcrossMachines>(),
            Ok(NcclAcrossMachines::Off)
        );
        let e = "nvls".parse::<NcclAcrossMachines>().unwrap_err();
        assert!(e.contains("auto, on or off"), "{e}");
    }
}
