//! `fairring-bench --collective`: each collective times and checks itself on a
//! local job, and the JSON names it with nccl-tests' bus factor applied; a
//! broadcast, an all-gather and a reduce-scatter take each algorithm.

use std::process::Command;

fn bench(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fairring-bench"))
        .args(args)
        .output()
        .expect("running fairring-bench");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// The rows of the bench's `--json` file.
fn json_rows(path: &std::path::Path) -> Vec<serde_json::Value> {
    let rows: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).expect("the JSON")).expect("JSON");
    rows.as_array().expect("an array of rows").clone()
}

#[test]
fn every_collective_runs_checked_on_a_local_job() {
    let dir =
        std::env::temp_dir().join(format!("fairring-bench-collectives-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    // nccl-tests' bus factors for two ranks: 2(n-1)/n, 1, (n-1)/n, (n-1)/n,
    // for the rooted collectives 1, (n-1)/n, (n-1)/n, for a ping-pong 1 and
    // for an all-to-all (n-1)/n.
    for (collective, factor) in [
        ("all_reduce", 1.0),
        ("broadcast", 1.0),
        ("all_gather", 0.5),
        ("reduce_scatter", 0.5),
        ("reduce", 1.0),
        ("gather", 0.5),
        ("scatter", 0.5),
        ("send_recv", 1.0),
        ("all_to_all", 0.5),
    ] {
        let json = dir.join(format!("{collective}.json"));
        let json_arg = json.to_string_lossy().into_owned();
        let (ok, text) = bench(&[
            "--local",
            "1x2",
            "--collective",
            collective,
            "--min-bytes",
            "4K",
            "--max-bytes",
            "256K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--parallel",
            "2",
            "--json",
            &json_arg,
        ]);
        assert!(ok, "{collective}:\n{text}");
        assert!(
            text.contains(&format!("# fairring-bench {collective}:")),
            "{text}"
        );
        let rows = json_rows(&json);
        assert_eq!(rows.len(), 4, "{collective}: 4K, 16K, 64K, 256K");
        for row in rows {
            assert_eq!(row["collective"], collective);
            assert_eq!(row["wrong"], 0, "{collective}: {row}");
            let (alg, bus) = (
                row["algbw_gbps"].as_f64().unwrap(),
                row["busbw_gbps"].as_f64().unwrap(),
            );
            assert!(
                (bus - alg * factor).abs() <= 1e-9 * alg.max(1.0),
                "{collective}: {row}"
            );
        }
    }
    // A reduce-scatter takes each algorithm: the ring sends half the bytes of
    // the all-reduce hierarchical runs, and both are checked. With two devices
    // per machine each rank's slot (half the input) crosses between machines:
    // half of it around the ring, all of it twice in the all-reduce.
    for (layout, ring, hierarchical) in [("2x1", 1 << 19, 1 << 20), ("2x2", 1 << 18, 1 << 19)] {
        let json = dir.join(format!("reduce_scatter_algorithms_{layout}.json"));
        let json_arg = json.to_string_lossy().into_owned();
        let (ok, text) = bench(&[
            "--local",
            layout,
            "--collective",
            "reduce_scatter",
            "--algo",
            "all",
            "--min-bytes",
            "1M",
            "--max-bytes",
            "1M",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            &json_arg,
        ]);
        assert!(ok, "reduce_scatter --algo all on {layout}:\n{text}");
        let rows = json_rows(&json);
        let sent = |algo: &str| {
            let row = rows
                .iter()
                .find(|r| r["algo"] == algo)
                .unwrap_or_else(|| panic!("no {algo} row on {layout}:\n{text}"));
            assert_eq!(row["wrong"], 0, "{row}");
            row["sent_bytes_per_op"].as_f64().expect("bytes sent")
        };
        assert_eq!(sent("ring"), f64::from(ring), "{layout}:\n{text}");
        assert_eq!(
            sent("hierarchical"),
            f64::from(hierarchical),
            "{layout}:\n{text}"
        );
    }
    // Relayed and summed, side by side and checked.
    for collective in ["broadcast", "all_gather"] {
        let (ok, text) = bench(&[
            "--local",
            "2x1",
            "--collective",
            collective,
            "--algo",
            "all",
            "--max-bytes",
            "256K",
            "--iters",
            "2",
            "--warmup",
            "1",
        ]);
        assert!(ok, "{collective}:\n{text}");
        for algo in [" hierarchical ", " ring ", " auto "] {
            assert!(text.contains(algo), "{collective}: no{algo}row:\n{text}");
        }
    }
    // A ping-pong between machines: each message crosses the fabric once
    // each way, and the message's bytes are counted.
    let json = dir.join("send_recv_2x1.json");
    let json_arg = json.to_string_lossy().into_owned();
    let (ok, text) = bench(&[
        "--local",
        "2x1",
        "--collective",
        "send_recv",
        "--min-bytes",
        "64K",
        "--max-bytes",
        "1M",
        "--factor",
        "16",
        "--iters",
        "4",
        "--json",
        &json_arg,
    ]);
    assert!(ok, "send_recv on 2x1:\n{text}");
    let rows = json_rows(&json);
    assert_eq!(rows.len(), 2, "64K and 1M");
    for row in rows {
        assert_eq!(row["wrong"], 0, "{row}");
        assert_eq!(row["sent_bytes_per_op"], row["bytes"], "{row}");
    }
    let (ok, text) = bench(&["--local", "1x2", "--collective", "all_to_none"]);
    assert!(!ok && text.contains("--collective: expected"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_compressed_wire_is_checked_and_sends_half_the_bytes() {
    let dir = std::env::temp_dir().join(format!("fairring-bench-wire-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let mut sent = Vec::new();
    for wire in ["exact", "bf16", "f16"] {
        let json = dir.join(format!("{wire}.json"));
        let json_arg = json.to_string_lossy().into_owned();
        let (ok, text) = bench(&[
            "--local",
            "2x1",
            "--wire",
            wire,
            "--min-bytes",
            "1M",
            "--max-bytes",
            "1M",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--json",
            &json_arg,
        ]);
        assert!(ok, "{wire}:\n{text}");
        let row = &json_rows(&json)[0];
        assert_eq!(row["wire"], wire, "{row}");
        assert_eq!(row["wrong"], 0, "{wire}: {row}");
        sent.push(row["sent_bytes_per_op"].as_u64().expect("sent bytes"));
    }
    assert_eq!(sent[1] * 2, sent[0], "bf16 against exact: {sent:?}");
    assert_eq!(sent[2] * 2, sent[0], "f16 against exact: {sent:?}");
    let (ok, text) = bench(&["--local", "2x1", "--wire", "bf16", "--dtype", "i32"]);
    assert!(
        !ok && text.contains("--wire bf16 carries f32 values only"),
        "{text}"
    );
}

/// `--op avg` is checked exactly: the inputs average to whole numbers, so every
/// algorithm's result is compared bit for bit (3 ranks: the division rounds
/// unless the check's inputs are chosen for it).
#[test]
fn averages_are_checked_for_every_algorithm() {
    let dir = std::env::temp_dir().join(format!("fairring-bench-avg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let json = dir.join("avg.json");
    let json_arg = json.to_string_lossy().into_owned();
    let (ok, text) = bench(&[
        "--local",
        "3x1",
        "--algo",
        "all",
        "--op",
        "avg",
        "--check",
        "--min-bytes",
        "4K",
        "--max-bytes",
        "64K",
        "--factor",
        "16",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
        &json_arg,
    ]);
    assert!(ok, "{text}");
    let rows = json_rows(&json);
    assert_eq!(rows.len(), 2 * 4, "4 KiB and 64 KiB, four algorithms");
    for row in rows {
        assert_eq!(row["wrong"], 0, "{row}");
    }
}

#[test]
fn calls_are_timed_after_a_barrier_or_back_to_back_and_count_only_their_own_bytes() {
    let dir = std::env::temp_dir().join(format!("fairring-bench-barrier-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    for (flag, header) in [
        ("--barrier", "a barrier before each timed call"),
        ("--no-barrier", "calls timed back to back"),
    ] {
        let json = dir.join(format!("{flag}.json"));
        let json_arg = json.to_string_lossy().into_owned();
        // Two machines of one rank: every byte crosses the fabric and is
        // counted, the barriers' too; recursive doubling sends the whole
        // tensor once per call. (Sends count when posted; landings when
        // taken, which may fall in a later call, so the received column is
        // not exact.)
        let (ok, text) = bench(&[
            "--local",
            "2x1",
            "--algo",
            "doubling",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "64K",
            "--factor",
            "16",
            "--iters",
            "24",
            flag,
            "--json",
            &json_arg,
        ]);
        assert!(ok, "{flag}:\n{text}");
        assert!(
            text.contains(header),
            "{flag}: the header names how calls are timed:\n{text}"
        );
        let rows = json_rows(&json);
        assert_eq!(rows.len(), 2, "{flag}: 4K and 64K");
        for row in rows {
            assert_eq!(row["wrong"], 0, "{flag}: {row}");
            assert_eq!(row["sent_bytes_per_op"], row["bytes"], "{flag}: {row}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
