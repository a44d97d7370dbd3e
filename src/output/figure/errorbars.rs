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
                .draw_series(
                    pts.iter()
                        .map(|p| Circle::new((p.x, p.y), MARKER, color.filled())),
                )
                .map_err(de)?
                .label(&s.name)
                .legend(move |(x, y)| Circle::new((x + 12, y), MARKER, color.filled()));
        }
        self.draw_labels(root, &chart)?;
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

impl ErrorScatterSpec {
    /// Draws every point's label where [`place_labels`] puts it, with a thin leader
    /// line to its point when the label had to move away from it.
    fn draw_labels<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        chart: &ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    ) -> DrawResult {
        let font = TextStyle::from((FONT, LABEL_SIZE).into_font());
        let pts: Vec<&ErrorPoint> = self.points().collect();
        let at: Vec<(i32, i32)> = pts
            .iter()
            .map(|p| chart.backend_coord(&(p.x, p.y)))
            .collect();
        let sizes = pts
            .iter()
            .map(|p| root.estimate_text_size(&p.label, &font).map_err(de))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        let mut blocked = vec![self.legend_box((xs.end, ys.start), root, &font)?];
        if let Some((x, _)) = &self.x_ref {
            // The reference line's own legend text sits in the legend; the line is thin.
            let (px, _) = chart.backend_coord(&(*x, 0.0));
            blocked.push((px - 1, ys.start, px + 1, ys.end));
        }
        let placed = place_labels(&at, &sizes, &blocked, (xs.start, ys.start, xs.end, ys.end));
        let grey = RGBColor(120, 120, 120);
        for ((p, &(px, py)), (&(w, h), &(lx, ly))) in
            pts.iter().zip(&at).zip(sizes.iter().zip(&placed))
        {
            let (w, h) = (w as i32, h as i32);
            // Leader line from the marker's edge to the nearest point of the label.
            let nx = px.clamp(lx, lx + w);
            let ny = py.clamp(ly, ly + h);
            let (dx, dy) = (f64::from(nx - px), f64::from(ny - py));
            let d = dx.hypot(dy);
            if d > f64::from(MARKER + 8) {
                let from = (
                    px + (dx / d * f64::from(MARKER)) as i32,
                    py + (dy / d * f64::from(MARKER)) as i32,
                );
                root.draw(&PathElement::new(
                    vec![from, (nx, ny)],
                    grey.stroke_width(1),
                ))
                .map_err(de)?;
            }
            // A light box keeps the label readable over error bars and the grid.
            root.draw(&Rectangle::new(
                [(lx - 2, ly - 1), (lx + w + 2, ly + h + 1)],
                WHITE.mix(0.75).filled(),
            ))
            .map_err(de)?;
            root.draw(&Text::new(p.label.clone(), (lx, ly), font.clone()))
                .map_err(de)?;
        }
        Ok(())
    }

    /// The legend box's pixel rectangle (upper right of the plot, as plotters draws
    /// it: one row per named series and the reference line), so labels avoid it.
    fn legend_box<DB: DrawingBackend>(
        &self,
        (right, top): (i32, i32),
        root: &DrawingArea<DB, Shift>,
        font: &TextStyle<'_>,
    ) -> std::result::Result<Rect, String> {
        let names: Vec<&str> = self
            .series
            .iter()
            .map(|s| s.name.as_str())
            .chain(self.x_ref.as_ref().map(|r| r.1.as_str()))
            .collect();
        let mut w = 0;
        for n in &names {
            w = w.max(root.estimate_text_size(n, font).map_err(de)?.0 as i32);
        }
        let rows = names.len() as i32;
        Ok((
            right - w - 70,
            top,
            right,
            top + rows * (LABEL_SIZE as i32 + 12) + 24,
        ))
    }
}

/// Marker radius in pixels.
const MARKER: i32 = 7;

/// A pixel rectangle `(x0, y0, x1, y1)`.
pub(crate) type Rect = (i32, i32, i32, i32);

fn overlap(a: Rect, b: Rect) -> i64 {
    let w = (a.2.min(b.2) - a.0.max(b.0)).max(0);
    let h = (a.3.min(b.3) - a.1.max(b.1)).max(0);
    i64::from(w) * i64::from(h)
}

/// Top-left corners for the labels of `sizes` (pixels) next to the points `at`, so
/// that labels overlap neither each other, nor any point's marker, nor the `blocked`
/// rectangles (the legend), and stay inside `area`. Crowded points are placed first;
/// each takes the first free position of a ring of candidates around its point (right
/// above, right, right below, left ..., above, below, then the same rows further out);
/// where none is free, the one with the least overlap. Deterministic.
pub(crate) fn place_labels(
    at: &[(i32, i32)],
    sizes: &[(u32, u32)],
    blocked: &[Rect],
    area: Rect,
) -> Vec<(i32, i32)> {
    let g = MARKER + 3;
    let markers: Vec<Rect> = at
        .iter()
        .map(|&(x, y)| {
            (
                x - MARKER - 1,
                y - MARKER - 1,
                x + MARKER + 1,
                y + MARKER + 1,
            )
        })
        .collect();
    // Crowded first: more neighbours within 120 px.
    let mut order: Vec<usize> = (0..at.len()).collect();
    let crowd = |i: usize| {
        at.iter()
            .filter(|&&(x, y)| (x - at[i].0).abs() < 120 && (y - at[i].1).abs() < 60)
            .count()
    };
    order.sort_by_key(|&i| (std::cmp::Reverse(crowd(i)), at[i].0, at[i].1));
    let mut placed: Vec<Option<Rect>> = vec![None; at.len()];
    for &i in &order {
        let (px, py) = at[i];
        let (w, h) = (sizes[i].0 as i32, sizes[i].1 as i32);
        let mut candidates = Vec::new();
        for ring in 0..8 {
            let step = ring * (h + 2);
            let up = py - g - h - step;
            let down = py + g + step;
            let mid_up = py - h / 2 - step;
            let mid_down = py - h / 2 + step;
            for (x, y) in [
                (px + g, up),
                (px + g, mid_up),
                (px + g, down),
                (px - g - w, up),
                (px - g - w, mid_up),
                (px - g - w, down),
                (px - w / 2, up),
                (px - w / 2, down),
                (px + g, mid_down),
                (px - g - w, mid_down),
            ] {
                candidates.push((x, y));
            }
        }
        let cost = |(x, y): (i32, i32)| {
            let r = (x, y, x + w, y + h);
            let inside = overlap(r, area);
            let outside = i64::from(w) * i64::from(h) - inside;
            let others: i64 = placed.iter().flatten().map(|&o| overlap(r, o)).sum();
            let marks: i64 = markers.iter().map(|&m| overlap(r, m)).sum();
            let block: i64 = blocked.iter().map(|&b| overlap(r, b)).sum();
            outside * 4 + others * 2 + marks * 2 + block
        };
        let best = candidates
            .iter()
            .copied()
            .find(|&c| cost(c) == 0)
            .unwrap_or_else(|| {
                candidates
                    .iter()
                    .copied()
                    .min_by_key(|&c| cost(c))
                    .expect("candidates are never empty")
            });
        placed[i] = Some((best.0, best.1, best.0 + w, best.1 + h));
    }
    placed
        .into_iter()
        .map(|r| r.map(|r| (r.0, r.1)).expect("every label is placed"))
        .collect()
}

/// Writes labelled points with error bars (see [`ErrorScatterSpec`]).
///
/// # Errors
/// As [`render`].
pub fn error_scatter(base: impl AsRef<Path>, spec: &ErrorScatterSpec) -> Result<FigureFiles> {
    render(base, spec)
}
