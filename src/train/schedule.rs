//! Learning-rate schedule: linear warm-up, then cosine decay to `min_lr_ratio * lr`.

use super::TrainConfig;

/// The learning rate at `step` (0-based).
pub fn lr_at(tc: &TrainConfig, step: u64) -> f64 {
    let warm = tc.warmup_steps;
    if step < warm {
        return tc.lr * (step + 1) as f64 / warm as f64;
    }
    let span = tc.steps.saturating_sub(warm).max(1);
    let progress = ((step - warm) as f64 / span as f64).min(1.0);
    let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    tc.lr * (tc.min_lr_ratio + (1.0 - tc.min_lr_ratio) * cos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let tc = TrainConfig {
            steps: 110,
            warmup_steps: 10,
            lr: 1.0,
            min_lr_ratio: 0.1,
            ..TrainConfig::default()
        };
        assert!((lr_at(&tc, 0) - 0.1).abs() < 1e-12);
        assert!((lr_at(&tc, 9) - 1.0).abs() < 1e-12);
        assert!((lr_at(&tc, 10) - 1.0).abs() < 1e-12);
        assert!((lr_at(&tc, 60) - 0.55).abs() < 1e-12);
        assert!((lr_at(&tc, 110) - 0.1).abs() < 1e-12);
    }
}
