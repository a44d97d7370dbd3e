//! Loss curve: training loss against step with a moving average.

use super::*;

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
            .caption(&self.title, title_font(&self.title, root))
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
pub(super) fn centred_moving_average(pts: &[(f64, f64)]) -> Vec<(f64, f64)> {
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
