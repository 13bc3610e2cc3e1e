//! Link parameters fitted to a real machine's `fairring-bench --json` rows.
//!
//! A hierarchical all-reduce's time on a job of `M` machines is, to first order,
//! `a + b * S`: a fixed cost (submission, stage hand-offs, one message per cell on
//! the critical path) and a cost per byte (the bytes each rail moves, over its
//! rate). [`fit_line`] finds `a` and `b` by least squares over the rows of one
//! algorithm; [`calibrate`] turns them into a NIC's `latency_us` and `gbps` with the
//! plan fairring-core makes for that job: the rate is the bytes the busiest rail
//! sends per byte of tensor over `b`, and the latency is `a` spread over the
//! dependent hops of the smallest size (two a slice: a contribution out, its
//! result back). Software costs are folded into the latency, which the model
//! charges once per dependent hop.

use serde::Deserialize;

use super::{Algo, Hardware, Job, ModelError, predict};

/// One row of `fairring-bench --json` (the fields the fit needs).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct BenchRow {
    /// Bytes of the tensor.
    pub bytes: u64,
    /// The algorithm (`hierarchical`, `ring`, `auto`).
    pub algo: String,
    /// Median time, microseconds.
    pub time_us: f64,
    /// Machines of the job.
    pub machines: u32,
    /// Ranks per machine.
    pub devices: u32,
}

/// The least-squares line `time = a + b * bytes` through `(bytes, seconds)`
/// points; `None` with fewer than two distinct sizes.
pub fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    if points.len() < 2 {
        return None;
    }
    #[expect(clippy::cast_precision_loss, reason = "few points")]
    let n = points.len() as f64;
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let b = sxy / sxx;
    Some((mean_y - b * mean_x, b))
}

/// A fitted rail.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// Machines and ranks per machine of the measured job.
    pub machines: u32,
    /// Ranks per machine.
    pub devices: u32,
    /// The fixed cost `a`, microseconds.
    pub fixed_us: f64,
    /// The rate one rail reached, GB/s.
    pub rail_gbps: f64,
    /// Latency per dependent hop, microseconds.
    pub latency_us: f64,
}

impl Calibration {
    /// The fit as the `nic` table of a presets file: it replaces that table in a
    /// copy of preset `preset`.
    pub fn to_toml(&self, preset: &str) -> String {
        format!(
            "# fitted to a {}x{} fairring-bench run: fixed cost {:.1} us; this replaces\n\
             # the nic table of a copy of the preset, renamed\n\
             [{preset}.nic]\nlatency_us = {:.2}\ngbps = {:.3}\ncount = {}\n",
            self.machines,
            self.devices,
            self.fixed_us,
            self.latency_us,
            self.rail_gbps,
            self.devices
        )
    }
}

/// Fits the rail of the job the `rows` of algorithm `algo` were measured on, using
/// `hw` for what the fit does not touch (memory, software costs) and fairring-core's
/// plan for the bytes and messages per rail.
pub fn calibrate(rows: &[BenchRow], algo: &str, hw: &Hardware) -> Result<Calibration, ModelError> {
    let rows: Vec<&BenchRow> = rows.iter().filter(|r| r.algo == algo).collect();
    let first = rows
        .first()
        .ok_or_else(|| ModelError::InvalidJob(format!("no rows of algorithm {algo:?}")))?;
    let (machines, devices) = (first.machines, first.devices);
    if rows
        .iter()
        .any(|r| (r.machines, r.devices) != (machines, devices))
    {
        return Err(ModelError::InvalidJob(
            "rows of more than one layout".into(),
        ));
    }
    if machines < 2 {
        return Err(ModelError::InvalidJob(
            "a run on one machine does not exercise the link between machines".into(),
        ));
    }
    #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
    let points: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.bytes as f64, r.time_us * 1e-6))
        .collect();
    let (a, b) = fit_line(&points)
        .ok_or_else(|| ModelError::InvalidJob("the fit needs at least two sizes".into()))?;
    if b <= 0.0 {
        return Err(ModelError::InvalidJob(
            "time does not grow with size: sweep larger sizes".into(),
        ));
    }
    let largest = rows.iter().map(|r| r.bytes).max().unwrap_or(0);
    let smallest = rows.iter().map(|r| r.bytes).min().unwrap_or(0);
    let traffic = |bytes: u64| {
        let job = Job::new(machines, devices, bytes);
        predict(hw, &job, Algo::Hierarchical).map(|p| p.traffic.unwrap_or_default())
    };
    let big = traffic(largest)?;
    let small = traffic(smallest)?;
    #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
    let bytes_per_byte = big.bytes_sent as f64 / largest as f64;
    #[expect(clippy::cast_precision_loss, reason = "a few slices")]
    let hops = 2.0 * small.slices.max(1) as f64;
    Ok(Calibration {
        machines,
        devices,
        fixed_us: a * 1e6,
        rail_gbps: bytes_per_byte / b / 1e9,
        latency_us: (a * 1e6 / hops).max(0.0),
    })
}
