//! The distillation text: the frozen model's own continuations of the built-in prompts
//! ([`super::prompts::PROMPTS`]), sampled at a temperature, made once per run and kept
//! in `<run>/data/group-NNN.json` (one file per generation batch, written atomically),
//! so an interrupted run keeps the groups it finished.

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::prompts::PROMPTS;
use crate::error::{Error, Result};
use crate::model::LanguageModel;
use crate::model::safetensors_io::write_atomic;
use crate::tokenizer::Tokenizer;

/// `[data]`: how the distillation text is made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Sequences generated.
    pub sequences: usize,
    /// Tokens of each prompt kept (its first ones, BOS included where the tokenizer
    /// adds one); every prompt must be at least this long.
    pub prompt_tokens: usize,
    /// Tokens the model adds to each prompt.
    pub new_tokens: usize,
    /// Sampling temperature (> 0).
    pub temperature: f64,
    /// Sequences generated together.
    pub batch: usize,
    /// Seed of the prompt order and of the sampling.
    pub seed: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            sequences: 48,
            prompt_tokens: 24,
            new_tokens: 104,
            temperature: 0.8,
            batch: 16,
            seed: 0,
        }
    }
}

impl DataConfig {
    /// Tokens per sequence.
    pub fn seq_len(&self) -> usize {
        self.prompt_tokens + self.new_tokens
    }

    /// Every count at least 1 and a positive temperature; the error names the key.
    pub fn validate(&self) -> Result<()> {
        for (k, v) in [
            ("sequences", self.sequences),
            ("prompt_tokens", self.prompt_tokens),
            ("new_tokens", self.new_tokens),
            ("batch", self.batch),
        ] {
            if v == 0 {
                return Err(Error::field(format!("data.{k}"), "must be at least 1"));
            }
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(Error::field(
                "data.temperature",
                format!("must be > 0, got {}", self.temperature),
            ));
        }
        Ok(())
    }
}

/// One generation batch as stored.
#[derive(Serialize, Deserialize)]
struct Group {
    /// The `[data]` table that made it, `sequences` left at 0: a group depends on
    /// every other key (a group of another table is made again), but not on how many
    /// groups there are, so a run can be made shorter or longer and keep its groups.
    data: DataConfig,
    /// Token ids, one row per sequence.
    sequences: Vec<Vec<u32>>,
}

/// The prompts of `cfg` as token ids, `prompt_tokens` each, in a seeded order (the
/// built-in prompts repeat when more sequences are asked for than there are prompts).
pub fn prompt_ids(cfg: &DataConfig, tok: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut order: Vec<usize> = Vec::new();
    while order.len() < cfg.sequences {
        let mut round: Vec<usize> = (0..PROMPTS.len()).collect();
        for i in (1..round.len()).rev() {
            round.swap(i, rng.random_range(0..=i));
        }
        order.extend(round);
    }
    order
        .into_iter()
        .take(cfg.sequences)
        .map(|i| {
            let ids = tok.encode(PROMPTS[i], true)?;
            if ids.len() < cfg.prompt_tokens {
                return Err(Error::field(
                    "data.prompt_tokens",
                    format!(
                        "{} is longer than built-in prompt {i} ({} tokens with this tokenizer)",
                        cfg.prompt_tokens,
                        ids.len()
                    ),
                ));
            }
            Ok(ids[..cfg.prompt_tokens].to_vec())
        })
        .collect()
}

/// The distillation text of `cfg` under `dir` (made with `teacher` where a group is
/// missing or was made by another `[data]` table).
pub fn load_or_make(
    dir: &Path,
    cfg: &DataConfig,
    teacher: &dyn LanguageModel,
    tok: &Tokenizer,
    device: &Device,
    progress: bool,
) -> Result<Vec<Vec<u32>>> {
    cfg.validate()?;
    let prompts = prompt_ids(cfg, tok)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let bar = if progress {
        ProgressBar::new((cfg.sequences * cfg.new_tokens) as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("distillation text [{bar:30}] {pos}/{len} tokens  eta {eta}")
            .expect("template")
            .progress_chars("=> "),
    );
    let mut out = Vec::with_capacity(cfg.sequences);
    let key = DataConfig {
        sequences: 0,
        ..cfg.clone()
    };
    for (g, chunk) in prompts.chunks(cfg.batch).enumerate() {
        let path = dir.join(format!("group-{g:03}.json"));
        let stored = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<Group>(&t).ok())
            .filter(|grp| grp.data == key && grp.sequences.len() == chunk.len());
        let sequences = match stored {
            Some(grp) => grp.sequences,
            None => {
                let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (0x9e37_79b9 + g as u64));
                let s = sample(teacher, chunk, cfg, &mut rng, device, &bar)?;
                let grp = Group {
                    data: key.clone(),
                    sequences: s,
                };
                write_atomic(&path, serde_json::to_string(&grp).expect("json").as_bytes())?;
                grp.sequences
            }
        };
        bar.inc(0);
        out.extend(sequences);
        bar.set_position((out.len() * cfg.new_tokens) as u64);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// Continue every prompt of `prompts` (all of one length) by `cfg.new_tokens` tokens
/// drawn at `cfg.temperature` (the whole batch rerun each step: exact and simple).
fn sample(
    teacher: &dyn LanguageModel,
    prompts: &[Vec<u32>],
    cfg: &DataConfig,
    rng: &mut ChaCha8Rng,
    device: &Device,
    bar: &ProgressBar,
) -> Result<Vec<Vec<u32>>> {
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let b = seqs.len();
    for _ in 0..cfg.new_tokens {
        let t = seqs[0].len();
        let ids: Vec<i64> = seqs.iter().flatten().map(|&i| i as i64).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, t]), device);
        let rows: Vec<i64> = (0..b).map(|r| (r * t + t - 1) as i64).collect();
        let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [b]), device);
        let logits = teacher
            .forward_logit_rows(tokens, rows)?
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| Error::Other(format!("reading logits back: {e:?}")))?;
        let v = logits.len() / b;
        for (r, seq) in seqs.iter_mut().enumerate() {
            let next = draw(&logits[r * v..(r + 1) * v], cfg.temperature, rng).ok_or_else(|| {
                Error::Other(format!(
                    "the model's logits are not finite at position {t} of a distillation sequence"
                ))
            })?;
            seq.push(next);
        }
        bar.inc(b as u64);
    }
    Ok(seqs)
}

/// A token drawn from `softmax(logits / temperature)`; `None` when a logit is not
/// finite.
pub fn draw(logits: &[f32], temperature: f64, rng: &mut ChaCha8Rng) -> Option<u32> {
    if logits.is_empty() || logits.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = logits
        .iter()
        .map(|&x| ((x as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = rng.random::<f64>() * total;
    for (i, wi) in w.iter().enumerate() {
        u -= wi;
        if u <= 0.0 {
            return Some(i as u32);
        }
    }
    Some((w.len() - 1) as u32)
}
