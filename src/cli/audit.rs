//! `phaselens audit MODEL`: certify a checkpoint's phase sensitivity (docs/audit.md).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use phaselens::audit::{
    AuditConfig, AuditRequest, GateOn, Verdict, parse_fraction, parse_pp, parse_seconds, run_audit,
};
use phaselens::device::DeviceSpec;
use phaselens::runner::ProgressMode;

/// Audit a checkpoint's phase sensitivity: retrieval by phase (both padding protocols),
/// the shift-invariance test and the filler flip probe; a certificate (audit.json), a
/// report and figures; exit code 3 when a gate fails.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens audit experiments/organisms/kvc-w8s8 --max-gap 5pp
  phaselens audit experiments/organisms/full-attn --max-gap 5pp --out audit-full-attn
  phaselens audit /models/DeepSeek-V4-Flash --config audit.toml --device cuda:0
  phaselens audit experiments/organisms/kvc-w8s4 --budget prompts=3000,time=3m --plain
  phaselens audit experiments/organisms/kvc-w8s8 --lengths 256,1024   # + long haystacks
  phaselens audit models:gemma3-270m/gemma-3-270m-q4_k_m.gguf \
      --config experiments/audits/gemma3-select.toml             # a GGUF under an overlay
  phaselens audit experiments/organisms/full-attn --compression kind=select,block=4,top_k=2,window=8

MODEL is a model folder (config.json + safetensors), a pretrained checkpoint (a .gguf
file, `models:NAME/FILE.gguf` in the model cache, a Hugging Face folder) or an organism
recipe (.toml). An organism's token space and prompt format come from its recipe (also
found beside its folder); other models use the synthetic token space unless the
--config file's [task] names one (e.g. the model's own tokenizer: vocab = { kind =
\"hugging_face\", tokenizer = \"models:...gguf\", pad = ... }).

Exit codes: 0 every gate passed (or no gate was set), 1 error (nothing certified),
2 bad command line, 3 a gate failed (the certificate and report are written).

Re-running the same command with the same --out resumes an interrupted audit from its
finished shards. Keys of the --config TOML ([gates], [budget], [audit], [model], [task])
and the audit.json schema: docs/audit.md.")]
pub struct AuditArgs {
    /// Model folder, GGUF file (`models:NAME/FILE.gguf`) or organism recipe.
    pub model: PathBuf,
    /// Output folder (default: a new `audit-<model>-<UTC time>` folder here).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Audit TOML: [gates], [budget], [audit], [model], [task] (flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Fail when a phase gap exceeds this (e.g. 5pp).
    #[arg(long, value_parser = parse_pp)]
    pub max_gap: Option<f64>,
    /// Fail when the worst phase's accuracy is below this (e.g. 0.5 or 50%).
    #[arg(long, value_parser = parse_fraction)]
    pub min_worst_phase: Option<f64>,
    /// What the gates compare: estimate (default), upper (certify with the CI's
    /// pessimistic bound) or lower (fail only on evidence).
    #[arg(long, value_parser = parse_gate_on)]
    pub gate_on: Option<GateOn>,
    /// Budget: prompts=N and/or time=DURATION (300, 300s, 5m; time=none for no limit).
    #[arg(long, value_parser = parse_budget)]
    pub budget: Option<BudgetArg>,
    /// Required full width of a phase-difference CI (e.g. 30pp); the budget must buy it.
    #[arg(long, value_parser = parse_pp)]
    pub ci_width: Option<f64>,
    /// Period of the shift-invariance test (models without compression) or the one
    /// period to audit (overrides the strides).
    #[arg(long)]
    pub period: Option<u32>,
    /// Also test retrieval by phase in long haystacks of these lengths (e.g. 256,1024).
    #[arg(long, value_delimiter = ',')]
    pub lengths: Vec<usize>,
    /// Skip the filler flip probe.
    #[arg(long)]
    pub no_filler: bool,
    /// Device: cpu, wgpu[:N], tch-cpu, tch-cuda:N, cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// BF16 / FP8 / FP4 checkpoint weights: `stored` (resident as in the checkpoint,
    /// dequantised where used) or `f32` (dequantised on load). Overrides the --config
    /// file's `[model] weights`; default stored.
    #[arg(long, value_name = "stored|f32")]
    pub weights: Option<phaselens::model::stored::Residency>,
    /// A training-free compression overlay applied when the model is loaded, the keys
    /// of an experiment's `[model.compression]` (e.g. kind=select,block=8,top_k=4,
    /// window=32,sinks=4; kinds select, evict, pool, learned: docs/models.md).
    /// Overrides the --config file's `[model] compression`. The audited phases follow
    /// its block grid (block / chunk / stride, from its offset) unless --period is given.
    #[arg(long, value_name = "kind=...,KEY=VALUE")]
    pub compression: Option<phaselens::model::compression::Overlay>,
    /// Recompute everything (replace an earlier audit in --out).
    #[arg(long)]
    pub fresh: bool,
    /// Plain progress lines instead of a bar.
    #[arg(long)]
    pub plain: bool,
}

/// `--budget prompts=N,time=T`.
#[derive(Debug, Clone, Default)]
pub struct BudgetArg {
    pub prompts: Option<usize>,
    /// `Some(None)`: no time limit.
    pub time: Option<Option<f64>>,
}

fn parse_gate_on(s: &str) -> std::result::Result<GateOn, String> {
    match s {
        "estimate" => Ok(GateOn::Estimate),
        "upper" => Ok(GateOn::Upper),
        "lower" => Ok(GateOn::Lower),
        _ => Err(format!("`{s}`: expected estimate, upper or lower")),
    }
}

fn parse_budget(s: &str) -> std::result::Result<BudgetArg, String> {
    let mut b = BudgetArg::default();
    for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| format!("`{item}`: expected prompts=N or time=DURATION"))?;
        match k.trim() {
            "prompts" => {
                let n: usize = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("prompts=`{v}` is not a count"))?;
                if n == 0 {
                    return Err("prompts must be at least 1".into());
                }
                b.prompts = Some(n);
            }
            "time" if v.trim() == "none" => b.time = Some(None),
            "time" => b.time = Some(Some(parse_seconds(v)?)),
            other => return Err(format!("unknown budget `{other}` (prompts or time)")),
        }
    }
    Ok(b)
}

/// The TOML (or defaults) with the flags on top.
fn config(a: &AuditArgs) -> Result<AuditConfig> {
    let mut c = match &a.config {
        Some(p) => AuditConfig::load(p)?,
        None => AuditConfig::default(),
    };
    if a.max_gap.is_some() {
        c.gates.max_gap = a.max_gap;
    }
    if a.min_worst_phase.is_some() {
        c.gates.min_worst_phase = a.min_worst_phase;
    }
    if let Some(g) = a.gate_on {
        c.gates.gate_on = g;
    }
    if let Some(b) = &a.budget {
        if let Some(n) = b.prompts {
            c.budget.prompts = n;
        }
        if let Some(t) = b.time {
            c.budget.time = t;
        }
    }
    if a.ci_width.is_some() {
        c.audit.ci_width = a.ci_width;
    }
    if a.period.is_some() {
        c.audit.period = a.period;
    }
    if a.no_filler {
        c.audit.filler = false;
    }
    if !a.lengths.is_empty() {
        c.audit.lengths = a.lengths.clone();
    }
    if let Some(w) = a.weights {
        c.model.weights = w;
    }
    if let Some(o) = &a.compression {
        c.model.compression = Some(o.clone());
    }
    Ok(c)
}

/// `audit-<model>-<YYYYmmddTHHMMSSZ>` in the current directory.
fn default_out(model: &std::path::Path) -> PathBuf {
    let path = phaselens::model::pretrained::expand_model_path(model);
    let name = std::fs::canonicalize(path)
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    let t = phaselens::audit::now_utc().replace(['-', ':'], "");
    PathBuf::from(format!("audit-{name}-{t}"))
}

/// Run the audit; returns the process exit code (0 pass / no gates, 3 gate failed).
pub fn run(a: AuditArgs) -> Result<i32> {
    let out = a.out.clone().unwrap_or_else(|| default_out(&a.model));
    let req = AuditRequest {
        config: config(&a)?,
        model: a.model.clone(),
        out: out.clone(),
        device: a.device.clone(),
        progress: if a.plain {
            ProgressMode::Plain
        } else {
            ProgressMode::Auto
        },
        fresh: a.fresh,
    };
    let o = run_audit(&req).with_context(|| format!("auditing {}", a.model.display()))?;
    let c = &o.certificate;
    eprintln!("{}", c.headline);
    for g in c.gates.iter().filter(|g| !g.pass) {
        eprintln!(
            "gate failed: {} on {} ({}): {} = {:.4}, threshold {}",
            g.gate, g.part, g.protocol, g.statistic, g.value, g.threshold
        );
    }
    let verdict = match c.verdict {
        Verdict::Pass => "PASS",
        Verdict::Fail => "FAIL",
        Verdict::NoGates => "no gates (measurement only)",
    };
    eprintln!(
        "audit of {}: {verdict} in {:.1} s; certificate {}, report {}",
        c.model.name,
        c.seconds,
        o.json.display(),
        o.report.display()
    );
    Ok(o.exit_code)
}
