//! Whether the machines of a job with dedicated servers serve an
//! all-reduce's shards themselves (`FAIRRING_MACHINES_SERVE`).

fairring_core::named_enum! {
    /// Where `auto` runs an all-reduce of a job with dedicated servers as the
    /// same job without servers would: the machines reduce their own shards
    /// among themselves, along the rails, and the servers serve none of it
    /// (`engine/choice.rs`). Every worker must set it alike (the servers take
    /// what the workers describe): a worker set otherwise fails as a mismatch
    /// of the first call it runs otherwise. A compressed wire, an algorithm
    /// asked for by name and a reduce keep the servers.
    pub enum MachinesServe {
        /// A device all-reduce, where every GPU of the job reduces in its
        /// NVSwitch (multicast objects, the attribute NCCL reads for NVLS) and
        /// the machines' ranks reduce through NCCL: there a machine reduces
        /// faster than a CPU server streams its memory (the scale model's h100
        /// against its servers). The workers agree on it when their device side
        /// is made. The default.
        Auto = 1 => "auto",
        /// Every all-reduce the servers would take, host tensors too (tests, or
        /// a site whose machines out-reduce its servers).
        On = 2 => "on",
        /// Never: the servers take every all-reduce they would (NCCL's rules
        /// beside servers still apply).
        Off = 3 => "off",
    }
}

impl std::str::FromStr for MachinesServe {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<MachinesServe, String> {
        MachinesServe::from_name(&s.trim().to_ascii_lowercase())
            .ok_or_else(|| "expected auto, on or off".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_others_are_refused() {
        for choice in [MachinesServe::Auto, MachinesServe::On, MachinesServe::Off] {
            assert_eq!(choice.name().parse::<MachinesServe>(), Ok(choice));
        }
        assert_eq!(" ON ".parse::<MachinesServe>(), Ok(MachinesServe::On));
        let e = "yes".parse::<MachinesServe>().unwrap_err();
        assert!(e.contains("auto, on or off"), "{e}");
    }
}
