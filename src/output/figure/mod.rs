//! Paper-quality figures with plotters, each written as both PNG and SVG.
//!
//! Every figure is described by a plain data struct (a *spec*: the numbers plus
//! title and axis labels), so figures can be redrawn from tables alone
//! (`just figures`). [`render`] draws a spec twice, to `<base>.png` (bitmap) and
//! `<base>.svg` (vector), through atomic writes.
//!
//! Text is rendered with the system's `sans-serif` font through fontconfig
//! (plotters' `ttf` feature). A machine without fonts cannot draw labels;
//! [`check_fonts`] reports that up front (on Debian: `apt-get install
//! fontconfig fonts-dejavu-core`).
//!
//! | Function | Spec | Shows |
//! |---|---|---|
//! | [`heatmap`] | [`HeatmapSpec`] | a matrix (layer x head, head x phase) with a colour bar; diverging around 0 for signed effects |
//! | [`line_with_bands`] | [`LinePlotSpec`] | lines with shaded CI bands (accuracy by phase) |
//! | [`scatter_predicted_vs_observed`] | [`ScatterSpec`] | predicted vs observed with the y = x line, R^2 and MAE in the title |
//! | [`bar_profile`] | [`BarProfileSpec`] | one bar per offset with a reference line (gate profile g(r), 1 = uniform) |
//! | [`loss_curve`] | [`LossCurveSpec`] | training loss against step, with a moving average |
//! | [`error_scatter`] | [`ErrorScatterSpec`] | labelled points with x and y error bars and a reference line (the grid frontier) |

use std::ffi::OsString;
use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::atomic::{TempFile, write_bytes_atomic};

/// Errors of figure rendering; each names the figure's file.
#[derive(Debug, thiserror::Error)]
pub enum FigureError {
    /// The input data cannot be drawn (lengths differ, nothing finite, ...).
    #[error("figure {path}: {reason}")]
    InvalidInput {
        /// The figure's base path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// plotters failed while drawing.
    #[error("figure {path}: drawing failed: {message}")]
    Draw {
        /// The file being drawn.
        path: PathBuf,
        /// plotters' message.
        message: String,
    },
    /// Filesystem error.
    #[error("figure {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// No usable font: text cannot be rendered.
    #[error(
        "no usable sans-serif font ({message}); install fontconfig and a font, e.g. `apt-get install fontconfig fonts-dejavu-core`"
    )]
    Font {
        /// The font lookup error.
        message: String,
    },
}

/// Result alias of figure functions.
pub type Result<T, E = FigureError> = std::result::Result<T, E>;

/// The two files of a rendered figure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FigureFiles {
    /// `<base>.png`.
    pub png: PathBuf,
    /// `<base>.svg`.
    pub svg: PathBuf,
}

/// Font family used for all text.
const FONT: &str = "sans-serif";
const TITLE_SIZE: u32 = 28;
const DESC_SIZE: u32 = 22;
const LABEL_SIZE: u32 = 17;

/// The title font size for `title` on a figure `width` px wide: `base`, shrunk a point
/// at a time (to 12 at the least) until the measured text fits with 16 px to spare on
/// each side, so a long model name never pushes a title past the figure's edges.
pub(crate) fn title_size(title: &str, width: u32, base: u32) -> u32 {
    let room = width.saturating_sub(32);
    let mut size = base;
    while size > 12 {
        let font = FontDesc::new(FontFamily::SansSerif, f64::from(size), FontStyle::Normal);
        match font.box_size(title) {
            Ok((w, _)) if w > room => size -= 1,
            _ => break,
        }
    }
    size
}

/// The house title font for `title` on `root`, fitted to its width ([`title_size`]).
fn title_font<DB: DrawingBackend>(
    title: &str,
    root: &DrawingArea<DB, Shift>,
) -> (&'static str, u32) {
    (FONT, title_size(title, root.dim_in_pixel().0, TITLE_SIZE))
}

/// Checks that a sans-serif font can be loaded and measured.
///
/// # Errors
/// [`FigureError::Font`] with installation advice.
pub fn check_fonts() -> Result<()> {
    let font = FontDesc::new(FontFamily::SansSerif, 16.0, FontStyle::Normal);
    match font.box_size("Phase 0-9") {
        Ok((w, h)) if w > 0 && h > 0 => Ok(()),
        Ok(_) => Err(FigureError::Font {
            message: "font measured text as empty".into(),
        }),
        Err(e) => Err(FigureError::Font {
            message: format!("{e:?}"),
        }),
    }
}

/// A figure that can draw itself on any plotters backend.
pub trait FigureSpec {
    /// Pixel size `(width, height)` (the SVG uses the same user units).
    fn size(&self) -> (u32, u32);
    /// Checks the data; the message becomes [`FigureError::InvalidInput`].
    fn validate(&self) -> std::result::Result<(), String>;
    /// Draws on `root` (already sized, not yet filled).
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult;
}

/// Result of drawing: plotters errors as text.
pub type DrawResult = std::result::Result<(), String>;

fn de<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> String {
    e.to_string()
}

/// The axes of a numeric x-y figure (scatter, error bars): caption, 70 / 90 px label
/// areas, the grey mesh, axis descriptions and `fmt_num` tick labels.
fn numeric_chart<'a, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, Shift>,
    caption: (&str, u32),
    (xr, yr): (Range<f64>, Range<f64>),
    (x_label, y_label): (&str, &str),
) -> std::result::Result<ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>, String>
{
    let size = title_size(caption.0, root.dim_in_pixel().0, caption.1);
    let mut chart = ChartBuilder::on(root)
        .caption(caption.0, (FONT, size))
        .margin(16)
        .x_label_area_size(70)
        .y_label_area_size(90)
        .build_cartesian_2d(xr, yr)
        .map_err(de)?;
    let fmt = |v: &f64| fmt_num(*v);
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&fmt)
        .y_label_formatter(&fmt)
        .axis_desc_style((FONT, DESC_SIZE))
        .label_style((FONT, LABEL_SIZE))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(210, 210, 210))
        .draw()
        .map_err(de)?;
    Ok(chart)
}

fn with_suffix(base: &Path, ext: &str) -> PathBuf {
    let mut s: OsString = base.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

/// Draws `spec` to `<base>.png` and `<base>.svg` (atomically; parent directories
/// are created). `base` has no extension: `reports/x/heatmap_phase3`.
///
/// # Errors
/// Invalid data, missing fonts, drawing or I/O errors, naming the file.
pub fn render<S: FigureSpec>(base: impl AsRef<Path>, spec: &S) -> Result<FigureFiles> {
    let base = base.as_ref();
    spec.validate()
        .map_err(|reason| FigureError::InvalidInput {
            path: base.to_path_buf(),
            reason,
        })?;
    check_fonts()?;
    let png = with_suffix(base, "png");
    let svg = with_suffix(base, "svg");
    let size = spec.size();

    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FigureError::Io {
            path: path.clone(),
            source,
        }
    };
    let draw_err = |path: &Path, message: String| FigureError::Draw {
        path: path.to_path_buf(),
        message,
    };

    let tmp = TempFile::for_target(&png).map_err(io(&png))?;
    {
        let root = BitMapBackend::new(tmp.path(), size).into_drawing_area();
        spec.draw(&root).map_err(|m| draw_err(&png, m))?;
        root.present().map_err(|e| draw_err(&png, de(e)))?;
    }
    tmp.commit().map_err(io(&png))?;

    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, size).into_drawing_area();
        spec.draw(&root).map_err(|m| draw_err(&svg, m))?;
        root.present().map_err(|e| draw_err(&svg, de(e)))?;
    }
    write_bytes_atomic(&svg, text.as_bytes()).map_err(io(&svg))?;
    Ok(FigureFiles { png, svg })
}

/// Draws `spec` into an in-memory RGB buffer (`width * height * 3` bytes, row
/// major); used to test what a figure looks like without files.
///
/// # Errors
/// As [`render`].
#[cfg(test)]
pub fn render_rgb<S: FigureSpec>(spec: &S) -> Result<Vec<u8>> {
    spec.validate()
        .map_err(|reason| FigureError::InvalidInput {
            path: PathBuf::from("<memory>"),
            reason,
        })?;
    check_fonts()?;
    let (w, h) = spec.size();
    let mut buf = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        let err = |message| FigureError::Draw {
            path: PathBuf::from("<memory>"),
            message,
        };
        spec.draw(&root).map_err(err)?;
        root.present().map_err(|e| err(de(e)))?;
    }
    Ok(buf)
}

// ---------------------------------------------------------------------------
// Colour maps

/// Linear interpolation in a list of evenly spaced RGB stops, `t` in `[0, 1]`.
fn interpolate(stops: &[(u8, u8, u8)], t: f64) -> RGBColor {
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.5
    };
    let x = t * (stops.len() - 1) as f64;
    let i = (x.floor() as usize).min(stops.len() - 2);
    let f = x - i as f64;
    let lerp = |a: u8, b: u8| (f64::from(a) + f * (f64::from(b) - f64::from(a))).round() as u8;
    let (a, b) = (stops[i], stops[i + 1]);
    RGBColor(lerp(a.0, b.0), lerp(a.1, b.1), lerp(a.2, b.2))
}

/// Viridis (perceptually uniform, colour-blind safe), 9 stops from matplotlib.
const VIRIDIS: [(u8, u8, u8); 9] = [
    (68, 1, 84),
    (71, 44, 122),
    (59, 81, 139),
    (44, 113, 142),
    (33, 144, 141),
    (39, 173, 129),
    (92, 200, 99),
    (170, 220, 50),
    (253, 231, 37),
];

/// ColorBrewer RdBu reversed: blue for negative, white at 0, red for positive.
const RDBU: [(u8, u8, u8); 7] = [
    (33, 102, 172),
    (67, 147, 195),
    (146, 197, 222),
    (247, 247, 247),
    (244, 165, 130),
    (214, 96, 77),
    (178, 24, 43),
];

/// Colour for missing (`NaN`) cells.
const MISSING: RGBColor = RGBColor(200, 200, 200);

/// Tableau 10, for series.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Series colour `i` (cycles after 10).
pub fn series_color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// A value-to-colour mapping with its range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColorScale {
    /// Lowest value of the colour bar.
    pub min: f64,
    /// Highest value of the colour bar.
    pub max: f64,
    /// Diverging (RdBu, white at 0) or sequential (viridis).
    pub diverging: bool,
}

impl ColorScale {
    /// The scale for `values` (non-finite ignored). Diverging: symmetric
    /// `[-m, m]` with `m = max |v|`, so 0 is white. Sequential: `[min, max]`.
    /// Degenerate ranges are widened so that the bar is drawable.
    pub fn fit(values: impl IntoIterator<Item = f64>, diverging: bool) -> Self {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.into_iter().filter(|v| v.is_finite()) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        if diverging {
            let m = lo.abs().max(hi.abs());
            let m = if m > 0.0 { m } else { 1.0 };
            Self {
                min: -m,
                max: m,
                diverging,
            }
        } else {
            if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
                let pad = if lo == 0.0 { 0.5 } else { lo.abs() * 0.05 };
                (lo, hi) = (lo - pad, hi + pad);
            }
            Self {
                min: lo,
                max: hi,
                diverging,
            }
        }
    }

    /// Colour of `v` (grey for NaN; values outside the range saturate).
    pub fn color(&self, v: f64) -> RGBColor {
        if !v.is_finite() {
            return MISSING;
        }
        let t = (v - self.min) / (self.max - self.min);
        if self.diverging {
            interpolate(&RDBU, t)
        } else {
            interpolate(&VIRIDIS, t)
        }
    }
}

/// Black or white, whichever is readable on `bg`.
fn text_color_on(bg: RGBColor) -> RGBColor {
    let lum = 0.299 * f64::from(bg.0) + 0.587 * f64::from(bg.1) + 0.114 * f64::from(bg.2);
    if lum > 140.0 { BLACK } else { WHITE }
}

/// Compact number formatting for tick labels and annotations.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    if (v - v.round()).abs() < 1e-9 && v.abs() < 1e9 {
        return format!("{}", v.round() as i64);
    }
    let a = v.abs();
    let s = if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 0.01 {
        format!("{v:.2}")
    } else {
        format!("{v:.1e}")
    };
    if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

// ---------------------------------------------------------------------------
// A categorical axis: n cells [i, i+1), labels at the cell centres.

#[derive(Clone)]
struct Cells {
    n: usize,
}

impl Ranged for Cells {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let frac = v / self.n as f64;
        limit.0 + (f64::from(limit.1 - limit.0) * frac).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        let max = hint.max_num_points().max(1);
        let step = self.n.div_ceil(max).max(1);
        (0..self.n).step_by(step).map(|i| i as f64 + 0.5).collect()
    }

    fn range(&self) -> Range<f64> {
        0.0..self.n as f64
    }
}

fn cell_label(labels: &[String], v: f64) -> String {
    let i = v.floor();
    if i < 0.0 {
        return String::new();
    }
    labels.get(i as usize).cloned().unwrap_or_default()
}

/// Padded `[lo, hi]` covering `values` (finite only), or `fallback`.
fn padded_range(
    values: impl IntoIterator<Item = f64>,
    pad_frac: f64,
    fallback: (f64, f64),
) -> Range<f64> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.into_iter().filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return fallback.0..fallback.1;
    }
    let span = hi - lo;
    let pad = if span > 0.0 {
        span * pad_frac
    } else {
        lo.abs().max(1.0) * 0.1
    };
    (lo - pad)..(hi + pad)
}

mod bars;
mod errorbars;
mod heatmap;
mod lines;
mod loss;
mod scatter;

pub use bars::{BarProfileSpec, bar_profile};
pub use errorbars::{ErrorPoint, ErrorScatterSpec, ErrorSeries, error_scatter};
pub use heatmap::{HeatmapSpec, heatmap};
pub use lines::{BandSeries, BandStyle, LinePlotSpec, draw_band_series, line_with_bands};
pub use loss::{LossCurveSpec, loss_curve};
pub use scatter::{ScatterSeries, ScatterSpec, scatter_predicted_vs_observed};

#[cfg(test)]
mod tests;
