//! Experiment reports: `report.md` and a self-contained `report.html` (inline
//! CSS, no scripts, no external resources except the figures, which are
//! referenced by paths relative to the report's directory).
//!
//! A [`Report`] is a list of blocks (sections, paragraphs, headline numbers,
//! tables, figures, code) rendered identically to Markdown and HTML.

use std::fmt::Display;
use std::path::{Component, Path, PathBuf};

use super::atomic::write_bytes_atomic;
use super::figure::FigureFiles;
use super::table::{ColumnData, Table};
use crate::analysis::{PhaseGap, RankedHead};

/// Errors of report writing.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Filesystem error on `path`.
    #[error("report {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A headline number: a label, its value and an optional detail (e.g. the CI).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headline {
    /// What is measured (`Phase gap`).
    pub label: String,
    /// The value as displayed (`13.9 pp`).
    pub value: String,
    /// Extra context (`95% CI 12.1-15.7, 2000 cluster-bootstrap replicates`).
    pub detail: Option<String>,
}

impl Headline {
    /// A headline without detail.
    pub fn new(label: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            value: value.into(),
            detail: None,
        }
    }

    /// Adds a detail line.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Block {
    Heading(u8, String),
    Paragraph(String),
    Headlines(Vec<Headline>),
    Table {
        caption: String,
        header: Vec<String>,
        rows: Vec<Vec<String>>,
    },
    Figure {
        caption: String,
        image: PathBuf,
        vector: Option<PathBuf>,
    },
    Code(String, String),
}

/// The paths written by [`Report::write`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportFiles {
    /// `<dir>/report.md`.
    pub markdown: PathBuf,
    /// `<dir>/report.html`.
    pub html: PathBuf,
}

/// A report under construction.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    title: String,
    blocks: Vec<Block>,
}

impl Report {
    /// An empty report with a title (the Markdown `#` heading and HTML `<title>`).
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            blocks: Vec::new(),
        }
    }

    /// A section heading (`##`).
    pub fn section(&mut self, heading: impl Into<String>) -> &mut Self {
        self.blocks.push(Block::Heading(2, heading.into()));
        self
    }

    /// A subsection heading (`###`).
    pub fn subsection(&mut self, heading: impl Into<String>) -> &mut Self {
        self.blocks.push(Block::Heading(3, heading.into()));
        self
    }

    /// A paragraph of plain text (escaped in HTML).
    pub fn paragraph(&mut self, text: impl Into<String>) -> &mut Self {
        self.blocks.push(Block::Paragraph(text.into()));
        self
    }

    /// One headline number; consecutive headlines form one list.
    pub fn headline(&mut self, headline: Headline) -> &mut Self {
        if let Some(Block::Headlines(list)) = self.blocks.last_mut() {
            list.push(headline);
        } else {
            self.blocks.push(Block::Headlines(vec![headline]));
        }
        self
    }

    /// Several headline numbers.
    pub fn headlines(&mut self, headlines: impl IntoIterator<Item = Headline>) -> &mut Self {
        for h in headlines {
            self.headline(h);
        }
        self
    }

    /// A table of preformatted cells; rows shorter than the header are padded.
    pub fn table(
        &mut self,
        caption: impl Into<String>,
        header: Vec<String>,
        rows: Vec<Vec<String>>,
    ) -> &mut Self {
        let width = header.len();
        let rows = rows
            .into_iter()
            .map(|mut r| {
                r.resize(width.max(r.len()), String::new());
                r
            })
            .collect();
        self.blocks.push(Block::Table {
            caption: caption.into(),
            header,
            rows,
        });
        self
    }

    /// The first `max_rows` rows of a [`Table`] (floats with 4 significant
    /// decimals, nulls empty); the caption notes omitted rows.
    pub fn data_table(
        &mut self,
        caption: impl Into<String>,
        table: &Table,
        max_rows: usize,
    ) -> &mut Self {
        let header: Vec<String> = table.column_names().iter().map(|s| s.to_string()).collect();
        let shown = table.num_rows().min(max_rows);
        let rows = (0..shown)
            .map(|i| {
                table
                    .columns()
                    .iter()
                    .map(|c| match &c.data {
                        ColumnData::Utf8(v) => v[i].clone().unwrap_or_default(),
                        ColumnData::Int64(v) => v[i].map_or_else(String::new, |x| x.to_string()),
                        ColumnData::UInt64(v) => v[i].map_or_else(String::new, |x| x.to_string()),
                        ColumnData::Float64(v) => v[i].map_or_else(String::new, fmt_cell),
                        ColumnData::Boolean(v) => v[i].map_or_else(String::new, |x| x.to_string()),
                    })
                    .collect()
            })
            .collect();
        let mut caption = caption.into();
        if shown < table.num_rows() {
            caption.push_str(&format!(" (first {shown} of {} rows)", table.num_rows()));
        }
        self.table(caption, header, rows)
    }

    /// A figure (PNG path; absolute, or relative to the report directory).
    pub fn figure(&mut self, caption: impl Into<String>, image: impl AsRef<Path>) -> &mut Self {
        self.blocks.push(Block::Figure {
            caption: caption.into(),
            image: image.as_ref().to_path_buf(),
            vector: None,
        });
        self
    }

    /// A rendered figure: the PNG is shown, and in HTML it links to the SVG.
    pub fn figure_files(&mut self, caption: impl Into<String>, files: &FigureFiles) -> &mut Self {
        self.blocks.push(Block::Figure {
            caption: caption.into(),
            image: files.png.clone(),
            vector: Some(files.svg.clone()),
        });
        self
    }

    /// A code block (e.g. the experiment TOML), with a language tag for Markdown.
    pub fn code(&mut self, language: impl Into<String>, text: impl Into<String>) -> &mut Self {
        self.blocks.push(Block::Code(language.into(), text.into()));
        self
    }

    /// The report as Markdown, with figure paths relative to `dir`.
    pub fn to_markdown(&self, dir: &Path) -> String {
        let mut out = format!("# {}\n\n", md_inline(&self.title));
        for block in &self.blocks {
            match block {
                Block::Heading(level, text) => {
                    out.push_str(&format!(
                        "{} {}\n\n",
                        "#".repeat(usize::from(*level)),
                        md_inline(text)
                    ));
                }
                Block::Paragraph(text) => out.push_str(&format!("{}\n\n", text.trim())),
                Block::Headlines(list) => {
                    for h in list {
                        out.push_str(&format!(
                            "- **{}**: {}",
                            md_inline(&h.label),
                            md_inline(&h.value)
                        ));
                        if let Some(d) = &h.detail {
                            out.push_str(&format!(" ({})", md_inline(d)));
                        }
                        out.push('\n');
                    }
                    out.push('\n');
                }
                Block::Table {
                    caption,
                    header,
                    rows,
                } => {
                    if !caption.is_empty() {
                        out.push_str(&format!("*{}*\n\n", md_inline(caption)));
                    }
                    let cells = |r: &[String]| {
                        format!(
                            "| {} |\n",
                            r.iter().map(|c| md_cell(c)).collect::<Vec<_>>().join(" | ")
                        )
                    };
                    out.push_str(&cells(header));
                    out.push_str(&format!("|{}\n", "---|".repeat(header.len().max(1))));
                    for r in rows {
                        out.push_str(&cells(r));
                    }
                    out.push('\n');
                }
                Block::Figure {
                    caption,
                    image,
                    vector,
                } => {
                    let img = url_path(&relative_to(image, dir));
                    out.push_str(&format!("![{}]({img})\n\n", md_inline(caption)));
                    let mut line = format!("*{}*", md_inline(caption));
                    if let Some(v) = vector {
                        line.push_str(&format!(" ([SVG]({}))", url_path(&relative_to(v, dir))));
                    }
                    out.push_str(&line);
                    out.push_str("\n\n");
                }
                Block::Code(lang, text) => {
                    let fence = if text.contains("```") { "~~~~" } else { "```" };
                    out.push_str(&format!("{fence}{lang}\n{}\n{fence}\n\n", text.trim_end()));
                }
            }
        }
        out
    }

    /// The report as a self-contained HTML page, with figure paths relative to `dir`.
    pub fn to_html(&self, dir: &Path) -> String {
        let mut body = format!("<h1>{}</h1>\n", esc(&self.title));
        for block in &self.blocks {
            match block {
                Block::Heading(level, text) => {
                    body.push_str(&format!("<h{level}>{}</h{level}>\n", esc(text)));
                }
                Block::Paragraph(text) => body.push_str(&format!("<p>{}</p>\n", esc(text.trim()))),
                Block::Headlines(list) => html_headlines(&mut body, list),
                Block::Table {
                    caption,
                    header,
                    rows,
                } => html_table(&mut body, caption, header, rows),
                Block::Figure {
                    caption,
                    image,
                    vector,
                } => {
                    let img = format!(
                        "<img src=\"{}\" alt=\"{}\">",
                        esc(&url_path(&relative_to(image, dir))),
                        esc(caption)
                    );
                    let img = match vector {
                        Some(v) => format!(
                            "<a href=\"{}\">{img}</a>",
                            esc(&url_path(&relative_to(v, dir)))
                        ),
                        None => img,
                    };
                    body.push_str(&format!(
                        "<figure>{img}<figcaption>{}</figcaption></figure>\n",
                        esc(caption)
                    ));
                }
                Block::Code(_, text) => {
                    body.push_str(&format!(
                        "<pre><code>{}</code></pre>\n",
                        esc(text.trim_end())
                    ));
                }
            }
        }
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
             <title>{}</title>\n<style>\n{CSS}</style>\n</head>\n<body>\n<main>\n{body}</main>\n</body>\n</html>\n",
            esc(&self.title)
        )
    }

    /// Writes `report.md` and `report.html` into `dir` (created if missing),
    /// atomically.
    ///
    /// # Errors
    /// [`ReportError::Io`] naming the file.
    pub fn write(&self, dir: impl AsRef<Path>) -> Result<ReportFiles, ReportError> {
        let dir = dir.as_ref();
        let markdown = dir.join("report.md");
        let html = dir.join("report.html");
        write_bytes_atomic(&markdown, self.to_markdown(dir).as_bytes()).map_err(|source| {
            ReportError::Io {
                path: markdown.clone(),
                source,
            }
        })?;
        write_bytes_atomic(&html, self.to_html(dir).as_bytes()).map_err(|source| {
            ReportError::Io {
                path: html.clone(),
                source,
            }
        })?;
        Ok(ReportFiles { markdown, html })
    }
}

/// A headlines block as HTML, appended to `body`.
fn html_headlines(body: &mut String, list: &[Headline]) {
    body.push_str("<div class=\"headlines\">\n");
    for h in list {
        body.push_str(&format!(
            "<div class=\"headline\"><div class=\"label\">{}</div><div class=\"value\">{}</div>",
            esc(&h.label),
            esc(&h.value)
        ));
        if let Some(d) = &h.detail {
            body.push_str(&format!("<div class=\"detail\">{}</div>", esc(d)));
        }
        body.push_str("</div>\n");
    }
    body.push_str("</div>\n");
}

/// A table block as HTML (numeric-looking cells classed `num`), appended to `body`.
fn html_table(body: &mut String, caption: &str, header: &[String], rows: &[Vec<String>]) {
    body.push_str("<table>\n");
    if !caption.is_empty() {
        body.push_str(&format!("<caption>{}</caption>\n", esc(caption)));
    }
    body.push_str("<thead><tr>");
    for h in header {
        body.push_str(&format!("<th>{}</th>", esc(h)));
    }
    body.push_str("</tr></thead>\n<tbody>\n");
    for r in rows {
        body.push_str("<tr>");
        for c in r {
            let class = if looks_numeric(c) {
                " class=\"num\""
            } else {
                ""
            };
            body.push_str(&format!("<td{class}>{}</td>", esc(c)));
        }
        body.push_str("</tr>\n");
    }
    body.push_str("</tbody>\n</table>\n");
}

/// The headline numbers of a phase sweep: mean accuracy, best and worst phase,
/// and the phase gap with its selection-adjusted CI (see
/// [`crate::analysis::phase_gap`]).
pub fn phase_gap_headlines(gap: &PhaseGap) -> Vec<Headline> {
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    let level = format!("{:.0}%", 100.0 * gap.level);
    vec![
        Headline::new("Mean accuracy", pct(gap.mean_accuracy)).with_detail(format!(
            "{level} CI {}-{}, {} logical examples",
            pct(gap.mean_ci.0),
            pct(gap.mean_ci.1),
            gap.n_clusters
        )),
        Headline::new("Best phase", format!("{}", gap.best_phase))
            .with_detail(format!("accuracy {}", pct(gap.accuracy[gap.best_phase]))),
        Headline::new("Worst phase", format!("{}", gap.worst_phase))
            .with_detail(format!("accuracy {}", pct(gap.accuracy[gap.worst_phase]))),
        Headline::new("Phase gap", format!("{:.1} pp", gap.gap_pp)).with_detail(format!(
            "{level} CI {:.1}-{:.1} pp (selection-adjusted cluster bootstrap, {} replicates)",
            gap.ci_lo_pp, gap.ci_hi_pp, gap.reps
        )),
    ]
}

/// Header and rows of a table of ranked heads (rank, head, score, effective
/// phases, peak phase, total effect), for [`Report::table`].
pub fn ranked_heads_rows<K: Display>(heads: &[RankedHead<K>]) -> (Vec<String>, Vec<Vec<String>>) {
    let header = [
        "rank",
        "head",
        "specialization",
        "effective phases",
        "peak phase",
        "total effect",
    ]
    .map(String::from)
    .to_vec();
    let rows = heads
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let s = &h.specialization;
            vec![
                (i + 1).to_string(),
                h.key.to_string(),
                s.score.map_or_else(String::new, |v| format!("{v:.3}")),
                s.effective_phases
                    .map_or_else(String::new, |v| format!("{v:.2}")),
                s.peak_phase.map_or_else(String::new, |v| v.to_string()),
                fmt_cell(s.total_effect),
            ]
        })
        .collect();
    (header, rows)
}

/// Table cell text of a float: 4 decimals (trailing zeros trimmed) in
/// `[1e-3, 1e6)`, scientific otherwise, `0` for both zeros, `NaN`/`inf` spelled out.
fn fmt_cell(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    if v == 0.0 {
        return "0".into();
    }
    if (1e-3..1e6).contains(&v.abs()) {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        format!("{v:.3e}")
    }
}

fn looks_numeric(s: &str) -> bool {
    !s.is_empty() && s.parse::<f64>().is_ok()
}

fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Single-line Markdown text (newlines folded).
fn md_inline(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

fn md_cell(s: &str) -> String {
    md_inline(s).replace('|', "\\|")
}

/// `path` relative to `dir`: relative paths are taken as already relative to
/// `dir`; absolute ones are expressed with `..` where needed.
fn relative_to(path: &Path, dir: &Path) -> PathBuf {
    if path.is_relative() || dir.is_relative() {
        if let Ok(p) = path.strip_prefix(dir) {
            return p.to_path_buf();
        }
        return path.to_path_buf();
    }
    let p: Vec<Component> = path.components().collect();
    let d: Vec<Component> = dir.components().collect();
    let common = p.iter().zip(&d).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..d.len() {
        out.push("..");
    }
    for c in &p[common..] {
        out.push(c.as_os_str());
    }
    out
}

/// A path as a URL path: `/` separators, spaces and specials percent-encoded.
fn url_path(p: &Path) -> String {
    let s = p
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/");
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

const CSS: &str = "\
body { font-family: -apple-system, 'Segoe UI', 'DejaVu Sans', Helvetica, Arial, sans-serif; color: #222; background: #fff; margin: 0; line-height: 1.5; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 32px 64px; }
h1 { font-size: 1.9em; border-bottom: 2px solid #ddd; padding-bottom: 8px; }
h2 { font-size: 1.4em; margin-top: 2em; border-bottom: 1px solid #eee; padding-bottom: 4px; }
h3 { font-size: 1.15em; margin-top: 1.5em; }
.headlines { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
.headline { border: 1px solid #ddd; border-radius: 6px; padding: 10px 14px; min-width: 180px; background: #fafafa; }
.headline .label { font-size: 0.85em; color: #666; text-transform: uppercase; letter-spacing: 0.03em; }
.headline .value { font-size: 1.6em; font-weight: 600; }
.headline .detail { font-size: 0.85em; color: #555; }
table { border-collapse: collapse; margin: 16px 0; font-size: 0.92em; }
caption { caption-side: top; text-align: left; font-style: italic; color: #555; padding-bottom: 6px; }
th, td { border: 1px solid #ddd; padding: 4px 10px; }
th { background: #f3f3f3; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tbody tr:nth-child(even) { background: #fbfbfb; }
figure { margin: 24px 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.92em; margin-top: 6px; }
pre { background: #f6f8fa; padding: 12px; overflow-x: auto; border-radius: 4px; }
";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{PhaseCluster, phase_gap, rank_specialized};

    fn sample(dir: &Path) -> Report {
        let clusters: Vec<PhaseCluster> = (0..40)
            .map(|i| PhaseCluster::from_correct(&[i % 2 == 0, i % 3 == 0, true, i % 5 == 0]))
            .collect();
        let gap = phase_gap(&clusters, 200, 1, 0.95).unwrap();
        let ranked = rank_specialized(
            &[
                ("L0.H1".to_string(), vec![0.0, 1.0, 0.0, 0.0]),
                ("L1.H0".to_string(), vec![0.5, 0.5, 0.0, 0.0]),
            ],
            5,
            0.0,
        )
        .unwrap();
        let (header, rows) = ranked_heads_rows(&ranked);
        let mut r = Report::new("patch-heads: v4pro <mini>");
        r.section("Headline numbers")
            .headlines(phase_gap_headlines(&gap))
            .paragraph("Phase = t mod 8 & the gap uses <all> phases.")
            .section("Heads")
            .table("Top specialized heads", header, rows)
            .figure("Accuracy by phase", dir.join("figs/acc by phase.png"))
            .figure_files(
                "Layer x head, phase 0",
                &FigureFiles {
                    png: PathBuf::from("figs/h0.png"),
                    svg: PathBuf::from("figs/h0.svg"),
                },
            )
            .code("toml", "[experiment]\nkind = \"patch-heads\"\n");
        r
    }

    #[test]
    fn writes_markdown_and_html() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("reports/v4pro");
        let files = sample(&out).write(&out).unwrap();
        let md = std::fs::read_to_string(&files.markdown).unwrap();
        assert!(md.starts_with("# patch-heads: v4pro <mini>\n"));
        assert!(md.contains("## Headline numbers"));
        assert!(md.contains("- **Phase gap**: "));
        assert!(md.contains("| rank | head | specialization |"));
        assert!(md.contains("| 1 | L0.H1 | 1.000 | 1.00 | 1 | 1 |"), "{md}");
        assert!(
            md.contains("![Accuracy by phase](figs/acc%20by%20phase.png)"),
            "{md}"
        );
        assert!(md.contains("![Layer x head, phase 0](figs/h0.png)"));
        assert!(md.contains("([SVG](figs/h0.svg))"));
        assert!(md.contains("```toml\n[experiment]"));

        let html = std::fs::read_to_string(&files.html).unwrap();
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<title>patch-heads: v4pro &lt;mini&gt;</title>"));
        assert!(html.contains("<style>") && !html.contains("<script") && !html.contains("http"));
        assert!(html.contains("&amp; the gap uses &lt;all&gt; phases."));
        assert!(html.contains("<img src=\"figs/acc%20by%20phase.png\""));
        assert!(html.contains("<a href=\"figs/h0.svg\"><img src=\"figs/h0.png\""));
        assert!(html.contains("<td class=\"num\">1.000</td>"));
        assert!(html.contains("kind = &quot;patch-heads&quot;"));
        assert!(html.trim_end().ends_with("</html>"));
    }

    #[test]
    fn relative_paths() {
        let d = Path::new("/a/reports/x");
        assert_eq!(
            relative_to(Path::new("/a/reports/x/f.png"), d),
            PathBuf::from("f.png")
        );
        assert_eq!(
            relative_to(Path::new("/a/reports/y/f.png"), d),
            PathBuf::from("../y/f.png")
        );
        assert_eq!(
            relative_to(Path::new("sub/f.png"), d),
            PathBuf::from("sub/f.png")
        );
        assert_eq!(
            relative_to(Path::new("reports/x/f.png"), Path::new("reports/x")),
            PathBuf::from("f.png")
        );
    }

    #[test]
    fn data_table_formats_and_truncates() {
        let t = Table::new("t")
            .with_column("name", vec!["a", "b|c", "d"])
            .unwrap()
            .with_column("x", vec![Some(0.123456), None, Some(-0.0)])
            .unwrap();
        let mut r = Report::new("r");
        r.data_table("values", &t, 2);
        let md = r.to_markdown(Path::new("."));
        assert!(md.contains("*values (first 2 of 3 rows)*"), "{md}");
        assert!(md.contains("| a | 0.1235 |"), "{md}");
        assert!(md.contains("| b\\|c |  |"), "{md}");
    }

    #[test]
    fn headlines_group_and_failed_write_names_file() {
        let mut r = Report::new("r");
        r.headline(Headline::new("a", "1"))
            .headline(Headline::new("b", "2"));
        let md = r.to_markdown(Path::new("."));
        assert!(md.contains("- **a**: 1\n- **b**: 2\n"));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let err = r.write(&file).unwrap_err().to_string();
        assert!(err.contains("report.md"), "{err}");
    }
}
