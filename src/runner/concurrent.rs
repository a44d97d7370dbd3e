//! Independent pieces of a run (a patching group's chunks) on several threads at once.
//!
//! A forward of a few rows keeps about one core busy: its matrix products split over
//! the rayon pool, but its elementwise passes (norms, softmax, RoPE, gathers) run on the
//! calling thread. Chunks are independent forwards over the same base run, so running
//! `width` of them at once keeps `width` cores busy. Each chunk computes exactly what it
//! computes alone (the same operations on the same inputs; the matrix products split
//! their output, never their sums), so the results do not depend on the width. The
//! results come back to the calling thread as each chunk finishes, which persists them:
//! an interruption loses only the chunks in flight.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

use crate::error::{Error, Result};
use crate::model::{attention, memory, precision};

/// The environment variable that caps how many chunks run at once (`1`: one after
/// another, as before chunks ran concurrently).
pub const CAP_ENV: &str = "PHASELENS_CHUNKS_AT_ONCE";

/// How many of `n` pieces of about `bytes` each (beyond what is allocated already) may
/// run at once: the rayon pool's threads (`RAYON_NUM_THREADS`, default every core), no
/// more than `n`, than [`CAP_ENV`] allows, or than the memory budget
/// ([`memory::budget`]) holds side by side; at least 1.
pub fn width(n: usize, bytes: Option<f64>) -> usize {
    let mut w = rayon::current_num_threads().min(n).max(1);
    if let Some(cap) = std::env::var(CAP_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        w = w.min(cap.max(1));
    }
    if let (Some(b), Ok(Some((avail, _)))) = (bytes, memory::budget())
        && b > 0.0
    {
        w = w.min((avail / b).floor() as usize).max(1);
    }
    w
}

/// `work(i)` for every `i` of `items`, on up to `width` threads; `done(i, result)` on
/// the calling thread as each finishes (in the order they finish). The compute dtype and
/// the attention's block budget of the calling thread hold on the workers too. The first
/// error (of `work` or `done`) stops the start of new pieces and is returned once the
/// pieces in flight have finished. With `width` 1 everything runs on the calling thread,
/// in order.
pub fn run<T: Send>(
    items: &[usize],
    width: usize,
    work: impl Fn(usize) -> Result<T> + Sync,
    mut done: impl FnMut(usize, T) -> Result<()>,
) -> Result<()> {
    if width <= 1 || items.len() <= 1 {
        for &i in items {
            done(i, work(i)?)?;
        }
        return Ok(());
    }
    let dtype = precision::compute();
    let budget = attention::block_budget();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (tx, rx) = mpsc::channel::<(usize, Result<T>)>();
    // The pieces run as jobs of the rayon pool (not threads of their own): their matrix
    // products and other parallel kernels then run on the same workers, stolen back and
    // forth, instead of blocking a thread of ours until the pool is free.
    rayon::in_place_scope(|s| {
        for _ in 0..width.min(items.len()) {
            let tx = tx.clone();
            let (next, stop, work) = (&next, &stop, &work);
            s.spawn(move |_| {
                let _dtype = precision::scoped(dtype);
                attention::with_block_budget(budget, || {
                    while !stop.load(Ordering::Relaxed) {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = items.get(k) else { break };
                        let r = work(i);
                        if r.is_err() {
                            stop.store(true, Ordering::Relaxed);
                        }
                        if tx.send((i, r)).is_err() {
                            break;
                        }
                    }
                })
            });
        }
        drop(tx);
        let mut first: Option<Error> = None;
        for (i, r) in rx {
            if first.is_some() {
                continue;
            }
            if let Err(e) = r.and_then(|v| done(i, v)) {
                stop.store(true, Ordering::Relaxed);
                first = Some(e);
            }
        }
        first.map_or(Ok(()), Err)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_once_and_errors_stop_the_rest() {
        let items: Vec<usize> = (0..20).collect();
        for w in [1, 2, 3] {
            let mut seen = Vec::new();
            run(
                &items,
                w,
                |i| Ok(i * 2),
                |i, v| {
                    assert_eq!(v, i * 2);
                    seen.push(i);
                    Ok(())
                },
            )
            .unwrap();
            seen.sort();
            assert_eq!(seen, items, "width {w}");
            let started = AtomicUsize::new(0);
            let err = run(
                &items,
                w,
                |i| {
                    started.fetch_add(1, Ordering::Relaxed);
                    if i == 3 {
                        Err(Error::Other("piece 3".into()))
                    } else {
                        Ok(i)
                    }
                },
                |_, _| Ok(()),
            )
            .unwrap_err();
            assert!(err.to_string().contains("piece 3"), "{err}");
            // Work stops soon after the error: at most one more piece per worker.
            assert!(started.load(Ordering::Relaxed) <= 4 + w, "width {w}");
        }
    }

    #[test]
    fn workers_compute_in_the_callers_dtype() {
        let _bf16 = precision::scoped(precision::ComputeDtype::Bf16);
        let items: Vec<usize> = (0..4).collect();
        run(
            &items,
            2,
            |_| Ok(precision::compute()),
            |_, d| {
                assert_eq!(d, precision::ComputeDtype::Bf16);
                Ok(())
            },
        )
        .unwrap();
    }
}
