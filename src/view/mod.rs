//! `phaselens view`: the static explorer. An experiment's tables (+ its exemplar table)
//! -> one folder `index.html`, `view.css`, `view.js`, `data.js` that opens from disk
//! (no server, nothing fetched): head x phase maps of every per-head metric, accuracy
//! by phase with CI bands, the prompt view of the exemplars, the phase-shift slider and
//! the per-phase intervention bars. docs/view.md describes the page.
//!
//! | file | role |
//! |---|---|
//! | [`exemplars`] | capture the exemplar table through the model's hook points; read it back |
//! | [`data`] | tables -> the page's JSON |
//! | `assets/` | the page (HTML, CSS, JS written for phaselens), embedded with `include_str!` |

pub mod data;
pub mod exemplars;

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::output::{META_SCHEMA, Table, committed_files, write_bytes_atomic};
use crate::runner::Experiment;
use crate::runner::report::ExperimentData;

pub use exemplars::{CaptureOptions, EXEMPLAR_FILE, EXEMPLAR_SCHEMA, ExemplarRow, read_exemplars};

const INDEX_HTML: &str = include_str!("assets/index.html");
const VIEW_CSS: &str = include_str!("assets/view.css");
const VIEW_JS: &str = include_str!("assets/view.js");

/// The page reads this global from `data.js`.
pub const DATA_GLOBAL: &str = "PHASELENS_DATA";

/// Where the inputs are and whether a model may be loaded to capture exemplars.
#[derive(Debug, Clone)]
pub struct ViewOptions {
    pub data_root: PathBuf,
    pub reports_root: PathBuf,
    /// Site folder; default `<reports_root>/<experiment>/view`.
    pub out: Option<PathBuf>,
    /// Where `<name>.toml` is looked up when the experiment is given by name.
    pub experiments_dir: PathBuf,
    /// Capture missing exemplars with these options; `None`: never load a model.
    pub capture: Option<CaptureOptions>,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Site {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    /// Bytes of the whole folder.
    pub bytes: u64,
    /// What the page also shows in its warning banner.
    pub warnings: Vec<String>,
    /// The exemplar table, when one was captured by this call.
    pub captured: Option<PathBuf>,
}

/// The experiment file and output name of `target`: a TOML path, or a name whose
/// `<experiments_dir>/<name>.toml` is read when it exists.
fn resolve_target(target: &str, o: &ViewOptions) -> Result<(String, Option<Experiment>)> {
    let p = Path::new(target);
    if target.ends_with(".toml") {
        let exp = Experiment::load(p)?;
        return Ok((exp.name(), Some(exp)));
    }
    crate::runner::experiment::check_output_name(target)
        .map_err(|m| Error::Input(format!("experiment `{target}`: {m}")))?;
    let file = o.experiments_dir.join(format!("{target}.toml"));
    let exp = file
        .exists()
        .then(|| Experiment::load(&file))
        .transpose()?
        .filter(|e| e.name() == target);
    Ok((target.to_string(), exp))
}

/// Refuse, with what exists, an experiment that has no long tables to draw from.
fn check_inputs(data_dir: &Path, data_root: &Path) -> Result<Vec<String>> {
    if !data_dir.is_dir() {
        let known: Vec<String> = std::fs::read_dir(data_root)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let mut known = known;
        known.sort();
        return Err(Error::Input(format!(
            "{}: this experiment has not run (no tables); run `phaselens run <experiment.toml>` first. Experiments with outputs under {}: {}",
            data_dir.display(),
            data_root.display(),
            if known.is_empty() {
                "none".into()
            } else {
                known.join(", ")
            }
        )));
    }
    let arrows = committed_files(data_dir, "arrow").map_err(|e| Error::io(data_dir, e))?;
    let mut warnings = Vec::new();
    let mut long = 0;
    for p in &arrows {
        let t = Table::read_arrow(p)?;
        match t.metadata().get(META_SCHEMA).map(String::as_str) {
            Some("long/v1") => long += 1,
            Some(EXEMPLAR_SCHEMA) => {}
            other => warnings.push(format!(
                "{}: schema `{}` is not one this viewer reads (long/v1); not shown (rerun the experiment with this phaselens to update it)",
                p.display(),
                other.unwrap_or("none")
            )),
        }
    }
    if long == 0 {
        let shards = data_dir.join("shards");
        let what = if shards.is_dir() {
            format!(
                "an interrupted run: shards under {} but no tables yet; run the experiment again to resume and finish it",
                shards.display()
            )
        } else {
            "no long/v1 tables".to_string()
        };
        let found: Vec<String> = arrows.iter().map(|p| p.display().to_string()).collect();
        return Err(Error::Input(format!(
            "{}: {what}. Found: {}. {}",
            data_dir.display(),
            if found.is_empty() {
                "no .arrow files".into()
            } else {
                found.join(", ")
            },
            warnings.join(" ")
        )));
    }
    Ok(warnings)
}

/// Warnings for maps with missing cells (a partial run) and for an experiment with no
/// per-head metric (the page says so instead of drawing an empty map).
fn map_warnings(data: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let maps = data["maps"].as_array().cloned().unwrap_or_default();
    for m in &maps {
        let n = |k: &str| m[k].as_array().map_or(0, Vec::len);
        let expected = n("layers") * n("heads") * n("phases");
        if n("cells") < expected {
            out.push(format!(
                "{} ({} heads): {} of {} head x phase cells in the tables (a partial run?); missing cells are hatched",
                m["metric"].as_str().unwrap_or(""),
                m["head_kind"].as_str().unwrap_or(""),
                n("cells"),
                expected
            ));
        }
    }
    out
}

/// Exemplars of the experiment: read, or captured when missing and allowed.
fn exemplar_data(
    data_dir: &Path,
    exp: Option<&Experiment>,
    o: &ViewOptions,
    warnings: &mut Vec<String>,
) -> Result<(Value, Option<PathBuf>)> {
    let path = data_dir.join(EXEMPLAR_FILE);
    let mut captured = None;
    if !path.exists() {
        match (exp, &o.capture) {
            (Some(e), Some(c)) => match exemplars::capture(e, data_dir, c) {
                Ok(p) => captured = Some(p),
                Err(err) => warnings.push(format!("no exemplars: capturing them failed: {err}")),
            },
            (None, Some(_)) => warnings.push(format!(
                "no exemplars: {} is missing and the experiment TOML was not found to load its model (give its path: `phaselens view experiments/<name>.toml`)",
                path.display()
            )),
            (_, None) => warnings.push(format!(
                "no exemplars: {} is missing (`phaselens view <experiment>` captures it from the model)",
                path.display()
            )),
        }
    }
    if !path.exists() {
        return Ok((Value::Null, None));
    }
    let rows = read_exemplars(&path)?;
    Ok((data::exemplars_json(&rows), captured))
}

/// Write the site of experiment `target` (name or TOML path).
pub fn view_experiment(target: &str, o: &ViewOptions) -> Result<Site> {
    let (name, exp) = resolve_target(target, o)?;
    let data_dir = o.data_root.join(&name);
    let mut warnings = check_inputs(&data_dir, &o.data_root)?;
    let d = ExperimentData::load(&data_dir)?;
    let exp = exp.or_else(|| {
        let file = o.experiments_dir.join(format!("{name}.toml"));
        Experiment::parse(&file, d.toml.clone()).ok()
    });
    let description = exp
        .as_ref()
        .map(|e| e.file.experiment.description.clone())
        .unwrap_or_default();
    let mut value = data::experiment_json(&d, &description);
    warnings.extend(map_warnings(&value));
    let (ex, captured) = exemplar_data(&data_dir, exp.as_ref(), o, &mut warnings)?;
    value["exemplars"] = ex;
    let dir = o
        .out
        .clone()
        .unwrap_or_else(|| o.reports_root.join(&name).join("view"));
    let mut site = write_site(&dir, value, warnings)?;
    site.captured = captured;
    Ok(site)
}

/// Write the site of a merged grid: `target` = grid name (under
/// `<data_root>/grids/`) or the grid TOML (its file stem).
pub fn view_grid(target: &str, o: &ViewOptions) -> Result<Site> {
    let name = Path::new(target)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = o.data_root.join("grids").join(&name);
    if !dir.is_dir() {
        return Err(Error::Input(format!(
            "{}: grid `{name}` has no outputs (run `phaselens grid {target} --local` or `grid merge`)",
            dir.display()
        )));
    }
    let value = data::grid_json(&dir, &name)?;
    let out = o
        .out
        .clone()
        .unwrap_or_else(|| o.reports_root.join("grids").join(&name).join("view"));
    write_site(&out, value, Vec::new())
}

/// Write `index.html`, `view.css`, `view.js` and `data.js` (every file atomically).
pub fn write_site(dir: &Path, mut value: Value, warnings: Vec<String>) -> Result<Site> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    value["warnings"] = json!(warnings);
    value["generator"] = json!(format!("phaselens {}", env!("CARGO_PKG_VERSION")));
    let data = format!(
        "// Written by phaselens view: the tables of this experiment (docs/view.md).\nwindow.{DATA_GLOBAL} = {};\n",
        serde_json::to_string(&value).map_err(|e| Error::Other(format!("site data: {e}")))?
    );
    let title = format!(
        "{} ({}) - phaselens view",
        value["experiment"].as_str().unwrap_or(""),
        value["kind"].as_str().unwrap_or("")
    );
    let html = INDEX_HTML.replace("{{TITLE}}", &html_escape(&title));
    let mut files = Vec::new();
    let mut bytes = 0u64;
    for (name, text) in [
        ("index.html", html.as_str()),
        ("view.css", VIEW_CSS),
        ("view.js", VIEW_JS),
        ("data.js", data.as_str()),
    ] {
        let p = dir.join(name);
        write_bytes_atomic(&p, text.as_bytes()).map_err(|e| Error::io(&p, e))?;
        bytes += text.len() as u64;
        files.push(p);
    }
    Ok(Site {
        dir: dir.to_path_buf(),
        files,
        bytes,
        warnings,
        captured: None,
    })
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Redraw the sites that exist under `<reports_root>/<experiment>/view` (what
/// `phaselens figures` calls; no model is loaded: exemplars are read, never captured).
pub fn redraw_sites(
    data_root: &Path,
    reports_root: &Path,
    only: Option<&str>,
) -> Result<Vec<Site>> {
    let o = ViewOptions {
        data_root: data_root.to_path_buf(),
        reports_root: reports_root.to_path_buf(),
        out: None,
        experiments_dir: PathBuf::from("experiments"),
        capture: None,
    };
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(reports_root) else {
        return Ok(out);
    };
    let mut names: Vec<String> = rd
        .flatten()
        .filter(|e| e.path().join("view").join("index.html").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| only.is_none_or(|o| o == n))
        .collect();
    names.sort();
    for n in names {
        if data_root.join(&n).is_dir() {
            out.push(view_experiment(&n, &o)?);
        }
    }
    Ok(out)
}
