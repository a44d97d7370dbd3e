//! Cluster-level observations and their per-phase statistics.
//!
//! Every effect the runner reports is a ratio of sums per phase over the prompts of
//! that phase (NLD, relative change, accuracy), so the bootstrap resamples logical
//! examples (clusters: one example rendered at every phase) and recomputes the same
//! ratio: [`per_phase`].

use std::collections::BTreeMap;

use super::{DEFAULT_LEVEL, PhaseCluster, bootstrap_ci};

/// A value with its interval and number of observations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Est {
    /// The estimate.
    pub value: f64,
    /// Its 95% cluster-bootstrap interval (`None`: undefined).
    pub ci: Option<(f64, f64)>,
    /// Observations behind it.
    pub n: u64,
}

/// One logical example's observations: per phase, the sums of `K` quantities and a
/// count.
#[derive(Debug, Clone, PartialEq)]
pub struct Obs<const K: usize> {
    /// Per phase, the sums of the `K` quantities.
    pub sums: Vec<[f64; K]>,
    /// Per phase, the number of observations.
    pub counts: Vec<u64>,
}

/// Observations keyed by logical example.
#[derive(Debug, Clone)]
pub struct Clusters<const K: usize> {
    p: usize,
    map: BTreeMap<u64, Obs<K>>,
}

impl<const K: usize> Clusters<K> {
    /// No observations over `p` phases.
    pub fn new(p: usize) -> Self {
        Clusters {
            p,
            map: BTreeMap::new(),
        }
    }

    /// Add one prompt's quantities at `phase`.
    pub fn add(&mut self, logical: u64, phase: u32, v: [f64; K]) {
        let p = self.p;
        let o = self.map.entry(logical).or_insert_with(|| Obs {
            sums: vec![[0.0; K]; p],
            counts: vec![0; p],
        });
        let r = phase as usize;
        for (s, x) in o.sums[r].iter_mut().zip(v) {
            *s += x;
        }
        o.counts[r] += 1;
    }

    /// The clusters, in logical-id order.
    pub fn list(&self) -> Vec<Obs<K>> {
        self.map.values().cloned().collect()
    }

    /// Number of phases.
    pub fn phases(&self) -> usize {
        self.p
    }
}

fn pooled<const K: usize>(s: &[&Obs<K>], phase: Option<usize>, p: usize) -> ([f64; K], u64) {
    let mut sum = [0.0; K];
    let mut n = 0;
    for o in s {
        let range = match phase {
            Some(r) => r..r + 1,
            None => 0..p,
        };
        for r in range {
            for (a, b) in sum.iter_mut().zip(o.sums[r]) {
                *a += b;
            }
            n += o.counts[r];
        }
    }
    (sum, n)
}

/// `stat(sums, count)` per phase (and pooled over all phases, last), each with a
/// percentile cluster-bootstrap interval. Phases without observations are `NaN`
/// without an interval. The estimates run on the rayon pool.
pub fn per_phase<const K: usize>(
    c: &Clusters<K>,
    stat: impl Fn(&[f64; K], u64) -> f64 + Sync,
    reps: usize,
    seed: u64,
) -> (Vec<Est>, Est) {
    let list = c.list();
    let p = c.phases();
    let est = |phase: Option<usize>| -> Est {
        let all: Vec<&Obs<K>> = list.iter().collect();
        let (sum, n) = pooled(&all, phase, p);
        if n == 0 {
            return Est {
                value: f64::NAN,
                ci: None,
                n: 0,
            };
        }
        let value = stat(&sum, n);
        let ci = if value.is_finite() {
            bootstrap_ci(
                &list,
                |s| {
                    let (sum, n) = pooled(s, phase, p);
                    if n == 0 { f64::NAN } else { stat(&sum, n) }
                },
                reps,
                seed,
                DEFAULT_LEVEL,
            )
            .ok()
            .map(|b| (b.lo, b.hi))
        } else {
            None
        };
        let clusters = list
            .iter()
            .filter(|o| match phase {
                Some(r) => o.counts[r] > 0,
                None => o.counts.iter().any(|&k| k > 0),
            })
            .count() as u64;
        Est {
            value,
            ci,
            n: clusters,
        }
    };
    // The phases and the pooled estimate on every core: each is its own resampling
    // from `seed`, so the results do not depend on the threads.
    use rayon::prelude::*;
    let mut all: Vec<Est> = (0..=p)
        .into_par_iter()
        .map(|r| est((r < p).then_some(r)))
        .collect();
    let pooled = all.pop().expect("the pooled estimate");
    (all, pooled)
}

/// Accuracy clusters (one correct/wrong per prompt).
pub fn accuracy_clusters(p: usize, obs: impl IntoIterator<Item = (u64, u32, bool)>) -> Clusters<1> {
    let mut c = Clusters::<1>::new(p);
    for (l, ph, ok) in obs {
        c.add(l, ph, [f64::from(u8::from(ok))]);
    }
    c
}

/// The same observations as [`PhaseCluster`]s (for the phase gap and
/// gate-cycling fits).
pub fn phase_clusters(c: &Clusters<1>) -> Vec<PhaseCluster> {
    c.list()
        .into_iter()
        .map(|o| {
            let mut pc = PhaseCluster::new(o.counts.len());
            for (r, (s, &k)) in o.sums.iter().zip(&o.counts).enumerate() {
                // One observation per phase and example in every design here; more
                // would be averaged into one.
                if k > 0 {
                    pc.observe(r, s[0] / k as f64)
                        .expect("phase in range, finite");
                }
            }
            pc
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_per_phase_and_pooled() {
        let mut c = Clusters::<2>::new(2);
        for l in 0..20u64 {
            c.add(l, 0, [1.0, 2.0]);
            c.add(l, 1, [3.0, 3.0]);
        }
        let (per, pooled) = per_phase(&c, |s, _| s[0] / s[1], 200, 0);
        assert_eq!(per[0].value, 0.5);
        assert_eq!(per[1].value, 1.0);
        assert!((pooled.value - 0.8).abs() < 1e-12);
        assert_eq!(per[0].ci, Some((0.5, 0.5)));
        assert_eq!(per[0].n, 20);
    }

    #[test]
    fn missing_phase_is_nan() {
        let mut c = Clusters::<1>::new(3);
        c.add(0, 0, [1.0]);
        let (per, _) = per_phase(&c, |s, n| s[0] / n as f64, 10, 0);
        assert!(per[1].value.is_nan() && per[1].ci.is_none() && per[1].n == 0);
    }
}
