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

// ---------------------------------------------------------------------------
// Heatmap

/// A matrix drawn as coloured cells with a colour bar.
///
/// `matrix[r][c]` is drawn at row `r` (row 0 at the top) and column `c`; `NaN`
/// cells are grey. With `diverging`, the colour map is RdBu centred at 0
/// (blue negative, white 0, red positive) with a symmetric range; otherwise
/// viridis from the minimum to the maximum. `range` overrides the colour range
/// (use the same range for a series of per-phase heatmaps so they compare).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HeatmapSpec {
    /// Values, `rows x cols` (every row has `cols` entries).
    pub matrix: Vec<Vec<f64>>,
    /// One label per row (e.g. `L0`..`L27`).
    pub row_labels: Vec<String>,
    /// One label per column (e.g. `H0`..`H7` or phases).
    pub col_labels: Vec<String>,
    /// Figure title.
    pub title: String,
    /// Horizontal axis description.
    pub x_label: String,
    /// Vertical axis description.
    pub y_label: String,
    /// Colour-bar description (metric and unit).
    pub colorbar_label: String,
    /// Diverging colour map centred at 0 (signed effects) instead of sequential.
    pub diverging: bool,
    /// Explicit colour range `(min, max)`; `None` fits the data.
    pub range: Option<(f64, f64)>,
    /// Write each cell's value in the cell (only drawn up to 400 cells).
    pub annotate: bool,
    /// Pixel size; `None` picks one from the matrix shape.
    pub size: Option<(u32, u32)>,
}

impl HeatmapSpec {
    fn scale(&self) -> ColorScale {
        match self.range {
            Some((min, max)) => ColorScale {
                min,
                max,
                diverging: self.diverging,
            },
            None => ColorScale::fit(self.matrix.iter().flatten().copied(), self.diverging),
        }
    }
}

impl FigureSpec for HeatmapSpec {
    fn size(&self) -> (u32, u32) {
        self.size.unwrap_or_else(|| {
            let rows = self.matrix.len().max(1) as u32;
            let cols = self.matrix.first().map_or(1, Vec::len).max(1) as u32;
            let cell = (720 / rows.max(cols)).clamp(18, 64);
            let w = (cols * cell + 420).clamp(760, 2400);
            let h = (rows * cell + 260).clamp(560, 2400);
            (w, h)
        })
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let rows = self.matrix.len();
        if rows == 0 {
            return Err("heatmap matrix has no rows".into());
        }
        let cols = self.matrix[0].len();
        if cols == 0 {
            return Err("heatmap matrix has no columns".into());
        }
        if let Some((r, row)) = self
            .matrix
            .iter()
            .enumerate()
            .find(|(_, row)| row.len() != cols)
        {
            return Err(format!(
                "heatmap row {r} has {} values, row 0 has {cols}",
                row.len()
            ));
        }
        if self.row_labels.len() != rows {
            return Err(format!(
                "{} row labels for {rows} rows",
                self.row_labels.len()
            ));
        }
        if self.col_labels.len() != cols {
            return Err(format!(
                "{} column labels for {cols} columns",
                self.col_labels.len()
            ));
        }
        if let Some((lo, hi)) = self.range
            && !(lo.is_finite() && hi.is_finite() && lo < hi)
        {
            return Err(format!("invalid colour range ({lo}, {hi})"));
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let (w, _) = root.dim_in_pixel();
        let root = if self.title.is_empty() {
            root.clone()
        } else {
            root.titled(&self.title, (FONT, TITLE_SIZE).into_font())
                .map_err(de)?
        };
        let (main, bar) = root.split_horizontally(w.saturating_sub(170));
        let rows = self.matrix.len();
        let cols = self.matrix[0].len();
        let scale = self.scale();
        let bottom = 72;

        let max_row_label = self.row_labels.iter().map(String::len).max().unwrap_or(1) as u32;
        let mut chart = ChartBuilder::on(&main)
            .margin(12)
            .x_label_area_size(bottom)
            .y_label_area_size((max_row_label * 10 + 50).min(260))
            .build_cartesian_2d(Cells { n: cols }, Cells { n: rows })
            .map_err(de)?;
        let row_label = |v: &f64| cell_label(&self.row_labels, rows as f64 - v);
        let col_label = |v: &f64| cell_label(&self.col_labels, *v);
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(cols.min(40))
            .y_labels(rows.min(40))
            .x_label_formatter(&col_label)
            .y_label_formatter(&row_label)
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .axis_desc_style((FONT, DESC_SIZE))
            .label_style((FONT, LABEL_SIZE))
            .draw()
            .map_err(de)?;

        let annotate = self.annotate && rows * cols <= 400;
        for (r, row) in self.matrix.iter().enumerate() {
            // Row 0 at the top.
            let y0 = (rows - 1 - r) as f64;
            for (c, &v) in row.iter().enumerate() {
                let color = scale.color(v);
                let x0 = c as f64;
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x0, y0), (x0 + 1.0, y0 + 1.0)],
                        color.filled(),
                    )))
                    .map_err(de)?;
                if annotate {
                    let ink = text_color_on(color);
                    let style = TextStyle::from((FONT, LABEL_SIZE - 3).into_font())
                        .color(&ink)
                        .pos(Pos::new(HPos::Center, VPos::Center));
                    chart
                        .draw_series(std::iter::once(Text::new(
                            fmt_num(v),
                            (x0 + 0.5, y0 + 0.5),
                            style,
                        )))
                        .map_err(de)?;
                }
            }
        }
        // Frame around the cells.
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, 0.0), (cols as f64, rows as f64)],
                BLACK.stroke_width(1),
            )))
            .map_err(de)?;

        draw_colorbar(&bar, &scale, &self.colorbar_label, bottom)
    }
}

/// A vertical colour bar for `scale` with its description on the right.
fn draw_colorbar<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    scale: &ColorScale,
    label: &str,
    bottom: u32,
) -> DrawResult {
    let mut bar = ChartBuilder::on(area)
        .margin_top(12)
        .margin_bottom(12 + bottom)
        .margin_left(8)
        .margin_right(12)
        .right_y_label_area_size(110)
        .build_cartesian_2d(0f64..1f64, scale.min..scale.max)
        .map_err(de)?;
    let fmt = |v: &f64| fmt_num(*v);
    bar.configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(7)
        .y_label_formatter(&fmt)
        .y_desc(label)
        .axis_desc_style((FONT, DESC_SIZE - 2))
        .label_style((FONT, LABEL_SIZE))
        .draw()
        .map_err(de)?;
    let steps = 256;
    let span = scale.max - scale.min;
    bar.draw_series((0..steps).map(|i| {
        let a = scale.min + span * i as f64 / steps as f64;
        let b = scale.min + span * (i + 1) as f64 / steps as f64;
        Rectangle::new([(0.0, a), (1.0, b)], scale.color((a + b) / 2.0).filled())
    }))
    .map_err(de)?;
    bar.draw_series(std::iter::once(Rectangle::new(
        [(0.0, scale.min), (1.0, scale.max)],
        BLACK.stroke_width(1),
    )))
    .map_err(de)?;
    Ok(())
}

/// Writes a heatmap (see [`HeatmapSpec`]) to `<base>.png` and `<base>.svg`.
///
/// # Errors
/// As [`render`].
pub fn heatmap(base: impl AsRef<Path>, spec: &HeatmapSpec) -> Result<FigureFiles> {
    render(base, spec)
}

// ---------------------------------------------------------------------------
// Lines with CI bands

/// One line with a confidence band; all vectors have the same length. Points
/// with a non-finite `y` are skipped, and so are band points with a non-finite
/// `lo` or `hi`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BandSeries {
    /// Legend entry.
    pub name: String,
    /// x values (e.g. phases).
    pub x: Vec<f64>,
    /// y values (e.g. accuracy).
    pub y: Vec<f64>,
    /// Lower band edge.
    pub lo: Vec<f64>,
    /// Upper band edge.
    pub hi: Vec<f64>,
}

/// Lines with shaded bands, e.g. accuracy by phase with 95% CIs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LinePlotSpec {
    /// The series (distinct colours, legend in the upper right).
    pub series: Vec<BandSeries>,
    /// Figure title.
    pub title: String,
    /// Horizontal axis description.
    pub x_label: String,
    /// Vertical axis description.
    pub y_label: String,
    /// Explicit y range; `None` fits the data and bands.
    pub y_range: Option<(f64, f64)>,
    /// Pixel size; `None` is 1100 x 700.
    pub size: Option<(u32, u32)>,
}

impl FigureSpec for LinePlotSpec {
    fn size(&self) -> (u32, u32) {
        self.size.unwrap_or((1100, 700))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.series.is_empty() {
            return Err("no series".into());
        }
        for s in &self.series {
            let n = s.x.len();
            if s.y.len() != n || s.lo.len() != n || s.hi.len() != n {
                return Err(format!(
                    "series `{}`: x, y, lo, hi have lengths {}, {}, {}, {}",
                    s.name,
                    n,
                    s.y.len(),
                    s.lo.len(),
                    s.hi.len()
                ));
            }
            if let Some(i) = s.x.iter().position(|x| !x.is_finite()) {
                return Err(format!("series `{}`: x[{i}] is not finite", s.name));
            }
        }
        if !self
            .series
            .iter()
            .any(|s| s.y.iter().any(|y| y.is_finite()))
        {
            return Err("no finite y value in any series".into());
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let (xs, ys) = self.ranges();
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, TITLE_SIZE))
            .margin(16)
            .x_label_area_size(70)
            .y_label_area_size(90)
            .build_cartesian_2d(xs, ys)
            .map_err(de)?;
        let fmt = |v: &f64| fmt_num(*v);
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&fmt)
            .y_label_formatter(&fmt)
            .axis_desc_style((FONT, DESC_SIZE))
            .label_style((FONT, LABEL_SIZE))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()
            .map_err(de)?;

        for (i, s) in self.series.iter().enumerate() {
            draw_band_series(&mut chart, s, i)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .label_font((FONT, LABEL_SIZE))
            .draw()
            .map_err(de)?;
        Ok(())
    }
}

impl LinePlotSpec {
    /// The x and y ranges: fitted to the data and bands (y unless given), with
    /// headroom above for the legend, so it never hides a point.
    fn ranges(&self) -> (Range<f64>, Range<f64>) {
        let xs = padded_range(
            self.series.iter().flat_map(|s| s.x.iter().copied()),
            0.04,
            (0.0, 1.0),
        );
        let ys = match self.y_range {
            Some((a, b)) => a..b,
            None => padded_range(
                self.series
                    .iter()
                    .flat_map(|s| s.y.iter().chain(&s.lo).chain(&s.hi).copied()),
                0.08,
                (0.0, 1.0),
            ),
        };
        let ys = ys.start..ys.end + 0.06 * (1 + self.series.len()) as f64 * (ys.end - ys.start);
        (xs, ys)
    }
}

/// Series `i` of a line plot: its band (an error bar for a single point), the line
/// (labelled for the legend) and its points.
fn draw_band_series<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    s: &BandSeries,
    i: usize,
) -> DrawResult {
    let color = series_color(i);
    let band: Vec<usize> = (0..s.x.len())
        .filter(|&k| s.lo[k].is_finite() && s.hi[k].is_finite())
        .collect();
    if band.len() >= 2 {
        let mut poly: Vec<(f64, f64)> = band.iter().map(|&k| (s.x[k], s.hi[k])).collect();
        poly.extend(band.iter().rev().map(|&k| (s.x[k], s.lo[k])));
        chart
            .draw_series(std::iter::once(Polygon::new(
                poly,
                color.mix(0.18).filled(),
            )))
            .map_err(de)?;
    } else {
        // A single point: an error bar instead of a band.
        chart
            .draw_series(band.iter().map(|&k| {
                PathElement::new(
                    vec![(s.x[k], s.lo[k]), (s.x[k], s.hi[k])],
                    color.stroke_width(2),
                )
            }))
            .map_err(de)?;
    }
    let pts: Vec<(f64, f64)> = (0..s.x.len())
        .filter(|&k| s.y[k].is_finite())
        .map(|k| (s.x[k], s.y[k]))
        .collect();
    chart
        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(3)))
        .map_err(de)?
        .label(&s.name)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
    chart
        .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
        .map_err(de)?;
    Ok(())
}

/// Writes a line plot with CI bands (see [`LinePlotSpec`]).
///
/// # Errors
/// As [`render`].
pub fn line_with_bands(base: impl AsRef<Path>, spec: &LinePlotSpec) -> Result<FigureFiles> {
    render(base, spec)
}

// ---------------------------------------------------------------------------
// Predicted vs observed

/// One group of points (e.g. one gate shift delta).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScatterSeries {
    /// Legend entry.
    pub name: String,
    /// Predicted values (x).
    pub predicted: Vec<f64>,
    /// Observed values (y).
    pub observed: Vec<f64>,
}

/// Predicted against observed, with the y = x line; R^2 and MAE over all points
/// ([`crate::analysis::r_squared`], [`crate::analysis::mae`]) are appended to the
/// title unless `r2_text` overrides them (e.g. with bootstrap CIs).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScatterSpec {
    /// Point groups.
    pub series: Vec<ScatterSeries>,
    /// Figure title (the fit statistics are appended).
    pub title: String,
    /// Horizontal axis description.
    pub x_label: String,
    /// Vertical axis description.
    pub y_label: String,
    /// Replaces the computed "R² = .., MAE = .." text.
    pub r2_text: Option<String>,
    /// Pixel size; `None` is 900 x 860.
    pub size: Option<(u32, u32)>,
}

impl ScatterSpec {
    /// Finite `(predicted, observed)` pairs over all series.
    fn pairs(&self) -> (Vec<f64>, Vec<f64>) {
        self.series
            .iter()
            .flat_map(|s| s.predicted.iter().zip(&s.observed))
            .filter(|(p, o)| p.is_finite() && o.is_finite())
            .map(|(p, o)| (*p, *o))
            .unzip()
    }

    /// The fit text shown in the title: `R² = 0.93, MAE = 0.012`.
    pub fn fit_text(&self) -> String {
        if let Some(t) = &self.r2_text {
            return t.clone();
        }
        let (p, o) = self.pairs();
        let r2 = crate::analysis::r_squared(&p, &o).unwrap_or(f64::NAN);
        let mae = crate::analysis::mae(&p, &o).unwrap_or(f64::NAN);
        format!("R² = {}, MAE = {}", fmt_fixed(r2, 3), fmt_fixed(mae, 3))
    }
}

fn fmt_fixed(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "n/a".into()
    }
}

impl FigureSpec for ScatterSpec {
    fn size(&self) -> (u32, u32) {
        self.size.unwrap_or((900, 860))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        for s in &self.series {
            if s.predicted.len() != s.observed.len() {
                return Err(format!(
                    "series `{}`: {} predicted vs {} observed values",
                    s.name,
                    s.predicted.len(),
                    s.observed.len()
                ));
            }
        }
        if self.pairs().0.is_empty() {
            return Err("no finite (predicted, observed) pair".into());
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let (p, o) = self.pairs();
        let r = padded_range(p.iter().chain(&o).copied(), 0.06, (0.0, 1.0));
        let title = if self.title.is_empty() {
            self.fit_text()
        } else {
            format!("{} ({})", self.title, self.fit_text())
        };
        let mut chart = ChartBuilder::on(root)
            .caption(title, (FONT, TITLE_SIZE - 4))
            .margin(16)
            .x_label_area_size(70)
            .y_label_area_size(90)
            .build_cartesian_2d(r.clone(), r.clone())
            .map_err(de)?;
        let fmt = |v: &f64| fmt_num(*v);
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&fmt)
            .y_label_formatter(&fmt)
            .axis_desc_style((FONT, DESC_SIZE))
            .label_style((FONT, LABEL_SIZE))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()
            .map_err(de)?;
        let grey = RGBColor(90, 90, 90);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(r.start, r.start), (r.end, r.end)],
                10,
                6,
                grey.stroke_width(2),
            ))
            .map_err(de)?
            .label("y = x")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], grey.stroke_width(2))
            });
        for (i, s) in self.series.iter().enumerate() {
            let color = series_color(i);
            chart
                .draw_series(
                    s.predicted
                        .iter()
                        .zip(&s.observed)
                        .filter(|(p, o)| p.is_finite() && o.is_finite())
                        .map(|(&p, &o)| Circle::new((p, o), 6, color.mix(0.85).filled())),
                )
                .map_err(de)?
                .label(&s.name)
                .legend(move |(x, y)| Circle::new((x + 12, y), 6, color.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .label_font((FONT, LABEL_SIZE))
            .draw()
            .map_err(de)?;
        Ok(())
    }
}

/// Writes a predicted-vs-observed scatter plot (see [`ScatterSpec`]).
///
/// # Errors
/// As [`render`].
pub fn scatter_predicted_vs_observed(
    base: impl AsRef<Path>,
    spec: &ScatterSpec,
) -> Result<FigureFiles> {
    render(base, spec)
}

// ---------------------------------------------------------------------------
// Bar profile

/// One bar per category with an optional horizontal reference line, e.g. the
/// gate profile `g(r)` per offset with the uniform share `g = 1`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BarProfileSpec {
    /// Category labels (e.g. offsets `0`..`W-1`).
    pub labels: Vec<String>,
    /// Bar heights (`NaN` bars are omitted).
    pub values: Vec<f64>,
    /// Figure title.
    pub title: String,
    /// Horizontal axis description.
    pub x_label: String,
    /// Vertical axis description.
    pub y_label: String,
    /// Height of a dashed horizontal reference line (`Some(1.0)` for g(r)).
    pub reference: Option<f64>,
    /// Legend text of the reference line.
    pub reference_label: Option<String>,
    /// Pixel size; `None` is 1000 x 650.
    pub size: Option<(u32, u32)>,
}

impl FigureSpec for BarProfileSpec {
    fn size(&self) -> (u32, u32) {
        self.size.unwrap_or((1000, 650))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.values.is_empty() {
            return Err("no bars".into());
        }
        if self.labels.len() != self.values.len() {
            return Err(format!(
                "{} labels for {} values",
                self.labels.len(),
                self.values.len()
            ));
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let n = self.values.len();
        let ys = self.y_range();
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, TITLE_SIZE))
            .margin(16)
            .x_label_area_size(70)
            .y_label_area_size(90)
            .build_cartesian_2d(Cells { n }, ys)
            .map_err(de)?;
        let xfmt = |v: &f64| cell_label(&self.labels, *v);
        let yfmt = |v: &f64| fmt_num(*v);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n.min(40))
            .x_label_formatter(&xfmt)
            .y_label_formatter(&yfmt)
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .axis_desc_style((FONT, DESC_SIZE))
            .label_style((FONT, LABEL_SIZE))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()
            .map_err(de)?;
        let (w, _) = root.dim_in_pixel();
        let gap = ((w / n.max(1) as u32) / 8).clamp(1, 20);
        chart
            .draw_series(
                self.values
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.is_finite())
                    .map(|(i, &v)| {
                        let mut bar = Rectangle::new(
                            [(i as f64, 0.0), (i as f64 + 1.0, v)],
                            series_color(0).filled(),
                        );
                        bar.set_margin(0, 0, gap, gap);
                        bar
                    }),
            )
            .map_err(de)?;
        if let Some(y) = self.reference {
            self.draw_reference(&mut chart, y)?;
        }
        Ok(())
    }
}

impl BarProfileSpec {
    /// The y range: fitted to the bars, the reference and 0; from 0 when no bar is
    /// negative.
    fn y_range(&self) -> Range<f64> {
        let extent = self
            .values
            .iter()
            .copied()
            .chain(self.reference)
            .chain(std::iter::once(0.0));
        let r = padded_range(extent, 0.08, (0.0, 1.0));
        // Bars grow from 0: keep 0 on the axis edge when all values are >= 0.
        if self.values.iter().all(|v| !v.is_finite() || *v >= 0.0) {
            0.0..r.end
        } else {
            r
        }
    }

    /// The dashed reference line at height `y` across the bars, with its legend
    /// entry when it has a label.
    fn draw_reference<'a, DB: DrawingBackend + 'a>(
        &self,
        chart: &mut ChartContext<'a, DB, Cartesian2d<Cells, RangedCoordf64>>,
        y: f64,
    ) -> DrawResult {
        let n = self.values.len();
        let red = RGBColor(214, 39, 40);
        let series = chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, y), (n as f64, y)],
                10,
                6,
                red.stroke_width(2),
            ))
            .map_err(de)?;
        if let Some(label) = &self.reference_label {
            series.label(label).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], red.stroke_width(2))
            });
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(160, 160, 160))
                .label_font((FONT, LABEL_SIZE))
                .draw()
                .map_err(de)?;
        }
        Ok(())
    }
}

/// Writes a bar profile (see [`BarProfileSpec`]).
///
/// # Errors
/// As [`render`].
pub fn bar_profile(base: impl AsRef<Path>, spec: &BarProfileSpec) -> Result<FigureFiles> {
    render(base, spec)
}

// ---------------------------------------------------------------------------
// Loss curve

/// Training loss against step. With 20 or more points a centred moving average
/// (window `max(5, n / 25)` points, shrinking at the ends; no lag) is drawn over
/// the raw curve.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossCurveSpec {
    /// Optimizer steps (x).
    pub steps: Vec<u64>,
    /// Loss per step (y; non-finite points skipped).
    pub losses: Vec<f64>,
    /// Figure title.
    pub title: String,
    /// Pixel size; `None` is 1000 x 620.
    pub size: Option<(u32, u32)>,
}

impl LossCurveSpec {
    /// A spec with the default title `Training loss`.
    pub fn new(steps: &[u64], losses: &[f64]) -> Self {
        Self {
            steps: steps.to_vec(),
            losses: losses.to_vec(),
            title: "Training loss".into(),
            size: None,
        }
    }

    fn points(&self) -> Vec<(f64, f64)> {
        self.steps
            .iter()
            .zip(&self.losses)
            .filter(|(_, l)| l.is_finite())
            .map(|(&s, &l)| (s as f64, l))
            .collect()
    }
}

impl FigureSpec for LossCurveSpec {
    fn size(&self) -> (u32, u32) {
        self.size.unwrap_or((1000, 620))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.steps.len() != self.losses.len() {
            return Err(format!(
                "{} steps for {} losses",
                self.steps.len(),
                self.losses.len()
            ));
        }
        if self.points().is_empty() {
            return Err("no finite loss".into());
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let pts = self.points();
        let xs = padded_range(pts.iter().map(|p| p.0), 0.02, (0.0, 1.0));
        let ys = padded_range(pts.iter().map(|p| p.1), 0.06, (0.0, 1.0));
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, TITLE_SIZE))
            .margin(16)
            .x_label_area_size(70)
            .y_label_area_size(90)
            .build_cartesian_2d(xs, ys)
            .map_err(de)?;
        let fmt = |v: &f64| fmt_num(*v);
        chart
            .configure_mesh()
            .x_desc("Step")
            .y_desc("Loss")
            .x_label_formatter(&fmt)
            .y_label_formatter(&fmt)
            .axis_desc_style((FONT, DESC_SIZE))
            .label_style((FONT, LABEL_SIZE))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()
            .map_err(de)?;
        let smooth = pts.len() >= 20;
        let raw_color = if smooth {
            series_color(0).mix(0.35)
        } else {
            series_color(0).to_rgba()
        };
        chart
            .draw_series(LineSeries::new(pts.clone(), raw_color.stroke_width(2)))
            .map_err(de)?
            .label("loss")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], raw_color.stroke_width(2))
            });
        if smooth {
            let smoothed = centred_moving_average(&pts);
            let c = series_color(0);
            chart
                .draw_series(LineSeries::new(smoothed, c.stroke_width(3)))
                .map_err(de)?
                .label("moving average")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .label_font((FONT, LABEL_SIZE))
            .draw()
            .map_err(de)?;
        Ok(())
    }
}

/// Centred moving average of the y values over a window of `max(5, n / 25)`
/// points (odd), truncated at both ends.
fn centred_moving_average(pts: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let half = (pts.len() / 25).max(5) / 2;
    (0..pts.len())
        .map(|i| {
            let lo = i.saturating_sub(half);
            let hi = (i + half + 1).min(pts.len());
            let mean = pts[lo..hi].iter().map(|p| p.1).sum::<f64>() / (hi - lo) as f64;
            (pts[i].0, mean)
        })
        .collect()
}

/// Writes a loss curve of `losses` against `steps` titled `title`.
///
/// # Errors
/// As [`render`].
pub fn loss_curve(
    base: impl AsRef<Path>,
    steps: &[u64],
    losses: &[f64],
    title: &str,
) -> Result<FigureFiles> {
    let mut spec = LossCurveSpec::new(steps, losses);
    spec.title = title.to_owned();
    render(base, &spec)
}

#[cfg(test)]
mod tests;
