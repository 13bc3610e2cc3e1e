//! Prints how fairring cuts a tensor for a job: the geometry, the staging buffer,
//! and the slices, with each slice's servers and the cells of one device.
//!
//! ```text
//! cargo run -p fairring-core --example plan -- --machines 16 --devices 8 --mib 100
//! ```
//!
//! Options (all optional): `--machines M` (8), `--devices D` (8), `--dtype T` (f32),
//! `--elements N` or `--mib S` (100 MiB worth), `--slice-bytes B` (25 MiB),
//! `--min-shard-bytes B` (64 KiB), `--budget-bytes B` (50 MiB), `--device d` (0),
//! `--layout contiguous|interleaved`, `--slices K` (how many slices to list, 4).

use fairring_core::DataType;
use fairring_core::plan::{Geometry, Plan, PlanConfig, Routing};
use fairring_core::topology::{Location, RankLayout, Topology};
use std::process::ExitCode;

struct Args {
    machines: u32,
    devices: u32,
    dtype: DataType,
    elements: Option<u64>,
    mib: u64,
    slice_bytes: u64,
    min_shard_bytes: u64,
    budget_bytes: u64,
    device: u32,
    layout: RankLayout,
    slices: u64,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        machines: 8,
        devices: 8,
        dtype: DataType::F32,
        elements: None,
        mib: 100,
        slice_bytes: PlanConfig::DEFAULT_SLICE_BYTES,
        min_shard_bytes: PlanConfig::DEFAULT_MIN_SHARD_BYTES,
        budget_bytes: 50 << 20,
        device: 0,
        layout: RankLayout::Contiguous,
        slices: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: '{value}' is not a non-negative integer"))
        };
        let small = || {
            number().and_then(|n| {
                u32::try_from(n).map_err(|_| format!("{flag}: {n} does not fit in 32 bits"))
            })
        };
        match flag.as_str() {
            "--machines" => args.machines = small()?,
            "--devices" => args.devices = small()?,
            "--dtype" => {
                args.dtype = DataType::from_name(&value).ok_or_else(|| {
                    format!(
                        "--dtype: '{value}' is not one of f32, f64, f16, bf16, i32, i64, u8, i8"
                    )
                })?;
            }
            "--elements" => args.elements = Some(number()?),
            "--mib" => args.mib = number()?,
            "--slice-bytes" => args.slice_bytes = number()?,
            "--min-shard-bytes" => args.min_shard_bytes = number()?,
            "--budget-bytes" => args.budget_bytes = number()?,
            "--device" => args.device = small()?,
            "--slices" => args.slices = number()?,
            "--layout" => {
                args.layout = match value.as_str() {
                    "contiguous" => RankLayout::Contiguous,
                    "interleaved" => RankLayout::Interleaved,
                    _ => {
                        return Err(format!(
                            "--layout: '{value}' is not contiguous or interleaved"
                        ));
                    }
                };
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(args)
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 20) == 0 => {
            format!("{:.2} GiB", b as f64 / f64::from(1 << 30))
        }
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / f64::from(1 << 20)),
        b if b >= 1 << 10 => format!("{:.2} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

fn run(args: &Args) -> Result<(), String> {
    let topology =
        Topology::new(args.machines, args.devices, args.layout).map_err(|e| e.to_string())?;
    let config =
        PlanConfig::new(args.slice_bytes, args.min_shard_bytes).map_err(|e| e.to_string())?;
    let geometry = Geometry::new(topology, config).map_err(|e| e.to_string())?;
    let elements = match args.elements {
        Some(n) => n,
        None => (args.mib << 20) / args.dtype.size_bytes(),
    };
    let plan = Plan::new(&geometry, args.dtype, elements, 0).map_err(|e| e.to_string())?;
    let layout = geometry.staging_layout();
    let buffers = geometry
        .staging_buffers(args.budget_bytes)
        .map_err(|e| e.to_string())?;
    if args.device >= args.devices {
        return Err(format!(
            "--device: {} is out of range for {} devices",
            args.device, args.devices
        ));
    }

    println!(
        "job: {} machines x {} devices = {} ranks ({:?} layout)",
        args.machines,
        args.devices,
        topology.world_size(),
        args.layout
    );
    println!(
        "full slice: {} = {} slots of {}, {} shards each ({} per cell; minimum shard {})",
        human(geometry.full_slice_bytes()),
        args.devices,
        human(geometry.full_slot_bytes()),
        geometry.shards_per_full_slice(),
        human(geometry.full_slot_bytes() / u64::from(geometry.shards_per_full_slice())),
        human(geometry.min_shard_bytes()),
    );
    println!(
        "cells travel: {}",
        match geometry.routing() {
            Routing::Flat => "straight to the machine serving them, and back",
            Routing::Trees => {
                "through a double binary tree: shard j up and down one tree, its root \
                 serving it (the machines outnumber a slot's shards)"
            }
            Routing::Groups => {
                "in two levels: each machine reduces a range of its slot over its group, \
                 and pieces of the range over the groups"
            }
        }
    );
    println!(
        "staging buffer: {} (slot {} + {} contribution areas of {}); {} buffers fit a budget of {}",
        human(layout.total_bytes()),
        human(layout.slot().byte_len()),
        layout.contribution_areas(),
        human(layout.shard_stride()),
        buffers,
        human(args.budget_bytes),
    );
    println!(
        "tensor: {} {} elements = {}, {} slices",
        elements,
        args.dtype,
        human(plan.bytes()),
        plan.slice_count()
    );
    let shown = args.slices.min(plan.slice_count());
    let mut indices: Vec<u64> = (0..shown).collect();
    if plan.slice_count() > shown && shown > 0 {
        *indices.last_mut().unwrap_or(&mut 0) = plan.slice_count() - 1;
    }
    for i in indices {
        let slice = plan.slice(i).map_err(|e| e.to_string())?;
        let servers: Vec<u32> = (0..slice.shards())
            .filter_map(|j| slice.server(args.device, j).ok())
            .collect();
        println!(
            "  slice {i}: elements {}..{} ({}), {} shards served by machines {servers:?}",
            slice.span().offset(),
            slice.span().end(),
            human(slice.span().byte_len()),
            slice.shards(),
        );
        let slot = slice.slot(args.device).map_err(|e| e.to_string())?;
        println!(
            "    device {}'s slot: elements {}..{} ({})",
            args.device,
            slot.offset(),
            slot.end(),
            human(slot.byte_len())
        );
        for j in 0..slice.shards().min(8) {
            let cell = slice.cell(args.device, j).map_err(|e| e.to_string())?;
            println!(
                "      shard {j}: bytes {}..{} of the tensor ({}), served by machine {}",
                cell.span().byte_offset(),
                cell.span().byte_end(),
                human(cell.span().byte_len()),
                cell.server()
            );
        }
        if slice.shards() > 8 {
            println!("      ... {} more shards", slice.shards() - 8);
        }
        let role = slice
            .role(Location {
                machine: 0,
                device: args.device,
            })
            .map_err(|e| e.to_string())?;
        println!(
            "    machine 0, device {}: sends {} contributions, receives {}, {}",
            args.device,
            role.contributions_to_send,
            role.contributions_to_receive,
            match (role.reduces, role.forwards) {
                (true, true) =>
                    "reduces a shard's partial sum for its parent, then sends the result down",
                (true, false) => "reduces and sends back a shard",
                _ => "serves nothing",
            }
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    match parse().and_then(|args| run(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
