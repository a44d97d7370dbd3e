//! Labelled points with horizontal and vertical error bars (a frontier: phase gap
//! against mean accuracy per design), with an optional vertical reference line (a
//! gate).

use super::*;

/// One labelled point with its intervals (`NaN` bounds draw no bar; a point with a
/// non-finite `x` or `y` is skipped).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ErrorPoint {
    /// Drawn next to the point.
    pub label: String,
    pub x: f64,
    pub x_lo: f64,
    pub x_hi: f64,
    pub y: f64,
    pub y_lo: f64,
    pub y_hi: f64,
}

/// One legend entry: points of one colour.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ErrorSeries {
    pub name: String,
    pub points: Vec<ErrorPoint>,
    /// Palette index ([`series_color`]); `None`: the series' position.
    pub color: Option<usize>,
}

/// Points with error bars in both directions, labelled, one colour per series, and a
/// dashed vertical line at `x_ref` (with its legend text).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ErrorScatterSpec {
    pub series: Vec<ErrorSeries>,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub x_ref: Option<(f64, String)>,
    /// Explicit axis ranges; `None` fits the data (x: with the reference line; y: with
    /// headroom for the legend).
    pub x_range: Option<(f64, f64)>,
    pub y_range: Option<(f64, f64)>,
    /// Pixel size; `None` is 1100 x 820.
    pub size: Option<(u32, u32)>,
}

impl ErrorScatterSpec {
    fn points(&self) -> impl Iterator<Item = &ErrorPoint> {
        self.series
            .iter()
            .flat_map(|s| &s.points)
            .filter(|p| p.x.is_finite() && p.y.is_finite())
    }

    fn ranges(&self) -> (Range<f64>, Range<f64>) {
        let xs = self
            .points()
            .flat_map(|p| [p.x, p.x_lo, p.x_hi])
            .chain(self.x_ref.as_ref().map(|r| r.0));
        let ys = self.points().flat_map(|p| [p.y, p.y_lo, p.y_hi]);
        let x = match self.x_range {
            Some((a, b)) => a..b,
            None => padded_range(xs, 0.08, (0.0, 1.0)),
        };
        let y = match self.y_range {
            Some((a, b)) => a..b,
            None => {
                // Headroom above the data for the legend (upper right).
                let r = padded_range(ys, 0.08, (0.0, 1.0));
                r.start..r.end + 0.25 * (r.end - r.start)
            }
        };
        (x, y)
    }
}

impl FigureSpec for ErrorScatterSpec {
    fn size(&self) -> (u32, u32) {
        self.size.unwrap_or((1100, 820))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.points().next().is_none() {
            return Err("no point with a finite x and y".into());
        }
        for (a, b) in [self.x_range, self.y_range].into_iter().flatten() {
            if !(a.is_finite() && b.is_finite() && a < b) {
                return Err(format!("axis range {a}..{b} is empty or not finite"));
            }
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(de)?;
        let (xr, yr) = self.ranges();
        let mut chart = numeric_chart(
            root,
            (&self.title, TITLE_SIZE - 6),
            (xr.clone(), yr.clone()),
            (&self.x_label, &self.y_label),
        )?;
        if let Some((x, text)) = &self.x_ref {
            let grey = RGBColor(90, 90, 90);
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(*x, yr.start), (*x, yr.end)],
                    10,
                    6,
                    grey.stroke_width(2),
                ))
                .map_err(de)?
                .label(text)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], grey.stroke_width(2))
                });
        }
        for (i, s) in self.series.iter().enumerate() {
            let color = series_color(s.color.unwrap_or(i));
            let pts: Vec<&ErrorPoint> = s
                .points
                .iter()
                .filter(|p| p.x.is_finite() && p.y.is_finite())
                .collect();
            let bars = pts.iter().flat_map(|p| {
                let mut v = Vec::new();
                if p.x_lo.is_finite() && p.x_hi.is_finite() {
                    v.push(vec![(p.x_lo, p.y), (p.x_hi, p.y)]);
                }
                if p.y_lo.is_finite() && p.y_hi.is_finite() {
                    v.push(vec![(p.x, p.y_lo), (p.x, p.y_hi)]);
                }
                v
            });
            chart
                .draw_series(bars.map(|line| PathElement::new(line, color.stroke_width(2))))
                .map_err(de)?;
            chart
                .draw_series(pts.iter().map(|p| {
                    EmptyElement::at((p.x, p.y))
                        + Circle::new((0, 0), 7, color.filled())
                        + Text::new(p.label.clone(), (9, -22), (FONT, LABEL_SIZE).into_font())
                }))
                .map_err(de)?
                .label(&s.name)
                .legend(move |(x, y)| Circle::new((x + 12, y), 7, color.filled()));
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

/// Writes labelled points with error bars (see [`ErrorScatterSpec`]).
///
/// # Errors
/// As [`render`].
pub fn error_scatter(base: impl AsRef<Path>, spec: &ErrorScatterSpec) -> Result<FigureFiles> {
    render(base, spec)
}
