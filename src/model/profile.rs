//! Where a forward's time goes, by stage (`phaselens bench forward --stages`): while
//! enabled, the model code's regions (attention, experts, mHC, the LM head) and the
//! work inside them (matrix products through `flops::Mm`, dequantisation of
//! stored weights) are timed on the calling thread, each exclusively: a product inside
//! the attention counts as the attention's products, not as its other work. What no
//! region or kind claims is the forward's own other work (embedding, norms, RoPE,
//! residual adds, elementwise ops between the regions).
//!
//! The backends run eagerly, so an op's time is its own work. Off by default: one
//! relaxed atomic load per region or product. The LM head is recognised by its output
//! width (`vocab` rows of the matrix, set by [`start`]) where the model code does not
//! mark it (kvc-family models).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use serde::Serialize;

static ON: AtomicBool = AtomicBool::new(false);
static VOCAB: AtomicUsize = AtomicUsize::new(0);
static TOTALS: Mutex<BTreeMap<(Region, Kind), f64>> = Mutex::new(BTreeMap::new());

/// A region of the model code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Region {
    /// The forward outside the regions below (embedding, projections, norms, RoPE, ...).
    Forward,
    /// The attention core (blocked scores, masks, softmax, gathers, the indexer's
    /// selection).
    Attention,
    /// DeepSeek-V4's routed and shared experts (routing, gathers, the experts' products).
    Experts,
    /// DeepSeek-V4's hyper-connections (mixing, Sinkhorn, collapse and expansion).
    Mhc,
    /// The LM head (final norm and the logits' product).
    Head,
}

/// What kind of work, within a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Matrix products (`flops::Mm::mm`).
    Products,
    /// Dequantising stored weights (FP8 / FP4 / GGUF blocks) into f32 / bf16 tensors.
    Dequant,
    /// Everything else (elementwise ops, reductions, gathers, allocation).
    Other,
}

struct Frame {
    region: Region,
    start: Instant,
    /// Time claimed by nested regions and timed kinds.
    inner: f64,
}

thread_local! {
    static STACK: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// Start profiling (resets the totals); `vocab`: the LM head's output width.
pub fn start(vocab: usize) {
    TOTALS.lock().expect("profile totals").clear();
    VOCAB.store(vocab, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
}

/// Stop profiling; the seconds per (region, kind) since [`start`].
pub fn stop() -> Vec<StageTime> {
    ON.store(false, Ordering::Relaxed);
    let totals = std::mem::take(&mut *TOTALS.lock().expect("profile totals"));
    totals
        .into_iter()
        .map(|((region, kind), seconds)| StageTime {
            region,
            kind,
            seconds,
        })
        .collect()
}

/// Whether profiling is on.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// One stage's time.
#[derive(Debug, Clone, Serialize)]
pub struct StageTime {
    /// Where in the model code.
    pub region: Region,
    /// What kind of work.
    pub kind: Kind,
    /// Wall seconds (summed over the profiled forwards).
    pub seconds: f64,
}

fn add(region: Region, kind: Kind, seconds: f64) {
    *TOTALS
        .lock()
        .expect("profile totals")
        .entry((region, kind))
        .or_default() += seconds;
}

/// A timed region; its time (less what nested regions and kinds claim) is added when
/// it is dropped.
pub struct RegionGuard(bool);

/// Enter `region` until the guard is dropped (a no-op while profiling is off).
pub fn region(region: Region) -> RegionGuard {
    if !enabled() {
        return RegionGuard(false);
    }
    STACK.with(|s| {
        s.borrow_mut().push(Frame {
            region,
            start: Instant::now(),
            inner: 0.0,
        })
    });
    RegionGuard(true)
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            let Some(f) = s.pop() else { return };
            let elapsed = f.start.elapsed().as_secs_f64();
            add(f.region, Kind::Other, (elapsed - f.inner).max(0.0));
            if let Some(parent) = s.last_mut() {
                parent.inner += elapsed;
            }
        });
    }
}

/// [`region`] `Head` when `rows` (a weight matrix's output rows) is the vocabulary size
/// (the LM head's matrix, multiplied block by block); else a no-op.
pub fn head_if_vocab(rows: usize) -> RegionGuard {
    if enabled() && rows > 0 && rows == VOCAB.load(Ordering::Relaxed) {
        region(Region::Head)
    } else {
        RegionGuard(false)
    }
}

/// Run `f` as work of `kind` in the current region (the LM head's when `out_rows` is
/// the vocabulary size), timed while profiling is on.
pub fn timed<T>(kind: Kind, out_rows: usize, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    record(kind, out_rows, t0.elapsed().as_secs_f64());
    out
}

/// [`timed`] for work of two kinds interleaved over the threads: `f` returns its value and
/// the share (0 to 1) of its threads' time that was `part`'s; the wall time is divided
/// between `part` and `kind` in that proportion.
pub fn timed_shared<T>(kind: Kind, part: Kind, out_rows: usize, f: impl FnOnce() -> (T, f64)) -> T {
    if !enabled() {
        return f().0;
    }
    let t0 = Instant::now();
    let (out, share) = f();
    let elapsed = t0.elapsed().as_secs_f64();
    let share = share.clamp(0.0, 1.0);
    record(part, out_rows, elapsed * share);
    record(kind, out_rows, elapsed * (1.0 - share));
    out
}

/// Add `seconds` of `kind` to the current region (claimed from it) or the LM head's.
fn record(kind: Kind, out_rows: usize, seconds: f64) {
    let head = out_rows > 0 && out_rows == VOCAB.load(Ordering::Relaxed);
    let region = STACK.with(|s| {
        let mut s = s.borrow_mut();
        match s.last_mut() {
            Some(parent) => {
                parent.inner += seconds;
                parent.region
            }
            None => Region::Forward,
        }
    });
    add(if head { Region::Head } else { region }, kind, seconds);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_take_their_own_time_and_kinds_their_region() {
        let nap = |ms| std::thread::sleep(std::time::Duration::from_millis(ms));
        start(7);
        let t0 = Instant::now();
        {
            let _f = region(Region::Forward);
            {
                let _a = region(Region::Attention);
                timed(Kind::Products, 3, || nap(20));
                nap(10);
            }
            timed(Kind::Dequant, 7, || nap(5));
        }
        let outer = t0.elapsed().as_secs_f64();
        let t = stop();
        let get = |r, k| {
            t.iter()
                .find(|s| s.region == r && s.kind == k)
                .map_or(0.0, |s| s.seconds)
        };
        // Sleeps last at least as long as asked; the stages split the forward's time
        // without counting any of it twice.
        assert!(get(Region::Attention, Kind::Products) >= 0.020);
        assert!(get(Region::Attention, Kind::Other) >= 0.010);
        assert!(get(Region::Head, Kind::Dequant) >= 0.005);
        assert_eq!(get(Region::Forward, Kind::Dequant), 0.0);
        let sum: f64 = t.iter().map(|s| s.seconds).sum();
        assert!(sum <= outer + 1e-9, "{sum} > {outer}");
        assert!(!enabled());
    }
}
