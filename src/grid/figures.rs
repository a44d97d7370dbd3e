//! The grid's paper-style figures, drawn from the merged rows with the project's
//! plotters figure code ([`crate::output::figure`]): two figure types of their own
//! (points with CI bars per design, small multiples) implement its [`FigureSpec`];
//! the line plots reuse [`line_with_bands`].
//!
//! | file (PNG + SVG) | shows |
//! |---|---|
//! | `phase_gap` | per design: phase gap (pp) and mean accuracy of the final query, 95% cluster-bootstrap CIs, each protocol |
//! | `accuracy_by_phase` | one panel per design: accuracy by phase of the final query, 95% Wilson bands, each protocol |
//! | `seed_variance[_<group>]` | designs that differ only in `seed`: their accuracy-by-phase profiles overlaid |
//! | `accuracy_by_slot` | mean accuracy of the final query when it is the k-th query, per design |
//! | `accuracy_by_bindings` | mean accuracy of a single final query against the number of bindings, per design |
//! | `frontier_<protocol>` | the frontier ([`super::frontier`]): per design pooled over seeds, phase gap against mean accuracy, 95% CIs both ways, coloured by the gate's verdict, the gate as a dashed line |
//! | `frontier_profiles` | one panel per pooled design: its seeds' accuracy-by-phase profiles overlaid (first protocol, 95% Wilson) |

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::analysis::effects::mean_sd;
use crate::error::{Error, Result};
use crate::output::figure::{
    BandStyle, DrawResult, FigureSpec, draw_band_series, fmt_num, series_color,
};
use crate::output::{BandSeries, LinePlotSpec, line_with_bands, render};

use super::merged::{
    Merged, PhaseRow, SummaryRow, bindings_of, detail, final_phases, final_row, protocols,
    seed_groups, slot_of,
};
use super::spec::Grid;

const FONT: &str = "sans-serif";

fn de<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> String {
    e.to_string()
}

/// One series of [`PointRangeSpec`]: a value and an interval per category (`NaN`
/// skips a point).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PointSeries {
    pub name: String,
    pub y: Vec<f64>,
    pub lo: Vec<f64>,
    pub hi: Vec<f64>,
}

/// One panel of [`PointRangeSpec`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PointPanel {
    pub y_label: String,
    pub series: Vec<PointSeries>,
    /// Explicit y range; `None` fits the data.
    pub y_range: Option<(f64, f64)>,
}

/// Categories (designs) on x, one point with a vertical CI bar per series, side by
/// side within a category; panels stacked with the same categories.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PointRangeSpec {
    pub categories: Vec<String>,
    pub panels: Vec<PointPanel>,
    pub title: String,
}

impl FigureSpec for PointRangeSpec {
    fn size(&self) -> (u32, u32) {
        let w = (200 + 110 * self.categories.len() as u32).max(1200);
        (w, 160 + 400 * self.panels.len() as u32)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.categories.is_empty() || self.panels.is_empty() {
            return Err("no categories or no panels".into());
        }
        let n = self.categories.len();
        for p in &self.panels {
            for s in &p.series {
                if s.y.len() != n || s.lo.len() != n || s.hi.len() != n {
                    return Err(format!(
                        "series `{}`: {} categories but y, lo, hi have {}, {}, {}",
                        s.name,
                        n,
                        s.y.len(),
                        s.lo.len(),
                        s.hi.len()
                    ));
                }
            }
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let root = root.titled(&self.title, (FONT, 28)).map_err(de)?;
        let panels = root.split_evenly((self.panels.len(), 1));
        for (k, (area, p)) in panels.iter().zip(&self.panels).enumerate() {
            self.draw_panel(area, p, k + 1 == self.panels.len())?;
        }
        Ok(())
    }
}

/// The chart of a figure panel: f64 on both axes.
type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

impl PointPanel {
    /// The y range fitted to the data (headroom above it for the legend), or 0..1
    /// without finite values.
    fn fitted_range(&self) -> (f64, f64) {
        let vals = self
            .series
            .iter()
            .flat_map(|s| s.y.iter().chain(&s.lo).chain(&s.hi))
            .copied()
            .filter(|v| v.is_finite());
        let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        if lo.is_finite() {
            // Headroom above the data for the legend (upper right).
            let pad = ((hi - lo.min(0.0)) * 0.3).max(0.5);
            (lo.min(0.0) - pad * 0.05, hi + pad)
        } else {
            (0.0, 1.0)
        }
    }
}

impl PointRangeSpec {
    /// Panel `p` in `area`: axes, one point-range series per protocol, the legend;
    /// category labels only under the `last` panel.
    fn draw_panel<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        p: &PointPanel,
        last: bool,
    ) -> DrawResult {
        let n = self.categories.len();
        let (ylo, yhi) = p.y_range.unwrap_or_else(|| p.fitted_range());
        // Category labels horizontal when they fit their slot, else vertical.
        let longest = self
            .categories
            .iter()
            .map(|c| c.chars().count())
            .max()
            .unwrap_or(0);
        let slot = area.dim_in_pixel().0.saturating_sub(120) / n.max(1) as u32;
        let vertical = longest as u32 * 9 > slot;
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(match (last, vertical) {
                (false, _) => 20,
                (true, false) => 40,
                (true, true) => 20 + 9 * longest as u32,
            })
            .y_label_area_size(90)
            .build_cartesian_2d(0f64..n as f64, ylo..yhi)
            .map_err(de)?;
        let cats = &self.categories;
        let xfmt = |v: &f64| {
            let i = v.floor();
            if last && i >= 0.0 && (v - i - 0.5).abs() < 1e-6 {
                cats.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let yfmt = |v: &f64| fmt_num(*v);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(2 * n + 1)
            .x_label_formatter(&xfmt)
            .y_label_formatter(&yfmt)
            .y_desc(&p.y_label)
            .axis_desc_style((FONT, 20))
            .x_label_style(if vertical {
                (FONT, 15)
                    .into_font()
                    .transform(FontTransform::Rotate270)
                    .into_text_style(area)
            } else {
                (FONT, 15).into_font().into_text_style(area)
            })
            .y_label_style((FONT, 16))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()
            .map_err(de)?;
        let m = p.series.len().max(1) as f64;
        for (si, s) in p.series.iter().enumerate() {
            draw_points(&mut chart, s, si, n, m)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .label_font((FONT, 16))
            .draw()
            .map_err(de)?;
        Ok(())
    }
}

/// Series `si` of `m` in a point-range panel of `n` categories: CI bars, then the
/// points (labelled for the legend), offset within each category.
fn draw_points<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    s: &PointSeries,
    si: usize,
    n: usize,
    m: f64,
) -> DrawResult {
    let color = series_color(si);
    let dx = (si as f64 + 0.5) / m * 0.6 + 0.2;
    let pts: Vec<(f64, f64, f64, f64)> = (0..n)
        .filter(|&i| s.y[i].is_finite())
        .map(|i| (i as f64 + dx, s.y[i], s.lo[i], s.hi[i]))
        .collect();
    chart
        .draw_series(
            pts.iter()
                .filter(|p| p.2.is_finite() && p.3.is_finite())
                .map(|&(x, _, lo, hi)| {
                    PathElement::new(vec![(x, lo), (x, hi)], color.stroke_width(3))
                }),
        )
        .map_err(de)?;
    chart
        .draw_series(
            pts.iter()
                .map(|&(x, y, _, _)| Circle::new((x, y), 6, color.filled())),
        )
        .map_err(de)?
        .label(&s.name)
        .legend(move |(x, y)| Circle::new((x + 10, y), 6, color.filled()));
    Ok(())
}

/// One small panel of [`SmallMultiplesSpec`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MiniPanel {
    pub title: String,
    pub series: Vec<BandSeries>,
}

/// A grid of small line plots with bands (same y range), e.g. accuracy by phase per
/// design; the legend is drawn once, in the first panel.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SmallMultiplesSpec {
    pub panels: Vec<MiniPanel>,
    pub cols: usize,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub y_range: (f64, f64),
}

impl SmallMultiplesSpec {
    fn rows(&self) -> usize {
        self.panels.len().div_ceil(self.cols.max(1))
    }
}

impl FigureSpec for SmallMultiplesSpec {
    fn size(&self) -> (u32, u32) {
        (
            40 + 380 * self.cols.max(1) as u32,
            90 + 300 * self.rows() as u32,
        )
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.panels.is_empty() {
            return Err("no panels".into());
        }
        for p in &self.panels {
            for s in &p.series {
                let n = s.x.len();
                if s.y.len() != n || s.lo.len() != n || s.hi.len() != n {
                    return Err(format!(
                        "panel `{}`, series `{}`: lengths differ",
                        p.title, s.name
                    ));
                }
            }
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let root = root.titled(&self.title, (FONT, 28)).map_err(de)?;
        let areas = root.split_evenly((self.rows(), self.cols.max(1)));
        for (k, (area, p)) in areas.iter().zip(&self.panels).enumerate() {
            self.draw_panel(area, k, p)?;
        }
        Ok(())
    }
}

impl SmallMultiplesSpec {
    /// Panel `k` (`p`) in `area`: axes, its series, and the legend in the first panel.
    fn draw_panel<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        k: usize,
        p: &MiniPanel,
    ) -> DrawResult {
        let (ylo, yhi) = self.y_range;
        let xmax = p
            .series
            .iter()
            .flat_map(|s| s.x.iter().copied())
            .fold(0f64, f64::max);
        let mut chart = ChartBuilder::on(area)
            .caption(&p.title, (FONT, 19))
            .margin(8)
            .x_label_area_size(42)
            .y_label_area_size(52)
            .build_cartesian_2d(-0.3f64..xmax + 0.3, ylo..yhi)
            .map_err(de)?;
        let fmt = |v: &f64| fmt_num(*v);
        chart
            .configure_mesh()
            .x_labels((xmax as usize + 1).min(13))
            .y_labels(6)
            .x_label_formatter(&fmt)
            .y_label_formatter(&fmt)
            .x_desc(&self.x_label)
            .y_desc(if k.is_multiple_of(self.cols.max(1)) {
                self.y_label.as_str()
            } else {
                ""
            })
            .axis_desc_style((FONT, 15))
            .label_style((FONT, 13))
            .light_line_style(RGBColor(238, 238, 238))
            .bold_line_style(RGBColor(215, 215, 215))
            .draw()
            .map_err(de)?;
        for (si, s) in p.series.iter().enumerate() {
            draw_band_series(&mut chart, s, si, &BandStyle::small(k == 0))?;
        }
        if k == 0 {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(160, 160, 160))
                .label_font((FONT, 13))
                .draw()
                .map_err(de)?;
        }
        Ok(())
    }
}

fn ferr(e: crate::output::FigureError) -> Error {
    Error::Figure(e)
}

fn profile(rows: &[&PhaseRow], name: &str) -> BandSeries {
    let mut rows: Vec<&&PhaseRow> = rows.iter().collect();
    rows.sort_by_key(|r| r.phase);
    BandSeries {
        name: name.into(),
        x: rows.iter().map(|r| r.phase as f64).collect(),
        y: rows.iter().map(|r| r.accuracy).collect(),
        lo: rows.iter().map(|r| r.wilson_lo).collect(),
        hi: rows.iter().map(|r| r.wilson_hi).collect(),
    }
}

/// Draw every grid figure into `dir` (PNG + SVG); returns the PNG paths.
pub fn draw(grid: &Grid, m: &Merged, dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if m.designs.is_empty() {
        return Ok(out);
    }
    let protos = protocols(m);
    let cats: Vec<String> = m
        .designs
        .iter()
        .filter(|d| protos.iter().any(|p| final_row(m, d, p).is_some()))
        .cloned()
        .collect();
    if !cats.is_empty() {
        out.push(phase_gap(grid, m, &protos, &cats, dir)?);
        out.push(accuracy_by_phase(grid, m, &protos, &cats, dir)?);
    }
    for p in &protos {
        out.extend(frontier_figure(grid, m, p, dir)?);
    }
    if let Some(p) = protos.first() {
        out.extend(frontier_profiles(grid, m, p, dir)?);
    }
    let groups = seed_groups(grid, m);
    let p = protos.first().cloned().unwrap_or_else(|| "prefix".into());
    for (gi, group) in groups.iter().enumerate() {
        let base = if groups.len() == 1 {
            "seed_variance".to_string()
        } else {
            format!("seed_variance_{gi}")
        };
        out.extend(seed_variance(grid, m, &p, group, &dir.join(base))?);
    }
    for fig in &DETAIL_FIGURES {
        out.extend(detail_figure(grid, m, fig, dir)?);
    }
    Ok(out)
}

/// `phase_gap`: phase gap and mean accuracy of the final query per design (`cats`),
/// one point-range series per protocol.
fn phase_gap(
    grid: &Grid,
    m: &Merged,
    protos: &[String],
    cats: &[String],
    dir: &Path,
) -> Result<PathBuf> {
    let series = |f: &dyn Fn(&SummaryRow) -> (f64, f64, f64)| -> Vec<PointSeries> {
        protos
            .iter()
            .map(|p| {
                let v: Vec<(f64, f64, f64)> = cats
                    .iter()
                    .map(|d| final_row(m, d, p).map_or((f64::NAN, f64::NAN, f64::NAN), f))
                    .collect();
                PointSeries {
                    name: format!("{p} padding"),
                    y: v.iter().map(|t| t.0).collect(),
                    lo: v.iter().map(|t| t.1).collect(),
                    hi: v.iter().map(|t| t.2).collect(),
                }
            })
            .collect()
    };
    let spec = PointRangeSpec {
        categories: cats.to_vec(),
        title: format!(
            "{}: phase gap and mean accuracy, final query (95% CI)",
            grid.name
        ),
        panels: vec![
            PointPanel {
                y_label: "phase gap (pp)".into(),
                series: series(&|r| (r.gap_pp, r.gap_ci.0, r.gap_ci.1)),
                y_range: None,
            },
            PointPanel {
                y_label: "mean accuracy".into(),
                series: series(&|r| (r.mean_accuracy, r.mean_ci.0, r.mean_ci.1)),
                y_range: Some((0.0, 1.05)),
            },
        ],
    };
    Ok(render(dir.join("phase_gap"), &spec).map_err(ferr)?.png)
}

/// `accuracy_by_phase`: one small panel per design (`cats`), accuracy by phase of the
/// final query for each protocol.
fn accuracy_by_phase(
    grid: &Grid,
    m: &Merged,
    protos: &[String],
    cats: &[String],
    dir: &Path,
) -> Result<PathBuf> {
    let panels = cats
        .iter()
        .map(|d| MiniPanel {
            title: d.clone(),
            series: protos
                .iter()
                .map(|p| profile(&final_phases(m, d, p), p))
                .filter(|s| !s.x.is_empty())
                .collect(),
        })
        .collect();
    let spec = SmallMultiplesSpec {
        panels,
        cols: 4.min(cats.len()),
        title: format!(
            "{}: accuracy by phase of the target key (final query, 95% Wilson)",
            grid.name
        ),
        x_label: "phase (t_K mod P)".into(),
        y_label: "accuracy".into(),
        y_range: (0.0, 1.02),
    };
    Ok(render(dir.join("accuracy_by_phase"), &spec)
        .map_err(ferr)?
        .png)
}

/// `frontier_<p>`: the frontier points of protocol `p`, one colour per verdict;
/// `None` without points.
fn frontier_figure(grid: &Grid, m: &Merged, p: &str, dir: &Path) -> Result<Option<PathBuf>> {
    use super::frontier::Verdict;
    use crate::output::figure::{ErrorPoint, ErrorScatterSpec, ErrorSeries};
    let rows: Vec<_> = m.frontier.iter().filter(|r| r.protocol == p).collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let gate = grid.max_gap_pp;
    // One seed count for every point goes in the title, not on every label.
    let seeds = rows[0].seeds();
    let same_seeds = rows.iter().all(|r| r.seeds() == seeds);
    let series = [
        (Verdict::Pass, format!("pass: gap CI <= {gate} pp"), 2),
        (Verdict::Inconclusive, "inconclusive".to_string(), 1),
        (Verdict::Fail, format!("fail: gap CI > {gate} pp"), 3),
    ]
    .into_iter()
    .map(|(v, name, color)| ErrorSeries {
        name,
        color: Some(color),
        points: rows
            .iter()
            .filter(|r| r.verdict == v)
            .map(|r| ErrorPoint {
                label: if r.seeds() > 1 && !same_seeds {
                    format!("{} ({} seeds)", r.design, r.seeds())
                } else {
                    r.design.clone()
                },
                x: r.gap_pp,
                x_lo: r.gap_ci.0,
                x_hi: r.gap_ci.1,
                y: r.mean_accuracy,
                y_lo: r.mean_ci.0,
                y_hi: r.mean_ci.1,
            })
            .collect(),
    })
    .filter(|s| !s.points.is_empty())
    .collect();
    let spec = ErrorScatterSpec {
        series,
        title: format!(
            "{}: phase gap vs mean accuracy ({p} padding, final query; {}, 95% CI)",
            grid.name,
            match (same_seeds, seeds) {
                (true, 1) => "one seed".to_string(),
                (true, n) => format!("mean over {n} seeds"),
                (false, _) => "mean over seeds".to_string(),
            }
        ),
        x_label: "phase gap (pp, best - worst phase)".into(),
        y_label: "mean accuracy over phases".into(),
        x_ref: Some((gate, format!("gate {gate} pp"))),
        x_range: None,
        y_range: None,
        size: None,
    };
    let base = dir.join(format!("frontier_{p}"));
    Ok(Some(
        crate::output::figure::error_scatter(base, &spec)
            .map_err(ferr)?
            .png,
    ))
}

/// `frontier_profiles`: one panel per pooled design with a merged seed, its seeds'
/// accuracy-by-phase profiles (protocol `p`) overlaid; `None` without any.
fn frontier_profiles(grid: &Grid, m: &Merged, p: &str, dir: &Path) -> Result<Option<PathBuf>> {
    let panels: Vec<MiniPanel> = m
        .groups
        .iter()
        .filter_map(|g| {
            let series: Vec<BandSeries> = g
                .members
                .iter()
                .map(|d| profile(&final_phases(m, d, p), d))
                .filter(|s| !s.x.is_empty())
                .collect();
            (!series.is_empty()).then(|| MiniPanel {
                title: format!(
                    "{} ({} of {} seeds)",
                    g.label,
                    series.len(),
                    g.members.len()
                ),
                series,
            })
        })
        .collect();
    if panels.is_empty() {
        return Ok(None);
    }
    let spec = SmallMultiplesSpec {
        cols: 4.min(panels.len()),
        panels,
        title: format!(
            "{}: accuracy by phase per design, seeds overlaid ({p} padding, final query, 95% Wilson)",
            grid.name
        ),
        x_label: "phase (t_K mod P)".into(),
        y_label: "accuracy".into(),
        y_range: (0.0, 1.02),
    };
    Ok(Some(
        render(dir.join("frontier_profiles"), &spec)
            .map_err(ferr)?
            .png,
    ))
}

/// A seed group's name in a figure title: its other keys when they fit on the title
/// line, else its first and last design (the report's seed table lists the keys).
fn seed_group_label(grid: &Grid, key: &str, members: &[String]) -> String {
    match (members.first(), members.last()) {
        _ if key.is_empty() => grid.name.clone(),
        (Some(first), Some(last)) if key.len() > 40 => format!("{first} .. {last}"),
        _ => key.to_string(),
    }
}

/// `seed_variance[_<group>]` at `base`: the accuracy-by-phase profiles of a seed group
/// (its key and members) in protocol `p` overlaid; `None` when none has a profile.
fn seed_variance(
    grid: &Grid,
    m: &Merged,
    p: &str,
    (key, members): &(String, Vec<String>),
    base: &Path,
) -> Result<Option<PathBuf>> {
    let gaps: Vec<f64> = members
        .iter()
        .filter_map(|d| final_row(m, d, p).map(|r| r.gap_pp))
        .collect();
    let (mean, sd) = mean_sd(&gaps);
    let spec = LinePlotSpec {
        series: members
            .iter()
            .map(|d| profile(&final_phases(m, d, p), d))
            .filter(|s| !s.x.is_empty())
            .collect(),
        title: format!(
            "seeds of {}: accuracy by phase ({p}); gap {mean:.1} +- {sd:.1} pp (mean +- sd)",
            seed_group_label(grid, key, members)
        ),
        x_label: "phase (t_K mod P)".into(),
        y_label: "accuracy (final query)".into(),
        y_range: Some((0.0, 1.02)),
        size: None,
    };
    if spec.series.is_empty() {
        return Ok(None);
    }
    Ok(Some(line_with_bands(base, &spec).map_err(ferr)?.png))
}

/// A detail-sweep figure: mean accuracy of the final query against `x_of`, per design.
struct DetailFigure {
    eval: &'static str,
    x_of: fn(&SummaryRow) -> i64,
    file: &'static str,
    x_label: &'static str,
    title: &'static str,
}

/// The detail-sweep figures, in drawing order.
const DETAIL_FIGURES: [DetailFigure; 2] = [
    DetailFigure {
        eval: "slot",
        x_of: slot_of,
        file: "accuracy_by_slot",
        x_label: "query slot of the final query (k - 1 queries before it)",
        title: "accuracy by query slot (a flat line: no gain from the queries before)",
    },
    DetailFigure {
        eval: "bindings",
        x_of: bindings_of,
        file: "accuracy_by_bindings",
        x_label: "bindings in the prompt",
        title: "accuracy of a single final query by number of bindings",
    },
];

/// Draw `fig` into `dir`; `None` when no design has that sweep.
fn detail_figure(
    grid: &Grid,
    m: &Merged,
    fig: &DetailFigure,
    dir: &Path,
) -> Result<Option<PathBuf>> {
    let x_of = fig.x_of;
    let series: Vec<BandSeries> = m
        .designs
        .iter()
        .filter_map(|d| {
            let rows = detail(m, d, fig.eval, x_of);
            (!rows.is_empty()).then(|| BandSeries {
                name: d.clone(),
                x: rows.iter().map(|r| x_of(r) as f64).collect(),
                y: rows.iter().map(|r| r.mean_accuracy).collect(),
                lo: rows.iter().map(|r| r.mean_ci.0).collect(),
                hi: rows.iter().map(|r| r.mean_ci.1).collect(),
            })
        })
        .collect();
    if series.is_empty() {
        return Ok(None);
    }
    let spec = LinePlotSpec {
        series,
        title: format!("{}: {}", grid.name, fig.title),
        x_label: fig.x_label.into(),
        y_label: "mean accuracy (95% CI)".into(),
        y_range: Some((0.0, 1.02)),
        size: Some((1200, 760)),
    };
    Ok(Some(
        line_with_bands(dir.join(fig.file), &spec)
            .map_err(ferr)?
            .png,
    ))
}
