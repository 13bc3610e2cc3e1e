//! Every knob from the environment: values taken, values refused naming the
//! variable, and the derived job secret.

use super::*;
use std::collections::HashMap;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let mut m: HashMap<String, String> = [
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for (k, v) in pairs {
        m.insert(k.to_string(), v.to_string());
    }
    move |k| m.get(k).cloned()
}

fn refused(pairs: &[(&str, &str)], variable: &str) {
    match Config::from_lookup(env(pairs)) {
        Err(Error::Config { variable: v, .. }) => assert_eq!(v, variable, "{pairs:?}"),
        other => panic!("{pairs:?}: expected a config error for {variable}, got {other:?}"),
    }
}

#[test]
fn torchrun_environment() {
    let c = Config::from_lookup(env(&[
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("FAIRRING_TOTAL_MEMORY", "100M"),
        ("FAIRRING_TIMEOUT", "30"),
        ("FAIRRING_ALGO", "ring"),
    ]))
    .unwrap();
    assert_eq!((c.rank, c.world_size), (1, 4));
    assert_eq!(c.local_rank, Some(1));
    assert_eq!(c.total_memory, Some(100 << 20));
    assert_eq!(c.timeout, Duration::from_secs(30));
    assert_eq!(c.algorithm, Algorithm::Ring);
}

#[test]
fn sending_from_tensors_starts_at_a_size_or_never() {
    let from = |pairs: &[(&str, &str)]| Config::from_lookup(env(pairs)).unwrap().direct_from;
    assert_eq!(from(&[]), Some(DEFAULT_DIRECT_FROM));
    assert_eq!(from(&[("FAIRRING_DIRECT_FROM", "1M")]), Some(1 << 20));
    assert_eq!(from(&[("FAIRRING_DIRECT_FROM", "0")]), Some(0));
    assert_eq!(from(&[("FAIRRING_DIRECT_FROM", " never ")]), None);
}

#[test]
fn the_tcp_receive_buffer_is_a_size_or_the_kernels_autotuning() {
    let asked =
        |pairs: &[(&str, &str)]| Config::from_lookup(env(pairs)).unwrap().tcp_receive_buffer;
    assert_eq!(asked(&[]), DEFAULT_TCP_RECEIVE_BUFFER);
    assert_eq!(asked(&[("FAIRRING_TCP_RECEIVE_BUFFER", "1M")]), 1 << 20);
    assert_eq!(asked(&[("FAIRRING_TCP_RECEIVE_BUFFER", "0")]), 0);
    refused(
        &[("FAIRRING_TCP_RECEIVE_BUFFER", "2G")],
        "FAIRRING_TCP_RECEIVE_BUFFER",
    );
    refused(
        &[("FAIRRING_TCP_RECEIVE_BUFFER", "lots")],
        "FAIRRING_TCP_RECEIVE_BUFFER",
    );
}

#[test]
fn the_wire_format_is_named_and_refused_with_dedicated_servers() {
    assert_eq!(
        Config::from_lookup(env(&[])).unwrap().wire(),
        WireFormat::Exact
    );
    let c = Config::from_lookup(env(&[("FAIRRING_WIRE", "bf16")])).unwrap();
    assert_eq!(c.wire(), WireFormat::Bf16);
    let c = Config::from_lookup(env(&[("FAIRRING_WIRE", " f16 ")])).unwrap();
    assert_eq!(c.wire(), WireFormat::F16);
    refused(&[("FAIRRING_WIRE", "fp8")], "FAIRRING_WIRE");
    // Dedicated servers reduce a compressed wire too.
    let c =
        Config::from_lookup(env(&[("FAIRRING_WIRE", "bf16"), ("FAIRRING_SERVERS", "1")])).unwrap();
    assert_eq!((c.wire(), c.servers()), (WireFormat::Bf16, 1));
}

/// The minimum shard is 64 KiB by default, 16 KiB with dedicated servers
/// (workers and servers alike), and what `FAIRRING_MIN_SHARD_SIZE` says when
/// it is given, with servers or without; the staging's geometry takes it.
#[test]
fn the_default_minimum_shard_is_smaller_with_dedicated_servers() {
    use fairring_core::plan::PlanConfig;
    let min_shard =
        |pairs: &[(&str, &str)]| Config::from_lookup(env(pairs)).unwrap().min_shard_bytes();
    assert_eq!(min_shard(&[]), PlanConfig::DEFAULT_MIN_SHARD_BYTES);
    assert_eq!(min_shard(&[("FAIRRING_SERVERS", "2")]), 16 << 10);
    let server = Config::from_lookup(|k| {
        env(&[
            ("FAIRRING_SERVERS", "2"),
            ("FAIRRING_ROLE", "server"),
            ("FAIRRING_SERVER_RANK", "0"),
        ])(k)
        .filter(|_| k != "RANK")
    })
    .unwrap();
    assert_eq!(server.min_shard_bytes(), 16 << 10);
    assert_eq!(min_shard(&[("FAIRRING_MIN_SHARD_SIZE", "128K")]), 128 << 10);
    assert_eq!(
        min_shard(&[
            ("FAIRRING_MIN_SHARD_SIZE", "64K"),
            ("FAIRRING_SERVERS", "2")
        ]),
        64 << 10
    );
    let topology = fairring_core::topology::Topology::new(
        2,
        2,
        fairring_core::topology::RankLayout::Contiguous,
    )
    .unwrap();
    let with_servers = Config::from_lookup(env(&[("FAIRRING_SERVERS", "2")])).unwrap();
    assert_eq!(
        with_servers
            .staging(topology)
            .unwrap()
            .geometry
            .min_shard_bytes(),
        16 << 10
    );
    let without = Config::from_lookup(env(&[])).unwrap();
    assert_eq!(
        without
            .staging(topology)
            .unwrap()
            .geometry
            .min_shard_bytes(),
        64 << 10
    );
}

#[test]
fn servers_and_their_roles() {
    let worker = Config::from_lookup(env(&[("FAIRRING_SERVERS", "2")])).unwrap();
    assert_eq!((worker.role, worker.servers), (Role::Worker, 2));
    assert_eq!((worker.process(), worker.processes()), (1, 6));
    // A server needs no RANK; it is WORLD_SIZE + its index on the fabric.
    let server = Config::from_lookup(|k| {
        env(&[
            ("FAIRRING_SERVERS", "2"),
            ("FAIRRING_ROLE", "server"),
            ("FAIRRING_SERVER_RANK", "1"),
        ])(k)
        .filter(|_| k != "RANK")
    })
    .unwrap();
    assert_eq!(server.role, Role::Server(1));
    assert_eq!((server.process(), server.processes()), (5, 6));
    refused(&[("FAIRRING_ROLE", "server")], "FAIRRING_SERVER_RANK");
    refused(
        &[("FAIRRING_ROLE", "server"), ("FAIRRING_SERVER_RANK", "0")],
        "FAIRRING_SERVER_RANK",
    );
    refused(
        &[
            ("FAIRRING_ROLE", "server"),
            ("FAIRRING_SERVER_RANK", "2"),
            ("FAIRRING_SERVERS", "2"),
        ],
        "FAIRRING_SERVER_RANK",
    );
    refused(&[("FAIRRING_ROLE", "reducer")], "FAIRRING_ROLE");
    refused(&[("FAIRRING_SERVERS", "x")], "FAIRRING_SERVERS");
    refused(&[("FAIRRING_SERVERS", "5000")], "FAIRRING_SERVERS");
}

#[test]
fn groups_are_named_with_or_without_dedicated_servers() {
    let grouping = |pairs: &[(&str, &str)]| Config::from_lookup(env(pairs)).unwrap().grouping;
    assert_eq!(grouping(&[]), Grouping::Auto);
    assert_eq!(
        grouping(&[("FAIRRING_GROUP_SIZE", " 16 ")]),
        Grouping::AtMost(16)
    );
    assert_eq!(grouping(&[("FAIRRING_GROUP_SIZE", "auto")]), Grouping::Auto);
    assert_eq!(
        grouping(&[("FAIRRING_GROUP_SIZE", "off")]),
        Grouping::OneLevel
    );
    // One level, or the default, with servers: they serve flat.
    assert_eq!(
        grouping(&[("FAIRRING_GROUP_SIZE", "off"), ("FAIRRING_SERVERS", "2")]),
        Grouping::OneLevel
    );
    refused(&[("FAIRRING_GROUP_SIZE", "sixteen")], "FAIRRING_GROUP_SIZE");
    refused(&[("FAIRRING_GROUP_SIZE", "1")], "FAIRRING_GROUP_SIZE");
    // With servers, a size groups the servers.
    assert_eq!(
        grouping(&[("FAIRRING_GROUP_SIZE", "4"), ("FAIRRING_SERVERS", "8")]),
        Grouping::AtMost(4)
    );
    // A subgroup's machines are not the job's: it reduces in one level.
    let job = env(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("FAIRRING_GROUP_SIZE", "2"),
    ]);
    assert_eq!(
        Config::for_group(2, 4, None, &job).unwrap().grouping,
        Grouping::AtMost(2)
    );
    assert_eq!(
        Config::for_group(1, 2, None, &job).unwrap().grouping,
        Grouping::Auto
    );
    let off = env(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("FAIRRING_GROUP_SIZE", "off"),
    ]);
    assert_eq!(
        Config::for_group(1, 2, None, &off).unwrap().grouping,
        Grouping::OneLevel
    );
}

#[test]
fn torchruns_agent_store_and_its_attempt() {
    assert_eq!(Config::from_lookup(env(&[])).unwrap().agent_store, None);
    let off = env(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]);
    assert_eq!(Config::from_lookup(off).unwrap().agent_store, None);
    let on = env(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]);
    assert_eq!(Config::from_lookup(on).unwrap().agent_store, Some(0));
    let restarted = env(&[
        ("TORCHELASTIC_USE_AGENT_STORE", "true"),
        ("TORCHELASTIC_RESTART_COUNT", "3"),
    ]);
    assert_eq!(Config::from_lookup(restarted).unwrap().agent_store, Some(3));
    refused(
        &[("TORCHELASTIC_USE_AGENT_STORE", "yes please")],
        "TORCHELASTIC_USE_AGENT_STORE",
    );
    refused(
        &[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "-1"),
        ],
        "TORCHELASTIC_RESTART_COUNT",
    );
}

#[test]
fn every_knob_refuses_bad_values() {
    for var in [
        "FAIRRING_TOTAL_MEMORY",
        "FAIRRING_SLICE_SIZE",
        "FAIRRING_MIN_SHARD_SIZE",
        "FAIRRING_DIRECT_FROM",
        "FAIRRING_TIMEOUT",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ] {
        for bad in ["abc", "-1", "4294967296000000000000"] {
            refused(&[(var, bad)], var);
        }
    }
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
        refused(&[(var, "4294967296")], var);
    }
    refused(&[("FAIRRING_ALGO", "tree")], "FAIRRING_ALGO");
    refused(&[("FAIRRING_JOB_SECRET", "1234")], "FAIRRING_JOB_SECRET");
    refused(&[("RANK", "4")], "RANK");
    refused(&[("RANK", "abc")], "RANK");
    refused(&[("WORLD_SIZE", "0")], "WORLD_SIZE");
    refused(&[("MASTER_PORT", "70000")], "MASTER_PORT");
    refused(&[("LOCAL_WORLD_SIZE", "3")], "LOCAL_WORLD_SIZE");
    refused(
        &[("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "2")],
        "LOCAL_RANK",
    );
    refused(&[("FAIRRING_TOTAL_MEMORY", "1K")], "FAIRRING_TOTAL_MEMORY");
    refused(&[("FAIRRING_SLICE_SIZE", "2G")], "FAIRRING_SLICE_SIZE");
    refused(&[("FAIRRING_TIMEOUT", "0")], "FAIRRING_TIMEOUT");
    refused(&[("FAIRRING_SOCKET_IFNAME", " ")], "FAIRRING_SOCKET_IFNAME");
    refused(&[("FAIRRING_FABRIC", "udp")], "FAIRRING_FABRIC");
    refused(&[("FAIRRING_VERBS_DEVICE", " ")], "FAIRRING_VERBS_DEVICE");
    for bad in ["0", "256", "x"] {
        refused(&[("FAIRRING_VERBS_PORT", bad)], "FAIRRING_VERBS_PORT");
    }
    refused(
        &[("FAIRRING_VERBS_GID_INDEX", "300")],
        "FAIRRING_VERBS_GID_INDEX",
    );
}

#[test]
fn the_device_local_step_is_chosen_by_name() {
    assert_eq!(
        Config::from_lookup(env(&[])).unwrap().device_local(),
        DeviceLocal::Auto
    );
    let c = Config::from_lookup(env(&[("FAIRRING_DEVICE_LOCAL", "host")])).unwrap();
    assert_eq!(c.device_local(), DeviceLocal::Host);
    refused(
        &[("FAIRRING_DEVICE_LOCAL", "gloo")],
        "FAIRRING_DEVICE_LOCAL",
    );
}

#[test]
fn nccl_across_machines_is_chosen_by_name() {
    assert_eq!(
        Config::from_lookup(env(&[]))
            .unwrap()
            .nccl_across_machines(),
        NcclAcrossMachines::Auto
    );
    let c = Config::from_lookup(env(&[("FAIRRING_NCCL_ACROSS_MACHINES", "off")])).unwrap();
    assert_eq!(c.nccl_across_machines(), NcclAcrossMachines::Off);
    refused(
        &[("FAIRRING_NCCL_ACROSS_MACHINES", "always")],
        "FAIRRING_NCCL_ACROSS_MACHINES",
    );
}

#[test]
fn machines_serving_beside_servers_is_chosen_by_name() {
    assert_eq!(
        Config::from_lookup(env(&[])).unwrap().machines_serve(),
        MachinesServe::Auto
    );
    let c = Config::from_lookup(env(&[("FAIRRING_MACHINES_SERVE", "on")])).unwrap();
    assert_eq!(c.machines_serve(), MachinesServe::On);
    refused(
        &[("FAIRRING_MACHINES_SERVE", "servers")],
        "FAIRRING_MACHINES_SERVE",
    );
}

#[test]
fn fabric_choice_and_verbs_knobs() {
    let c = Config::from_lookup(env(&[
        ("FAIRRING_FABRIC", "TCP"),
        ("FAIRRING_VERBS_DEVICE", "mlx5_1"),
        ("FAIRRING_VERBS_PORT", "2"),
        ("FAIRRING_VERBS_GID_INDEX", "3"),
    ]))
    .unwrap();
    assert_eq!(c.fabric(), FabricChoice::Tcp);
    assert_eq!(c.verbs.device.as_deref(), Some("mlx5_1"));
    assert_eq!((c.verbs.port, c.verbs.gid_index), (2, 3));
    assert_eq!(
        Config::from_lookup(env(&[])).unwrap().fabric(),
        FabricChoice::Auto
    );
    let verbs = Config::from_lookup(env(&[("FAIRRING_FABRIC", "verbs")]));
    if cfg!(feature = "verbs") {
        assert_eq!(verbs.unwrap().fabric(), FabricChoice::Verbs);
    } else {
        let e = verbs.unwrap_err().to_string();
        assert!(
            e.contains("FAIRRING_FABRIC") && e.contains("`verbs` feature"),
            "{e}"
        );
    }
}

#[test]
fn missing_variables_are_named() {
    let lookup = |k: &str| (k == "RANK").then(|| "0".to_string());
    match Config::from_lookup(lookup) {
        Err(Error::Config { variable, .. }) => assert_eq!(variable, "WORLD_SIZE"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_same_job_gets_the_same_tag() {
    let a = Config::from_lookup(env(&[])).unwrap();
    let b = Config::from_lookup(env(&[("RANK", "3")])).unwrap();
    let c = Config::from_lookup(env(&[("MASTER_PORT", "29501")])).unwrap();
    assert_eq!(a.job_tag, b.job_tag);
    assert_ne!(a.job_tag, c.job_tag);
}

#[test]
fn a_subgroup_does_not_read_the_jobs_local_layout_or_servers() {
    let job = env(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("FAIRRING_SERVERS", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ]);
    // The job's own group: its variables are checked as from_env checks them.
    let own = Config::for_group(2, 4, None, &job).unwrap();
    assert_eq!(own.local_world_size, Some(4));
    assert_eq!(own.local_rank, Some(0));
    assert_eq!(own.servers, 1);
    // A subgroup of two: LOCAL_WORLD_SIZE=4 would not divide it, and the
    // job's servers do not serve it.
    let sub = Config::for_group(1, 2, None, &job).unwrap();
    assert_eq!(sub.local_world_size, None);
    assert_eq!(sub.local_rank, None);
    assert_eq!(sub.servers, 0);
    assert_eq!(sub.world_size, 2);
}

#[test]
fn the_gpu_readied_at_creation_is_named_by_ordinal_or_local_rank() {
    assert_eq!(Config::from_lookup(env(&[])).unwrap().device(), None);
    let c = Config::from_lookup(env(&[("FAIRRING_DEVICE", "3")])).unwrap();
    assert_eq!(c.device(), Some(3));
    let c = Config::from_lookup(env(&[("FAIRRING_DEVICE", "local"), ("LOCAL_RANK", "2")])).unwrap();
    assert_eq!(c.device(), Some(2));
    refused(&[("FAIRRING_DEVICE", "local")], "FAIRRING_DEVICE");
    refused(&[("FAIRRING_DEVICE", "gpu0")], "FAIRRING_DEVICE");
    // A subgroup's configuration names the process's GPU by the process's
    // local rank, though its own local rank is not the job's.
    let job = env(&[("FAIRRING_DEVICE", "local"), ("LOCAL_RANK", "1")]);
    let sub = Config::for_group(0, 2, None, &job).unwrap();
    assert_eq!((sub.local_rank, sub.device()), (None, Some(1)));
    assert_eq!(
        Config::builder(0, 1, "127.0.0.1", 29500)
            .device(5)
            .build()
            .unwrap()
            .device(),
        Some(5)
    );
}
