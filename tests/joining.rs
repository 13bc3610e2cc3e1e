//! Joining a job other than through torchrun. By id, as NCCL's
//! `ncclGetUniqueId` and `ncclCommInitRank` do: one process makes the id,
//! every rank joins with (id, rank, world size); a changed id is refused at
//! once, naming it, and a stale one fails within the timeout, naming it. By
//! a launcher's environment: a job it describes with a rank missing fails
//! within the timeout, naming the rank.

use std::time::{Duration, Instant};

use fairring::{Communicator, ConfigBuilder, Error, Grouping, JobId, ReduceOp};
use fairring_core::topology::{RankLayout, Topology};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(20));

#[test]
fn ranks_join_by_id_and_all_reduce_exactly() {
    let id = JobId::new().unwrap();
    // The id travels as bytes, as MPI_Bcast or a file would carry it.
    let bytes = id.as_bytes().to_vec();
    let world = 3u32;
    let sums: Vec<Vec<i64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let bytes = bytes.clone();
                s.spawn(move || {
                    let id = JobId::from_bytes(&bytes).unwrap();
                    let comm = Communicator::from_id(&id, rank, world, TIMEOUT)
                        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    assert_eq!((comm.rank(), comm.world_size()), (rank, world));
                    let mut data: Vec<i64> = (0..1000).map(|i| i * i64::from(rank + 1)).collect();
                    comm.all_reduce(&mut data, ReduceOp::Sum).unwrap();
                    data
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for data in sums {
        assert!(data.iter().enumerate().all(|(i, &v)| v == i as i64 * 6));
    }
}

#[test]
fn a_changed_id_is_refused_and_a_stale_one_fails_within_the_timeout() {
    let id = JobId::new().unwrap();
    let mut changed = *id.as_bytes();
    changed[30] ^= 0x40;
    match JobId::from_bytes(&changed) {
        Err(Error::InvalidArgument { argument, reason }) => {
            assert_eq!(argument, "id");
            assert!(reason.contains("checksum"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    match Communicator::from_id(&id, 1, 1, TIMEOUT) {
        Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "rank"),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("rank 1 of 1 joined"),
    }
    // A job of one rank, made and ended: its maker's store goes with it.
    let comm = Communicator::from_id(&id, 0, 1, TIMEOUT).unwrap();
    drop(comm);
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let Err(e) = Communicator::from_id(&id, 0, 2, Some(timeout)) else {
        panic!("joined with a stale id");
    };
    let took = start.elapsed();
    let text = e.to_string();
    assert!(
        text.contains("joining by id") && text.contains("JobId("),
        "{text}"
    );
    assert!(took < timeout * 3, "took {took:?}");
}

/// A job that mpirun describes, with a rank that never starts: the rank
/// that did fails within its timeout, naming the rank it waited for (the
/// same as under torchrun: launchers change only how the job is read).
#[test]
fn a_launched_job_missing_a_rank_fails_within_the_timeout_naming_it() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().to_string()
    };
    let env = |name: &str| -> Option<String> {
        match name {
            "OMPI_COMM_WORLD_RANK" => Some("0".into()),
            "OMPI_COMM_WORLD_SIZE" => Some("2".into()),
            "OMPI_COMM_WORLD_LOCAL_RANK" => Some("0".into()),
            "OMPI_COMM_WORLD_LOCAL_SIZE" => Some("2".into()),
            "OMPI_MCA_ess_base_jobid" => Some("4242".into()),
            "MASTER_PORT" => Some(port.clone()),
            "FAIRRING_TIMEOUT" => Some("2s".into()),
            _ => None,
        }
    };
    let config = fairring::Config::from_lookup(env).unwrap();
    assert_eq!((config.rank(), config.world_size()), (0, 2));
    let start = Instant::now();
    let Err(e) = Communicator::new(config) else {
        panic!("a job of two ranks formed with one");
    };
    let took = start.elapsed();
    let text = e.to_string();
    assert!(text.contains("rank(s) 1 of 2"), "{text}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
}

/// Ranks configured to plan differently (here one of them with other slices)
/// are refused as the communicator is made, each naming the peer that plans
/// otherwise and both sides' terms, within the timeout: no slice travels
/// between them to land in the wrong cells.
#[test]
fn ranks_that_plan_other_slices_are_refused_naming_the_peer() {
    let errors = refused_job(
        2,
        |rank, b| {
            if rank == 1 { b.slice_bytes(1 << 20) } else { b }
        },
    );
    for (rank, e) in errors.iter().enumerate() {
        let said = e.to_string();
        let other = 1 - rank;
        assert!(
            matches!(e, Error::Peer { rank: r, .. } if *r as usize == other),
            "rank {rank}: {said}"
        );
        // The default's 25 MiB, halved until 50 MiB holds two buffers.
        assert!(
            said.contains("slices of 1048576 bytes")
                && said.contains("slices of 13107200 bytes")
                && said.contains("FAIRRING_SLICE_SIZE"),
            "rank {rank}: {said}"
        );
    }
}

/// Machines in groups (`FAIRRING_GROUP_SIZE`) where one rank of four plans
/// in one level: every rank is refused as the communicator is made, naming
/// a peer that plans otherwise and the groups. A size that does not split
/// the machines in two levels (two machines) is refused naming the
/// variable.
#[test]
fn ranks_that_plan_other_groups_are_refused_and_sizes_that_split_nothing_named() {
    let errors = refused_job(4, |rank, b| {
        b.grouping(if rank == 3 {
            Grouping::OneLevel
        } else {
            Grouping::AtMost(2)
        })
    });
    for (rank, e) in errors.iter().enumerate() {
        let said = e.to_string();
        assert!(matches!(e, Error::Peer { .. }), "rank {rank}: {said}");
        assert!(
            said.contains("machines in groups of at most 2")
                && said.contains("FAIRRING_GROUP_SIZE"),
            "rank {rank}: {said}"
        );
    }

    let errors = refused_job(2, |_, b| b.grouping(Grouping::AtMost(2)));
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            matches!(e, Error::Config { variable, .. } if *variable == "FAIRRING_GROUP_SIZE"),
            "rank {rank}: {e}"
        );
    }
}

/// Beside a dedicated server, a worker whose machines' own plan
/// (`FAIRRING_MACHINES_SERVE`) differs while the servers' geometry does not
/// (the servers' default minimum shard, 16 KiB, given on rank 1 and left to
/// the defaults elsewhere, where the machines' plan takes a job without
/// servers' 64 KiB): every worker and the server are refused as they are
/// made, naming a peer that plans otherwise and the machines' plan.
#[test]
fn workers_whose_machines_plan_differs_beside_servers_are_refused() {
    let port = fairring_local_job::free_port().expect("a free port");
    let world = 2;
    let run = format!("refused-colocated-{port}");
    let started = Instant::now();
    let errors: Vec<Error> = std::thread::scope(|s| {
        let server = {
            let run = run.clone();
            s.spawn(move || {
                let b = fairring::Config::server_builder(0, world, "127.0.0.1", port)
                    .run_id(run)
                    .timeout(TIMEOUT.unwrap());
                let config = b.servers(1).build().unwrap();
                fairring::Server::new(config)
                    .err()
                    .unwrap_or_else(|| panic!("the server was made"))
            })
        };
        let workers: Vec<_> = (0..world)
            .map(|rank| {
                let run = run.clone();
                s.spawn(move || {
                    let mut b = fairring::Config::builder(rank, world, "127.0.0.1", port)
                        .host_id(format!("machine-{rank}"))
                        .run_id(run)
                        .timeout(TIMEOUT.unwrap())
                        .servers(1);
                    if rank == 1 {
                        b = b.min_shard_bytes(16 << 10);
                    }
                    Communicator::new(b.build().unwrap())
                        .err()
                        .unwrap_or_else(|| panic!("rank {rank} was made"))
                })
            })
            .collect();
        let mut errors: Vec<Error> = workers.into_iter().map(|h| h.join().unwrap()).collect();
        errors.push(server.join().unwrap());
        errors
    });
    assert!(started.elapsed() < TIMEOUT.unwrap());
    for (process, e) in errors.iter().enumerate() {
        let said = e.to_string();
        assert!(matches!(e, Error::Peer { .. }), "process {process}: {said}");
        assert!(
            said.contains("the machines' own plan: slices")
                && said.contains("shards of at least 16384 bytes")
                && said.contains("shards of at least 65536 bytes")
                && said.contains("FAIRRING_MIN_SHARD_SIZE"),
            "process {process}: {said}"
        );
    }
}

/// On the flat plan of 16 machines in the default slices, a rank that
/// forms no groups for its small tensors (`FAIRRING_GROUP_SIZE=off` on rank
/// 3) while its flat plan is the others': every rank is refused as it is
/// made, naming a peer that plans otherwise, the small tensors' groups and
/// `FAIRRING_GROUP_SIZE`.
#[test]
fn a_rank_without_the_small_tensors_groups_is_refused() {
    let world = 16;
    let topology = Topology::new(world, 1, RankLayout::Contiguous).unwrap();
    // A budget of two of the default slices' buffers keeps them whole.
    let whole = fairring::Config::builder(0, world, "127.0.0.1", 1)
        .total_memory(1 << 40)
        .build()
        .unwrap()
        .staging(topology)
        .unwrap();
    assert!(whole.grouped.is_some());
    let errors = refused_job(world, |rank, b| {
        let b = b.total_memory(2 * whole.buffer_bytes);
        if rank == 3 {
            b.grouping(Grouping::OneLevel)
        } else {
            b
        }
    });
    for (rank, e) in errors.iter().enumerate() {
        let said = e.to_string();
        assert!(matches!(e, Error::Peer { .. }), "rank {rank}: {said}");
        assert!(
            said.contains("small tensors: slices") && said.contains("FAIRRING_GROUP_SIZE"),
            "rank {rank}: {said}"
        );
    }
}

/// A rank that serves the job's store (rank 0) and fails to join after the
/// rendezvous (here its budget holds no staging buffer) tells the peers
/// still waiting for its keys why, within the timeout: they fail naming it
/// and its error, not a closed store.
#[test]
fn a_failed_rank_0_tells_its_peers_why() {
    let errors = refused_job(2, |rank, b| {
        if rank == 0 {
            b.slice_bytes(40 << 20).total_memory(50 << 20)
        } else {
            b
        }
    });
    assert!(
        matches!(&errors[0], Error::Config { variable, .. } if *variable == "FAIRRING_TOTAL_MEMORY"),
        "rank 0: {}",
        errors[0]
    );
    assert!(
        matches!(&errors[1], Error::Peer { rank: 0, reason } if reason.contains("FAIRRING_TOTAL_MEMORY")),
        "rank 1: {}",
        errors[1]
    );
}

/// Makes a communicator on every rank of a job of `world` machines of one
/// rank, each configured further by `configure`, and returns each rank's
/// error: every rank must fail, within the timeout.
fn refused_job(
    world: u32,
    configure: impl Fn(u32, ConfigBuilder) -> ConfigBuilder + Sync,
) -> Vec<Error> {
    let port = fairring_local_job::free_port().expect("a free port");
    let started = Instant::now();
    let errors = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let configure = &configure;
                s.spawn(move || {
                    let b = fairring::Config::builder(rank, world, "127.0.0.1", port)
                        .host_id(format!("machine-{rank}"))
                        .run_id(format!("refused-{port}"))
                        .timeout(TIMEOUT.unwrap());
                    Communicator::new(configure(rank, b).build().unwrap())
                        .err()
                        .unwrap_or_else(|| panic!("rank {rank} was made"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(started.elapsed() < TIMEOUT.unwrap());
    errors
}
