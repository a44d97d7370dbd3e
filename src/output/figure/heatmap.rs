//! Heatmap: a matrix drawn as coloured cells with a colour bar.

use super::*;

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
            root.titled(
                &self.title,
                (FONT, title_size(&self.title, w, TITLE_SIZE)).into_font(),
            )
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
