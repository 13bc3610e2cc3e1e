//! What rank 0 writes besides the table: JSON rows and busbw charts.

use super::*;

pub(crate) fn write_json(
    path: &str,
    rows: &[Row],
    dtype: DataType,
    o: &Options,
    comm: &Communicator,
) -> std::io::Result<()> {
    let t = comm.topology();
    let (machines, devices, servers) = (t.machines(), t.devices_per_machine(), comm.servers());
    // Only f32 values travel compressed; every other type runs exact.
    let wire = if dtype == DataType::F32 {
        comm.wire()
    } else {
        WireFormat::Exact
    };
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "machines": machines,
                "devices": devices,
                "servers": servers,
                "bytes": r.bytes,
                "count": r.count,
                "collective": o.collective.name(),
                "device": if o.device { "cuda" } else { "host" },
                "wire": wire.name(),
                "dtype": dtype.name(),
                "op": o.op.name(),
                "algo": r.algorithm.name(),
                "time_us": r.time_us,
                "timed_after_barrier": o.barrier,
                "algbw_gbps": r.algbw,
                "busbw_gbps": r.busbw,
                "wrong": r.wrong,
                "sent_bytes_per_op": r.sent_per_op,
                "received_bytes_per_op": r.received_per_op,
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&rows).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

/// Busbw against size, one line per algorithm.
pub(crate) fn plot_rows(
    comm: &Communicator,
    path: &str,
    rows: &[Row],
    o: &Options,
) -> fairring::Result<()> {
    let t = comm.topology();
    #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
    let series = o
        .algorithms
        .iter()
        .map(|&a| fairring_bench::plot::Series {
            label: a.name().to_owned(),
            points: rows
                .iter()
                .filter(|r| r.algorithm == a)
                .map(|r| (r.bytes as f64, r.busbw))
                .collect(),
        })
        .collect();
    let chart = fairring_bench::plot::Chart {
        title: format!(
            "fairring-bench: {} machines x {} ranks, {} {}",
            t.machines(),
            t.devices_per_machine(),
            o.dtype,
            o.op
        ),
        x_axis: fairring_bench::plot::Axis::Bytes,
        x_label: "tensor size".into(),
        y_label: "busbw (GB/s)".into(),
        series,
    };
    let files = fairring_bench::plot::write(&chart, std::path::Path::new(path)).map_err(|e| {
        fairring::Error::Io {
            context: format!("--plot {path}"),
            source: std::io::Error::other(e).into(),
        }
    })?;
    for f in files {
        println!("# wrote {}", f.display());
    }
    Ok(())
}
