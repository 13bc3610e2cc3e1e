//! A dedicated reduction server of a fairring job (Herring's design).
//!
//! Start `K` of them beside the workers, every process with `FAIRRING_SERVERS=K`,
//! the job's `WORLD_SIZE` (workers), `MASTER_ADDR` and `MASTER_PORT`, and here
//! `FAIRRING_SERVER_RANK=i` (`FAIRRING_ROLE=server` is implied):
//!
//! ```text
//! FAIRRING_SERVERS=2 FAIRRING_SERVER_RANK=0 WORLD_SIZE=16 MASTER_ADDR=node0 \
//!     MASTER_PORT=29500 fairring-server
//! ```
//!
//! It prints `SERVING rank R` once it has joined, serves until every worker of
//! its rail group has left, prints `DONE sent S received R bytes` (the data bytes it moved) and
//! exits 0; if the job fails it prints `FAILED message` and exits 3; if it
//! cannot join, `INIT-FAILED message` and exits 2.

use std::io::Write;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() {
    let config = fairring::Config::from_lookup(|name| match name {
        "FAIRRING_ROLE" => Some("server".to_owned()),
        _ => std::env::var(name).ok(),
    });
    let server = match config.and_then(fairring::Server::new) {
        Ok(s) => s,
        Err(e) => {
            say(&format!("INIT-FAILED {e}"));
            std::process::exit(2);
        }
    };
    say(&format!("SERVING rank {}", server.rank()));
    match server.run() {
        Ok(t) => say(&format!(
            "DONE sent {} received {} bytes",
            t.sent_bytes, t.received_bytes
        )),
        Err(e) => {
            say(&format!("FAILED {e}"));
            std::process::exit(3);
        }
    }
}
