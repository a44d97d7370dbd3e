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

/// Whether `a` and `b` hold the same values bit for bit (and as many).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
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
            assert!(
                same_bits(&one, &other),
                "logits differ between 1 and {n} threads"
            );
        }
    }
}

/// A patching run's chunks run at once on the pool's threads (`runner::concurrent`): a
/// run in a pool of 3 threads (several chunks in flight, saved as each finishes) writes
/// the table a run in a pool of 1 thread (one chunk after another) writes, value for
/// value, and resumes from it.
#[test]
fn patching_chunks_at_once_give_the_table_of_one_at_a_time() {
    use crate::common::runner::{experiment, opts, organism, tiny};
    use phaselens::output::{Table, read_long_rows};
    use phaselens::runner::run_experiment;

    const EXP: &str = r#"
[experiment]
kind = "patch-heads"
bootstrap_reps = 20
max_rows = 8

[model]
organism = "tiny"

[task]
n_logical = 8
"#;
    let table = |threads: usize| {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
        let exp = experiment(d, "patch.toml", EXP);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let s = pool.install(|| run_experiment(&exp, &opts(d)).unwrap());
        assert_eq!(s.stats.cells_computed, 96, "{threads} threads");
        // 96 cells of 2 rows in chunks of 8 rows: 24 forwards besides the base runs.
        assert!(
            s.stats.forwards >= 24,
            "{threads} threads: {}",
            s.stats.forwards
        );
        let again = pool.install(|| run_experiment(&exp, &opts(d)).unwrap());
        assert_eq!(again.stats.cells_resumed, 96, "{threads} threads");
        let t = Table::read_arrow(d.join("notebooks-data/patch/heads.arrow")).unwrap();
        read_long_rows(&t)
            .unwrap()
            .into_iter()
            .map(|r| (r.metric.clone(), r.value.to_bits(), r.n))
            .collect::<Vec<_>>()
    };
    let one = table(1);
    assert!(!one.is_empty());
    assert_eq!(one, table(3));
}

/// A layer's query blocks run at once on the pool's threads on flex
/// (`attention::blocks_at_once`): with a block budget small enough for many blocks,
/// forwards of kvc (full causal attention; a window with compressed entries) and of
/// DeepSeek-V4 (CSA's indexer choosing for every block, HCA, sliding), plain and patched,
/// give bit-identical logits in pools of 1, 2 and 3 threads. Under autodiff, where the
/// graph records in order, blocks run one after another.
#[test]
fn attention_blocks_at_once_give_the_logits_of_one_at_a_time() {
    use phaselens::model::LanguageModel;
    use phaselens::model::attention::{blocks_at_once, take_largest_block, with_block_budget};

    fn logits<M: LanguageModel + Sync>(m: &M, threads: usize, spec: &HookSpec) -> Vec<f32> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            assert_eq!(blocks_at_once(&dev(), 8, 1.0), threads.min(8));
            assert_eq!(blocks_at_once(&dev(), 1, 1.0), 1);
            assert_eq!(blocks_at_once(&dev().autodiff(), 8, 1.0), 1);
            // Blocks that would hold more than every thread's scratch run alone.
            assert_eq!(blocks_at_once(&dev(), 8, 1e12), 1);
            let vocab = m.info().vocab_size as i64;
            let ids: Vec<i64> = (0..2 * 96).map(|i| (i * 7 + 3) % vocab).collect();
            let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 96]), &dev());
            take_largest_block();
            let out = with_block_budget(1 << 9, || vals(m.forward(t, spec).unwrap().logits));
            // The budget was small enough for many blocks, and the calling thread saw them.
            let largest = take_largest_block();
            assert!(largest > 0 && largest <= 1 << 11, "{largest}");
            out
        })
    }
    fn check<M: LanguageModel + Sync>(name: &str, m: &M) {
        let patched = HookSpec::new()
            .intervene(
                "blocks.1.attn.hook_z",
                Action::Scale(0.5),
                Scope::heads([1]),
            )
            .unwrap();
        for spec in [HookSpec::new(), patched] {
            let one = logits(m, 1, &spec);
            for n in [2, 3] {
                let other = logits(m, n, &spec);
                assert!(
                    same_bits(&one, &other),
                    "{name}: logits differ between 1 and {n} threads"
                );
            }
        }
    }
    let kvc = |c: KvcConfig| KvcModel::new(&c, &Vb::new(&RandomInit { seed: 3 }, &dev())).unwrap();
    check("kvc full", &kvc(KvcConfig::tiny().full_attention()));
    check(
        "kvc w4s4 tail 8",
        &kvc(KvcConfig::tiny().with_compression(4, 4, 8)),
    );
    check("deepseek-v4", &crate::edges::tiny_v4(5));
}
