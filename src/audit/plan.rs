//! From a model to an audit plan: its compression geometry, the periods to audit,
//! the runner experiments of each, and how many logical examples the budget buys.
//! Everything here runs before any compute; every refusal is an error that says
//! what to change.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::compression::Overlay;
use crate::model::{LanguageModel, LayerKind, ModelInfo};
use crate::tasks::Protocol;

use super::stats::{logical_for_width, width_for_logical};
use super::{AuditConfig, Target};

/// One layer's attention geometry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerGeometry {
    /// The layer index.
    pub layer: usize,
    /// `full`, `sliding` or `compressed`.
    pub kind: String,
    /// Compression window (or sliding window) in tokens.
    pub window: Option<usize>,
    /// Compression stride.
    pub stride: Option<usize>,
    /// Raw tokens beside the compressed entries.
    pub local_tail: Option<usize>,
}

/// The model's compression geometry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Geometry {
    /// Whether any layer compresses.
    pub compressed: bool,
    /// Distinct compression strides, ascending.
    pub strides: Vec<usize>,
    /// Every layer.
    pub layers: Vec<LayerGeometry>,
}

impl Geometry {
    /// Read from the model's layer specs.
    pub fn of(info: &ModelInfo) -> Self {
        let layers = info
            .layers
            .iter()
            .enumerate()
            .map(|(l, s)| match s.kind {
                LayerKind::Full => LayerGeometry {
                    layer: l,
                    kind: "full".into(),
                    window: None,
                    stride: None,
                    local_tail: None,
                },
                LayerKind::Sliding { window } => LayerGeometry {
                    layer: l,
                    kind: "sliding".into(),
                    window: Some(window),
                    stride: None,
                    local_tail: None,
                },
                LayerKind::Compressed {
                    window,
                    stride,
                    local_tail,
                } => LayerGeometry {
                    layer: l,
                    kind: "compressed".into(),
                    window: Some(window),
                    stride: Some(stride),
                    local_tail: Some(local_tail),
                },
                LayerKind::Selected { block, window, .. } => LayerGeometry {
                    layer: l,
                    kind: "selected".into(),
                    window: Some(block),
                    stride: Some(block),
                    local_tail: Some(window),
                },
            })
            .collect();
        Geometry {
            compressed: info.compressed(),
            strides: info.strides(),
            layers,
        }
    }

    /// The smallest window of the layers with stride `s`.
    fn min_window(&self, s: usize) -> usize {
        self.layers
            .iter()
            .filter(|l| l.stride == Some(s))
            .filter_map(|l| l.window)
            .min()
            .unwrap_or(s)
    }
}

/// A stride the audit does not test, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// The stride.
    pub stride: usize,
    /// Why it is not audited.
    pub reason: String,
}

/// One audited period.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// `period-P` (or `shift-P` for a model without compression).
    pub name: String,
    pub period: usize,
    /// False for a model without compression (shift-invariance only).
    pub phased: bool,
    /// Why this period (a stride, their least common multiple, `[audit] period`).
    pub why: String,
    pub protocols: Vec<Protocol>,
    pub filler: bool,
    /// Logical examples per phase (set by [`size`]).
    pub n_logical: usize,
    /// Where the block grid starts (a compression overlay's `offset`): a prompt's
    /// phase is `(position - offset) mod P`.
    #[serde(default)]
    pub offset: usize,
}

impl Part {
    /// Filler lengths `[3P, 5P - 1]`: two periods, away from the prompt start.
    pub fn filler_lengths(&self) -> (usize, usize) {
        (3 * self.period, 5 * self.period - 1)
    }

    /// Prompts per logical example (every phase under every protocol).
    pub fn per_logical(&self) -> usize {
        self.period * self.protocols.len()
    }

    /// Prompts of the filler probe.
    pub fn filler_prompts(&self, instances: usize) -> usize {
        if self.filler {
            2 * self.period * instances
        } else {
            0
        }
    }

    /// Cost of the long-context test in retrieval-prompt equivalents (a prompt of
    /// length L costs about L / `prompt_len` retrieval prompts).
    pub fn long_prompts(&self, cfg: &AuditConfig, prompt_len: usize) -> usize {
        let a = &cfg.audit;
        let per = 3 * a.long_logical * self.period * self.protocols.len();
        a.lengths
            .iter()
            .map(|&l| per * l.div_ceil(prompt_len.max(1)))
            .sum()
    }

    /// Prompts besides the retrieval sweep: the filler probe and the long-context test.
    fn fixed_prompts(&self, cfg: &AuditConfig, prompt_len: usize) -> usize {
        self.filler_prompts(cfg.audit.filler_instances) + self.long_prompts(cfg, prompt_len)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The parts to audit and the strides left out. `prompt_len`: the retrieval prompts'
/// length before padding (a stride whose windows do not close inside it has no
/// compressed entry to test).
pub fn parts(geo: &Geometry, cfg: &AuditConfig, prompt_len: usize) -> (Vec<Part>, Vec<Skipped>) {
    let a = &cfg.audit;
    let part = |p: usize, phased: bool, why: String| Part {
        name: format!("{}-{p}", if phased { "period" } else { "shift" }),
        period: p,
        phased,
        why,
        protocols: if phased {
            Protocol::ALL.to_vec()
        } else {
            vec![Protocol::PrefixPadding]
        },
        filler: phased && a.filler,
        n_logical: 0,
        offset: 0,
    };
    if !geo.compressed {
        let p = a.period.unwrap_or(8) as usize;
        let why = format!(
            "no chunked compression: no phase; the shift-invariance test only (shifts 0..{})",
            p - 1
        );
        return (vec![part(p, false, why)], Vec::new());
    }
    let offset = cfg.model.compression.as_ref().map_or(0, Overlay::offset);
    if let Some(p) = a.period {
        let mut one = part(p as usize, true, "[audit] period".into());
        one.offset = offset % p as usize;
        return (vec![one], Vec::new());
    }
    if let Some(o) = &cfg.model.compression {
        // The overlay's block grid: its block / chunk / stride, from its offset.
        let why = format!("the compression overlay's grid: {o}");
        let mut one = part(o.period(), true, why);
        one.offset = offset;
        return (vec![one], Vec::new());
    }
    let mut kept = Vec::new();
    let mut skipped = Vec::new();
    for &s in &geo.strides {
        let w = geo.min_window(s);
        let reason = if s < 2 {
            Some("stride 1 has a single phase".to_string())
        } else if s > a.max_period {
            Some(format!(
                "P = {s} is above [audit] max_period = {} (a matched design needs 2 P^2 = {} logical examples)",
                a.max_period,
                2 * s * s
            ))
        } else if w > prompt_len {
            Some(format!(
                "its windows ({w} tokens) do not close within the {prompt_len}-token retrieval prompts"
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => skipped.push(Skipped { stride: s, reason }),
            None => kept.push(s),
        }
    }
    let mut out: Vec<Part> = kept
        .iter()
        .map(|&s| part(s, true, format!("compression stride {s}")))
        .collect();
    if kept.len() > 1 {
        let l = kept.iter().fold(1, |acc, &s| acc / gcd(acc, s) * s);
        if !kept.contains(&l) && l <= a.max_period {
            out.push(part(
                l,
                true,
                format!("least common multiple of strides {kept:?}"),
            ));
        }
    }
    (out, skipped)
}

/// Refuse an overlay that compresses nothing in retrieval prompts of `prompt_len`
/// tokens (before padding): a block longer than the prompt, or a raw window (an
/// observation window) that covers it. The error names the key.
pub fn check_overlay(o: &Overlay, prompt_len: usize) -> Result<()> {
    let (block, raw) = match *o {
        Overlay::Select { block, window, .. } => (("block", block), ("window", window)),
        Overlay::Evict { chunk, observe, .. } => (("chunk", chunk), ("observe", observe)),
        Overlay::Pool { window, local, .. } | Overlay::Learned { window, local, .. } => {
            (("window", window), ("local", local))
        }
    };
    let bad = |(key, v): (&str, usize), what: &str| {
        Err(Error::Input(format!(
            "[model] compression.{key} (or --compression {key}=...) = {v} {what} the {prompt_len}-token \
             retrieval prompts: nothing would be compressed. Use a smaller {key}, or longer prompts \
             ([task] prompt n_bindings)"
        )))
    };
    if block.1 > prompt_len {
        return bad(block, "is longer than");
    }
    if raw.1 >= prompt_len {
        return bad(raw, "covers");
    }
    Ok(())
}

/// The runner experiment of `kind` (`phase-sweep` or `filler-probe`) for `part`.
pub fn experiment_text(
    target: &Target,
    cfg: &AuditConfig,
    part: &Part,
    kind: &str,
    n_logical: usize,
) -> Result<String> {
    use toml::Value as V;
    let mut root = toml::Table::new();
    let mut e = toml::Table::new();
    e.insert("kind".into(), V::String(kind.into()));
    e.insert("name".into(), V::String(format!("audit-{}", part.name)));
    e.insert(
        "bootstrap_reps".into(),
        V::Integer(cfg.audit.bootstrap_reps as i64),
    );
    e.insert("seed".into(), V::Integer(cfg.audit.seed as i64));
    root.insert("experiment".into(), V::Table(e));
    root.insert("model".into(), V::Table(model_table(target, cfg)?));
    let mut t = cfg.task.clone().unwrap_or_default();
    t.insert("period".into(), V::Integer(part.period as i64));
    t.insert("n_logical".into(), V::Integer(n_logical as i64));
    if target.organism.is_none() && !t.contains_key("vocab") {
        // The documented default for a model that is not an organism.
        let mut v = toml::Table::new();
        v.insert("kind".into(), V::String("synthetic".into()));
        t.insert("vocab".into(), V::Table(v));
    }
    if !t.contains_key("seed") {
        t.insert("seed".into(), V::Integer(cfg.audit.seed as i64));
    }
    if !part.phased {
        t.insert("allow_period_mismatch".into(), V::Boolean(true));
    }
    root.insert("task".into(), V::Table(t));
    if kind == "filler-probe" {
        let (lo, hi) = part.filler_lengths();
        let mut f = toml::Table::new();
        f.insert("probe".into(), V::String("binding".into()));
        let mut l = toml::Table::new();
        l.insert("min".into(), V::Integer(lo as i64));
        l.insert("max".into(), V::Integer(hi as i64));
        f.insert("lengths".into(), V::Table(l));
        f.insert("filler_token".into(), V::String("pad".into()));
        f.insert("seed".into(), V::Integer(cfg.audit.seed as i64));
        root.insert("filler".into(), V::Table(f));
    }
    if kind == "long-context" {
        let mut l = toml::Table::new();
        let ints = |v: &[usize]| V::Array(v.iter().map(|&x| V::Integer(x as i64)).collect());
        l.insert("lengths".into(), ints(&cfg.audit.lengths));
        let protos = part
            .protocols
            .iter()
            .map(|p| V::String(p.name().into()))
            .collect();
        l.insert("protocols".into(), V::Array(protos));
        root.insert("long_context".into(), V::Table(l));
    }
    let body = toml::to_string(&root).map_err(|e| Error::Other(format!("audit plan: {e}")))?;
    Ok(format!(
        "# Written by `phaselens audit` ({}): one of the runner experiments the audit ran.\n{body}",
        part.why
    ))
}

/// The `[model]` table of the plan's experiments: the model, its name, and how the
/// audit loaded it (f32 weights, the overlay), so `phaselens run` reruns the same.
fn model_table(target: &Target, cfg: &AuditConfig) -> Result<toml::Table> {
    use toml::Value as V;
    let mut m = toml::Table::new();
    match &target.organism {
        Some(recipe) => m.insert("organism".into(), V::String(path_text(recipe)?)),
        None => m.insert("path".into(), V::String(path_text(&target.dir)?)),
    };
    m.insert("name".into(), V::String(target.name.clone()));
    if cfg.model.weights == crate::model::stored::Residency::F32 {
        m.insert("weights".into(), V::String("f32".into()));
    }
    if let Some(o) = &cfg.model.compression {
        let v = V::try_from(o).map_err(|e| Error::Other(format!("audit plan: {e}")))?;
        m.insert("compression".into(), v);
    }
    Ok(m)
}

/// An absolute path as TOML text (the plan files live in the output folder).
fn path_text(p: &std::path::Path) -> Result<String> {
    let abs = std::path::absolute(p).map_err(|e| Error::io(p, e))?;
    abs.to_str()
        .map(str::to_string)
        .ok_or_else(|| Error::Input(format!("{}: the path is not UTF-8", abs.display())))
}

/// Seconds per prompt of `len` tokens: one forward of `rows` pad prompts after a
/// warm-up (the budget's time estimate). Like the audit's evaluation, the LM head runs
/// only at the positions read (the last 4 of each prompt): at a 262,144-word
/// vocabulary it would be most of a short forward's cost at every position.
pub fn calibrate(model: &dyn LanguageModel, pad: u32, len: usize, rows: usize) -> Result<f64> {
    use burn::tensor::{Int, Tensor, TensorData};
    let device = model.device();
    let run = |n: usize| {
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(vec![i64::from(pad); n * len], [n, len]),
            &device,
        );
        let read: Vec<i64> = (0..n)
            .flat_map(|r| (len.saturating_sub(4)..len).map(move |p| (r * len + p) as i64))
            .collect();
        let k = read.len();
        let idx = Tensor::<1, Int>::from_data(TensorData::new(read, [k]), &device);
        let logits = model.forward_logit_rows(tokens, idx)?;
        // Read a value back so that lazy backends finish the work inside the timing.
        let _ = logits.slice([0..1, 0..1]).into_data();
        Ok::<_, Error>(())
    };
    run(1)?;
    let t0 = Instant::now();
    run(rows)?;
    Ok(t0.elapsed().as_secs_f64() / rows as f64)
}

/// How many logical examples per phase the budget buys, and the estimate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sizing {
    /// Logical examples per phase (the smallest over parts).
    pub n_logical: usize,
    /// Prompts in all.
    pub prompts: usize,
    /// Estimated compute (s), from a timed forward.
    pub estimated_seconds: f64,
    /// The timed forward's cost per prompt (s).
    pub seconds_per_prompt: f64,
    /// The worst-case full width (pp) of a phase-difference CI at `n_logical`.
    pub ci_width_pp: f64,
}

/// Size the parts (set `n_logical`) within the budget; an error when the budget does
/// not buy the requested CI width.
pub fn size(
    parts: &mut [Part],
    cfg: &AuditConfig,
    sec_per_prompt: f64,
    prompt_len: usize,
) -> Result<Sizing> {
    let a = &cfg.audit;
    let per: usize = parts.iter().map(Part::per_logical).sum();
    let fixed: usize = parts.iter().map(|p| p.fixed_prompts(cfg, prompt_len)).sum();
    let by_prompts = cfg.budget.prompts.saturating_sub(fixed) / per.max(1);
    let by_time = match cfg.budget.time {
        Some(t) => {
            let prompts = (t / sec_per_prompt.max(1e-9)).floor() as usize;
            prompts.saturating_sub(fixed) / per.max(1)
        }
        None => usize::MAX,
    };
    let n = a.max_logical.min(by_prompts).min(by_time);
    let need = a.ci_width.map_or(2, logical_for_width).max(2);
    if n < need {
        let prompts = need * per + fixed;
        return Err(Error::Input(format!(
            "the budget is too small for the requested CI: {} needs {need} logical examples per phase \
             ({prompts} prompts, about {:.0} s at {:.2} ms per prompt measured here), but the budget \
             (prompts = {}, time = {}) buys {n}. Raise --budget (e.g. --budget prompts={prompts},time={:.0}s) \
             or accept a wider interval (--ci-width)",
            a.ci_width.map_or("a CI".to_string(), |w| format!(
                "a {w} pp wide phase-difference CI"
            )),
            prompts as f64 * sec_per_prompt,
            sec_per_prompt * 1e3,
            cfg.budget.prompts,
            cfg.budget
                .time
                .map_or("none".to_string(), |t| format!("{t:.0} s")),
            (prompts as f64 * sec_per_prompt * 1.5).ceil(),
        )));
    }
    for p in parts.iter_mut() {
        // A multiple of 2 P^2 matches the phase groups exactly; round down to one when
        // the result still buys the requested width.
        let block = 2 * p.period * p.period;
        let rounded = n / block * block;
        p.n_logical = if rounded >= need { rounded } else { n };
    }
    let prompts: usize = parts
        .iter()
        .map(|p| p.n_logical * p.per_logical() + p.fixed_prompts(cfg, prompt_len))
        .sum();
    let least = parts.iter().map(|p| p.n_logical).min().unwrap_or(n);
    Ok(Sizing {
        n_logical: least,
        prompts,
        estimated_seconds: prompts as f64 * sec_per_prompt,
        seconds_per_prompt: sec_per_prompt,
        ci_width_pp: width_for_logical(least),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(layers: &[(usize, usize)]) -> Geometry {
        Geometry {
            compressed: !layers.is_empty(),
            strides: {
                let mut s: Vec<usize> = layers.iter().map(|l| l.1).collect();
                s.sort_unstable();
                s.dedup();
                s
            },
            layers: layers
                .iter()
                .enumerate()
                .map(|(i, &(w, s))| LayerGeometry {
                    layer: i,
                    kind: "compressed".into(),
                    window: Some(w),
                    stride: Some(s),
                    local_tail: Some(0),
                })
                .collect(),
        }
    }

    #[test]
    fn v4_geometry_audits_the_csa_stride_and_skips_a_stride_too_long_for_the_prompts() {
        let cfg = AuditConfig::default();
        let (p, s) = parts(&geo(&[(8, 4), (128, 128)]), &cfg, 90);
        assert_eq!(p.iter().map(|p| p.period).collect::<Vec<_>>(), vec![4]);
        assert_eq!(s[0].stride, 128);
        // Two testable strides: each, and their lcm when it is new.
        let (p, _) = parts(&geo(&[(8, 4), (6, 6)]), &cfg, 90);
        assert_eq!(
            p.iter().map(|p| p.period).collect::<Vec<_>>(),
            vec![4, 6, 12]
        );
        let (p, _) = parts(&geo(&[(8, 4), (16, 16)]), &cfg, 90);
        assert_eq!(p.iter().map(|p| p.period).collect::<Vec<_>>(), vec![4, 16]);
    }

    #[test]
    fn full_attention_gets_one_shift_part_with_prefix_padding_only() {
        let (p, s) = parts(&geo(&[]), &AuditConfig::default(), 90);
        assert!(s.is_empty());
        assert_eq!(p.len(), 1);
        assert!(!p[0].phased && !p[0].filler);
        assert_eq!(p[0].protocols, vec![Protocol::PrefixPadding]);
    }

    #[test]
    fn an_overlay_sets_the_period_and_offset_and_must_compress_the_prompts() {
        let mut cfg = AuditConfig::default();
        let o: Overlay = "kind=select,block=8,top_k=2,window=16,offset=5"
            .parse()
            .unwrap();
        cfg.model.compression = Some(o.clone());
        let (p, s) = parts(&geo(&[(8, 8)]), &cfg, 90);
        assert!(s.is_empty());
        assert_eq!((p.len(), p[0].period, p[0].offset), (1, 8, 5));
        assert!(p[0].phased && p[0].why.contains("overlay"));
        // `--period` wins; the grid's offset stays (modulo the period).
        cfg.audit.period = Some(4);
        let (p, _) = parts(&geo(&[(8, 8)]), &cfg, 90);
        assert_eq!((p[0].period, p[0].offset), (4, 1));
        check_overlay(&o, 90).unwrap();
        let e = check_overlay(&o, 6).unwrap_err().to_string();
        assert!(
            e.contains("compression.block") && e.contains("6-token"),
            "{e}"
        );
        let e = check_overlay(&o, 12).unwrap_err().to_string();
        assert!(
            e.contains("compression.window") && e.contains("covers"),
            "{e}"
        );
        let pool: Overlay = "kind=pool,window=16,stride=8,local=4".parse().unwrap();
        assert_eq!(pool.offset(), 0);
        let e = check_overlay(&pool, 10).unwrap_err().to_string();
        assert!(e.contains("compression.window"), "{e}");
    }

    #[test]
    fn sizing_fits_the_budget_or_says_what_the_ci_needs() {
        let mut cfg = AuditConfig::default();
        let (mut p, _) = parts(&geo(&[(8, 8)]), &cfg, 90);
        let s = size(&mut p, &cfg, 1e-3, 90).unwrap();
        assert!(s.prompts <= cfg.budget.prompts, "{s:?}");
        assert_eq!(p[0].n_logical % 128, 0);
        cfg.budget.prompts = 500;
        let e = size(&mut p, &cfg, 1e-3, 90).unwrap_err().to_string();
        assert!(
            e.contains("budget is too small") && e.contains("86 logical"),
            "{e}"
        );
    }
}
