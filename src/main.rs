//! The `phaselens` command line.

mod cli;

use clap::{Parser, Subcommand};

/// phaselens: a workbench for phase sensitivity in chunk-compressed KV-cache models.
#[derive(Parser, Debug)]
#[command(name = "phaselens", version, about, long_about = None, after_help = "\
Examples:
  phaselens hooks                                  # list hook points and shapes
  phaselens forward --model experiments/organisms/kvc-w8s8 --input ids.json --out out.safetensors
  phaselens train experiments/organisms/kvc-w8s8.toml
  phaselens run experiments/v4pro.toml             # what `just patch-heads exp/v4pro.toml` runs
  phaselens figures                                # redraw every figure from the tables
  phaselens view v4pro                             # the static explorer: reports/v4pro/view/
  phaselens backends                               # check every backend against flex
  phaselens audit experiments/organisms/kvc-w8s8 --max-gap 5pp   # certify phase sensitivity
  phaselens tokenize --model model.gguf 'Key 4821: value 7710'    # ids and pieces")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a model on token ids; write logits and captured activations (safetensors).
    Forward(cli::forward::ForwardArgs),
    /// List every hook point with its shape.
    Hooks {
        /// Print the Markdown table of docs/hooks.md.
        #[arg(long)]
        markdown: bool,
        /// List the points this model exposes, with their shapes on a 4-token prompt
        /// (a model folder, or a `.gguf` file).
        #[arg(long, value_name = "PATH")]
        model: Option<std::path::PathBuf>,
        /// With --model: the points under a compression overlay, e.g.
        /// `kind=evict,chunk=8,keep=0.25,observe=16` (the keys of `[model.compression]`).
        #[arg(long, value_name = "KEY=VALUE,...", requires = "model")]
        compression: Option<phaselens::model::compression::Overlay>,
    },
    /// Speed benchmarks (ratios within one run).
    Bench(cli::bench::BenchArgs),
    /// Load a model; report layers, parameters, load time, peak memory (and forward time).
    Inspect(cli::inspect::InspectArgs),
    /// Train (or resume) a model organism from its TOML recipe.
    Train(cli::train::TrainArgs),
    /// Run an experiment TOML (tables, figures, report; resumes interrupted runs).
    Run(cli::run::RunArgs),
    /// Redraw every figure and report from the tables (no model runs).
    Figures(cli::figures::FiguresArgs),
    /// Train and phase-sweep a grid of designs, locally or as a Slurm job array.
    Grid(Box<cli::grid::GridArgs>),
    /// The grid-shift test of a phase effect from two phase sweeps' per-example tables.
    GridShift(cli::grid_shift::GridShiftArgs),
    /// Check every backend against flex on this machine (device x check matrix).
    Backends(cli::backends::BackendsArgs),
    /// Write the static explorer of an experiment or grid (open index.html from disk).
    View(cli::view::ViewArgs),
    /// Plan a DeepSeek-V4 model's memory over devices (weights, KV, working sets, placement).
    Plan(cli::plan::PlanArgs),
    /// Certify a checkpoint's phase sensitivity (audit.json, report; exit 3 on a failed gate).
    Audit(Box<cli::audit::AuditArgs>),
    /// A model's token ids and pieces for a text (or the text of ids, with --decode).
    Tokenize(cli::tokenize::TokenizeArgs),
    /// Greedy decoding from a text prompt (pretrained models with a tokenizer).
    Generate(cli::generate::GenerateArgs),
}

fn main() {
    ensure_runtime_dir();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Forward(a) => cli::forward::run(a),
        Command::Hooks {
            markdown,
            model,
            compression,
        } => cli::hooks::run(markdown, model.as_deref(), compression.as_ref()),
        Command::Bench(a) => cli::bench::run(a),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Train(a) => cli::train::run(a),
        Command::Run(a) => cli::run::run(a),
        Command::Figures(a) => cli::figures::run(a),
        Command::Grid(a) => cli::grid::run(*a),
        Command::GridShift(a) => cli::grid_shift::run(a),
        Command::Backends(a) => cli::backends::run(a),
        Command::View(a) => cli::view::run(a),
        Command::Plan(a) => cli::plan::run(a),
        Command::Generate(a) => cli::generate::run(a),
        Command::Tokenize(a) => cli::tokenize::run(a),
        Command::Audit(a) => cli::audit::run(*a).map(|code| {
            if code != 0 {
                std::process::exit(code)
            }
        }),
    };
    if let Err(e) = result {
        eprintln!("error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// Mesa's software Vulkan driver (wgpu on a machine without a GPU) looks for a Wayland
/// display while it lists adapters, and libwayland prints `error: XDG_RUNTIME_DIR is
/// invalid or not set in the environment` when that variable is missing or relative,
/// although nothing is wrong. A process without a usable runtime folder gets a private
/// one (`$TMPDIR/phaselens-runtime-UID`, mode 0700), so all-is-well output has no
/// `error:` line. Runs first in `main`, before any thread exists.
#[cfg(unix)]
fn ensure_runtime_dir() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let usable = std::env::var_os("XDG_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .is_some_and(|d| d.is_absolute() && d.is_dir());
    if usable {
        return;
    }
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("phaselens-runtime-{uid}"));
    let made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    if made.is_ok() || dir.is_dir() {
        // SAFETY: called at the start of `main`, before any other thread is started.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
    }
}

#[cfg(not(unix))]
fn ensure_runtime_dir() {}

/// The error and its causes joined by ": ", each cause once: library errors already
/// show their source in their own message (`path: No such file or directory`), so
/// a cause whose text is already there is not printed a second time.
fn error_chain(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if msg.contains(&text) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&text);
    }
    msg
}
