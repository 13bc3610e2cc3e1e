//! Prints the PTX NVRTC makes of the reduction kernels for an architecture
//! (`cargo run -p fairring-cuda --example kernel_ptx -- 9.0`); needs libnvrtc, no
//! device.

use std::process::ExitCode;

fn main() -> ExitCode {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "9.0".to_owned());
    let Some((major, minor)) = arch
        .split_once('.')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
    else {
        eprintln!("the architecture must be MAJOR.MINOR, e.g. 9.0; got {arch:?}");
        return ExitCode::FAILURE;
    };
    match fairring_cuda::kernel::compile((major, minor)) {
        Ok(compiled) => {
            println!("{}", compiled.ptx);
            eprintln!(
                "{}: {} bytes of machine code",
                compiled.arch,
                compiled.cubin.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
