//! BPE merges recovered from a vocabulary, as transformers' `generate_merges`
//! (`tokenization_utils_base.py`) does for a GGUF that lists no `tokenizer.ggml.merges`
//! (SentencePiece vocabularies: Llama 2, Gemma).
//!
//! Every token that splits into two tokens of the vocabulary gives one merge per split
//! point; the merges are ranked by the token's score (best first), ties by the lengths of
//! the left and then the right piece (longer first), and remaining ties keep the order of
//! the vocabulary (Python's sort is stable, also with `reverse=True`). Lengths count
//! Unicode code points, as Python's `len` does.

use std::collections::HashMap;

/// How the tokens are ranked.
pub(super) enum Rank<'a> {
    /// Lower id first (transformers with `vocab_scores=None`): ascending by
    /// `(id, len(left), len(right))`.
    ById,
    /// Higher score first, the score of each token given in vocabulary order (the last
    /// occurrence of a repeated token counts, as in a Python dict): descending by
    /// `(score, len(left), len(right))`.
    ByScore(&'a [f64]),
}

/// The merges of `tokens` (id order; a token given twice keeps the last id, as the
/// Python dict `{token: id}` does), best first.
pub(super) fn generate(tokens: &[&str], rank: Rank<'_>) -> Vec<(String, String)> {
    let vocab: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    struct Merge<'t> {
        left: &'t str,
        right: &'t str,
        score: f64,
        len_left: usize,
        len_right: usize,
    }
    let mut seen = std::collections::HashSet::with_capacity(tokens.len());
    let mut merges: Vec<Merge<'_>> = Vec::new();
    for token in tokens {
        // A dict iterates its keys once, in first-insertion order.
        if !seen.insert(*token) {
            continue;
        }
        let id = vocab[token];
        let score = match rank {
            Rank::ById => id as f64,
            Rank::ByScore(scores) => scores.get(id).copied().unwrap_or(f64::NAN),
        };
        let mut local: Vec<Merge<'_>> = token
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (left, right) = token.split_at(at);
                (vocab.contains_key(left) && vocab.contains_key(right)).then(|| Merge {
                    left,
                    right,
                    score,
                    len_left: left.chars().count(),
                    len_right: right.chars().count(),
                })
            })
            .collect();
        local.sort_by_key(|m| (vocab[m.left], vocab[m.right]));
        merges.extend(local);
    }
    let descending = matches!(rank, Rank::ByScore(_));
    // `slice::sort_by` is stable: equal keys keep their order, in both directions.
    merges.sort_by(|a, b| {
        let order = a
            .score
            .total_cmp(&b.score)
            .then(a.len_left.cmp(&b.len_left))
            .then(a.len_right.cmp(&b.len_right));
        if descending { order.reverse() } else { order }
    });
    merges
        .into_iter()
        .map(|m| (m.left.to_string(), m.right.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(merges: &[(String, String)]) -> Vec<String> {
        merges.iter().map(|(a, b)| format!("{a} {b}")).collect()
    }

    // The expected merges are transformers 5.25.0's `generate_merges` on the same
    // vocabularies and scores (positions negated, as its Gemma builder does).
    #[test]
    fn merges_follow_transformers_order_by_position() {
        let tokens = ["a", "b", "ab", "c", "abc", "bc", "▁", "▁a"];
        let scores: Vec<f64> = (0..tokens.len()).map(|i| -(i as f64)).collect();
        let merges = generate(&tokens, Rank::ByScore(&scores));
        assert_eq!(pairs(&merges), ["a b", "ab c", "a bc", "b c", "▁ a"]);
    }

    #[test]
    fn equal_scores_rank_longer_left_pieces_first_then_keep_vocabulary_order() {
        let tokens = ["x", "y", "z", "yz", "xy", "xyz"];
        let scores = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let merges = generate(&tokens, Rank::ByScore(&scores));
        assert_eq!(pairs(&merges), ["xy z", "x yz", "y z", "x y"]);
        let by_id = generate(&tokens, Rank::ById);
        assert_eq!(pairs(&by_id), ["y z", "x y", "x yz", "xy z"]);
    }
}
