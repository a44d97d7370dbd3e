//! Bar profile: one bar per offset with a reference line.

use super::*;

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
            .caption(&self.title, title_font(&self.title, root))
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
