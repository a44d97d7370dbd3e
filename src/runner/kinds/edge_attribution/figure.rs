//! The circuit figure: a layered graph of components (embeddings, query heads, KV
//! heads, MLPs, logits) in forward order, one line per component pair carrying edges of
//! the circuit, its width the summed |value| of those edges, its colour the sign of
//! their sum.

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::output::FigureSpec;

const FONT: &str = "sans-serif";

/// A component of the drawn graph: `embed`, `L<l>H<h>`, `L<l>KV<g>`, `L<l>MLP`,
/// `logits`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Component {
    /// Forward column: embed 0, attention of layer l `2l + 1`, MLP `2l + 2`, logits last.
    pub column: usize,
    /// Slot within the column (query heads first, then KV heads).
    pub slot: usize,
    pub label: String,
}

/// The component of a node label (`L2KV0.ck` -> `L2KV0`), from the edge labels of the
/// tables; `n_layers` places the logits.
pub fn component(node: &str, n_layers: usize) -> Option<Component> {
    let name = node.split('.').next()?;
    if name == "embed" {
        return Some(Component {
            column: 0,
            slot: 0,
            label: name.into(),
        });
    }
    if name == "logits" {
        return Some(Component {
            column: 2 * n_layers + 1,
            slot: 0,
            label: name.into(),
        });
    }
    let rest = name.strip_prefix('L')?;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    let layer: usize = digits.parse().ok()?;
    let tail = &rest[digits.len()..];
    let (column, slot) = if tail == "MLP" {
        (2 * layer + 2, 0)
    } else if let Some(h) = tail.strip_prefix("KV") {
        (2 * layer + 1, 1000 + h.parse::<usize>().ok()?)
    } else if let Some(h) = tail.strip_prefix('H') {
        (2 * layer + 1, h.parse::<usize>().ok()?)
    } else {
        return None;
    };
    Some(Component {
        column,
        slot,
        label: name.into(),
    })
}

/// The graph to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct CircuitSpec {
    pub title: String,
    /// Every component, drawn whether or not an edge touches it.
    pub nodes: Vec<Component>,
    /// (from, to, value): indices into `nodes`.
    pub edges: Vec<(usize, usize, f64)>,
}

impl CircuitSpec {
    /// Node positions in `[0, 1]^2`: columns left to right, slots top to bottom.
    fn positions(&self) -> Vec<(f64, f64)> {
        let max_col = self
            .nodes
            .iter()
            .map(|n| n.column)
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        self.nodes
            .iter()
            .map(|n| {
                let mut col: Vec<&Component> =
                    self.nodes.iter().filter(|m| m.column == n.column).collect();
                col.sort();
                let k = col.len() as f64;
                let i = col.iter().position(|m| *m == n).unwrap_or(0) as f64;
                (n.column as f64 / max_col, 1.0 - (i + 1.0) / (k + 1.0))
            })
            .collect()
    }
}

impl FigureSpec for CircuitSpec {
    fn size(&self) -> (u32, u32) {
        (1400, 800)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.nodes.is_empty() {
            return Err("no nodes".into());
        }
        if let Some(e) = self
            .edges
            .iter()
            .find(|e| e.0 >= self.nodes.len() || e.1 >= self.nodes.len())
        {
            return Err(format!(
                "edge {e:?} names a node outside 0..{}",
                self.nodes.len()
            ));
        }
        Ok(())
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> std::result::Result<(), String> {
        let de = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        root.fill(&WHITE).map_err(de)?;
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 26))
            .margin(30)
            .build_cartesian_2d(-0.05f64..1.08f64, -0.02f64..1.02f64)
            .map_err(de)?;
        let pos = self.positions();
        let max = self
            .edges
            .iter()
            .map(|e| e.2.abs())
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);
        for &(a, b, v) in &self.edges {
            if !v.is_finite() || max == 0.0 {
                continue;
            }
            let w = (1.0 + 11.0 * v.abs() / max) as u32;
            let color = if v >= 0.0 {
                RGBColor(200, 60, 40)
            } else {
                RGBColor(40, 90, 200)
            };
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![pos[a], pos[b]],
                    color.mix(0.75).stroke_width(w),
                )))
                .map_err(de)?;
        }
        for (n, &(x, y)) in self.nodes.iter().zip(&pos) {
            let touched = self
                .edges
                .iter()
                .any(|e| (self.nodes[e.0] == *n || self.nodes[e.1] == *n) && e.2.is_finite());
            let fill = if touched {
                RGBColor(60, 60, 60)
            } else {
                RGBColor(200, 200, 200)
            };
            chart
                .draw_series(std::iter::once(Circle::new((x, y), 7, fill.filled())))
                .map_err(de)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    n.label.clone(),
                    (x + 0.008, y + 0.012),
                    (FONT, 15).into_font().color(&fill),
                )))
                .map_err(de)?;
        }
        Ok(())
    }
}
