//! A communicator made with a GPU (`FAIRRING_DEVICE`, [`ConfigBuilder::device`])
//! readies it when it is made, before any stream can wait for one of its
//! operations: a build without device calls refuses it naming the variable,
//! and a build with them fails making it, naming the GPU layer's reason, where
//! the GPU cannot be readied (this machine has no driver). On a GPU the
//! communicator is made, and its first device operation has nothing left to
//! ready.
//!
//! [`ConfigBuilder::device`]: fairring::ConfigBuilder::device

mod common;

use fairring::{Communicator, Config, Error};

#[test]
fn a_communicator_made_with_a_gpu_readies_it_when_it_is_made() {
    let config = Config::builder(0, 1, "127.0.0.1", common::free_port())
        .device(0)
        .build()
        .expect("a GPU ordinal configures");
    let made = Communicator::new(config);
    if !cfg!(feature = "cuda") {
        match made {
            Err(e @ Error::Config { variable, .. }) => {
                assert_eq!(variable, "FAIRRING_DEVICE");
                assert!(e.to_string().contains("`cuda` feature"), "{e}");
            }
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("a build without device calls made a communicator with a GPU"),
        }
        return;
    }
    #[cfg(feature = "cuda")]
    if !fairring::cuda::cuda_available() {
        match made {
            Err(e @ Error::Gpu(_)) => {
                let text = e.to_string();
                assert!(text.contains("CUDA") || text.contains("GPU"), "{text}");
            }
            Err(e) => panic!("failed for another reason than the GPU: {e}"),
            Ok(_) => panic!("made a communicator with a GPU where the driver is missing"),
        }
        return;
    }
    let comm = made.expect("a communicator with a GPU on a GPU machine");
    assert_eq!(comm.world_size(), 1);
}
