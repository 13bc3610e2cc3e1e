//! Charts of bench and model results, written as SVG and PNG with plotters.
//!
//! Text is set in DejaVu Sans, embedded in the binary (the `dejavu` crate), so a
//! chart looks the same on a machine without fonts.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

/// What the x axis counts, for its tick labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// Bytes: ticks read 4 KiB, 64 MiB, 1 GiB.
    Bytes,
    /// A count: ticks read 8, 64, 2048.
    Count,
}

/// One line of a chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Its legend entry.
    pub label: String,
    /// `(x, y)` points, in increasing `x`.
    pub points: Vec<(f64, f64)>,
}

/// A chart: lines over a logarithmic x axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    /// Its caption.
    pub title: String,
    /// What x counts.
    pub x_axis: Axis,
    /// The x axis' description.
    pub x_label: String,
    /// The y axis' description.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

const SIZE: (u32, u32) = (960, 600);
const FONT: &str = "sans-serif";

fn font() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
                .map_err(|_| "the embedded DejaVu Sans font did not load".to_owned())
        })
        .clone()
}

/// `stem` with its `.svg` or `.png` extension, if any, taken off.
fn stem_of(path: &Path) -> PathBuf {
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg" | "png") => path.with_extension(""),
        _ => path.to_path_buf(),
    }
}

/// Writes `chart` to `PATH.svg` and `PATH.png` (an `.svg` or `.png` on `path` is
/// replaced) and returns the two paths.
pub fn write(chart: &Chart, path: &Path) -> Result<[PathBuf; 2], String> {
    font()?;
    if chart.series.iter().all(|s| s.points.is_empty()) {
        return Err(format!("chart {:?} has no points", chart.title));
    }
    let stem = stem_of(path);
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    draw(SVGBackend::new(&svg, SIZE).into_drawing_area(), chart)
        .map_err(|e| format!("drawing {}: {e}", svg.display()))?;
    draw(BitMapBackend::new(&png, SIZE).into_drawing_area(), chart)
        .map_err(|e| format!("drawing {}: {e}", png.display()))?;
    Ok([svg, png])
}

fn tick(axis: Axis, v: f64) -> String {
    match axis {
        Axis::Count => format!("{v:.0}"),
        Axis::Bytes => {
            let units = [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
            for (size, name) in units {
                #[expect(clippy::cast_precision_loss, reason = "powers of two")]
                let size = size as f64;
                if v >= size {
                    let n = v / size;
                    return if (n - n.round()).abs() < 1e-9 {
                        format!("{n:.0} {name}")
                    } else {
                        format!("{n:.1} {name}")
                    };
                }
            }
            format!("{v:.0} B")
        }
    }
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, chart: &Chart) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let points = chart.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, 0.0f64, 0.0f64);
    // Ticks where the data is (the sizes or GPU counts swept), not at powers of ten.
    let mut ticks: Vec<f64> = Vec::new();
    for &(x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
        ticks.push(x);
    }
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    if x1 <= x0 {
        x1 = x0 * 2.0;
    }
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    root.fill(&WHITE).map_err(err)?;
    let mut c = ChartBuilder::on(&root)
        .caption(&chart.title, (FONT, 22))
        .margin(16)
        .x_label_area_size(52)
        .y_label_area_size(70)
        .build_cartesian_2d((x0..x1).log_scale().with_key_points(ticks), 0.0..y1)
        .map_err(err)?;
    let axis = chart.x_axis;
    c.configure_mesh()
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .x_label_formatter(&|v| tick(axis, *v))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()
        .map_err(err)?;
    for (i, s) in chart.series.iter().enumerate() {
        let color = Palette99::pick(i).mix(1.0);
        c.draw_series(LineSeries::new(
            s.points.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(err)?
        .label(s.label.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
        c.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_ticks_read_as_sizes() {
        assert_eq!(tick(Axis::Bytes, 4096.0), "4 KiB");
        assert_eq!(tick(Axis::Bytes, 1.5 * 1048576.0), "1.5 MiB");
        assert_eq!(tick(Axis::Bytes, 1073741824.0), "1 GiB");
        assert_eq!(tick(Axis::Bytes, 100.0), "100 B");
        assert_eq!(tick(Axis::Count, 2048.0), "2048");
    }

    #[test]
    fn an_extension_on_the_path_is_replaced() {
        assert_eq!(stem_of(Path::new("a/b.svg")), PathBuf::from("a/b"));
        assert_eq!(stem_of(Path::new("a/b.png")), PathBuf::from("a/b"));
        assert_eq!(stem_of(Path::new("a/b")), PathBuf::from("a/b"));
    }
}
