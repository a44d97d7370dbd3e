//! DeepSeek-V4 rotary embeddings: default and YaRN inverse frequencies computed in f32
//! exactly as transformers does, interleaved pairs on the LAST `rot_dims` channels of a
//! head (`[nope | rope]` layout).

use burn::tensor::{Device, Tensor, TensorData};

use super::config::RopeSpec;
use crate::model::layers::{RopeLayout, RopeTables, apply_rope_range};

/// Inverse frequencies, one per rotated pair, in f32 as the reference computes them.
pub fn inv_freq(spec: &RopeSpec) -> Vec<f32> {
    let dim = spec.rot_dims;
    let half = dim / 2;
    let base = spec.theta as f32;
    // base ** (2i / dim), f32
    let pos_freqs: Vec<f32> = (0..half)
        .map(|i| base.powf((2 * i) as f32 / dim as f32))
        .collect();
    if spec.rope_type != "yarn" {
        return pos_freqs.iter().map(|p| 1.0 / p).collect();
    }
    let factor = spec.factor as f32;
    let corr = |rot: f64| {
        dim as f64
            * (spec.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * spec.theta.ln())
    };
    // truncate = true in transformers 5.24 (read from the top-level dict, never set).
    let low = corr(spec.beta_fast).floor().max(0.0);
    let mut high = corr(spec.beta_slow).ceil().min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    (0..half)
        .map(|i| {
            let extra = 1.0 / pos_freqs[i];
            let inter = 1.0 / (factor * pos_freqs[i]);
            let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
            let ext = 1.0 - ramp;
            inter * (1.0 - ext) + extra * ext
        })
        .collect()
}

/// Rotary tables (`[n_pos, rot_dims / 2]` cos and sin) for `positions`; angles are
/// `f32(position) * inv_freq` in f32, as in the reference.
pub fn tables(spec: &RopeSpec, positions: &[usize], device: &Device) -> RopeTables {
    let inv = inv_freq(spec);
    let half = inv.len();
    let scale = spec.attention_scaling as f32;
    let mut c = Vec::with_capacity(positions.len() * half);
    let mut s = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &f in &inv {
            let a = p as f32 * f;
            c.push((a as f64).cos() as f32 * scale);
            s.push((a as f64).sin() as f32 * scale);
        }
    }
    let n = positions.len();
    RopeTables {
        cos: Tensor::from_data(TensorData::new(c, [n, half]), device),
        sin: Tensor::from_data(TensorData::new(s, [n, half]), device),
    }
}

/// Rotate the last `2 * tables.cos.dims()[1]` channels of `x: [batch, pos, heads, d]`
/// (interleaved pairs); `inverse` rotates by the negative angle. Tables shared by the
/// batch or per (row, position), as in [`apply_rope_range`].
pub fn rotate(x: Tensor<4>, t: &RopeTables, inverse: bool) -> Tensor<4> {
    let d = x.dims()[3];
    let rot = 2 * t.cos.dims()[1];
    apply_rope_range(x, t, RopeLayout::Interleaved, inverse, d - rot)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(rope_type: &str) -> RopeSpec {
        RopeSpec {
            rope_type: rope_type.into(),
            theta: 160000.0,
            rot_dims: 8,
            factor: 16.0,
            original_max_position_embeddings: 65536.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_scaling: 1.0,
        }
    }

    #[test]
    fn yarn_matches_reference_values() {
        // torch: _compute_yarn_parameters for theta 160000, dim 8, factor 16, 65536, 32/1
        let inv = inv_freq(&spec("yarn"));
        let want = [1.0f32, 0.05, 0.001_718_75, 4.687_5e-5];
        for (a, b) in inv.iter().zip(want) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{inv:?}");
        }
        // theta 40000, factor 4, original 32, beta 16/2 (the `long` fixture)
        let mut s = spec("yarn");
        s.theta = 40000.0;
        s.factor = 4.0;
        s.original_max_position_embeddings = 32.0;
        s.beta_fast = 16.0;
        s.beta_slow = 2.0;
        let inv = inv_freq(&s);
        let want = [1.0f32, 0.017_677_67, 0.00125, 8.838_834e-5];
        for (a, b) in inv.iter().zip(want) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{inv:?}");
        }
        let d = inv_freq(&spec("default"));
        assert_eq!(d[0], 1.0);
        assert!((d[1] - 160000f32.powf(-0.25)).abs() < 1e-9);
    }
}
