//! `ci/gpu-check`, the GPU kit's one prepared run, against a stand-in kit
//! whose test executables pass, hang or outlive the run: it kills a hung
//! test's process group (the ranks it started too), keeps to its deadline,
//! records what it had no time for, and prints its summary table, also when
//! it is stopped from outside.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A stand-in test executable: lists `tests`; runs `passes` (exits 0),
/// `hangs` (starts a child that would outlive it, writing the child's pid
/// into `marks`, then sleeps) or `slow` (sleeps).
fn stand_in(kit: &Path, name: &str, tests: &[&str], marks: &Path) {
    let listed: String = tests
        .iter()
        .map(|t| format!("echo '{t}: test'\n"))
        .collect();
    let script = format!(
        "#!/usr/bin/env bash\n\
         if [[ $1 == --list ]]; then\n{listed}exit 0\nfi\n\
         case $1 in\n\
         passes) exit 0 ;;\n\
         hangs) sleep 300 & echo $! > '{marks}/{name}-child.pid'; sleep 300 ;;\n\
         slow) sleep 300 ;;\n\
         esac\n",
        marks = marks.display()
    );
    let path = kit.join(name);
    std::fs::write(&path, script).unwrap();
    Command::new("chmod").arg("+x").arg(&path).status().unwrap();
}

fn gpu_check() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ci/gpu-check")
}

/// A kit of stand-ins, its marks folder and its output folder.
fn kit(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let root = std::env::temp_dir().join(format!("gpu-check-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (kit, marks, out) = (root.join("kit"), root.join("marks"), root.join("out"));
    for d in [&kit, &marks, &out] {
        std::fs::create_dir_all(d).unwrap();
    }
    stand_in(&kit, "ffi-device-tests", &["passes", "hangs"], &marks);
    stand_in(&kit, "fairring-cuda-gpu-tests", &["slow"], &marks);
    (kit, marks, out)
}

/// Whether process `pid` still runs (a zombie, dead and waiting for its
/// new parent to reap it, does not).
fn alive(pid: &str) -> bool {
    let stat = std::fs::read_to_string(Path::new("/proc").join(pid.trim()).join("stat"));
    stat.is_ok_and(|s| {
        // The state follows the command name, which is in parentheses.
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

#[test]
fn a_hung_test_is_killed_with_its_group_and_the_run_keeps_its_deadline() {
    let (kit, marks, out) = kit("deadline");
    let began = Instant::now();
    let run = Command::new("bash")
        .arg(gpu_check())
        .arg(&kit)
        .env("DEADLINE", "8")
        .env("OUT", &out)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let took = began.elapsed();
    let text = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(1), "{text}");
    assert!(took < Duration::from_secs(20), "took {took:?}: {text}");
    assert!(
        text.contains("| 1 | ffi-device-tests::passes | passed |"),
        "{text}"
    );
    assert!(
        text.contains("| 1 | ffi-device-tests::hangs | timed out"),
        "{text}"
    );
    assert!(text.contains("skipped (no time left)"), "{text}");
    let saved = std::fs::read_to_string(out.join("gpu-check-summary.md")).unwrap();
    assert!(
        saved.contains("ffi-device-tests::hangs | timed out"),
        "{saved}"
    );
    let child = std::fs::read_to_string(marks.join("ffi-device-tests-child.pid")).unwrap();
    assert!(
        !alive(&child),
        "the hung test's child {child} outlived its group"
    );
}

#[test]
fn a_run_stopped_from_outside_kills_what_runs_and_still_prints_its_summary() {
    let (kit, marks, out) = kit("stopped");
    let mut run = Command::new("bash")
        .arg(gpu_check())
        .arg(&kit)
        .env("DEADLINE", "120")
        .env("OUT", &out)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the hung test has started its child, stop the run.
    let pid_file = marks.join("ffi-device-tests-child.pid");
    let began = Instant::now();
    while !pid_file.exists() && began.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let child = std::fs::read_to_string(&pid_file).unwrap();
    Command::new("kill")
        .arg("-TERM")
        .arg(run.id().to_string())
        .status()
        .unwrap();
    let status = run.wait().unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut run.stdout.take().unwrap(), &mut text).unwrap();
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(text.contains("cut short (signal)"), "{text}");
    assert!(text.contains("ffi-device-tests::passes | passed"), "{text}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !alive(&child),
        "the running test's child {child} outlived the run"
    );
}
