//! flex runs matrix products, reductions and element-wise kernels on every core (rayon):
//! the results must not depend on how many threads run them. A forward (and a patched
//! forward) in a pool of 1 thread and in pools of 2 and 3 give bit-identical logits.

use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::{Action, HookSpec, Scope};
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::model::{KvcConfig, KvcModel};

use crate::common::{dev, vals};

fn logits_in_pool(threads: usize, m: &KvcModel, spec: &HookSpec) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let ids: Vec<i64> = (0..2 * 300).map(|i| (i * 7 + 3) % 37).collect();
        let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 300]), &dev());
        vals(m.forward(t, spec).unwrap().logits)
    })
}

#[test]
fn logits_are_bit_identical_for_1_2_and_3_threads() {
    // Wide enough that gemm and the reductions split the work across threads.
    let c = KvcConfig {
        d_model: 256,
        d_ff: 512,
        n_heads: 8,
        n_kv_heads: 4,
        d_head: Some(32),
        ..KvcConfig::tiny()
    }
    .with_compression(8, 4, 16);
    let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed: 7 }, &dev())).unwrap();
    let patched = HookSpec::new()
        .intervene(
            "blocks.1.attn.hook_z",
            Action::Scale(0.5),
            Scope::heads([2]),
        )
        .unwrap();
    for spec in [HookSpec::new(), patched] {
        let one = logits_in_pool(1, &m, &spec);
        for n in [2, 3] {
            let other = logits_in_pool(n, &m, &spec);
            let same = one
                .iter()
                .zip(&other)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "logits differ between 1 and {n} threads");
        }
    }
}
