//! A plain DeepSeek-V4 forward of a prompt longer than one block runs in blocks of
//! positions (`deepseek_v4::token_blocks`): the streams stay in blocks from layer to
//! layer, the attention's queries run in sub-blocks over keys, compressed entries and
//! index keys built from every position. Its logits match the whole forward's (CSA with
//! the indexer choosing, HCA, sliding; two prompts; uneven blocks), the last-position
//! rows read from the blocks match, the thread count changes no bit, and a forward with
//! hooks runs whole.

use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::deepseek_v4::token_blocks::{
    BlockSizes, take_blocked_layers, with_token_blocks,
};

use crate::common::{dev, vals};

const T: usize = 96;

fn sizes(stream: usize, query: usize, experts: usize) -> BlockSizes {
    BlockSizes {
        stream,
        query,
        experts,
    }
}

fn prompts(vocab: usize) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..2 * T as i64)
        .map(|i| (i * 7 + 3 + i / 11) % vocab as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [2, T]), &dev())
}

/// Largest |a - b| over the largest |a|.
fn relative(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    d / a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

#[test]
fn a_forward_in_blocks_of_positions_gives_the_logits_of_the_whole_forward() {
    let m = crate::edges::tiny_v4(5);
    let vocab = m.info().vocab_size;
    let plain = HookSpec::new();
    take_blocked_layers();
    let whole = vals(m.forward(prompts(vocab), &plain).unwrap().logits);
    assert_eq!(take_blocked_layers(), 0, "a short prompt runs whole");
    // Stream blocks with query sub-blocks and expert groups of every kind: even, uneven,
    // one query, groups of one block, of several, of every block.
    for (stream, query, experts) in [
        (32, 32, 32),
        (40, 16, 80),
        (95, 7, 95),
        (17, 1, 40),
        (16, 8, 1000),
    ] {
        let blocked = with_token_blocks(sizes(stream, query, experts), || {
            vals(m.forward(prompts(vocab), &plain).unwrap().logits)
        });
        let what = format!("blocks {stream}/{query}/{experts}");
        assert_eq!(take_blocked_layers(), 3, "{what}");
        let r = relative(&whole, &blocked);
        assert!(r < 1e-5, "{what}: relative difference {r:e}");
    }
    // Rows of both prompts, in the first, a middle and the last block.
    let rows = [0i64, 5, 39, 40, 95, 96, 136, 191];
    let picked = with_token_blocks(sizes(40, 16, 80), || {
        let r = Tensor::<1, Int>::from_data(TensorData::new(rows.to_vec(), [rows.len()]), &dev());
        vals(m.forward_logit_rows(prompts(vocab), r).unwrap())
    });
    assert_eq!(take_blocked_layers(), 3);
    let want: Vec<f32> = rows
        .iter()
        .flat_map(|&r| whole[r as usize * vocab..(r as usize + 1) * vocab].to_vec())
        .collect();
    let r = relative(&want, &picked);
    assert!(r < 1e-5, "logit rows: relative difference {r:e}");
    // A row past the end is refused, naming it.
    let err = with_token_blocks(sizes(40, 16, 80), || {
        let r = Tensor::<1, Int>::from_data(TensorData::new(vec![192i64], [1]), &dev());
        m.forward_logit_rows(prompts(vocab), r)
            .unwrap_err()
            .to_string()
    });
    assert!(err.contains("192"), "{err}");
    take_blocked_layers();
    // Hooks see whole tensors: a forward with a capture runs whole.
    let spec = HookSpec::new().capture("blocks.1.hook_resid_pre").unwrap();
    let hooked = with_token_blocks(sizes(32, 16, 64), || {
        vals(m.forward(prompts(vocab), &spec).unwrap().logits)
    });
    assert_eq!(take_blocked_layers(), 0);
    assert!(relative(&whole, &hooked) == 0.0);
}

#[test]
fn a_forward_in_blocks_of_positions_is_bit_identical_for_1_and_2_threads() {
    let m = crate::edges::tiny_v4(7);
    let vocab = m.info().vocab_size;
    let logits = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            with_token_blocks(sizes(40, 16, 80), || {
                let out = vals(m.forward(prompts(vocab), &HookSpec::new()).unwrap().logits);
                assert_eq!(take_blocked_layers(), 3);
                out
            })
        })
    };
    let (one, two) = (logits(1), logits(2));
    assert!(
        one.iter()
            .zip(&two)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
}
