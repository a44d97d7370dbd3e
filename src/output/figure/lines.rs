//! Lines with CI bands (accuracy by phase), and the band-line drawing other figures reuse.

use super::*;

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
            .caption(&self.title, title_font(&self.title, root))
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
            draw_band_series(&mut chart, s, i, &BandStyle::FULL)?;
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

/// How a band series is drawn: line width, point radius, legend swatch length, whether
/// a single point gets an error bar, whether the line is labelled for the legend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BandStyle {
    pub line_width: u32,
    pub point_radius: u32,
    pub legend_len: i32,
    pub error_bar: bool,
    pub labelled: bool,
}

impl BandStyle {
    /// A full-size line plot ([`line_with_bands`]).
    pub const FULL: BandStyle = BandStyle {
        line_width: 3,
        point_radius: 4,
        legend_len: 24,
        error_bar: true,
        labelled: true,
    };

    /// A small panel of small multiples (thinner lines, no error bar for a single
    /// point); `labelled` in the panel that holds the legend.
    pub fn small(labelled: bool) -> BandStyle {
        BandStyle {
            line_width: 2,
            point_radius: 3,
            legend_len: 20,
            error_bar: false,
            labelled,
        }
    }
}

/// Series `i` of a line plot: its band (where it has two or more finite bounds; for a
/// single point an error bar when the style says so), the line (labelled for the
/// legend when the style says so) and its points.
pub fn draw_band_series<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    s: &BandSeries,
    i: usize,
    style: &BandStyle,
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
    } else if style.error_bar {
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
    let (width, len) = (style.line_width, style.legend_len);
    let line = chart
        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(width)))
        .map_err(de)?;
    if style.labelled {
        line.label(&s.name).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + len, y)], color.stroke_width(width))
        });
    }
    let r = style.point_radius;
    chart
        .draw_series(pts.iter().map(|&p| Circle::new(p, r, color.filled())))
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
