//! The DeepSeek-V4 decoder: embedding -> `hc_mult` residual streams -> layers (mHC around
//! attention and MoE) -> hyper-head collapse -> RMSNorm -> LM head.
//!
//! The residual state at `blocks.{l}.hook_resid_pre/mid/post` is the mHC stream tensor
//! `[batch, pos, hc_mult, d_model]`; `forward_from` starts from it.

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};

use super::attention::{Attention, Tables};
use super::compressor::{Compressor, Pooler};
use super::config::{AttnType, DeepseekV4Config, MODEL_TYPE};
use super::indexer::Indexer;
use super::mhc::{self, HyperConnection, HyperHead, Sublayer};
use super::moe::Moe;
use crate::error::{Error, Result};
use crate::hooks::{Act, ActivationCache, HookPoint, HookRun, HookSpec, Site};
use crate::model::kv_state::{PrefixState, Queries, Suffix, TokenFlow};
use crate::model::layers::{Embedding, Linear, RmsNorm, cat_dim1};
use crate::model::placement::{PerDevice, Placed, to};
use crate::model::profile;
use crate::model::stored::StoredWeight;
use crate::model::weights::{Init, Vb};
use crate::model::{
    ForwardOutput, LayerKind, LayerSpec, ModelInfo, StreamLinear, StreamModel, StreamPoint,
    StreamRead,
};

/// One decoder layer (`model.layers.{l}`).
#[derive(Module, Debug)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Moe,
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
    pub attn_hc: HyperConnection,
    pub ffn_hc: HyperConnection,
}

impl DecoderLayer {
    /// The layer's weights kept as stored (attention, compressor and indexer projections,
    /// router, routed and shared experts).
    fn stored_weights<'a>(&'a self, out: &mut Vec<&'a StoredWeight>) {
        let a = &self.self_attn;
        let mut lin: Vec<&Linear> = vec![
            &a.q_a_proj,
            &a.q_b_proj,
            &a.kv_proj,
            &a.o_a_proj,
            &a.o_b_proj,
        ];
        if let Some(c) = &a.compressor {
            lin.extend([&c.pooler.kv_proj, &c.pooler.gate_proj]);
            if let Some(i) = &c.indexer {
                lin.extend([
                    &i.pooler.kv_proj,
                    &i.pooler.gate_proj,
                    &i.q_b_proj,
                    &i.scorer.weights_proj,
                ]);
            }
        }
        let m = &self.mlp;
        let s = &m.shared_experts;
        lin.extend([&s.gate_proj, &s.up_proj, &s.down_proj]);
        out.extend(lin.into_iter().filter_map(|l| l.weight.stored()));
        out.extend(m.gate.weight.stored());
        for e in std::iter::once(&m.experts).chain(m.host_experts.as_ref()) {
            out.extend(e.gate_up_proj.stored());
            out.extend(e.down_proj.stored());
        }
    }
}

/// Resident bytes by storage of a module with `params` (f32) parameter values and the
/// weights `stored` kept as stored (their stored bytes).
fn resident(
    stored: Vec<&StoredWeight>,
    params: usize,
) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for w in stored {
        w.add_bytes(&mut out);
    }
    let dense = 4 * params;
    if dense > 0 {
        *out.entry("f32".to_string()).or_default() += dense;
    }
    out
}

/// `model.*`: everything but the LM head.
#[derive(Module, Debug)]
pub struct Backbone {
    pub embed_tokens: Embedding,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    pub hc_head: HyperHead,
}

/// A DeepSeek-V4 causal LM (`DeepseekV4ForCausalLM`).
#[derive(Module, Debug)]
pub struct DeepseekV4Model {
    pub model: Backbone,
    /// Absent with `tie_word_embeddings`.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    pub config: DeepseekV4Config,
}

impl DeepseekV4Model {
    /// Build from a weight source; parameter names are transformers' module paths
    /// (`model.layers.3.self_attn.q_a_proj.weight`, ...; see `checkpoint.rs` for the
    /// other spellings).
    pub fn new(config: &DeepseekV4Config, vb: &Vb) -> Result<Self> {
        config.validate()?;
        let c = config;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let vm = vb.pp("model");
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(l, &kind)| decoder_layer(c, &vm.pp("layers").pp(l), l, kind))
            .collect::<Result<Vec<_>>>()?;
        Ok(DeepseekV4Model {
            model: Backbone {
                embed_tokens: Embedding::new(&vm.pp("embed_tokens"), c.vocab_size, h, 1.0)?,
                layers,
                norm: RmsNorm::new(&vm.pp("norm"), h, eps)?,
                hc_head: HyperHead::new(&vm.pp("hc_head"), h, c.hc_mult, c.hc_eps, eps)?,
            },
            lm_head: (!c.tie_word_embeddings)
                .then(|| Linear::new(&vb.pp("lm_head"), h, c.vocab_size, 1.0 / (h as f64).sqrt()))
                .transpose()?,
            config: config.clone(),
        })
    }

    /// Static description. Sliding layers: `Sliding { window }`; CSA: `Compressed
    /// { window: 2m, stride: m, local_tail: sliding_window }` (entry w pools tokens
    /// `(w-1)m .. (w+1)m`); HCA: `Compressed { window: m', stride: m', local_tail }`.
    pub fn info(&self) -> ModelInfo {
        let c = &self.config;
        let w = c.sliding_window;
        ModelInfo {
            arch: MODEL_TYPE.into(),
            vocab_size: c.vocab_size,
            d_model: c.hidden_size,
            n_heads: c.num_attention_heads,
            n_kv_heads: 1,
            d_head: c.head_dim,
            streams: c.hc_mult,
            layers: c
                .layer_types
                .iter()
                .map(|t| LayerSpec {
                    kind: match t {
                        AttnType::Sliding => LayerKind::Sliding { window: w },
                        AttnType::Csa => LayerKind::Compressed {
                            window: 2 * c.csa_rate,
                            stride: c.csa_rate,
                            local_tail: w,
                        },
                        AttnType::Hca => LayerKind::Compressed {
                            window: c.hca_rate,
                            stride: c.hca_rate,
                            local_tail: w,
                        },
                    },
                    n_heads: c.num_attention_heads,
                    n_kv_heads: 1,
                })
                .collect(),
        }
    }

    /// Number of weight values: the parameters (`Module::num_params`) and the values of
    /// the weights kept as stored.
    pub fn n_params(&self) -> usize {
        let mut v = Vec::new();
        self.stored_weights(&mut v);
        self.num_params() + v.iter().map(|w| w.values()).sum::<usize>()
    }

    fn token_ids(&self, tokens: &Tensor<2, Int>) -> Result<Vec<i64>> {
        let [b, t] = tokens.dims();
        if b == 0 || t == 0 {
            return Err(Error::Input(format!("empty token batch [{b}, {t}]")));
        }
        crate::model::check_token_ids(tokens, self.config.vocab_size)
    }

    /// Full forward pass: `[batch, pos]` ids -> logits `[batch, pos, vocab]` and captures.
    pub fn forward(&self, tokens: Tensor<2, Int>, spec: &HookSpec) -> Result<ForwardOutput> {
        let ids = self.token_ids(&tokens)?;
        let [b, t] = tokens.dims();
        let mut hooks = spec.run();
        let x = self.streams(tokens, &mut hooks)?;
        self.run_layers(x, 0, &ids, &mut TokenFlow::plain(b, t), &mut hooks)
    }

    /// Embed `[b, t]` ids and copy them into the `hc_mult` streams `[b, t, hc, d]`.
    fn streams(&self, tokens: Tensor<2, Int>, hooks: &mut HookRun) -> Result<Tensor<4>> {
        let e = self.model.embed_tokens.forward(tokens);
        Ok(self.expand_streams(hooks.apply(HookPoint::global(Site::Embed), e)?))
    }

    /// The embeddings `e: [b, t, d_model]` copied into the `hc_mult` streams `[b, t, hc,
    /// d]` (a broadcast view).
    pub(super) fn expand_streams(&self, e: Tensor<3>) -> Tensor<4> {
        let [b, t, h] = e.dims();
        let n = self.config.hc_mult;
        e.reshape([b, t, 1, h]).expand([b, t, n, h])
    }

    /// [`DeepseekV4Model::forward`], also keeping every layer's per-token state (and the
    /// token ids, for hash routing) for [`DeepseekV4Model::forward_suffix`].
    pub fn forward_with_state(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
    ) -> Result<(ForwardOutput, PrefixState)> {
        let ids = self.token_ids(&tokens)?;
        let [b, t] = tokens.dims();
        let mut hooks = spec.run();
        let x = self.streams(tokens, &mut hooks)?;
        let mut state = PrefixState::new(MODEL_TYPE, b, t);
        let out = self.run_layers(x, 0, &ids, &mut TokenFlow::record(&mut state), &mut hooks)?;
        Ok((out, state.with_ids(ids)))
    }

    /// Run layers `start..` over only the positions `suffix` names (see
    /// [`crate::model::LanguageModel::forward_suffix`]); `resid: [rows, len, hc_mult,
    /// d_model]`.
    pub fn forward_suffix(
        &self,
        start: usize,
        state: &PrefixState,
        suffix: &Suffix,
        resid: Tensor<4>,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        let (mut flow, ids) = self.suffix_flow(start, state, suffix, &resid)?;
        let mut hooks = spec.run();
        self.run_layers(resid, start, &ids, &mut flow, &mut hooks)
    }

    /// [`DeepseekV4Model::forward_suffix`] through layers `start..end` only, without the
    /// later layers and the LM head: the streams leaving layer `end - 1` at the suffix
    /// positions (`[rows, len, hc_mult, d_model]`, what its `hook_resid_post` shows) and
    /// the captures. Recomputing one layer's outputs query block by query block (e.g.
    /// under a forced indexer selection, whose hook runs the layer as one dense block)
    /// costs that layer only.
    pub fn forward_suffix_streams(
        &self,
        layers: std::ops::Range<usize>,
        state: &PrefixState,
        suffix: &Suffix,
        resid: Tensor<4>,
        spec: &HookSpec,
    ) -> Result<(Tensor<4>, ActivationCache)> {
        let n_layers = self.model.layers.len();
        if layers.start >= layers.end || layers.end > n_layers {
            return Err(Error::Input(format!(
                "layers {layers:?}: expected a non-empty range within 0..{n_layers}"
            )));
        }
        let (mut flow, ids) = self.suffix_flow(layers.start, state, suffix, &resid)?;
        let mut hooks = spec.run();
        let home = self.model.embed_tokens.weight.device();
        let x = self.run_blocks(resid, layers, &ids, &mut flow, &mut hooks)?;
        Ok((to(x, &home), hooks.finish().to_device(&home)))
    }

    /// The token flow of a suffix forward from layer `start`, after checking the
    /// residual's shape, and the token ids at the suffix positions (hash routing).
    fn suffix_flow<'s>(
        &self,
        start: usize,
        state: &'s PrefixState,
        suffix: &Suffix,
        resid: &Tensor<4>,
    ) -> Result<(TokenFlow<'s>, Vec<i64>)> {
        let device = resid.device();
        let n_layers = self.model.layers.len();
        let flow = TokenFlow::suffix(state, suffix, MODEL_TYPE, start, n_layers, &device)?;
        let c = &self.config;
        let want = [suffix.rows.len(), suffix.len, c.hc_mult, c.hidden_size];
        if resid.dims() != want {
            return Err(Error::Input(format!(
                "suffix residual streams of shape {:?}, expected {want:?}",
                resid.dims()
            )));
        }
        let total = state.len();
        let all = state.ids();
        if all.len() != state.rows() * total {
            return Err(Error::Input(
                "the prefix state holds no token ids (hash routing needs them)".into(),
            ));
        }
        let ids: Vec<i64> = suffix
            .rows
            .iter()
            .zip(&suffix.from)
            .flat_map(|(&row, &f)| {
                all[row * total + f..row * total + f + suffix.len]
                    .iter()
                    .copied()
            })
            .collect();
        Ok((flow, ids))
    }

    /// Forward from layer `start` given the streams entering it
    /// (`blocks.{start}.hook_resid_pre`, `[batch, pos, hc_mult, d_model]`). `tokens` are
    /// needed for hash routing.
    pub fn forward_from(
        &self,
        tokens: Tensor<2, Int>,
        start: usize,
        resid: Tensor<4>,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        let n_layers = self.model.layers.len();
        if start > n_layers {
            return Err(Error::Input(format!(
                "start layer {start} out of range 0..={n_layers}"
            )));
        }
        let ids = self.token_ids(&tokens)?;
        let [b, t] = tokens.dims();
        let want = [b, t, self.config.hc_mult, self.config.hidden_size];
        if resid.dims() != want {
            return Err(Error::Input(format!(
                "residual streams have shape {:?}, expected {want:?} ([batch, pos, hc_mult, d_model] for the tokens)",
                resid.dims()
            )));
        }
        let mut hooks = spec.run();
        self.run_layers(resid, start, &ids, &mut TokenFlow::plain(b, t), &mut hooks)
    }

    /// The per-forward tables of a plain forward over `t` tokens.
    pub fn tables(&self, t: usize, device: &Device) -> Tables {
        Tables::new(&self.config, &Queries::All { rows: 1, len: t }, device)
    }

    /// Resident bytes of each layer and of what the home device holds besides
    /// (embedding), for an automatic split: weights kept as stored count their stored
    /// bytes, the others 4 bytes per value.
    pub fn placement_bytes(&self) -> (Vec<f64>, f64) {
        let total = |m: Vec<&StoredWeight>, n: usize| resident(m, n).values().sum::<usize>() as f64;
        let layers = self
            .model
            .layers
            .iter()
            .map(|l| {
                let mut v = Vec::new();
                l.stored_weights(&mut v);
                total(v, l.num_params())
            })
            .collect();
        let e = &self.model.embed_tokens;
        let home = total(e.weight.stored().into_iter().collect(), e.num_params());
        (layers, home)
    }

    /// The model's resident weight bytes by storage: `f32` for parameters (and weights
    /// dequantised on load), `bf16` / `fp8` / `fp4` / `scales` for weights kept as stored,
    /// `i64` for the hash-routing tables.
    pub fn resident_bytes(&self) -> std::collections::BTreeMap<String, usize> {
        let mut v = Vec::new();
        self.stored_weights(&mut v);
        let mut out = resident(v, self.num_params());
        let ints: usize = self
            .model
            .layers
            .iter()
            .filter_map(|l| l.mlp.gate.tid2eid.as_ref())
            .map(|t| 8 * t.len())
            .sum();
        if ints > 0 {
            out.insert("i64".into(), ints);
        }
        out
    }

    /// Every weight of the model kept as stored.
    fn stored_weights<'a>(&'a self, out: &mut Vec<&'a StoredWeight>) {
        out.extend(self.model.embed_tokens.weight.stored());
        out.extend(self.lm_head.as_ref().and_then(|h| h.weight.stored()));
        for l in &self.model.layers {
            l.stored_weights(out);
        }
    }

    /// Put the layers (and the routed experts a placement keeps in host memory), the
    /// head and the embedding on the devices of `p` (see [`crate::model::placement`]).
    pub fn place(mut self, p: &Placed) -> Result<Self> {
        p.check_layers(self.model.layers.len())?;
        let last = p.last();
        let m = self.model;
        let layers = m
            .layers
            .into_iter()
            .enumerate()
            .map(|(l, layer)| {
                let mut layer = layer.to_device(&p.layers[l]);
                if let Some(keep) = p.experts_on_device[l] {
                    layer.mlp = layer.mlp.offload_experts(keep, &p.host)?;
                }
                Ok(layer)
            })
            .collect::<Result<Vec<_>>>()?;
        self.model = Backbone {
            embed_tokens: m.embed_tokens.to_device(&p.home),
            layers,
            norm: m.norm.to_device(&last),
            hc_head: m.hc_head.to_device(&last),
        };
        self.lm_head = self.lm_head.map(|h| h.to_device(&last));
        Ok(self)
    }

    fn run_layers(
        &self,
        x: Tensor<4>,
        start: usize,
        ids: &[i64],
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<ForwardOutput> {
        let home = self.model.embed_tokens.weight.device();
        let x = self.run_blocks(x, start..self.model.layers.len(), ids, flow, hooks)?;
        let logits = self.head_logits(x, hooks)?;
        Ok(ForwardOutput {
            logits,
            cache: hooks.finish().to_device(&home),
        })
    }

    /// Layers `layers` over the streams `x` entering the first of them -> the streams
    /// leaving the last (on its device): layer by layer over the whole streams or, in a
    /// plain forward of a long prompt without hooks, span by span
    /// (`deepseek_v4::token_blocks`).
    fn run_blocks(
        &self,
        mut x: Tensor<4>,
        layers: std::ops::Range<usize>,
        ids: &[i64],
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        if let Some(block) = self.blocks_of(flow, hooks) {
            let [b, t, _, _] = x.dims();
            let mut out = Vec::new();
            let input = |r| Ok(x.clone().slice_dim(1, r));
            self.run_spans([b, t], layers, block, ids, hooks, input, |_, blocks| {
                out.extend(blocks);
                Ok(())
            })?;
            return Ok(cat_dim1(out));
        }
        // A placed model: the streams move to each layer's device, per-forward tables
        // are built once per device, logits and captures come back home.
        let mut per_device = PerDevice::new();
        let (start, n) = (layers.start, layers.len());
        for (l, layer) in self.model.layers.iter().enumerate().skip(start).take(n) {
            let here = layer.input_layernorm.weight.val().device();
            let tables = per_device.get(&here, |d| Tables::new(&self.config, flow.queries(), d));
            x = self.layer_whole((l, layer), to(x, &here), tables, ids, flow, hooks)?;
        }
        Ok(x)
    }

    /// Layer `l` over the whole streams `x` (on its device), through its hook points.
    fn layer_whole(
        &self,
        (l, layer): (usize, &DecoderLayer),
        x: Tensor<4>,
        tables: &Tables,
        ids: &[i64],
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        let x = hooks.apply(HookPoint::block(l, Site::ResidPre), x)?;
        let mhc = profile::region(profile::Region::Mhc);
        let hc = layer.attn_hc.forward(l, Sublayer::Attention, &x, hooks)?;
        drop(mhc);
        let a = layer.self_attn.forward(
            l,
            layer.input_layernorm.forward(hc.collapsed.clone()),
            tables,
            flow,
            hooks,
        )?;
        let a = hooks.apply(HookPoint::block(l, Site::AttnOut), a)?;
        let mhc = profile::region(profile::Region::Mhc);
        let x = mhc::expand(x, a, &hc);
        drop(mhc);
        let x = hooks.apply(HookPoint::block(l, Site::ResidMid), x)?;
        let mhc = profile::region(profile::Region::Mhc);
        let hc = layer.ffn_hc.forward(l, Sublayer::Mlp, &x, hooks)?;
        drop(mhc);
        let experts = profile::region(profile::Region::Experts);
        let m = layer.mlp.forward(
            l,
            layer.post_attention_layernorm.forward(hc.collapsed.clone()),
            ids,
            hooks,
        )?;
        drop(experts);
        let m = hooks.apply(HookPoint::block(l, Site::MlpOut), m)?;
        let mhc = profile::region(profile::Region::Mhc);
        let x = mhc::expand(x, m, &hc);
        drop(mhc);
        hooks.apply(HookPoint::block(l, Site::ResidPost), x)
    }

    /// Logits at the flat positions `rows` (indices into `[batch * pos]`) only: every
    /// layer over every position, then the hyper-head collapse, final norm and LM head
    /// over those rows alone (`[rows, vocab]`; at 129,280 words the full logits of a
    /// 16K-token prompt would be 8.5 GB).
    pub fn forward_logit_rows(
        &self,
        tokens: Tensor<2, Int>,
        rows: Tensor<1, Int>,
    ) -> Result<Tensor<2>> {
        let ids = self.token_ids(&tokens)?;
        let [b, t] = tokens.dims();
        let spec = HookSpec::new();
        let mut hooks = spec.run();
        let plain = TokenFlow::plain(b, t);
        if let Some(block) = self.blocks_of(&plain, &hooks) {
            return self.logit_rows_in_spans(tokens, &ids, rows, block, &mut hooks);
        }
        let x = self.streams(tokens, &mut hooks)?;
        let n = self.model.layers.len();
        let x = self.run_blocks(x, 0..n, &ids, &mut TokenFlow::plain(b, t), &mut hooks)?;
        let [_, _, hc, d] = x.dims();
        let k = rows.dims()[0];
        let rows = to(rows, &x.device());
        let picked = x
            .reshape([b * t, hc, d])
            .select(0, rows)
            .reshape([1, k, hc, d]);
        let logits = self.head_logits(picked, &mut hooks)?;
        let v = logits.dims()[2];
        Ok(logits.reshape([k, v]))
    }

    /// The streams after the last layer `[b, t, hc, d]` -> logits (on the home device):
    /// hyper-head collapse, final norm (`hook_final_norm`), LM head.
    pub(super) fn head_logits(&self, x: Tensor<4>, hooks: &mut HookRun) -> Result<Tensor<3>> {
        let _stage = profile::region(profile::Region::Head);
        let h = self.final_hidden(x, hooks)?;
        Ok(self.lm(h))
    }

    /// The streams after the last layer `[b, t, hc, d]` -> the hyper-head collapse and
    /// final norm `[b, t, d]`, through `hook_final_norm` (on the norm's device).
    fn final_hidden(&self, x: Tensor<4>, hooks: &mut HookRun) -> Result<Tensor<3>> {
        let x = to(x, &self.model.norm.weight.val().device());
        let h = self.model.hc_head.forward(x, hooks)?;
        let h = self.model.norm.forward(h);
        hooks.apply(HookPoint::global(Site::FinalNorm), h)
    }

    /// The LM head over `h: [b, t, d]` -> `[b, t, vocab]` on the home device.
    fn lm(&self, h: Tensor<3>) -> Tensor<3> {
        let home = self.model.embed_tokens.weight.device();
        let logits = match &self.lm_head {
            Some(head) => head.forward(h),
            None => {
                let [b, t, d] = h.dims();
                let w = &self.model.embed_tokens.weight;
                let v = w.dims()[0];
                w.matmul_t(to(h, &home).reshape([b * t, d]))
                    .reshape([b, t, v])
            }
        };
        to(logits, &home)
    }

    /// [`crate::model::LanguageModel::forward_rows`]: every layer, the hyper-head and the
    /// final norm over every position (hooks and captures as in a forward), the LM head
    /// at the flat positions `rows` alone; with `state`, the state of
    /// [`DeepseekV4Model::forward_with_state`].
    pub fn forward_rows(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
        rows: Tensor<1, Int>,
        state: bool,
    ) -> Result<(Tensor<2>, ActivationCache, Option<PrefixState>)> {
        let ids = self.token_ids(&tokens)?;
        let [b, t] = tokens.dims();
        let mut hooks = spec.run();
        let x = self.streams(tokens, &mut hooks)?;
        let n = self.model.layers.len();
        let mut kept = state.then(|| PrefixState::new(MODEL_TYPE, b, t));
        let x = match &mut kept {
            Some(st) => self.run_blocks(x, 0..n, &ids, &mut TokenFlow::record(st), &mut hooks)?,
            None => self.run_blocks(x, 0..n, &ids, &mut TokenFlow::plain(b, t), &mut hooks)?,
        };
        let stage = profile::region(profile::Region::Head);
        let h = self.final_hidden(x, &mut hooks)?;
        let d = h.dims()[2];
        let k = rows.dims()[0];
        let rows = to(rows, &h.device());
        let logits = self.lm(h.reshape([b * t, d]).select(0, rows).reshape([1, k, d]));
        drop(stage);
        let v = logits.dims()[2];
        let home = self.model.embed_tokens.weight.device();
        Ok((
            logits.reshape([k, v]),
            hooks.finish().to_device(&home),
            kept.map(|st| st.with_ids(ids)),
        ))
    }

    fn layer_at(&self, l: usize) -> Result<&DecoderLayer> {
        self.model.layers.get(l).ok_or_else(|| {
            Error::Input(format!(
                "stream point of layer {l}: the model has {} layers",
                self.model.layers.len()
            ))
        })
    }
}

impl StreamModel for DeepseekV4Model {
    fn read_stream(
        &self,
        tokens: Tensor<2, Int>,
        at: StreamPoint,
        stream: &Act,
        spec: &HookSpec,
    ) -> Result<StreamRead> {
        let x = stream.get::<4>()?;
        let [b, t, _, _] = x.dims();
        let home = self.model.embed_tokens.weight.device();
        let mut hooks = spec.run();
        let mut flow = TokenFlow::plain(b, t);
        let logits = match at {
            StreamPoint::Attn(l) => {
                let layer = self.layer_at(l)?;
                let here = layer.input_layernorm.weight.val().device();
                let x = to(x, &here);
                let tables = Tables::new(&self.config, flow.queries(), &here);
                let hc = layer
                    .attn_hc
                    .forward(l, Sublayer::Attention, &x, &mut hooks)?;
                layer.self_attn.read_inputs(
                    l,
                    layer.input_layernorm.forward(hc.collapsed),
                    &tables,
                    &mut flow,
                    &mut hooks,
                )?;
                None
            }
            StreamPoint::Mlp(l) => {
                let ids = self.token_ids(&tokens)?;
                let layer = self.layer_at(l)?;
                let x = to(x, &layer.input_layernorm.weight.val().device());
                let hc = layer.ffn_hc.forward(l, Sublayer::Mlp, &x, &mut hooks)?;
                let m = layer.mlp.forward(
                    l,
                    layer.post_attention_layernorm.forward(hc.collapsed),
                    &ids,
                    &mut hooks,
                )?;
                hooks.apply(HookPoint::block(l, Site::MlpOut), m)?;
                None
            }
            StreamPoint::Final => Some(self.head_logits(x, &mut hooks)?),
        };
        Ok(StreamRead {
            logits,
            cache: hooks.finish().to_device(&home),
        })
    }

    fn additive_stream(&self) -> bool {
        false
    }

    fn stream_from_outputs(
        &self,
        embed: Tensor<3>,
        attn_out: &[Tensor<3>],
        mlp_out: &[Tensor<3>],
    ) -> Result<Vec<Act>> {
        let nl = self.model.layers.len();
        crate::model::check_stream_outputs(nl, ("MoE", "layers"), attn_out, mlp_out)?;
        let home = self.model.embed_tokens.weight.device();
        let spec = HookSpec::new();
        let mut hooks = spec.run();
        let [b, t, h] = embed.dims();
        let n = self.config.hc_mult;
        let mut x = embed.reshape([b, t, 1, h]).expand([b, t, n, h]);
        let mut out = Vec::with_capacity(2 * nl + 1);
        for (l, layer) in self.model.layers.iter().enumerate() {
            let here = layer.input_layernorm.weight.val().device();
            x = to(x, &here);
            out.push(Act::new(to(x.clone(), &home)));
            let hc = layer
                .attn_hc
                .forward(l, Sublayer::Attention, &x, &mut hooks)?;
            x = mhc::expand(x, to(attn_out[l].clone(), &here), &hc);
            out.push(Act::new(to(x.clone(), &home)));
            let hc = layer.ffn_hc.forward(l, Sublayer::Mlp, &x, &mut hooks)?;
            x = mhc::expand(x, to(mlp_out[l].clone(), &here), &hc);
        }
        out.push(Act::new(to(x, &home)));
        Ok(out)
    }

    fn linearize_stream(
        &self,
        embed: Tensor<3>,
        attn_out: &[Tensor<3>],
        mlp_out: &[Tensor<3>],
    ) -> Result<Box<dyn StreamLinear + '_>> {
        let nl = self.model.layers.len();
        crate::model::check_stream_outputs(nl, ("MoE", "layers"), attn_out, mlp_out)?;
        let home = self.model.embed_tokens.weight.device();
        let [b, t, h] = embed.dims();
        let n = self.config.hc_mult;
        let mut x = embed.reshape([b, t, 1, h]).expand([b, t, n, h]);
        let mut steps = Vec::with_capacity(2 * nl);
        for (l, layer) in self.model.layers.iter().enumerate() {
            let here = layer.input_layernorm.weight.val().device();
            x = to(x, &here);
            for (hc, out) in [(&layer.attn_hc, &attn_out[l]), (&layer.ffn_hc, &mlp_out[l])] {
                let (next, lin) = hc.linearize(&x, to(out.clone(), &here))?;
                steps.push((here.clone(), lin));
                x = next;
            }
        }
        Ok(Box::new(MhcLinear { steps, home, n }))
    }
}

/// [`StreamLinear`] of the hyper-connections: one [`mhc::HcLinear`] per step, on its
/// layer's device.
struct MhcLinear {
    steps: Vec<(Device, mhc::HcLinear)>,
    home: Device,
    n: usize,
}

impl StreamLinear for MhcLinear {
    fn step_back(&self, k: usize, adj: Tensor<3>) -> Result<(Tensor<3>, Tensor<3>)> {
        let (here, lin) = k
            .checked_sub(1)
            .and_then(|i| self.steps.get(i))
            .ok_or_else(|| {
                Error::Input(format!(
                    "stream step {k}: the steps are 1..={}",
                    self.steps.len()
                ))
            })?;
        let (prev, g) = lin.back(to(adj, here))?;
        Ok((to(prev, &self.home), to(g, &self.home)))
    }

    fn embed_back(&self, adj: Tensor<3>) -> Result<Tensor<3>> {
        let [rows, t, w] = adj.dims();
        if !w.is_multiple_of(self.n) {
            return Err(Error::Input(format!(
                "a stream adjoint of width {w} for {} streams",
                self.n
            )));
        }
        let d = w / self.n;
        Ok(adj
            .reshape([rows, t, self.n, d])
            .sum_dim(2)
            .reshape([rows, t, d]))
    }
}

impl crate::model::LanguageModel for DeepseekV4Model {
    fn info(&self) -> ModelInfo {
        DeepseekV4Model::info(self)
    }
    fn stream_model(&self) -> Option<&dyn StreamModel> {
        Some(self)
    }
    fn n_params(&self) -> Option<usize> {
        Some(DeepseekV4Model::n_params(self))
    }
    fn resident_bytes(&self) -> Option<std::collections::BTreeMap<String, usize>> {
        Some(DeepseekV4Model::resident_bytes(self))
    }
    fn memory_widths(&self) -> crate::model::memory::Widths {
        self.config.memory_widths()
    }
    fn prefill_span(&self) -> Option<(usize, f64)> {
        Some(self.span_and_cache())
    }
    fn device(&self) -> Device {
        self.model.embed_tokens.weight.device()
    }
    fn forward(&self, tokens: Tensor<2, Int>, spec: &HookSpec) -> Result<ForwardOutput> {
        DeepseekV4Model::forward(self, tokens, spec)
    }
    fn forward_from(
        &self,
        tokens: Tensor<2, Int>,
        start: usize,
        resid: &Act,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        DeepseekV4Model::forward_from(self, tokens, start, resid.get::<4>()?, spec)
    }
    fn forward_logit_rows(
        &self,
        tokens: Tensor<2, Int>,
        rows: Tensor<1, Int>,
    ) -> Result<Tensor<2>> {
        DeepseekV4Model::forward_logit_rows(self, tokens, rows)
    }
    fn forward_rows(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
        rows: Tensor<1, Int>,
        state: bool,
    ) -> Result<(Tensor<2>, ActivationCache, Option<PrefixState>)> {
        DeepseekV4Model::forward_rows(self, tokens, spec, rows, state)
    }
    fn forward_with_state(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
    ) -> Result<(ForwardOutput, Option<PrefixState>)> {
        let (out, state) = DeepseekV4Model::forward_with_state(self, tokens, spec)?;
        Ok((out, Some(state)))
    }
    fn forward_suffix(
        &self,
        start: usize,
        state: &PrefixState,
        suffix: &Suffix,
        resid: &Act,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        DeepseekV4Model::forward_suffix(self, start, state, suffix, resid.get::<4>()?, spec)
    }
}

/// Decoder layer `l` (attention `kind`) under `vl` (`model.layers.{l}`).
fn decoder_layer(c: &DeepseekV4Config, vl: &Vb, l: usize, kind: AttnType) -> Result<DecoderLayer> {
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    let hc = |name: &str| {
        HyperConnection::new(
            &vl.pp(name),
            h,
            c.hc_mult,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            eps,
        )
    };
    Ok(DecoderLayer {
        self_attn: attention(c, &vl.pp("self_attn"), kind)?,
        mlp: Moe::new(&vl.pp("mlp"), c, c.mlp_layer_types[l])?,
        input_layernorm: RmsNorm::new(&vl.pp("input_layernorm"), h, eps)?,
        post_attention_layernorm: RmsNorm::new(&vl.pp("post_attention_layernorm"), h, eps)?,
        attn_hc: hc("attn_hc")?,
        ffn_hc: hc("ffn_hc")?,
    })
}

/// The attention of a layer of type `kind` under `va` (`model.layers.{l}.self_attn`).
fn attention(c: &DeepseekV4Config, va: &Vb, kind: AttnType) -> Result<Attention> {
    let (h, nh, dh, q) = (
        c.hidden_size,
        c.num_attention_heads,
        c.head_dim,
        c.q_lora_rank,
    );
    let eps = c.rms_norm_eps;
    let s = |d_in: usize| 1.0 / (d_in as f64).sqrt();
    let gr = c.o_groups * c.o_lora_rank;
    Ok(Attention {
        q_a_proj: Linear::new(&va.pp("q_a_proj"), h, q, s(h))?,
        q_a_norm: RmsNorm::new(&va.pp("q_a_norm"), q, eps)?,
        q_b_proj: Linear::new(&va.pp("q_b_proj"), q, nh * dh, s(q))?,
        kv_proj: Linear::new(&va.pp("kv_proj"), h, dh, s(h))?,
        kv_norm: RmsNorm::new(&va.pp("kv_norm"), dh, eps)?,
        o_a_proj: Linear::new(
            &va.pp("o_a_proj"),
            nh * dh / c.o_groups,
            gr,
            s(nh * dh / c.o_groups),
        )?,
        o_b_proj: Linear::new(&va.pp("o_b_proj"), gr, h, s(gr))?,
        sinks: va.param("sinks", [nh], Init::Zeros)?,
        compressor: compressor(c, &va.pp("compressor"), kind)?,
        kind,
        n_heads: nh,
        head_dim: dh,
        o_groups: c.o_groups,
        eps,
    })
}

/// The compressor (and, for CSA, the lightning indexer) of a layer of type `kind` under
/// `vc` (`...self_attn.compressor`); `None` for sliding layers.
fn compressor(c: &DeepseekV4Config, vc: &Vb, kind: AttnType) -> Result<Option<Compressor>> {
    let (h, dh, eps) = (c.hidden_size, c.head_dim, c.rms_norm_eps);
    Ok(match kind {
        AttnType::Sliding => None,
        AttnType::Hca => Some(Compressor {
            pooler: Pooler::new(vc, h, dh, c.hca_rate, false, eps)?,
            indexer: None,
        }),
        AttnType::Csa => Some(Compressor {
            pooler: Pooler::new(vc, h, dh, c.csa_rate, true, eps)?,
            indexer: Some(Indexer::new(&vc.pp("indexer"), c)?),
        }),
    })
}
