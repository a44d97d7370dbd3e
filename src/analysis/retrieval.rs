//! Where a head's attention lands, in the key layout of `hook_pattern`
//! (`[compressed entries ; raw tokens ; sink]`), and where the indexer ranks an entry.
//!
//! A compressed entry pools a window of tokens: the needle token is "in" every entry
//! whose window holds it. Two conventions place the windows (see docs/models.md):
//! kvc entry `w` pools tokens `w*S .. w*S + W - 1` ([`EntryAlign::Start`]); DeepSeek-V4
//! entry `w` pools the `W` tokens ending at `(w + 1)*S - 1` ([`EntryAlign::End`]; for
//! CSA, W = 2m: the previous window's half and its own).

/// How entry windows sit on the token axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryAlign {
    /// Entry `w` starts at `w * stride` (kvc).
    Start,
    /// Entry `w` ends at `(w + 1) * stride - 1` (DeepSeek-V4).
    End,
}

/// The key slots of one layer's `hook_pattern` for a sequence of `T` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLayout {
    /// Compressed entries (the first slots).
    pub entries: usize,
    /// Pooling window W and stride S of the entries (unused when `entries == 0`).
    pub window: usize,
    /// Entry stride S.
    pub stride: usize,
    /// Where an entry sits on the token axis.
    pub align: EntryAlign,
    /// Raw token slots after the entries (`T`, or 0 for a layer without raw keys).
    pub raw: usize,
    /// Whether a sink slot ends the row.
    pub sink: bool,
}

impl SlotLayout {
    /// The layout of a pattern row of `slots` key slots over `t` tokens with
    /// `entries` entries: raw tokens are `t` or absent, the sink present or not.
    /// `None` when no combination adds up to `slots`.
    pub fn infer(
        slots: usize,
        t: usize,
        entries: usize,
        window: usize,
        stride: usize,
        align: EntryAlign,
    ) -> Option<SlotLayout> {
        for (raw, sink) in [(t, true), (t, false), (0, true), (0, false)] {
            if entries + raw + usize::from(sink) == slots {
                return Some(SlotLayout {
                    entries,
                    window,
                    stride,
                    align,
                    raw,
                    sink,
                });
            }
        }
        None
    }

    /// Total key slots.
    pub fn slots(&self) -> usize {
        self.entries + self.raw + usize::from(self.sink)
    }

    /// Inclusive token span `[first, last]` pooled into entry `w` (clipped at 0).
    pub fn entry_span(&self, w: usize) -> (usize, usize) {
        match self.align {
            EntryAlign::Start => (w * self.stride, w * self.stride + self.window - 1),
            EntryAlign::End => {
                let last = (w + 1) * self.stride - 1;
                ((last + 1).saturating_sub(self.window), last)
            }
        }
    }

    /// The entries whose window holds token `pos`, ascending.
    pub fn entries_holding(&self, pos: usize) -> Vec<usize> {
        (0..self.entries)
            .filter(|&w| {
                let (a, b) = self.entry_span(w);
                a <= pos && pos <= b
            })
            .collect()
    }

    /// The slots that hold token `pos`: its raw slot (if the layer has raw keys) and
    /// every entry holding it.
    pub fn needle_slots(&self, pos: usize) -> Vec<usize> {
        let mut v = self.entries_holding(pos);
        if self.raw > pos {
            v.push(self.entries + pos);
        }
        v
    }
}

/// Whether the most-attended slot of `probs` (lower index wins among ties) is one of
/// `needle`, and the attention mass on `needle`.
pub fn top_hit(probs: &[f32], needle: &[usize]) -> (bool, f64) {
    let mut best = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > probs[best] {
            best = i;
        }
    }
    let mass = needle
        .iter()
        .filter_map(|&s| probs.get(s))
        .map(|&p| f64::from(p))
        .sum();
    (!probs.is_empty() && needle.contains(&best), mass)
}

/// The rank (0 = the top) of the best-ranked of `targets` among the first `closed`
/// entries' `scores`, under the models' top-k rule (higher score first; among equal
/// scores the lower index first). `None` when no target is closed.
pub fn best_rank(scores: &[f32], closed: usize, targets: &[usize]) -> Option<usize> {
    let closed = closed.min(scores.len());
    targets
        .iter()
        .filter(|&&e| e < closed)
        .map(|&e| {
            let s = scores[e];
            (0..closed)
                .filter(|&j| scores[j] > s || (scores[j] == s && j < e))
                .count()
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvc_and_deepseek_windows() {
        let kvc = SlotLayout {
            entries: 3,
            window: 8,
            stride: 4,
            align: EntryAlign::Start,
            raw: 16,
            sink: true,
        };
        assert_eq!(kvc.entry_span(1), (4, 11));
        assert_eq!(kvc.entries_holding(5), vec![0, 1]);
        assert_eq!(kvc.needle_slots(5), vec![0, 1, 3 + 5]);
        assert_eq!(kvc.slots(), 20);
        let csa = SlotLayout {
            align: EntryAlign::End,
            ..kvc
        };
        // DeepSeek-V4 CSA (m = 4, W = 8): entry w pools (w-1)m .. (w+1)m - 1.
        assert_eq!(csa.entry_span(0), (0, 3));
        assert_eq!(csa.entry_span(2), (4, 11));
        assert_eq!(csa.entries_holding(5), vec![1, 2]);
        assert_eq!(
            SlotLayout::infer(20, 16, 3, 8, 4, EntryAlign::Start),
            Some(kvc)
        );
        assert_eq!(
            SlotLayout::infer(3, 16, 3, 8, 4, EntryAlign::Start).map(|l| (l.raw, l.sink)),
            Some((0, false))
        );
        assert_eq!(SlotLayout::infer(7, 16, 3, 8, 4, EntryAlign::Start), None);
    }

    #[test]
    fn top_hit_and_mass() {
        let p = [0.1, 0.5, 0.2, 0.2];
        assert_eq!(top_hit(&p, &[1]), (true, 0.5));
        let (hit, mass) = top_hit(&p, &[2, 3]);
        assert!(!hit && (mass - 0.4).abs() < 1e-6);
        // Ties: the lower index is the top.
        assert!(top_hit(&[0.5, 0.5], &[0]).0);
        assert!(!top_hit(&[0.5, 0.5], &[1]).0);
    }

    #[test]
    fn ranks_follow_the_top_k_rule() {
        let s = [0.0, 3.0, 1.0, 3.0, 9.0];
        assert_eq!(best_rank(&s, 4, &[1]), Some(0));
        assert_eq!(best_rank(&s, 4, &[3]), Some(1));
        assert_eq!(best_rank(&s, 5, &[3]), Some(2));
        assert_eq!(best_rank(&s, 4, &[0, 2]), Some(2));
        assert_eq!(best_rank(&s, 2, &[3]), None);
    }
}
