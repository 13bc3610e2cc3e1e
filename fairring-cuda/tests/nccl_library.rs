//! NCCL's host side, on any machine that has libnccl (no device needed).
//! `.ci/run` installs it from the nvidia-nccl-cu13 wheel, links `libnccl.so` to
//! its `libnccl.so.2`, and runs these with `--ignored`; without the library they
//! fail, naming it.

use fairring_cuda::nccl::UniqueId;
use fairring_cuda::probe;

#[test]
#[ignore = "needs libnccl.so on the loader path (no device)"]
fn the_probe_reports_the_loaded_nccl() {
    let version = probe::nccl_version().unwrap_or_else(|e| panic!("{e}"));
    assert!(version >= probe::MIN_NCCL_VERSION, "{version}");
    assert!(version < 100_000, "a 2.x version code: {version}");
}

#[test]
#[ignore = "needs libnccl.so on the loader path (no device)"]
fn a_unique_id_survives_the_trip_through_a_store_as_128_bytes() {
    let first = UniqueId::new().unwrap_or_else(|e| panic!("{e}"));
    let second = UniqueId::new().unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(first, second, "each id names its own bootstrap");
    assert!(
        first.as_bytes().iter().any(|b| *b != 0),
        "an id is not all zeros"
    );
    let stored: Vec<u8> = first.as_bytes().to_vec();
    assert_eq!(UniqueId::from_bytes(&stored).unwrap(), first);
}
