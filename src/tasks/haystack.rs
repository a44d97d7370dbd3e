//! Long-context phase-matched retrieval: the KV prompt of `docs/prompt_format.md`
//! section 2 with its bindings spread through a long haystack of filler, the target
//! binding (the needle) at a controlled depth, rendered at every phase of the period.
//!
//! Layout of one prompt of `length` tokens (`P` = period, `w` = binding width):
//!
//! ```text
//! [lead s] BOS? F(g_0) B_0 F(g_1) B_1 ... B_{N-1} F(g_N) QUERY? Q_1 .. Q_T [tail P-1-s]
//! ```
//!
//! `F(k)` is k filler tokens (pads, or random filler atoms). The haystack (everything
//! between BOS and the query section) has `H = length - |BOS| - |queries| - (P - 1)`
//! positions before the phase shift: `N w` binding tokens and `H - N w` filler. The
//! needle is binding `j* = round(depth (N - 1))` and starts at haystack offset
//! `round(depth (H - w))` (clamped so the bindings fit around it); the other bindings
//! split the filler before and after it at random. The last query asks the needle
//! (the paper's single final query with the default `n_queries = 1`).
//!
//! Phases, exactly as in the short evaluation sets: with the needle's unshifted key
//! position `B` and `s = (r - B mod P) mod P`, prefix padding puts `s` pads before the
//! prompt and `P - 1 - s` after the last answer; in-sequence padding puts `s` filler
//! tokens right before the needle and `P - 1 - s` right after it (only the needle
//! moves). Every prompt has exactly `length` tokens.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::kv::{Pads, Rendering, render, rng_for, sample_content};
use super::vocab::TokenSpace;
use super::{KvExample, KvPromptConfig, Period, Protocol, TaskError, TaskResult};

/// What fills the haystack between the bindings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HaystackFiller {
    /// The pad token (what the organisms saw between bindings in training).
    #[default]
    Pad,
    /// Random filler atoms (the filler probe's atoms; tokens the organisms never saw).
    Atoms,
}

/// Longest prompt the generator builds (tokens).
pub const MAX_HAYSTACK_LEN: usize = 1 << 22;

/// A long-context evaluation design: lengths x depths x phases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HaystackConfig {
    /// Binding and query format. Default: the organisms' 24 single-token bindings with
    /// ONE query at the end (the paper's headline).
    pub prompt: KvPromptConfig,
    /// Total prompt lengths in tokens, padding included. Default 1024, 4096.
    pub lengths: Vec<usize>,
    /// Needle depths, fractions of the haystack in 0..=1. Default 0.1, 0.5, 0.9.
    pub depths: Vec<f64>,
    /// Haystack filler. Default `pad`.
    pub filler: HaystackFiller,
    /// Period P; phase groups are the needle key's position mod P. Default 8.
    pub period: Period,
    /// Padding protocol. Default `prefix_padding`.
    pub protocol: Protocol,
    /// Logical examples per (length, depth); each is rendered at every phase.
    /// Default 16.
    pub n_logical: usize,
    /// Seed. Default 0.
    pub seed: u64,
}

impl Default for HaystackConfig {
    fn default() -> Self {
        HaystackConfig {
            prompt: KvPromptConfig {
                n_queries: 1,
                ..KvPromptConfig::default()
            },
            lengths: vec![1024, 4096],
            depths: vec![0.1, 0.5, 0.9],
            filler: HaystackFiller::Pad,
            period: Period::new(8).expect("nonzero"),
            protocol: Protocol::PrefixPadding,
            n_logical: 16,
            seed: 0,
        }
    }
}

/// One rendered long-context prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HaystackExample {
    /// Index into [`HaystackConfig::lengths`] and the length itself.
    pub length_index: usize,
    /// The prompt length (tokens).
    pub length: usize,
    /// Index into [`HaystackConfig::depths`] and the requested depth.
    pub depth_index: usize,
    /// The requested needle depth (a fraction of the haystack).
    pub depth: f64,
    /// Where the needle actually starts, as a fraction of the haystack.
    pub needle_depth: f64,
    /// The prompt (answers included) and its scored query.
    pub example: KvExample,
}

impl HaystackConfig {
    /// Positions of a prompt that are not haystack: BOS, the query section, and the
    /// `P - 1` positions the phase shift uses.
    fn fixed_len(&self, space: &TokenSpace) -> usize {
        usize::from(self.prompt.bos) + self.prompt.query_section_len(space) + self.period.len() - 1
    }

    /// The shortest valid length: the bindings and the queries with no filler.
    pub fn min_len(&self, space: &TokenSpace) -> usize {
        self.fixed_len(space) + self.prompt.n_bindings * self.prompt.binding_width(space)
    }

    /// Check every field (errors name the field).
    pub fn validate(&self, space: &TokenSpace) -> TaskResult<()> {
        self.prompt.validate(space)?;
        if self.prompt.max_len.is_some() {
            return Err(TaskError::config(
                "prompt.max_len",
                "not used by haystack sets (their lengths are `lengths`)",
            ));
        }
        if self.lengths.is_empty() {
            return Err(TaskError::config("lengths", "give at least one length"));
        }
        let min = self.min_len(space);
        for &l in &self.lengths {
            if l < min || l > MAX_HAYSTACK_LEN {
                return Err(TaskError::config(
                    "lengths",
                    format!(
                        "{l} tokens: a prompt needs {min}..={MAX_HAYSTACK_LEN} tokens ({} \
                         bindings of {} tokens, the queries and P - 1 = {} shift positions)",
                        self.prompt.n_bindings,
                        self.prompt.binding_width(space),
                        self.period.len() - 1
                    ),
                ));
            }
        }
        if self.depths.is_empty() || self.depths.iter().any(|d| !(0.0..=1.0).contains(d)) {
            return Err(TaskError::config(
                "depths",
                format!("give depths in 0..=1 (got {:?})", self.depths),
            ));
        }
        if self.n_logical == 0 {
            return Err(TaskError::config("n_logical", "must be at least 1"));
        }
        if self.filler == HaystackFiller::Atoms && space.filler_atoms().is_empty() {
            return Err(TaskError::config(
                "filler",
                "the token space has no filler atoms (use filler = \"pad\")",
            ));
        }
        Ok(())
    }

    /// The `n_logical * P` prompts of one (length, depth) cell: logical example `i`
    /// rendered at residue `r` is entry `i * P + r`.
    pub fn cell(
        &self,
        space: &TokenSpace,
        length_index: usize,
        depth_index: usize,
    ) -> TaskResult<Vec<HaystackExample>> {
        self.validate(space)?;
        let (Some(&length), Some(&depth)) =
            (self.lengths.get(length_index), self.depths.get(depth_index))
        else {
            return Err(TaskError::config(
                "lengths",
                format!("no cell ({length_index}, {depth_index})"),
            ));
        };
        let p = self.period.len();
        let mut out = Vec::with_capacity(self.n_logical * p);
        for i in 0..self.n_logical {
            let logical =
                ((length_index * self.depths.len() + depth_index) * self.n_logical + i) as u64;
            let mut rng = rng_for(self.seed, logical + 1);
            let layout = self.layout(space, length, depth, &mut rng);
            let content = sample_content(&mut rng, space, &self.prompt, Some(layout.needle));
            let filler: Vec<u32> = match self.filler {
                HaystackFiller::Pad => Vec::new(),
                HaystackFiller::Atoms => {
                    let atoms = space.filler_atoms();
                    (0..length)
                        .map(|_| atoms[rng.random_range(0..atoms.len())])
                        .collect()
                }
            };
            for r in 0..p {
                let shift = (r + p - layout.base % p) % p;
                let pads = match self.protocol {
                    Protocol::PrefixPadding => Pads {
                        lead: shift,
                        gaps: layout.gaps.clone(),
                        tail: p - 1 - shift,
                    },
                    Protocol::InSequencePadding => {
                        let mut gaps = layout.gaps.clone();
                        gaps[layout.needle] += shift;
                        gaps[layout.needle + 1] += p - 1 - shift;
                        Pads {
                            lead: 0,
                            gaps,
                            tail: 0,
                        }
                    }
                };
                let mut example = render(
                    space,
                    &self.prompt,
                    &content,
                    &pads,
                    self.period,
                    Rendering {
                        logical_id: logical,
                        protocol: Some(self.protocol),
                        shift,
                    },
                );
                if !filler.is_empty() {
                    fill_haystack(&mut example, &pads, space.pad(), &filler);
                }
                debug_assert_eq!(example.tokens.len(), length);
                out.push(HaystackExample {
                    length_index,
                    length,
                    depth_index,
                    depth,
                    needle_depth: layout.offset as f64 / layout.haystack.max(1) as f64,
                    example,
                });
            }
        }
        Ok(out)
    }

    /// Where the bindings go in a haystack of `length`: the needle's index and offset,
    /// and the filler before every binding (and after the last).
    fn layout(
        &self,
        space: &TokenSpace,
        length: usize,
        depth: f64,
        rng: &mut ChaCha8Rng,
    ) -> Layout {
        let n = self.prompt.n_bindings;
        let w = self.prompt.binding_width(space);
        let haystack = length - self.fixed_len(space);
        let filler = haystack - n * w;
        let needle = (depth * (n - 1) as f64).round() as usize;
        // The needle's offset, clamped so that `needle` bindings fit before it and the
        // rest after it.
        let want = (depth * (haystack - w) as f64).round() as usize;
        let offset = want.clamp(needle * w, haystack - (n - needle) * w);
        let before = offset - needle * w;
        let mut gaps = split(rng, before, needle + 1);
        gaps.extend(split(rng, filler - before, n - needle));
        let bos = usize::from(self.prompt.bos);
        Layout {
            needle,
            offset,
            haystack,
            base: bos + offset,
            gaps,
        }
    }
}

struct Layout {
    /// Index of the needle binding.
    needle: usize,
    /// Its offset in the haystack, and the haystack size.
    offset: usize,
    haystack: usize,
    /// The needle key's position with no shift.
    base: usize,
    /// Filler before binding i (`gaps[N]`: after the last).
    gaps: Vec<usize>,
}

/// `total` split into `parts` non-negative parts, uniformly over compositions.
fn split(rng: &mut ChaCha8Rng, total: usize, parts: usize) -> Vec<usize> {
    if parts == 1 {
        return vec![total];
    }
    // Stars and bars: `parts - 1` distinct bar positions among `total + parts - 1`.
    let slots = total + parts - 1;
    let mut bars = rand::seq::index::sample(rng, slots, parts - 1).into_vec();
    bars.sort_unstable();
    let mut out = Vec::with_capacity(parts);
    let mut prev = 0;
    for (i, &b) in bars.iter().enumerate() {
        out.push(b - prev - usize::from(i > 0));
        prev = b;
    }
    out.push(slots - prev - usize::from(!bars.is_empty()));
    out
}

/// Replace the pads inside the haystack (after BOS, before the query section; the
/// prefix protocol's lead and tail pads stay pads) with the filler sequence, in order.
fn fill_haystack(example: &mut KvExample, pads: &Pads, pad: u32, filler: &[u32]) {
    let first_key = example.bindings[0].key_pos;
    let start = first_key - pads.gaps[0];
    let end = example.queries[0].query_pos;
    let mut k = 0;
    for t in &mut example.tokens[start..end] {
        if *t == pad {
            *t = filler[k % filler.len()];
            k += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> TokenSpace {
        TokenSpace::default_synthetic()
    }

    fn cfg(protocol: Protocol, filler: HaystackFiller) -> HaystackConfig {
        HaystackConfig {
            lengths: vec![200, 1000],
            depths: vec![0.0, 0.37, 1.0],
            n_logical: 3,
            protocol,
            filler,
            ..HaystackConfig::default()
        }
    }

    #[test]
    fn every_prompt_has_its_length_and_the_needle_at_each_phase() {
        let s = space();
        for protocol in Protocol::ALL {
            for filler in [HaystackFiller::Pad, HaystackFiller::Atoms] {
                let c = cfg(protocol, filler);
                for li in 0..2 {
                    for di in 0..3 {
                        let cell = c.cell(&s, li, di).unwrap();
                        assert_eq!(cell.len(), 3 * 8);
                        for (k, h) in cell.iter().enumerate() {
                            let e = &h.example;
                            assert_eq!(e.tokens.len(), c.lengths[li]);
                            assert_eq!(e.phase.residue() as usize, k % 8);
                            let q = e.scored_query();
                            let b = &e.bindings[q.binding];
                            assert_eq!(b.key_pos, e.target_key_pos);
                            assert_eq!(&e.tokens[b.key_pos..b.key_pos + 1], &b.key[..]);
                            // Teacher forcing: the answer sits after its target position.
                            assert_eq!(e.tokens[e.target_positions[0] + 1], e.answers[0]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_needle_sits_at_the_requested_depth() {
        let s = space();
        let c = HaystackConfig {
            lengths: vec![4000],
            depths: vec![0.0, 0.25, 0.5, 0.75, 1.0],
            n_logical: 2,
            ..HaystackConfig::default()
        };
        for di in 0..5 {
            for h in c.cell(&s, 0, di).unwrap() {
                assert!(
                    (h.needle_depth - c.depths[di]).abs() < 0.02,
                    "depth {} got {}",
                    c.depths[di],
                    h.needle_depth
                );
            }
        }
    }

    #[test]
    fn in_sequence_padding_moves_only_the_needle() {
        let s = space();
        let c = cfg(Protocol::InSequencePadding, HaystackFiller::Pad);
        let cell = c.cell(&s, 1, 1).unwrap();
        for i in 0..3 {
            let e0 = &cell[i * 8].example;
            for r in 1..8 {
                let e = &cell[i * 8 + r].example;
                let needle = e.scored_query().binding;
                for (j, (a, b)) in e0.bindings.iter().zip(&e.bindings).enumerate() {
                    if j != needle {
                        assert_eq!(a.key_pos, b.key_pos, "binding {j} moved");
                    }
                }
                assert_eq!(e0.target_positions, e.target_positions);
            }
        }
    }

    #[test]
    fn atoms_fill_the_haystack_but_not_the_shift_pads() {
        let s = space();
        let c = cfg(Protocol::PrefixPadding, HaystackFiller::Atoms);
        for h in c.cell(&s, 0, 1).unwrap() {
            let e = &h.example;
            let pads = e.tokens.iter().filter(|&&t| t == s.pad()).count();
            assert_eq!(pads, 7, "only the prefix/tail shift pads remain");
        }
    }

    #[test]
    fn bad_settings_name_their_field() {
        let s = space();
        let mut c = HaystackConfig {
            lengths: vec![10],
            ..HaystackConfig::default()
        };
        assert!(
            c.validate(&s)
                .unwrap_err()
                .to_string()
                .contains("`lengths`")
        );
        c.lengths = vec![usize::MAX];
        assert!(
            c.validate(&s)
                .unwrap_err()
                .to_string()
                .contains("`lengths`")
        );
        c.lengths = vec![1024];
        c.depths = vec![f64::NAN];
        assert!(c.validate(&s).unwrap_err().to_string().contains("`depths`"));
        c.depths = vec![0.5];
        c.n_logical = 0;
        assert!(
            c.validate(&s)
                .unwrap_err()
                .to_string()
                .contains("`n_logical`")
        );
    }

    #[test]
    fn split_covers_the_total() {
        let mut rng = rng_for(1, 2);
        for (total, parts) in [(0, 1), (0, 5), (7, 1), (100, 3), (5, 9)] {
            let v = split(&mut rng, total, parts);
            assert_eq!(v.len(), parts);
            assert_eq!(v.iter().sum::<usize>(), total);
        }
    }
}
