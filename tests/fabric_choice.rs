//! The fabric chosen at run time: `tcp` and `auto` all-reduce correctly, `verbs`
//! is refused naming `FAIRRING_FABRIC` where this build or host lacks it, and runs
//! where an RDMA device exists (`--include-ignored`).

mod common;

use common::job;
use fairring::{Communicator, Config, Error, FabricChoice, ReduceOp};

/// A 2x1 all-reduce on `choice`; returns the fabric each rank ended up on.
fn all_reduce_on(choice: FabricChoice) -> Vec<FabricChoice> {
    let n = 100_000;
    let results = job(
        2,
        1,
        |b| b.fabric(choice),
        |rank, comm| {
            let mut data: Vec<f32> = (0..n).map(|i| (i % 7) as f32 + rank as f32).collect();
            comm.all_reduce(&mut data, ReduceOp::Sum)
                .expect("all-reduce");
            let wrong = data
                .iter()
                .enumerate()
                .filter(|&(i, &v)| v != 2.0 * (i % 7) as f32 + 1.0)
                .count();
            (wrong, comm.fabric())
        },
    );
    for (rank, (wrong, _)) in results.iter().enumerate() {
        assert_eq!(*wrong, 0, "{choice}: rank {rank}");
    }
    results.into_iter().map(|(_, f)| f).collect()
}

#[test]
fn tcp_when_asked_for() {
    assert_eq!(
        all_reduce_on(FabricChoice::Tcp),
        [FabricChoice::Tcp, FabricChoice::Tcp]
    );
}

#[test]
fn auto_takes_verbs_only_where_built_and_present() {
    let verbs_here = cfg!(feature = "verbs") && !devices().is_empty();
    let want = if verbs_here {
        FabricChoice::Verbs
    } else {
        FabricChoice::Tcp
    };
    assert_eq!(all_reduce_on(FabricChoice::Auto), [want, want]);
}

fn devices() -> Vec<String> {
    #[cfg(feature = "verbs")]
    return fairring::rdma::verbs::devices();
    #[cfg(not(feature = "verbs"))]
    Vec::new()
}

#[test]
fn verbs_is_refused_naming_the_variable_where_it_cannot_run() {
    let built = Config::builder(0, 1, "127.0.0.1", common::free_port())
        .fabric(FabricChoice::Verbs)
        .build();
    if !cfg!(feature = "verbs") {
        let e = built.unwrap_err();
        assert!(
            matches!(
                &e,
                Error::Config {
                    variable: "FAIRRING_FABRIC",
                    ..
                }
            ),
            "{e}"
        );
        return;
    }
    let config = built.expect("a verbs build takes FAIRRING_FABRIC=verbs");
    match Communicator::new(config) {
        Err(e) if devices().is_empty() => {
            let text = e.to_string();
            assert!(
                matches!(
                    &e,
                    Error::Config {
                        variable: "FAIRRING_FABRIC",
                        ..
                    }
                ) && text.contains("no RDMA device"),
                "{text}"
            );
        }
        Ok(comm) => {
            assert!(!devices().is_empty(), "verbs ran without a device");
            assert_eq!(comm.fabric(), FabricChoice::Verbs);
        }
        Err(e) => panic!("verbs with a device failed: {e}"),
    }
}

#[cfg(feature = "verbs")]
#[test]
#[ignore = "needs an RDMA device"]
fn verbs_all_reduce_between_two_ranks() {
    assert_eq!(
        all_reduce_on(FabricChoice::Verbs),
        [FabricChoice::Verbs, FabricChoice::Verbs]
    );
}
