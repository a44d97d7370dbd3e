//! The edge graph of a model: the nodes that write the residual stream (senders), the
//! inputs that read it (receivers), and an edge from every sender to every receiver
//! that reads after it writes.
//!
//! Senders: the token embeddings (`hook_embed`), each query head's output (its slice of
//! `hook_z`, mapped into the stream by the output projection), each MLP / MoE output
//! (`hook_mlp_out`). Receivers: each query head's query (`hook_q` slice); each KV
//! head's raw per-token keys and values (`hook_k` / `hook_v` slice: with MQA / GQA one
//! KV node is read by several query heads, and its edges are separate from the query
//! heads' q edges); on compressing layers each KV head's compressed entries (keys and
//! values, `hook_compressed_k` / `_v` slice: pooled from their window's tokens, read by
//! every query head that sees them); each MLP's input (read through its output); the
//! logit difference.
//!
//! The raw K/V receivers count only the raw-slot path: where the entries are pooled
//! from `hook_k` / `hook_v` (kvc), the path through the entries belongs to the entry
//! receivers, so the two never count the same effect twice.

use crate::hooks::{HookPoint, Site};
use crate::model::{LayerKind, ModelInfo};

/// A node that writes the residual stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SenderNode {
    Embed,
    Head { layer: usize, head: usize },
    Mlp { layer: usize },
}

impl SenderNode {
    /// `embed`, `L1H2`, `L1MLP`.
    pub fn label(&self) -> String {
        match self {
            SenderNode::Embed => "embed".into(),
            SenderNode::Head { layer, head } => format!("L{layer}H{head}"),
            SenderNode::Mlp { layer } => format!("L{layer}MLP"),
        }
    }

    /// The hook point holding its output.
    pub fn point(&self) -> HookPoint {
        match self {
            SenderNode::Embed => HookPoint::global(Site::Embed),
            SenderNode::Head { layer, .. } => HookPoint::block(*layer, Site::AttnZ),
            SenderNode::Mlp { layer } => HookPoint::block(*layer, Site::MlpOut),
        }
    }

    /// The head slice of its point (axis 2), if any.
    pub fn head(&self) -> Option<usize> {
        match self {
            SenderNode::Head { head, .. } => Some(*head),
            _ => None,
        }
    }

    /// Its place in the forward order: embed 0, attention of layer l `2l + 1`, MLP of
    /// layer l `2l + 2`.
    pub fn order(&self) -> usize {
        match self {
            SenderNode::Embed => 0,
            SenderNode::Head { layer, .. } => 2 * layer + 1,
            SenderNode::Mlp { layer } => 2 * layer + 2,
        }
    }

    /// The layer (None: the embeddings).
    pub fn layer(&self) -> Option<usize> {
        match self {
            SenderNode::Embed => None,
            SenderNode::Head { layer, .. } | SenderNode::Mlp { layer } => Some(*layer),
        }
    }
}

/// Which input of an attention layer or MLP a receiver is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Input {
    /// A query head's `hook_q`.
    Q,
    /// A KV head's raw keys (`hook_k`).
    K,
    /// A KV head's raw values (`hook_v`).
    V,
    /// A KV head's compressed keys (`hook_compressed_k`).
    Ck,
    /// A KV head's compressed values (`hook_compressed_v`).
    Cv,
}

impl Input {
    pub fn name(self) -> &'static str {
        match self {
            Input::Q => "q",
            Input::K => "k",
            Input::V => "v",
            Input::Ck => "ck",
            Input::Cv => "cv",
        }
    }

    fn site(self) -> Site {
        match self {
            Input::Q => Site::AttnQ,
            Input::K => Site::AttnK,
            Input::V => Site::AttnV,
            Input::Ck => Site::CompressedK,
            Input::Cv => Site::CompressedV,
        }
    }

    /// Whether it is a compressed-entry input.
    pub fn compressed(self) -> bool {
        matches!(self, Input::Ck | Input::Cv)
    }
}

/// A node that reads the residual stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReceiverNode {
    /// An attention input: `head` is a query head for `Q`, a KV head otherwise.
    Attn {
        layer: usize,
        head: usize,
        input: Input,
    },
    /// An MLP's input (read through its output `hook_mlp_out`).
    Mlp { layer: usize },
    /// The logit difference.
    Logits,
}

impl ReceiverNode {
    /// `L2H1.q`, `L2KV0.k`, `L2KV0.ck`, `L2MLP`, `logits`.
    pub fn label(&self) -> String {
        match self {
            ReceiverNode::Attn {
                layer,
                head,
                input: Input::Q,
            } => format!("L{layer}H{head}.q"),
            ReceiverNode::Attn { layer, head, input } => {
                format!("L{layer}KV{head}.{}", input.name())
            }
            ReceiverNode::Mlp { layer } => format!("L{layer}MLP"),
            ReceiverNode::Logits => "logits".into(),
        }
    }

    /// The hook point whose activation the receiver's functional reads (None: the
    /// logits).
    pub fn point(&self) -> Option<HookPoint> {
        match self {
            ReceiverNode::Attn { layer, input, .. } => Some(HookPoint::block(*layer, input.site())),
            ReceiverNode::Mlp { layer } => Some(HookPoint::block(*layer, Site::MlpOut)),
            ReceiverNode::Logits => None,
        }
    }

    /// The head slice (axis 2) of its point, if any.
    pub fn head(&self) -> Option<usize> {
        match self {
            ReceiverNode::Attn { head, .. } => Some(*head),
            _ => None,
        }
    }

    /// Where it reads in the forward order ([`SenderNode::order`]): a sender feeds it
    /// iff `sender.order() < receiver.order()`.
    pub fn order(&self, n_layers: usize) -> usize {
        match self {
            ReceiverNode::Attn { layer, .. } => 2 * layer + 1,
            ReceiverNode::Mlp { layer } => 2 * layer + 2,
            ReceiverNode::Logits => 2 * n_layers + 1,
        }
    }

    /// The layer (None: the logits).
    pub fn layer(&self) -> Option<usize> {
        match self {
            ReceiverNode::Attn { layer, .. } | ReceiverNode::Mlp { layer } => Some(*layer),
            ReceiverNode::Logits => None,
        }
    }
}

/// One edge: indices into [`Graph::senders`] and [`Graph::receivers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Edge {
    pub sender: usize,
    pub receiver: usize,
}

/// Senders, receivers and every edge between them.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    pub n_layers: usize,
    pub senders: Vec<SenderNode>,
    pub receivers: Vec<ReceiverNode>,
    /// Sorted by receiver, then sender.
    pub edges: Vec<Edge>,
}

impl Graph {
    /// The full graph of a model: every node, every forward edge.
    pub fn of(info: &ModelInfo) -> Graph {
        let nl = info.n_layers();
        let mut senders = vec![SenderNode::Embed];
        let mut receivers = Vec::new();
        for (l, spec) in info.layers.iter().enumerate() {
            for h in 0..spec.n_heads {
                senders.push(SenderNode::Head { layer: l, head: h });
                receivers.push(ReceiverNode::Attn {
                    layer: l,
                    head: h,
                    input: Input::Q,
                });
            }
            let mut inputs = vec![Input::K, Input::V];
            if matches!(spec.kind, LayerKind::Compressed { .. }) {
                inputs.extend([Input::Ck, Input::Cv]);
            }
            for input in inputs {
                for g in 0..spec.n_kv_heads {
                    receivers.push(ReceiverNode::Attn {
                        layer: l,
                        head: g,
                        input,
                    });
                }
            }
            senders.push(SenderNode::Mlp { layer: l });
            receivers.push(ReceiverNode::Mlp { layer: l });
        }
        receivers.push(ReceiverNode::Logits);
        let mut edges = Vec::new();
        for (ri, r) in receivers.iter().enumerate() {
            for (si, s) in senders.iter().enumerate() {
                if s.order() < r.order(nl) {
                    edges.push(Edge {
                        sender: si,
                        receiver: ri,
                    });
                }
            }
        }
        Graph {
            n_layers: nl,
            senders,
            receivers,
            edges,
        }
    }

    /// `L0H1->L2KV0.k`.
    pub fn edge_label(&self, e: Edge) -> String {
        format!(
            "{}->{}",
            self.senders[e.sender].label(),
            self.receivers[e.receiver].label()
        )
    }

    /// The edges into receiver `ri`, in sender order.
    pub fn edges_into(&self, ri: usize) -> impl Iterator<Item = (usize, Edge)> + '_ {
        self.edges
            .iter()
            .copied()
            .enumerate()
            .filter(move |(_, e)| e.receiver == ri)
    }
}
