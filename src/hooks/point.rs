//! Hook point names, TransformerLens style.
//!
//! A [`HookPoint`] is a site in the forward pass, optionally inside block `l`. It prints
//! and parses as the TransformerLens string (`blocks.3.attn.hook_z`), and a
//! [`PointPattern`] selects several points with `*` globs (`blocks.*.attn.hook_z`).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Which kind of head (defined with the `head_kind` table column it is stored in).
pub use crate::output::schema::HeadKind;

/// A site in the forward pass. `doc` gives the shape; the axes say which dimension a
/// head or position scope restricts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Site {
    /// `hook_embed`: token embeddings.
    Embed,
    /// `hook_resid_pre`: residual stream entering the block.
    ResidPre,
    /// `hook_resid_mid`: residual stream after attention, before the MLP.
    ResidMid,
    /// `hook_resid_post`: residual stream leaving the block.
    ResidPost,
    /// `attn.hook_q`: queries, after Q-norm, before RoPE.
    AttnQ,
    /// `attn.hook_k`: raw per-token keys, after K-norm, before RoPE and before compression.
    AttnK,
    /// `attn.hook_v`: raw per-token values, before compression.
    AttnV,
    /// `attn.hook_z`: per-head attention output (pattern x values), before the output
    /// projection (DeepSeek-V4: after the inverse RoPE of its rope slice).
    AttnZ,
    /// `attn.hook_attn_scores`: attention logits (scaled q . k, the sink logit in the sink
    /// slot) before masking and the softmax, key slots as in hook_pattern; invisible slots
    /// (masked, not yet closed, not selected) hold -1e30, and stay invisible whatever an
    /// intervention writes there. Touching this point runs the layer as one dense block,
    /// like hook_pattern.
    AttnScores,
    /// `attn.hook_pattern`: attention probabilities; key slots = [compressed entries...,
    /// raw tokens..., sink (if any)].
    AttnPattern,
    /// `attn.hook_result`: per-head contribution to the attention output (computed only
    /// when requested).
    AttnResult,
    /// `hook_attn_out`: attention sublayer output (DeepSeek-V4: before the mHC expansion
    /// into the streams).
    AttnOut,
    /// `mlp.hook_pre`: the gated MLP's gate pre-activation (kvc-family models).
    MlpPre,
    /// `mlp.hook_post`: the activation times the up projection, the down projection's
    /// input (kvc-family models).
    MlpPost,
    /// `hook_mlp_out`: MLP (or MoE: routed + shared experts) sublayer output.
    MlpOut,
    /// `hook_final_norm`: final normalised residual fed to the LM head.
    FinalNorm,
    /// `attn.compressor.hook_key_gate_logits`: compressor gate logits for keys, before the
    /// softmax over each window's offsets, per-offset gate bias included (kvc: learned
    /// gates only, uniform pooling has none; DeepSeek-V4: gate_proj(x) + position_bias,
    /// shared by K and V; CSA entry 0's A-half offsets are -inf). Adding (rolled bias -
    /// bias) here rolls the bias alone.
    KeyGateLogits,
    /// `attn.compressor.hook_value_gate_logits`: compressor gate logits for values, before
    /// the softmax (DeepSeek-V4: the same logits as hook_key_gate_logits unless one of them
    /// is changed).
    ValueGateLogits,
    /// `attn.compressor.hook_key_gate`: compressor pooling weights for keys: softmax over
    /// the offsets of each window (DeepSeek-V4: vector gates shared by K and V; CSA offsets
    /// 0..m = previous window's A half, m..2m = own window's B half).
    KeyGate,
    /// `attn.compressor.hook_value_gate`: compressor pooling weights for values
    /// (DeepSeek-V4: the same gates as hook_key_gate unless one of them is changed).
    ValueGate,
    /// `attn.compressor.hook_compressed_k`: pooled (compressed) keys, before RoPE
    /// (DeepSeek-V4: after the compressor's kv_norm).
    CompressedK,
    /// `attn.compressor.hook_compressed_v`: pooled (compressed) values (DeepSeek-V4: after
    /// kv_norm, before RoPE; K = V).
    CompressedV,
    /// `attn.indexer.hook_scores`: lightning-indexer scores of each compressed entry,
    /// before causal masking (DeepSeek-V4 CSA); the `select` overlay's block scores per
    /// query; the `evict` overlay's chunk scores (`[batch, chunk]`, one row per
    /// sequence: the observation window's attention mass on each chunk).
    IndexerScores,
    /// `attn.indexer.hook_selected`: the indexer's choice per query (DeepSeek-V4 CSA): 1.0
    /// = entry kept by the top-k of the closed entries, 0.0 = not. An intervention changes
    /// what the query reads: values > 0.5 are read (any number of them), entries not yet
    /// closed at the query stay unread; touching this point runs the layer as one dense
    /// block. The `select` overlay: the blocks each query keeps; the `evict` overlay:
    /// the kept chunks (`[batch, chunk]`, 1.0 = kept for every query from the
    /// observation window on).
    IndexerSelected,
    /// `attn.indexer.hook_topk`: indices of the entries the indexer's top-k kept (before
    /// any hook_selected intervention), in ascending order (as f32; -1 = none; capture
    /// only); top-k rule: among equal scores the lower index wins.
    IndexerTopk,
    /// `attn_hc.hook_pre`: mHC collapse weights of the attention sublayer (DeepSeek-V4):
    /// input = sum_n pre\[n\] * stream n.
    HcPre,
    /// `attn_hc.hook_post`: mHC expand weights of the attention sublayer: stream k gets
    /// post\[k\] * output.
    HcPost,
    /// `attn_hc.hook_comb`: mHC Sinkhorn-normalised stream mixing of the attention
    /// sublayer, [from j, to k]: stream k += sum_j comb[j, k] * stream j.
    HcComb,
    /// `mlp_hc.hook_pre`: mHC collapse weights of the MoE sublayer (DeepSeek-V4).
    MlpHcPre,
    /// `mlp_hc.hook_post`: mHC expand weights of the MoE sublayer.
    MlpHcPost,
    /// `mlp_hc.hook_comb`: mHC stream mixing of the MoE sublayer, [from j, to k].
    MlpHcComb,
    /// `mlp.hook_router_scores`: MoE router scores after the scoring function, before the
    /// score-correction bias (DeepSeek-V4).
    RouterScores,
    /// `mlp.hook_router_weights`: weights of the chosen experts (normalised, times
    /// routed_scaling_factor), aligned with hook_router_topk.
    RouterWeights,
    /// `mlp.hook_router_topk`: experts chosen per token (as f32; capture only): score top-k
    /// layers in ascending order, among equal scores the lower expert index wins; hash
    /// layers: the tid2eid row.
    RouterTopk,
    /// `hook_hc_head_pre`: final hyper-head collapse weights before the last norm
    /// (DeepSeek-V4).
    HcHeadPre,
}

/// What a site's position axis counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PosCounts {
    /// Token (or query) positions.
    Tokens,
    /// Compressed cache entries (one per window).
    Entries,
}

/// Static description of a site.
#[derive(Debug, Clone, Copy)]
pub struct SiteInfo {
    /// Name after `blocks.{l}.` (or the whole name for global sites).
    pub suffix: &'static str,
    /// Whether the site lives inside a block.
    pub layered: bool,
    /// Shape, in the docs' notation.
    pub shape: &'static str,
    /// What it is.
    pub doc: &'static str,
    /// Axis indexed by a position scope.
    pub pos_axis: Option<usize>,
    /// What the position axis counts: token positions, or compressed entries (whose
    /// index is not a token position, so token-position scopes do not apply).
    pub pos_counts: PosCounts,
    /// Axis indexed by a head scope, and which heads it counts.
    pub head_axis: Option<(usize, HeadKind)>,
    /// A per-token point of a block's stream: its value at token position p is computed
    /// from the block's input at p and the keys and values of positions <= p, so an
    /// edit at positions >= f leaves every earlier position of the same forward
    /// unchanged, and a suffix forward (recomputing positions f.. over a base run's
    /// keys and values) can apply it (the residual stream, queries, keys, values, z,
    /// per-head results, attention and MLP outputs).
    pub per_token: bool,
}

macro_rules! sites {
    ($( $v:ident => ($suffix:expr, $layered:expr, $shape:expr, $pos:expr, $counts:ident, $head:expr, $doc:expr) ),* $(,)?) => {
        impl Site {
            /// Every site, in forward order.
            pub const ALL: &'static [Site] = &[$(Site::$v),*];

            /// The site's static description.
            pub fn info(self) -> SiteInfo {
                match self {
                    $(Site::$v => SiteInfo {
                        suffix: $suffix,
                        layered: $layered,
                        shape: $shape,
                        doc: $doc,
                        pos_axis: $pos,
                        pos_counts: PosCounts::$counts,
                        head_axis: $head,
                        per_token: matches!(
                            Site::$v,
                            Site::ResidPre
                                | Site::ResidMid
                                | Site::ResidPost
                                | Site::AttnQ
                                | Site::AttnK
                                | Site::AttnV
                                | Site::AttnZ
                                | Site::AttnResult
                                | Site::AttnOut
                                | Site::MlpPre
                                | Site::MlpPost
                                | Site::MlpOut
                        ),
                    },)*
                }
            }
        }
    };
}

use HeadKind::{Kv, Query};

sites! {
    Embed => ("hook_embed", false, "[batch, pos, d_model]", Some(1), Tokens, None,
        "token embeddings"),
    ResidPre => ("hook_resid_pre", true, "[batch, pos, d_model] (DeepSeek-V4: [batch, pos, hc_mult, d_model])", Some(1), Tokens, None,
        "residual stream entering the block"),
    ResidMid => ("hook_resid_mid", true, "[batch, pos, d_model] (DeepSeek-V4: [batch, pos, hc_mult, d_model])", Some(1), Tokens, None,
        "residual stream after attention, before the MLP"),
    ResidPost => ("hook_resid_post", true, "[batch, pos, d_model] (DeepSeek-V4: [batch, pos, hc_mult, d_model])", Some(1), Tokens, None,
        "residual stream leaving the block"),
    AttnQ => ("attn.hook_q", true, "[batch, pos, head, d_head]", Some(1), Tokens, Some((2, Query)),
        "queries, after Q-norm, before RoPE"),
    AttnK => ("attn.hook_k", true, "[batch, pos, kv_head, d_head]", Some(1), Tokens, Some((2, Kv)),
        "raw per-token keys, after K-norm, before RoPE and before compression"),
    AttnV => ("attn.hook_v", true, "[batch, pos, kv_head, d_head]", Some(1), Tokens, Some((2, Kv)),
        "raw per-token values, before compression"),
    AttnZ => ("attn.hook_z", true, "[batch, pos, head, d_head]", Some(1), Tokens, Some((2, Query)),
        "per-head attention output (pattern x values), before the output projection (DeepSeek-V4: after the inverse RoPE of its rope slice)"),
    AttnScores => ("attn.hook_attn_scores", true, "[batch, head, query_pos, key_slot]", Some(2), Tokens, Some((1, Query)),
        "attention logits (scaled q . k, the sink logit in the sink slot) before masking and the softmax, key slots as in hook_pattern; invisible slots (masked, not yet closed, not selected) hold -1e30, and stay invisible whatever an intervention writes there. Touching this point runs the layer as one dense block, like hook_pattern"),
    AttnPattern => ("attn.hook_pattern", true, "[batch, head, query_pos, key_slot]", Some(2), Tokens, Some((1, Query)),
        "attention probabilities; key slots = [compressed entries..., raw tokens..., sink (if any)]"),
    AttnResult => ("attn.hook_result", true, "[batch, pos, head, d_model]", Some(1), Tokens, Some((2, Query)),
        "per-head contribution to the attention output (computed only when requested)"),
    AttnOut => ("hook_attn_out", true, "[batch, pos, d_model]", Some(1), Tokens, None,
        "attention sublayer output (DeepSeek-V4: before the mHC expansion into the streams)"),
    MlpPre => ("mlp.hook_pre", true, "[batch, pos, d_mlp]", Some(1), Tokens, None,
        "the gated MLP's gate pre-activation (kvc, Llama, Gemma 3)"),
    MlpPost => ("mlp.hook_post", true, "[batch, pos, d_mlp]", Some(1), Tokens, None,
        "act(gate) * up: the MLP's down projection input (kvc, Llama, Gemma 3)"),
    MlpOut => ("hook_mlp_out", true, "[batch, pos, d_model]", Some(1), Tokens, None,
        "MLP (or MoE: routed + shared experts) sublayer output"),
    FinalNorm => ("hook_final_norm", false, "[batch, pos, d_model]", Some(1), Tokens, None,
        "final normalised residual fed to the LM head"),
    KeyGateLogits => ("attn.compressor.hook_key_gate_logits", true, "[batch, entry, offset, kv_head] (vector gates: [batch, entry, offset, kv_head, d_head])", Some(1), Entries, Some((3, Kv)),
        "compressor gate logits for keys, before the softmax over each window's offsets, per-offset gate bias included (kvc: learned gates only, uniform pooling has none; DeepSeek-V4: gate_proj(x) + position_bias, shared by K and V; CSA entry 0's A-half offsets are -inf). Adding (rolled bias - bias) here rolls the bias alone"),
    ValueGateLogits => ("attn.compressor.hook_value_gate_logits", true, "[batch, entry, offset, kv_head] (vector gates: [batch, entry, offset, kv_head, d_head])", Some(1), Entries, Some((3, Kv)),
        "compressor gate logits for values, before the softmax (DeepSeek-V4: the same logits as hook_key_gate_logits unless one of them is changed)"),
    KeyGate => ("attn.compressor.hook_key_gate", true, "[batch, entry, offset, kv_head] (vector gates: [batch, entry, offset, kv_head, d_head])", Some(1), Entries, Some((3, Kv)),
        "compressor pooling weights for keys: softmax over the offsets of each window (DeepSeek-V4: vector gates shared by K and V; CSA offsets 0..m = previous window's A half, m..2m = own window's B half)"),
    ValueGate => ("attn.compressor.hook_value_gate", true, "[batch, entry, offset, kv_head] (vector gates: [batch, entry, offset, kv_head, d_head])", Some(1), Entries, Some((3, Kv)),
        "compressor pooling weights for values (DeepSeek-V4: the same gates as hook_key_gate unless one of them is changed)"),
    CompressedK => ("attn.compressor.hook_compressed_k", true, "[batch, entry, kv_head, d_head]", Some(1), Entries, Some((2, Kv)),
        "pooled (compressed) keys, before RoPE (DeepSeek-V4: after the compressor's kv_norm)"),
    CompressedV => ("attn.compressor.hook_compressed_v", true, "[batch, entry, kv_head, d_head]", Some(1), Entries, Some((2, Kv)),
        "pooled (compressed) values (DeepSeek-V4: after kv_norm, before RoPE; K = V)"),
    IndexerScores => ("attn.indexer.hook_scores", true, "[batch, query_pos, entry] (select overlay: entry = block; evict overlay: [batch, chunk])", Some(1), Tokens, None,
        "lightning-indexer scores of each compressed entry, before causal masking (DeepSeek-V4 CSA). `select` overlay: each block's score per query (Quest's bound or the mean key, max over the layer's query heads), before the candidate mask. `evict` overlay: one row per sequence, each chunk's attention mass from the observation window (softmax over each window query's visible keys, summed over query heads, window queries and the chunk's tokens before the window; chunks tile the tokens before the window, boundaries at offset + i * chunk); the top `keep` fraction is kept. An intervention changes what is kept"),
    IndexerSelected => ("attn.indexer.hook_selected", true, "[batch, query_pos, entry] (select overlay: entry = block; evict overlay: [batch, chunk])", Some(1), Tokens, None,
        "the indexer's choice per query (DeepSeek-V4 CSA): 1.0 = entry kept by the top-k of the closed entries, 0.0 = not. An intervention changes what the query reads: values > 0.5 are read (any number of them), entries not yet closed at the query stay unread; touching this point runs the layer as one dense block. `select` overlay: 1.0 = block kept by the query (a patched choice may keep any candidate block: one holding a token before the query's raw window). `evict` overlay: one row per sequence, 1.0 = chunk kept, 0.0 = evicted, for every query from the observation window on; a patched mask (values > 0.5 kept, any number) changes which chunks those queries read (the prefill's queries, the window, the decode tokens and the sinks are never evicted)"),
    IndexerTopk => ("attn.indexer.hook_topk", true, "[batch, query_pos, k]", Some(1), Tokens, None,
        "indices of the entries the indexer's top-k kept (before any hook_selected intervention), in ascending order (as f32; -1 = none; capture only); top-k rule: among equal scores the lower index wins"),
    HcPre => ("attn_hc.hook_pre", true, "[batch, pos, hc_mult]", Some(1), Tokens, None,
        "mHC collapse weights of the attention sublayer (DeepSeek-V4): input = sum_n pre[n] * stream n"),
    HcPost => ("attn_hc.hook_post", true, "[batch, pos, hc_mult]", Some(1), Tokens, None,
        "mHC expand weights of the attention sublayer: stream k gets post[k] * output"),
    HcComb => ("attn_hc.hook_comb", true, "[batch, pos, hc_mult, hc_mult]", Some(1), Tokens, None,
        "mHC Sinkhorn-normalised stream mixing of the attention sublayer, [from j, to k]: stream k += sum_j comb[j, k] * stream j"),
    MlpHcPre => ("mlp_hc.hook_pre", true, "[batch, pos, hc_mult]", Some(1), Tokens, None,
        "mHC collapse weights of the MoE sublayer (DeepSeek-V4)"),
    MlpHcPost => ("mlp_hc.hook_post", true, "[batch, pos, hc_mult]", Some(1), Tokens, None,
        "mHC expand weights of the MoE sublayer"),
    MlpHcComb => ("mlp_hc.hook_comb", true, "[batch, pos, hc_mult, hc_mult]", Some(1), Tokens, None,
        "mHC stream mixing of the MoE sublayer, [from j, to k]"),
    RouterScores => ("mlp.hook_router_scores", true, "[batch, pos, n_experts]", Some(1), Tokens, None,
        "MoE router scores after the scoring function, before the score-correction bias (DeepSeek-V4)"),
    RouterWeights => ("mlp.hook_router_weights", true, "[batch, pos, top_k]", Some(1), Tokens, None,
        "weights of the chosen experts (normalised, times routed_scaling_factor), aligned with hook_router_topk"),
    RouterTopk => ("mlp.hook_router_topk", true, "[batch, pos, top_k]", Some(1), Tokens, None,
        "experts chosen per token (as f32; capture only): score top-k layers in ascending order, among equal scores the lower expert index wins; hash layers: the tid2eid row"),
    HcHeadPre => ("hook_hc_head_pre", false, "[batch, pos, hc_mult]", Some(1), Tokens, None,
        "final hyper-head collapse weights before the last norm (DeepSeek-V4)"),
}

/// The table of every site as Markdown (the body of `docs/hooks.md`; a test keeps the
/// file current: regenerate it with `phaselens hooks --markdown > docs/hooks.md`).
pub fn markdown_table() -> String {
    let mut out = String::from(
        "# Hook points\n\n\
         Generated by `phaselens hooks --markdown`. `{l}` is the block index. \\\n\
         *head axis* / *position axis*: the dimensions that an intervention `Scope`'s \\\n\
         `heads` / `positions` restrict (`q` = query heads, `kv` = KV heads; a position \\\n\
         axis marked `entries` counts compressed entries, not tokens).\n\n\
         | name | shape | head axis | position axis | meaning |\n|---|---|---|---|---|\n",
    );
    for site in Site::ALL {
        let i = site.info();
        let name = if i.layered {
            format!("blocks.{{l}}.{}", i.suffix)
        } else {
            i.suffix.to_string()
        };
        let head = match i.head_axis {
            Some((a, HeadKind::Query)) => format!("{a} (q)"),
            Some((a, HeadKind::Kv)) => format!("{a} (kv)"),
            None => "-".into(),
        };
        let pos = match (i.pos_axis, i.pos_counts) {
            (None, _) => "-".to_string(),
            (Some(a), PosCounts::Tokens) => a.to_string(),
            (Some(a), PosCounts::Entries) => format!("{a} (entries)"),
        };
        out.push_str(&format!(
            "| `{name}` | `{}` | {head} | {pos} | {} |\n",
            i.shape, i.doc
        ));
    }
    out
}

/// A concrete hook point: a site, inside block `layer` when the site is layered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HookPoint {
    /// The block (`blocks.{layer}.`); None for the sites outside the blocks.
    pub layer: Option<usize>,
    /// What the point is (`attn.hook_z`, `hook_resid_pre`, ...).
    pub site: Site,
}

impl HookPoint {
    /// A global point (`hook_embed`, `hook_final_norm`).
    pub const fn global(site: Site) -> Self {
        HookPoint { layer: None, site }
    }

    /// A point inside block `layer`.
    pub const fn block(layer: usize, site: Site) -> Self {
        HookPoint {
            layer: Some(layer),
            site,
        }
    }
}

impl fmt::Display for HookPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layer {
            Some(l) => write!(f, "blocks.{l}.{}", self.site.info().suffix),
            None => write!(f, "{}", self.site.info().suffix),
        }
    }
}

impl FromStr for HookPoint {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        if let Some(rest) = s.strip_prefix("blocks.") {
            let (layer, suffix) = rest
                .split_once('.')
                .ok_or_else(|| Error::hook(s, "expected `blocks.<layer>.<name>`"))?;
            let layer: usize = layer
                .parse()
                .map_err(|_| Error::hook(s, format!("`{layer}` is not a layer number")))?;
            for site in Site::ALL {
                let info = site.info();
                if info.layered && info.suffix == suffix {
                    return Ok(HookPoint::block(layer, *site));
                }
            }
            return Err(Error::hook(s, unknown_hint()));
        }
        for site in Site::ALL {
            let info = site.info();
            if !info.layered && info.suffix == s {
                return Ok(HookPoint::global(*site));
            }
        }
        Err(Error::hook(s, unknown_hint()))
    }
}

fn unknown_hint() -> String {
    "unknown hook point; run `phaselens hooks` for the list (e.g. `blocks.0.attn.hook_z`, `hook_embed`)".into()
}

/// A pattern over hook point names: an exact name or a glob where `*` matches any run
/// of characters within one dot-separated part (`blocks.*.attn.hook_z`) and `**` matches
/// anything (`blocks.2.**`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PointPattern(String);

impl PointPattern {
    /// Parse a pattern. An exact name must be a known hook point.
    pub fn new(pattern: &str) -> Result<Self> {
        if pattern.is_empty() {
            return Err(Error::hook(pattern, "empty hook pattern"));
        }
        if !pattern.contains('*') {
            pattern.parse::<HookPoint>()?;
        }
        Ok(PointPattern(pattern.to_string()))
    }

    /// The pattern text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `name` (a hook point's string) matches.
    pub fn matches(&self, name: &str) -> bool {
        glob_match(self.0.as_bytes(), name.as_bytes())
    }

    /// Whether the pattern matches the point.
    pub fn matches_point(&self, point: &HookPoint) -> bool {
        if !self.0.contains('*') {
            // Fast path: exact names compare without formatting when the site differs.
            return self.0.ends_with(point.site.info().suffix) && self.matches(&point.to_string());
        }
        self.matches(&point.to_string())
    }
}

impl fmt::Display for PointPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for PointPattern {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        PointPattern::new(s)
    }
}

fn glob_match(p: &[u8], s: &[u8]) -> bool {
    match p.first() {
        None => s.is_empty(),
        Some(b'*') if p.get(1) == Some(&b'*') => {
            let rest = &p[2..];
            (0..=s.len()).any(|i| glob_match(rest, &s[i..]))
        }
        Some(b'*') => {
            let rest = &p[1..];
            for i in 0..=s.len() {
                if glob_match(rest, &s[i..]) {
                    return true;
                }
                if i < s.len() && s[i] == b'.' {
                    break;
                }
            }
            false
        }
        Some(c) => s.first() == Some(c) && glob_match(&p[1..], &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for site in Site::ALL {
            let p = if site.info().layered {
                HookPoint::block(3, *site)
            } else {
                HookPoint::global(*site)
            };
            let s = p.to_string();
            assert_eq!(s.parse::<HookPoint>().unwrap(), p, "{s}");
        }
        assert_eq!(
            HookPoint::block(2, Site::AttnZ).to_string(),
            "blocks.2.attn.hook_z"
        );
    }

    #[test]
    fn bad_names_are_errors() {
        assert!("blocks.x.attn.hook_z".parse::<HookPoint>().is_err());
        assert!("blocks.0.attn.hook_zz".parse::<HookPoint>().is_err());
        assert!("hook_resid_pre".parse::<HookPoint>().is_err());
        assert!(PointPattern::new("blocks.0.nope").is_err());
    }

    #[test]
    fn docs_hooks_md_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/hooks.md");
        let doc = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            doc == markdown_table(),
            "docs/hooks.md is stale: run `cargo run -- hooks --markdown > docs/hooks.md`"
        );
    }

    #[test]
    fn globs() {
        let p = PointPattern::new("blocks.*.attn.hook_z").unwrap();
        assert!(p.matches("blocks.0.attn.hook_z"));
        assert!(p.matches("blocks.12.attn.hook_z"));
        assert!(!p.matches("blocks.0.attn.hook_q"));
        assert!(!p.matches("blocks.0.x.attn.hook_z"));
        let p = PointPattern::new("blocks.1.**").unwrap();
        assert!(p.matches("blocks.1.attn.compressor.hook_key_gate"));
        assert!(!p.matches("blocks.10.hook_resid_pre"));
        let p = PointPattern::new("blocks.0.hook_resid_pre").unwrap();
        assert!(p.matches_point(&HookPoint::block(0, Site::ResidPre)));
        assert!(!p.matches_point(&HookPoint::block(1, Site::ResidPre)));
    }
}
