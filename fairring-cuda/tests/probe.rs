//! The probe and every entry point answer with an error naming what is missing,
//! on any machine, and never panic.

use fairring_cuda::nccl::UniqueId;
use fairring_cuda::probe::{self, probe};
use fairring_cuda::{Device, Error, Library, cuda_available};

fn unavailable(result: Result<impl std::fmt::Debug, Error>, library: Library) {
    match result {
        Err(Error::Unavailable { library: l, reason }) => {
            assert_eq!(l, library, "{reason}");
            assert!(!reason.is_empty());
        }
        other => panic!("expected {library} to be unavailable, got {other:?}"),
    }
}

#[test]
fn each_library_is_either_usable_or_named_as_missing() {
    let found = probe();
    match &found.cuda {
        Ok(info) => {
            assert!(info.devices > 0);
            assert!(info.version >= probe::MIN_DRIVER_VERSION);
        }
        Err(e) => unavailable(Err::<(), _>(e.clone()), Library::Cuda),
    }
    match &found.nccl {
        Ok(version) => assert!(*version >= probe::MIN_NCCL_VERSION),
        Err(e) => unavailable(Err::<(), _>(e.clone()), Library::Nccl),
    }
    match &found.nvrtc {
        Ok((major, _)) => assert!(*major >= 11),
        Err(e) => unavailable(Err::<(), _>(e.clone()), Library::Nvrtc),
    }
    // Asking again gives the same answer (it is cached, not re-probed).
    assert_eq!(probe().cuda.is_ok(), found.cuda.is_ok());
}

#[test]
fn opening_a_device_fails_with_a_named_cause() {
    if cuda_available() {
        let count = probe::driver_info().unwrap().devices;
        match Device::for_local_rank(count) {
            Err(Error::InvalidArgument { argument, reason }) => {
                assert_eq!(argument, "local rank");
                assert!(reason.contains(&format!("{count} device")), "{reason}");
            }
            other => panic!("local rank {count} must be refused, got {other:?}"),
        }
    } else {
        unavailable(Device::for_local_rank(0), Library::Cuda);
        unavailable(Device::open(0), Library::Cuda);
        unavailable(fairring_cuda::module_loading(), Library::Cuda);
    }
}

#[test]
fn nccl_entry_points_refuse_without_the_library() {
    if probe::nccl_version().is_err() {
        unavailable(UniqueId::new(), Library::Nccl);
    } else {
        assert!(UniqueId::new().is_ok());
    }
}
