//! A standalone rank of a tcp fabric, for tests across processes and machines.
//!
//! It dials rank 0, reports `admitted` on stdout, then either streams writes into a
//! region of rank 0 (`--stream BYTES`, needs `--target KEY:LEN`) or idles, replying
//! to nothing (`--idle`). It exits with status 1, naming the peer, when rank 0
//! fails, and with status 2 on bad arguments.
//!
//! ```text
//! FAIRRING_JOB_SECRET=<64 hex digits> fairring-fabric-peer --rank 1 --world 2 \
//!     --job 0xfa12 --dial 10.0.0.1:41000 --bind 10.0.0.2:0 --stream 16777216 --target 1:67108864
//! ```

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::ptr::NonNull;
use std::time::Duration;

use fairring_rdma::fabric::{Completion, CompletionEvent, Fabric, RemoteRegion, WriteRequest};
use fairring_rdma::tcp::{BindTo, TcpConfig, TcpFabric};
use fairring_rdma::{FabricError, JobSecret};

struct Args {
    rank: u32,
    world: u32,
    job: u64,
    dial: SocketAddr,
    bind: Option<SocketAddr>,
    stream: Option<usize>,
    target: Option<(u32, u64)>,
    silence: Option<Duration>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        rank: 0,
        world: 0,
        job: 0,
        dial: SocketAddr::from(([127, 0, 0, 1], 0)),
        bind: None,
        stream: None,
        target: None,
        silence: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--idle" {
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--rank" => args.rank = value.parse().map_err(|e| bad(&e))?,
            "--world" => args.world = value.parse().map_err(|e| bad(&e))?,
            "--job" => {
                let digits = value.trim_start_matches("0x");
                args.job = u64::from_str_radix(digits, 16).map_err(|e| bad(&e))?;
            }
            "--dial" => args.dial = value.parse().map_err(|e| bad(&e))?,
            "--bind" => args.bind = Some(value.parse().map_err(|e| bad(&e))?),
            "--stream" => args.stream = Some(value.parse().map_err(|e| bad(&e))?),
            "--silence-ms" => {
                args.silence = Some(Duration::from_millis(value.parse().map_err(|e| bad(&e))?));
            }
            "--target" => {
                let (key, len) = value.split_once(':').ok_or(bad(&"expected KEY:LEN"))?;
                let key = key.parse().map_err(|e| bad(&e))?;
                let len = len.parse().map_err(|e| bad(&e))?;
                args.target = Some((key, len));
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.rank == 0 || args.rank >= args.world {
        return Err("--rank must be in 1..world (this tool dials rank 0)".into());
    }
    if args.stream.is_some() && args.target.is_none() {
        return Err("--stream needs --target KEY:LEN".into());
    }
    Ok(args)
}

fn run(args: &Args) -> Result<(), FabricError> {
    let secret = JobSecret::from_env()?.ok_or(FabricError::Config {
        variable: fairring_rdma::JOB_SECRET_VAR,
        reason: "not set".into(),
    })?;
    let bind = match args.bind {
        Some(address) => BindTo::Address(address),
        None => BindTo::from_env(None)?,
    };
    let mut config = TcpConfig::new(args.rank, args.world, args.job, secret, bind);
    if let Some(silence) = args.silence {
        config = config.with_silence_timeout(silence);
    }
    let fabric = TcpFabric::new(config)?;
    let endpoint = TcpFabric::endpoint_of(args.dial);
    fabric.connect(0, &endpoint)?;
    println!("admitted");
    let _ = std::io::stdout().flush();

    let mut completions = [Completion {
        peer: 0,
        event: CompletionEvent::Sent { token: 0 },
    }; 64];
    let mut source = match args.stream {
        Some(len) => (0..len)
            .map(|i| u8::try_from(i % 251).unwrap_or(0))
            .collect(),
        None => Vec::new(),
    };
    let region = match args.stream {
        // SAFETY: `source` outlives the region (dropped at the end of this
        // function, after the region), and is never written after registration.
        Some(_) => Some(unsafe {
            fabric.register(NonNull::new(source.as_mut_ptr()).unwrap(), source.len())?
        }),
        None => None,
    };
    let mut outstanding = 0;
    let mut token = 0;
    loop {
        if let (Some(region), Some((key, len))) = (&region, args.target) {
            while outstanding < 4 {
                let target = RemoteRegion {
                    key,
                    address: 0,
                    len,
                };
                let request = WriteRequest {
                    source: region,
                    source_offset: 0,
                    len: source.len(),
                    target,
                    target_offset: 0,
                    immediate: 0,
                    token,
                };
                fabric.write(0, request)?;
                token += 1;
                outstanding += 1;
            }
        }
        let n = fabric.wait(&mut completions, Duration::from_millis(100));
        for c in &completions[..n] {
            match c.event {
                CompletionEvent::Sent { .. } => outstanding -= 1,
                CompletionEvent::PeerFailed { failure } => {
                    return Err(FabricError::PeerFailed {
                        peer: c.peer,
                        failure,
                    });
                }
                _ => {}
            }
        }
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("fairring-fabric-peer: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fairring-fabric-peer: {e}");
            ExitCode::from(1)
        }
    }
}
