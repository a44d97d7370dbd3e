//! Predicted vs observed: points, the y = x line, R^2 and MAE in the title.

use super::*;

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
        let mut chart = numeric_chart(
            root,
            (&title, TITLE_SIZE - 4),
            (r.clone(), r.clone()),
            (&self.x_label, &self.y_label),
        )?;
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
