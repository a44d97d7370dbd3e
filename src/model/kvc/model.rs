//! The kvc decoder: embedding -> pre-norm blocks (attention + SwiGLU MLP) -> final
//! norm -> LM head, and its [`LanguageModel`] implementation.

use std::path::Path;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};

use super::attention::{Attention, LayerAt, Need, Tables};
use super::compressor::{Compressor, CompressorStack};
use super::config::{AttentionKind, CompressionConfig, GateMode, KvcConfig, MODEL_TYPE, MlpAct};
use crate::error::{Error, Result};
use crate::hooks::{Act, ActivationCache, HookPoint, HookRun, HookSpec, Site};
use crate::model::compression::{Overlay, learned};
use crate::model::kv_state::{PrefixState, Suffix, TokenFlow};
use crate::model::layers::{Embedding, Gate, Linear, RmsNorm, SwiGlu};
use crate::model::placement::{PerDevice, Placed, to};
use crate::model::safetensors_io::SafetensorsReader;
use crate::model::weights::{CheckpointSource, RandomInit, Vb, WeightSource};
use crate::model::{
    AdditiveLinear, ForwardOutput, LanguageModel, LayerKind, LayerSpec, ModelInfo, StreamLinear,
    StreamModel, StreamPoint, StreamRead,
};

/// One pre-norm block.
#[derive(Module, Debug)]
pub struct Block {
    /// RMSNorm before attention.
    pub attn_norm: RmsNorm,
    /// The attention layer.
    pub attn: Attention,
    /// RMSNorm before the MLP.
    pub mlp_norm: RmsNorm,
    /// The gated MLP (SwiGLU, or GeGLU with `arch.mlp_act = "gelu_tanh"`).
    pub mlp: SwiGlu,
    /// RMSNorm on the attention output (`arch.post_norms`).
    pub post_attn_norm: Option<RmsNorm>,
    /// RMSNorm on the MLP output (`arch.post_norms`).
    pub post_mlp_norm: Option<RmsNorm>,
}

impl Block {
    /// The attention output as it joins the residual stream (after the post-norm).
    fn attn_joins(&self, a: Tensor<3>) -> Tensor<3> {
        match &self.post_attn_norm {
            Some(n) => n.forward(a),
            None => a,
        }
    }

    /// The MLP branch from the stream `x` at layer `l`: norm, MLP (through `mlp.hook_pre`
    /// and `mlp.hook_post` when they are captured or edited), post-norm.
    fn mlp_branch(
        &self,
        l: usize,
        x: Tensor<3>,
        act: MlpAct,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        let h = self.mlp_norm.forward(x);
        let gate = match act {
            MlpAct::Silu => Gate::Silu,
            MlpAct::GeluTanh => Gate::GeluTanh,
        };
        let (pre, post) = (
            HookPoint::block(l, Site::MlpPre),
            HookPoint::block(l, Site::MlpPost),
        );
        let m = if hooks.touches(&pre) || hooks.touches(&post) {
            // Unchunked, so the hooks see every position at once.
            let g = hooks.apply(pre, self.mlp.gate.forward(h.clone()))?;
            let p = hooks.apply(post, gate.gated(g, self.mlp.up.forward(h)))?;
            self.mlp.down.forward(p)
        } else {
            self.mlp.forward_with(h, gate)
        };
        Ok(match &self.post_mlp_norm {
            Some(n) => n.forward(m),
            None => m,
        })
    }
}

/// A kvc model.
#[derive(Module, Debug)]
pub struct KvcModel {
    /// Token embedding.
    pub embed: Embedding,
    /// The blocks.
    pub blocks: Vec<Block>,
    /// RMSNorm before the LM head.
    pub final_norm: RmsNorm,
    /// Absent with `tie_embeddings`.
    pub lm_head: Option<Linear>,
    /// The configuration it was built from.
    #[module(skip)]
    pub config: KvcConfig,
}

impl KvcModel {
    /// Build from a weight source (checkpoint or random init).
    pub fn new(config: &KvcConfig, vb: &Vb) -> Result<Self> {
        config.validate()?;
        let c = config;
        let d = c.d_model;
        let std = c.init_std;
        let out_std = std / (2.0 * c.n_layers as f64).sqrt();
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let vb = vb.pp(format!("blocks.{l}"));
            let post = |name: &str| {
                c.arch
                    .post_norms
                    .then(|| RmsNorm::new(&vb.pp(name), d, c.norm_eps))
                    .transpose()
            };
            blocks.push(Block {
                attn_norm: RmsNorm::new(&vb.pp("attn_norm"), d, c.norm_eps)?,
                attn: Attention::new(&vb.pp("attn"), c, std, out_std)?,
                mlp_norm: RmsNorm::new(&vb.pp("mlp_norm"), d, c.norm_eps)?,
                mlp: SwiGlu::new(&vb.pp("mlp"), d, c.d_ff, std, out_std)?,
                post_attn_norm: post("post_attn_norm")?,
                post_mlp_norm: post("post_mlp_norm")?,
            });
        }
        Ok(KvcModel {
            embed: crate::model::layers::Embedding::new(&vb.pp("embed"), c.vocab_size, d, std)?,
            blocks,
            final_norm: RmsNorm::new(&vb.pp("final_norm"), d, c.norm_eps)?,
            lm_head: (!c.tie_embeddings)
                .then(|| Linear::new(&vb.pp("lm_head"), d, c.vocab_size, std))
                .transpose()?,
            config: config.clone(),
        })
    }

    /// The same model under a compression overlay (see [`crate::model::compression`]):
    /// `select` and `evict` in every layer's attention, `pool` as compressed attention
    /// with uniform gates (no parameters), `learned` as compressed attention with the
    /// trained gates of its checkpoint folder. Refused on a model that already
    /// compresses, naming the key.
    pub fn with_overlay(mut self, overlay: &Overlay) -> Result<Self> {
        overlay.validate(self.config.arch.max_positions)?;
        if self.config.attention == AttentionKind::Compressed || self.config.overlay.is_some() {
            return Err(Error::field(
                "compression",
                "this model already compresses its cache (attention = \"compressed\"); an overlay applies to uncompressed models",
            ));
        }
        match overlay {
            Overlay::Select { .. } | Overlay::Evict { .. } => {
                self.config.overlay = Some(overlay.clone());
                self.config.validate()?;
                Ok(self)
            }
            &Overlay::Pool {
                window,
                stride,
                local,
            } => {
                // Uniform gates without a bias: no parameter is drawn.
                let cc = learned::compression(window, stride, local, GateMode::Uniform);
                self.with_compressors(cc, &RandomInit { seed: 0 })
            }
            Overlay::Learned {
                checkpoint,
                window,
                stride,
                local,
            } => {
                let dir = learned::folder(checkpoint);
                let meta = learned::read_meta(&dir)?;
                let identity = learned::ModelIdentity::of(&self.config, Path::new(""));
                learned::check(&meta, (*window, *stride, *local), &identity)?;
                let path = dir.join(learned::WEIGHTS_FILE);
                let src = CheckpointSource::from_reader(SafetensorsReader::open(&path)?);
                let model = self.with_compressors(meta.compression(), &src)?;
                src.check_all_used()?;
                Ok(model)
            }
        }
    }

    /// The same model with a `learned` compressor of `window`, `stride`, `local` and
    /// `gate` whose gates are read from `from` (a checkpoint being resumed) or else are
    /// all zero (so it pools like `pool` until trained), and which, unlike the model's
    /// own parameters, require gradients: the student of `phaselens train` on a
    /// `[compressor]` recipe.
    pub fn with_trainable_compressor(
        self,
        (window, stride, local): (usize, usize, usize),
        gate: GateMode,
        from: Option<&dyn WeightSource>,
    ) -> Result<Self> {
        Overlay::Pool {
            window,
            stride,
            local,
        }
        .validate(self.config.arch.max_positions)?;
        if gate == GateMode::Uniform {
            return Err(Error::field(
                "compressor.gate",
                "a trained compressor needs `scalar` or `vector` gates",
            ));
        }
        let cc = learned::compression(window, stride, local, gate);
        // N(0, 0) draws zeros: softmax of zero logits is the mean.
        let zeros = RandomInit { seed: 0 };
        self.no_grad().with_compressors(cc, from.unwrap_or(&zeros))
    }

    /// The compressors of every layer (for saving a trained one): a module whose
    /// parameter names are those of `compressor.safetensors`.
    pub fn compressor_stack(&self) -> Option<CompressorStack> {
        let layers: Option<Vec<Compressor>> = self
            .blocks
            .iter()
            .map(|b| b.attn.compressor.clone())
            .collect();
        layers.map(|layers| CompressorStack { layers })
    }

    /// Compressed attention of `cc` in every layer, the gates read from `src` under the
    /// names of [`CompressorStack`].
    fn with_compressors(mut self, cc: CompressionConfig, src: &dyn WeightSource) -> Result<Self> {
        let c = &self.config;
        let (n, d, kvh, dh) = (c.n_layers, c.d_model, c.n_kv_heads, c.d_head());
        let device = self.home();
        let stack = CompressorStack::new(&Vb::new(src, &device), &cc, n, (d, kvh, dh))?;
        for (b, comp) in self.blocks.iter_mut().zip(stack.layers) {
            b.attn.compressor = Some(comp);
        }
        self.config.attention = AttentionKind::Compressed;
        self.config.compression = Some(cc);
        self.config.validate()?;
        Ok(self)
    }

    /// Static description for runners and checks.
    pub fn info(&self) -> ModelInfo {
        let c = &self.config;
        let kind = |l: usize| match (&c.overlay, &c.compression, c.attention) {
            (
                Some(Overlay::Select {
                    block,
                    top_k,
                    window,
                    ..
                }),
                _,
                _,
            ) => LayerKind::Selected {
                block: *block,
                top_k: *top_k,
                window: *window,
            },
            (Some(Overlay::Evict { chunk, observe, .. }), _, _) => LayerKind::Selected {
                block: *chunk,
                top_k: 0,
                window: *observe,
            },
            (_, Some(cc), AttentionKind::Compressed) => LayerKind::Compressed {
                window: cc.window,
                stride: cc.stride,
                local_tail: cc.local_tail,
            },
            _ => match c.arch.window(l) {
                Some(window) => LayerKind::Sliding { window },
                None => LayerKind::Full,
            },
        };
        ModelInfo {
            arch: c.arch.name.clone().unwrap_or_else(|| MODEL_TYPE.into()),
            vocab_size: c.vocab_size,
            d_model: c.d_model,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            d_head: c.d_head(),
            streams: 1,
            layers: (0..c.n_layers)
                .map(|l| LayerSpec {
                    kind: kind(l),
                    n_heads: c.n_heads,
                    n_kv_heads: c.n_kv_heads,
                })
                .collect(),
        }
    }

    /// Full forward pass: `[batch, pos]` token ids -> logits `[batch, pos, vocab]` and
    /// the activations the spec captures.
    pub fn forward(&self, tokens: Tensor<2, Int>, spec: &HookSpec) -> Result<ForwardOutput> {
        let [rows, len] = self.check_tokens(&tokens)?;
        self.embedded(tokens, spec, &mut TokenFlow::plain(rows, len))
    }

    /// [`KvcModel::forward`], also keeping every block's per-token keys, values and
    /// gate logits for [`KvcModel::forward_suffix`].
    pub fn forward_with_state(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
    ) -> Result<(ForwardOutput, PrefixState)> {
        let [rows, len] = self.check_tokens(&tokens)?;
        let mut state = PrefixState::new(MODEL_TYPE, rows, len);
        let out = self.embedded(tokens, spec, &mut TokenFlow::record(&mut state))?;
        Ok((out, state))
    }

    fn embedded(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
        flow: &mut TokenFlow,
    ) -> Result<ForwardOutput> {
        let mut hooks = spec.run();
        let x = self.embed_tokens(tokens);
        let x = hooks.apply(HookPoint::global(Site::Embed), x)?;
        self.run_blocks(x, 0, flow, &mut hooks)
    }

    /// Run blocks `start..` over only the positions `suffix` names (see
    /// [`LanguageModel::forward_suffix`]); `resid: [rows, len, d_model]`.
    pub fn forward_suffix(
        &self,
        start: usize,
        state: &PrefixState,
        suffix: &Suffix,
        resid: Tensor<3>,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        let device = resid.device();
        let mut flow =
            TokenFlow::suffix(state, suffix, MODEL_TYPE, start, self.blocks.len(), &device)?;
        let want = [suffix.rows.len(), suffix.len, self.config.d_model];
        if resid.dims() != want {
            return Err(Error::Input(format!(
                "suffix residual of shape {:?}, expected {want:?}",
                resid.dims()
            )));
        }
        let mut hooks = spec.run();
        self.run_blocks(resid, start, &mut flow, &mut hooks)
    }

    /// Forward from block `start`, given the residual stream entering it
    /// (`blocks.{start}.hook_resid_pre`, `[batch, pos, d_model]`). Blocks before
    /// `start` are not run: batched patching computes the shared prefix once.
    pub fn forward_from(
        &self,
        start: usize,
        resid: Tensor<3>,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        if start > self.blocks.len() {
            return Err(Error::Input(format!(
                "start layer {start} out of range 0..={}",
                self.blocks.len()
            )));
        }
        let [rows, len, d] = resid.dims();
        if d != self.config.d_model || rows == 0 || len == 0 {
            return Err(Error::Input(format!(
                "residual of shape [{rows}, {len}, {d}], expected [batch, pos, {}]",
                self.config.d_model
            )));
        }
        let mut hooks = spec.run();
        self.run_blocks(resid, start, &mut TokenFlow::plain(rows, len), &mut hooks)
    }

    /// The token embeddings (scaled by `arch.embed_scale`): `[b, t] -> [b, t, d]`.
    fn embed_tokens(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let x = self.embed.forward(tokens);
        match self.config.arch.embed_scale {
            // Rounded to f32 first, as transformers multiplies by a tensor of the dtype.
            Some(s) => x * (s as f32),
            None => x,
        }
    }

    /// `[rows, len]`, checked: not empty, no longer than the model's positions, every
    /// id inside the vocabulary.
    fn check_tokens(&self, tokens: &Tensor<2, Int>) -> Result<[usize; 2]> {
        let [b, t] = tokens.dims();
        if b == 0 || t == 0 {
            return Err(Error::Input(format!("empty token batch [{b}, {t}]")));
        }
        if let Some(max) = self.config.arch.max_positions
            && t > max
        {
            return Err(Error::Input(format!(
                "a prompt of {t} tokens is longer than the model's context of {max} positions"
            )));
        }
        crate::model::check_token_ids(tokens, self.config.vocab_size)?;
        Ok([b, t])
    }

    /// Resident bytes of each block and of the embedding (home), for an automatic
    /// split (f32 values).
    pub fn placement_bytes(&self) -> (Vec<f64>, f64) {
        let layers = self
            .blocks
            .iter()
            .map(|b| 4.0 * b.num_params() as f64)
            .collect();
        (layers, 4.0 * self.embed.num_params() as f64)
    }

    /// Put the blocks, the final norm and head, and the embedding on the devices of
    /// `p` (see [`crate::model::placement`]; kvc blocks have no experts).
    pub fn place(mut self, p: &Placed) -> Result<Self> {
        p.check_layers(self.blocks.len())?;
        let last = p.last();
        self.blocks = std::mem::take(&mut self.blocks)
            .into_iter()
            .zip(&p.layers)
            .map(|(b, d)| b.to_device(d))
            .collect();
        self.embed = self.embed.to_device(&p.home);
        self.final_norm = self.final_norm.to_device(&last);
        self.lm_head = self.lm_head.map(|h| h.to_device(&last));
        Ok(self)
    }

    /// The home device (embedding): inputs, logits and captures live there.
    fn home(&self) -> Device {
        self.embed.weight.device()
    }

    fn run_blocks(
        &self,
        x: Tensor<3>,
        start: usize,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<ForwardOutput> {
        let x = self.final_hidden(x, start, flow, hooks)?;
        let home = self.home();
        Ok(ForwardOutput {
            logits: to(self.head(x), &home),
            cache: hooks.finish().to_device(&home),
        })
    }

    /// Blocks `start..` and the final norm (through `hook_final_norm`).
    fn final_hidden(
        &self,
        mut x: Tensor<3>,
        start: usize,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        // A placed model: the residual moves to each block's device, tables are built
        // once per device.
        let mut per_device = PerDevice::new();
        for (l, block) in self.blocks.iter().enumerate().skip(start) {
            let here = block.attn_norm.weight.val().device();
            x = to(x, &here);
            let tables = per_device.get(&here, |d| Tables::new(&self.config, flow.queries(), d));
            x = hooks.apply(HookPoint::block(l, Site::ResidPre), x)?;
            let h = block.attn_norm.forward(x.clone());
            let at = LayerAt {
                layer: l,
                config: &self.config,
                tables,
            };
            let a = block.attn_joins(block.attn.forward(at, h, flow, hooks)?);
            let a = hooks.apply(HookPoint::block(l, Site::AttnOut), a)?;
            x = x + a;
            x = hooks.apply(HookPoint::block(l, Site::ResidMid), x)?;
            let m = block.mlp_branch(l, x.clone(), self.config.arch.mlp_act, hooks)?;
            let m = hooks.apply(HookPoint::block(l, Site::MlpOut), m)?;
            x = x + m;
            x = hooks.apply(HookPoint::block(l, Site::ResidPost), x)?;
        }
        let x = to(x, &self.final_norm.weight.val().device());
        let x = self.final_norm.forward(x);
        hooks.apply(HookPoint::global(Site::FinalNorm), x)
    }

    /// The LM head (or the tied embedding) on the last axis of `x`.
    fn head<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let logits = self.head_linear(x);
        match self.config.arch.final_softcap {
            Some(cap) => (logits / cap).tanh() * cap,
            None => logits,
        }
    }

    /// The LM head's matrix product alone.
    fn head_linear<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match &self.lm_head {
            Some(h) => h.forward(x),
            None => {
                let mut dims = x.dims();
                let d = dims[D - 1];
                let rows = dims[..D - 1].iter().product();
                let w = &self.embed.weight;
                dims[D - 1] = w.dims()[0];
                w.matmul_t(to(x, &w.device()).reshape([rows, d]))
                    .reshape(dims)
            }
        }
    }

    /// [`LanguageModel::forward_rows`]: every block and the final norm over every
    /// position (hooks and captures as in [`KvcModel::forward`]), the LM head only at
    /// the flat positions `rows`; with `state`, the state of
    /// [`KvcModel::forward_with_state`].
    pub fn forward_rows(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
        rows: Tensor<1, Int>,
        state: bool,
    ) -> Result<(Tensor<2>, ActivationCache, Option<PrefixState>)> {
        let [b, t] = self.check_tokens(&tokens)?;
        let mut kept = state.then(|| PrefixState::new(MODEL_TYPE, b, t));
        let mut hooks = spec.run();
        let x = self.embed_tokens(tokens);
        let x = hooks.apply(HookPoint::global(Site::Embed), x)?;
        let x = match &mut kept {
            Some(st) => self.final_hidden(x, 0, &mut TokenFlow::record(st), &mut hooks)?,
            None => self.final_hidden(x, 0, &mut TokenFlow::plain(b, t), &mut hooks)?,
        };
        let d = self.config.d_model;
        let rows = to(rows, &x.device());
        let home = self.home();
        let logits = to(self.head(x.reshape([b * t, d]).select(0, rows)), &home);
        Ok((logits, hooks.finish().to_device(&home), kept))
    }

    /// [`LanguageModel::forward_logit_rows`]: the LM head only at `rows`.
    pub fn forward_logit_rows(
        &self,
        tokens: Tensor<2, Int>,
        rows: Tensor<1, Int>,
    ) -> Result<Tensor<2>> {
        let [b, t] = self.check_tokens(&tokens)?;
        let spec = HookSpec::new();
        let mut hooks = spec.run();
        let x = self.embed_tokens(tokens);
        let x = self.final_hidden(x, 0, &mut TokenFlow::plain(b, t), &mut hooks)?;
        let d = self.config.d_model;
        let rows = to(rows, &x.device());
        Ok(to(
            self.head(x.reshape([b * t, d]).select(0, rows)),
            &self.home(),
        ))
    }
}

impl KvcModel {
    /// The weights' resident bytes by storage: `f32` parameters, and matrices kept as
    /// stored (GGUF blocks: `Q4_1`, `Q8_0`, ...; BF16 ...) under their labels.
    pub fn resident_bytes(&self) -> std::collections::BTreeMap<String, usize> {
        let mut out = std::collections::BTreeMap::new();
        for w in self.stored_weights() {
            w.add_bytes(&mut out);
        }
        let dense = 4 * self.num_params();
        if dense > 0 {
            *out.entry("f32".to_string()).or_default() += dense;
        }
        out
    }

    /// Every matrix kept as stored (GGUF blocks, BF16, ...).
    fn stored_weights(&self) -> Vec<&crate::model::stored::StoredWeight> {
        let mut stored = vec![self.embed.weight.stored()];
        stored.push(self.lm_head.as_ref().and_then(|h| h.weight.stored()));
        for b in &self.blocks {
            let a = &b.attn;
            for w in [Some(&a.w_q), Some(&a.w_k), a.w_v.as_ref(), Some(&a.w_o)] {
                stored.push(w.and_then(|l| l.weight.stored()));
            }
            for l in [&b.mlp.gate, &b.mlp.up, &b.mlp.down] {
                stored.push(l.weight.stored());
            }
        }
        stored.into_iter().flatten().collect()
    }

    /// Parameters: the dense ones and every value of the matrices kept as stored.
    pub fn n_values(&self) -> usize {
        self.num_params()
            + self
                .stored_weights()
                .iter()
                .map(|w| w.values())
                .sum::<usize>()
    }

    fn block_at(&self, l: usize) -> Result<&Block> {
        self.blocks.get(l).ok_or_else(|| {
            Error::Input(format!(
                "stream point of layer {l}: the model has {} blocks",
                self.blocks.len()
            ))
        })
    }
}

impl StreamModel for KvcModel {
    fn read_stream(
        &self,
        _tokens: Tensor<2, Int>,
        at: StreamPoint,
        stream: &Act,
        spec: &HookSpec,
    ) -> Result<StreamRead> {
        let x = stream.get::<3>()?;
        let [b, t, _] = x.dims();
        let mut hooks = spec.run();
        let home = self.home();
        let mut flow = TokenFlow::plain(b, t);
        let logits = match at {
            StreamPoint::Attn(l) => {
                let block = self.block_at(l)?;
                let here = block.attn_norm.weight.val().device();
                let tables = Tables::new(&self.config, flow.queries(), &here);
                let h = block.attn_norm.forward(to(x, &here));
                let need = Need::touched(&hooks, l);
                let at = LayerAt {
                    layer: l,
                    config: &self.config,
                    tables: &tables,
                };
                block.attn.inputs(at, h, need, &mut flow, &mut hooks)?;
                None
            }
            StreamPoint::Mlp(l) => {
                let block = self.block_at(l)?;
                let here = block.mlp_norm.weight.val().device();
                let m = block.mlp_branch(l, to(x, &here), self.config.arch.mlp_act, &mut hooks)?;
                hooks.apply(HookPoint::block(l, Site::MlpOut), m)?;
                None
            }
            StreamPoint::Final => {
                let x = to(x, &self.final_norm.weight.val().device());
                let x = self.final_norm.forward(x);
                let x = hooks.apply(HookPoint::global(Site::FinalNorm), x)?;
                Some(to(self.head(x), &home))
            }
        };
        Ok(StreamRead {
            logits,
            cache: hooks.finish().to_device(&home),
        })
    }

    fn additive_stream(&self) -> bool {
        true
    }

    fn stream_from_outputs(
        &self,
        embed: Tensor<3>,
        attn_out: &[Tensor<3>],
        mlp_out: &[Tensor<3>],
    ) -> Result<Vec<Act>> {
        let nl = self.blocks.len();
        crate::model::check_stream_outputs(nl, ("MLP", "blocks"), attn_out, mlp_out)?;
        let mut x = embed;
        let mut out = Vec::with_capacity(2 * nl + 1);
        for (a, m) in attn_out.iter().zip(mlp_out) {
            out.push(Act::new(x.clone()));
            x = x + a.clone();
            out.push(Act::new(x.clone()));
            x = x + m.clone();
        }
        out.push(Act::new(x));
        Ok(out)
    }

    fn linearize_stream(
        &self,
        _embed: Tensor<3>,
        attn_out: &[Tensor<3>],
        mlp_out: &[Tensor<3>],
    ) -> Result<Box<dyn StreamLinear + '_>> {
        let nl = self.blocks.len();
        crate::model::check_stream_outputs(nl, ("MLP", "blocks"), attn_out, mlp_out)?;
        Ok(Box::new(AdditiveLinear { steps: 2 * nl }))
    }
}

impl LanguageModel for KvcModel {
    fn info(&self) -> ModelInfo {
        KvcModel::info(self)
    }
    fn stream_model(&self) -> Option<&dyn StreamModel> {
        Some(self)
    }
    fn n_params(&self) -> Option<usize> {
        Some(self.n_values())
    }
    fn resident_bytes(&self) -> Option<std::collections::BTreeMap<String, usize>> {
        Some(KvcModel::resident_bytes(self))
    }
    fn device(&self) -> Device {
        self.embed.weight.device()
    }
    fn forward(&self, tokens: Tensor<2, Int>, spec: &HookSpec) -> Result<ForwardOutput> {
        KvcModel::forward(self, tokens, spec)
    }
    fn forward_logit_rows(
        &self,
        tokens: Tensor<2, Int>,
        rows: Tensor<1, Int>,
    ) -> Result<Tensor<2>> {
        KvcModel::forward_logit_rows(self, tokens, rows)
    }
    fn forward_rows(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
        rows: Tensor<1, Int>,
        state: bool,
    ) -> Result<(Tensor<2>, ActivationCache, Option<PrefixState>)> {
        KvcModel::forward_rows(self, tokens, spec, rows, state)
    }
    fn forward_from(
        &self,
        _tokens: Tensor<2, Int>,
        start: usize,
        resid: &Act,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        KvcModel::forward_from(self, start, resid.get::<3>()?, spec)
    }
    fn forward_with_state(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
    ) -> Result<(ForwardOutput, Option<PrefixState>)> {
        let (out, state) = KvcModel::forward_with_state(self, tokens, spec)?;
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
        KvcModel::forward_suffix(self, start, state, suffix, resid.get::<3>()?, spec)
    }
}
