//! A local job: this program started as every rank (and dedicated server)
//! of an `M x D` job on this host, and waited for.

use super::*;

/// Starts `m*d` ranks (and `--servers` servers) of this program on this host
/// and waits for them; the first to fail ends the others.
pub(crate) fn launch((m, d): (u32, u32), args: &[String]) -> ExitCode {
    let exe =
        std::env::current_exe().unwrap_or_else(|e| usage(&format!("cannot find myself: {e}")));
    let job = fairring_local_job::LocalJob::new("fairring-bench", m, d)
        .unwrap_or_else(|e| usage(&format!("cannot lay out the job: {e}")))
        .with_servers(parse(args).servers);
    let spawned = job.spawn(|index| {
        let mut command = job.command(&exe, index);
        command.args(args).env(CHILD_VAR, "1");
        command
    });
    let mut ranks = match spawned {
        Ok(ranks) => ranks,
        Err(e) => {
            eprintln!("fairring-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match ranks.wait(None) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fairring-bench: {e}");
            ExitCode::FAILURE
        }
    }
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
