//! C programs built against `include/fairring.h`, linked with the `cdylib` and
//! with the `staticlib`, each run as a 1x2 job.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The folder holding this crate's `cdylib` and `staticlib`.
///
/// Cargo compiles a library target with all its crate types at once, so the
/// `rlib` this test links comes with the two C libraries, beside the test in
/// `<target>/<profile>/deps`. Where they are not there, they are built by
/// cargo, once per test run, into a target folder of their own (the test's
/// own is locked while it runs).
fn library_dir() -> PathBuf {
    static FOUND: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FOUND
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("the test's own path");
            // <target>/<profile>/deps/c_program-<hash>
            let deps = exe.parent().expect("the test's folder");
            if ["libfairring_ffi.so", "libfairring_ffi.a"]
                .iter()
                .all(|lib| deps.join(lib).exists())
            {
                return deps.to_path_buf();
            }
            let target = exe
                .ancestors()
                .nth(3)
                .expect("a <target>/<profile>/deps folder")
                .join("c-abi");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .args(["build", "-q", "-p", "fairring-ffi", "--lib"])
                .env("CARGO_TARGET_DIR", &target)
                .status()
                .expect("running cargo to build the C libraries");
            assert!(
                status.success(),
                "building fairring-ffi's C libraries failed"
            );
            target.join("debug")
        })
        .clone()
}

/// Where the C programs are written.
fn program_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// The C runtime's libraries a `staticlib` links on Linux: what
/// `rustc --print native-static-libs` lists.
const RUNTIME_LIBRARIES: [&str; 7] = ["gcc_s", "util", "rt", "pthread", "m", "dl", "c"];

/// Linker arguments for the shared libraries a build of the library needs
/// beyond the C runtime's (libibverbs, where it was built with the verbs
/// provider): the `cdylib` of the same build names them (`readelf -d`), and
/// its `staticlib` needs the same. None where `readelf` is missing.
fn libraries_beyond_the_runtime(shared: &Path) -> Vec<String> {
    let Ok(output) = Command::new("readelf").arg("-d").arg(shared).output() else {
        return Vec::new();
    };
    let runtime = |name: &str| {
        name.starts_with("ld-linux")
            || RUNTIME_LIBRARIES
                .iter()
                .any(|lib| name.starts_with(&format!("lib{lib}.")))
    };
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.contains("(NEEDED)"))
        .filter_map(|line| line.split('[').nth(1)?.split(']').next())
        .filter(|name| !runtime(name))
        .map(|name| format!("-l:{name}"))
        .collect()
}

fn compile(linkage: &str, out: &Path) {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let libs = library_dir();
    let mut cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cc.arg(crate_dir.join("tests/c/all_reduce.c"))
        .arg("-std=c11")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg("-o")
        .arg(out);
    match linkage {
        "dynamic" => {
            let lib = libs.join("libfairring_ffi.so");
            assert!(lib.exists(), "{} was not built", lib.display());
            cc.arg(format!("-L{}", libs.display()))
                .arg(format!("-Wl,-rpath,{}", libs.display()))
                .arg("-lfairring_ffi");
        }
        _ => {
            let lib = libs.join("libfairring_ffi.a");
            assert!(lib.exists(), "{} was not built", lib.display());
            // What the build's features add, then the C runtime.
            cc.arg(lib)
                .args(libraries_beyond_the_runtime(
                    &libs.join("libfairring_ffi.so"),
                ))
                .args(RUNTIME_LIBRARIES.map(|lib| format!("-l{lib}")));
        }
    }
    let status = cc
        .status()
        .expect("a C compiler (`cc`, or $CC) to build the C test program");
    assert!(status.success(), "compiling the {linkage} C program failed");
}

fn run_job(program: &Path) {
    let job = fairring_local_job::LocalJob::new("c-program", 1, 2).expect("a local job");
    let mut ranks = job
        .spawn(|rank| {
            let mut c = job.command(program, rank);
            // cargo puts its own deps folder, whose copy of the shared
            // library may be older than the one built above, on the test's
            // library path, ahead of the program's rpath.
            c.env_remove("LD_LIBRARY_PATH");
            c.env("FAIRRING_TIMEOUT", "20s")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        })
        .expect("starting the C program");
    let ended = ranks.wait(Some(Duration::from_secs(60)));
    let mut outputs = Vec::new();
    for rank in 0..2 {
        let child = ranks.child_mut(rank).expect("a rank not killed");
        let text = |pipe: Option<&mut dyn Read>| {
            let mut t = String::new();
            if let Some(p) = pipe {
                let _ = p.read_to_string(&mut t);
            }
            t
        };
        let stdout = text(child.stdout.as_mut().map(|p| p as &mut dyn Read));
        let stderr = text(child.stderr.as_mut().map(|p| p as &mut dyn Read));
        outputs.push((stdout, stderr));
    }
    for (rank, (stdout, stderr)) in outputs.iter().enumerate() {
        assert!(
            ended.is_ok() && stdout.contains(&format!("rank {rank}: ok")),
            "rank {rank} of {}: {ended:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            program.display(),
        );
    }
}
#[test]
fn a_c_program_linked_with_the_shared_library_runs_a_job() {
    let out = program_dir().join("fairring-c-test-dynamic");
    let _ = std::fs::remove_file(&out);
    compile("dynamic", &out);
    run_job(&out);
}

#[test]
fn a_c_program_linked_with_the_static_library_runs_a_job() {
    let out = program_dir().join("fairring-c-test-static");
    let _ = std::fs::remove_file(&out);
    compile("static", &out);
    run_job(&out);
}

/// With `FAIRRING_CUDA` defined, the header declares every device call with
/// the signature the C ABI promises (compiled, not linked: the library
/// exports them when built with its `cuda` feature).
#[test]
fn the_header_declares_the_device_calls_under_fairring_cuda() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .arg(crate_dir.join("tests/c/device_calls.c"))
        .args(["-std=c11", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(crate_dir.join("include"))
        .status()
        .expect("a C compiler (`cc`, or $CC) to check the header");
    assert!(
        status.success(),
        "tests/c/device_calls.c does not compile against the header"
    );
}
