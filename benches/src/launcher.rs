//! A local job: this program started as every rank (and dedicated server)
//! of an `M x D` job on this host, and waited for.

use super::*;

/// Starts `m*d` ranks of this program on this host and waits for them.
pub(crate) fn launch((m, d): (u32, u32), args: &[String]) -> ExitCode {
    let exe =
        std::env::current_exe().unwrap_or_else(|e| usage(&format!("cannot find myself: {e}")));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| usage(&format!("no free port: {e}")));
    let mut secret = [0u8; 32];
    if let Err(e) = getrandom::fill(&mut secret) {
        usage(&format!("no random source: {e}"));
    }
    let secret: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let world = m * d;
    let servers = parse(args).servers;
    let mut children: Vec<(u32, Child)> = Vec::new();
    for rank in 0..world + servers {
        let mut command = Command::new(&exe);
        if rank >= world {
            command
                .env("FAIRRING_ROLE", "server")
                .env("FAIRRING_SERVER_RANK", (rank - world).to_string());
        }
        let spawned = command
            .args(args)
            .env(CHILD_VAR, "1")
            .env("FAIRRING_SERVERS", servers.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", (rank % d).to_string())
            .env("LOCAL_WORLD_SIZE", d.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(
                "FAIRRING_HOST_ID",
                format!("fairring-bench-machine-{}", rank / d),
            )
            .env("FAIRRING_JOB_SECRET", &secret)
            .spawn();
        match spawned {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                eprintln!("fairring-bench: starting rank {rank}: {e}");
                kill_all(&mut children);
                return ExitCode::FAILURE;
            }
        }
    }
    let mut result = ExitCode::SUCCESS;
    let mut pending: Vec<(u32, Child)> = children;
    while !pending.is_empty() {
        let mut still = Vec::new();
        for (rank, mut c) in pending {
            match c.try_wait() {
                Ok(Some(status)) if status.success() => {}
                Ok(Some(status)) => {
                    eprintln!("fairring-bench: rank {rank} failed ({status})");
                    result = ExitCode::FAILURE;
                }
                Ok(None) => still.push((rank, c)),
                Err(e) => {
                    eprintln!("fairring-bench: waiting for rank {rank}: {e}");
                    result = ExitCode::FAILURE;
                }
            }
        }
        pending = still;
        if result != ExitCode::SUCCESS {
            // The other ranks would only wait for the failed one until their timeout.
            kill_all(&mut pending);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    result
}

pub(crate) fn kill_all(children: &mut Vec<(u32, Child)>) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    children.clear();
}

/// A dedicated server of a local job: serves, then prints its bytes.
pub(crate) fn server() -> ExitCode {
    let served = fairring::Server::from_env().and_then(|s| {
        let index = s.index();
        s.run().map(|t| (index, t))
    });
    match served {
        Ok((index, t)) => {
            eprintln!(
                "# fairring-bench: server {index} sent {} and received {} data bytes in all",
                t.sent_bytes, t.received_bytes
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fairring-bench: server: {e}");
            ExitCode::FAILURE
        }
    }
}
