//! How several ranks of one machine reduce device tensors among themselves
//! (`FAIRRING_DEVICE_LOCAL`).

/// The intra-machine step of device tensors where a machine runs several
/// ranks (`D > 1`); a rank alone on its machine has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceLocal {
    /// NCCL where every local rank can make its communicators, the host
    /// otherwise (each rank says, and they go one way together). The default.
    Auto,
    /// NCCL's collectives among the machine's GPUs: an error at the first
    /// device operation where NCCL is missing or refuses.
    Nccl,
    /// Through the machine's shared host memory: copies down, a reduction on
    /// the host, copies up. Needs nothing but the driver.
    Host,
}

impl DeviceLocal {
    /// The choice's name, as `FAIRRING_DEVICE_LOCAL` spells it.
    pub const fn name(self) -> &'static str {
        match self {
            DeviceLocal::Auto => "auto",
            DeviceLocal::Nccl => "nccl",
            DeviceLocal::Host => "host",
        }
    }
}

impl std::fmt::Display for DeviceLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DeviceLocal {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<DeviceLocal, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceLocal::Auto),
            "nccl" => Ok(DeviceLocal::Nccl),
            "host" => Ok(DeviceLocal::Host),
            _ => Err("expected auto, nccl or host".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_others_are_refused() {
        for choice in [DeviceLocal::Auto, DeviceLocal::Nccl, DeviceLocal::Host] {
            assert_eq!(choice.name().parse::<DeviceLocal>(), Ok(choice));
        }
        assert_eq!(" NCCL ".parse::<DeviceLocal>(), Ok(DeviceLocal::Nccl));
        let e = "gloo".parse::<DeviceLocal>().unwrap_err();
        assert!(e.contains("auto, nccl or host"), "{e}");
    }
}
