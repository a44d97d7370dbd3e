//! The corrupted partner of a rendered passkey / needle prompt (activation patching):
//! the same prompt, token for token, with another value in the needle and in the
//! query's teacher-forced answer. The value is drawn per logical example (ChaCha8 on
//! the config's seed, a stream apart from the generator's), so a logical example has
//! the same corrupted value at every phase. A pass key changes every digit (the first
//! stays 1-9); a needle takes another value of its fact. The value must tokenize to
//! as many tokens as the clean one in both places, with the same tokens around it and
//! another first token; candidates that do not are skipped.

use super::*;

/// How many pass keys are drawn before giving up on one that tokenizes like the clean.
const PASSKEY_TRIES: usize = 64;

/// The stream offset of the corrupted values (the generator uses streams `1..=n`).
const STREAM: u64 = 1 << 40;

/// The corrupted partner of one example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextCorruption {
    /// The corrupted value as text.
    pub value: String,
    /// `(position, token)` of every replaced token of the prompt: the needle's value
    /// tokens, then the query's (the teacher-forced answer).
    pub edits: Vec<(usize, u32)>,
    /// The corrupted value's tokens in the query (the corrupted prompt's answers).
    pub answers: Vec<u32>,
}

impl TextCorruption {
    /// The corrupted prompt of `e` (every position of `e.tokens`).
    pub fn apply(&self, e: &TextNeedleExample) -> Vec<u32> {
        let mut t = e.tokens.clone();
        for &(p, id) in &self.edits {
            t[p] = id;
        }
        t
    }
}

/// The needle template, question and other values of example `e`'s content.
fn templates(cfg: &TextNeedleConfig, e: &TextNeedleExample) -> TaskResult<(String, String)> {
    match cfg.task {
        TextTask::Passkey => Ok((PASSKEY_SENTENCE.into(), PASSKEY_QUESTION.into())),
        TextTask::Needle => {
            let f = fact_of(cfg, e)?;
            Ok((f.sentence.clone(), f.question.clone()))
        }
    }
}

/// The fact whose sentence, with the example's value, is the example's needle.
fn fact_of<'c>(cfg: &'c TextNeedleConfig, e: &TextNeedleExample) -> TaskResult<&'c Fact> {
    cfg.facts
        .iter()
        .find(|f| {
            f.values.contains(&e.value) && f.sentence.replace(VALUE_SLOT, &e.value) == e.needle_text
        })
        .ok_or_else(|| {
            TaskError::config(
                "facts",
                format!(
                    "no fact renders the needle {:?} of logical example {}",
                    e.needle_text, e.logical_id
                ),
            )
        })
}

/// The needle and the query of `value`, tokenized as the generator does.
fn encode_pair(
    tok: &Tokenizer,
    sentence: &str,
    question: &str,
    value: &str,
) -> TaskResult<(Encoded, Encoded)> {
    let (before, after) = split_slot("sentence", sentence)?;
    let needle = encode_with_value(tok, "needle", &format!(" {before}"), value, after)?;
    let query = encode_with_value(tok, "question", &format!("\n{question} "), value, "")?;
    Ok((needle, query))
}

/// Whether `new` has `old`'s tokens but inside the (same) value range, and another
/// first value token.
fn same_frame(old: &Encoded, new: &Encoded) -> bool {
    let (o, n) = (&old.ids, &new.ids);
    o.len() == n.len()
        && old.value == new.value
        && (0..o.len()).all(|i| old.value.contains(&i) || o[i] == n[i])
        && o[old.value.start] != n[new.value.start]
}

/// The edits that turn `e` into its partner with value `value`, when it tokenizes in
/// the same frame as the clean value's needle and query `(n0, q0)`; `None` otherwise.
fn edits_for(
    tok: &Tokenizer,
    (sentence, question): (&str, &str),
    (n0, q0): (&Encoded, &Encoded),
    e: &TextNeedleExample,
    value: &str,
) -> TaskResult<Option<TextCorruption>> {
    let (n1, q1) = encode_pair(tok, sentence, question, value)?;
    if !same_frame(n0, &n1) || !same_frame(q0, &q1) {
        return Ok(None);
    }
    let needle_at = e.needle_span.0;
    let query_at = e.target_positions[0] + 1 - q0.value.start;
    let mut edits: Vec<(usize, u32)> = n1
        .value
        .clone()
        .map(|k| (needle_at + k, n1.ids[k]))
        .collect();
    edits.extend(q1.value.clone().map(|k| (query_at + k, q1.ids[k])));
    for &(p, _) in &edits {
        if p >= e.tokens.len() {
            return Err(TaskError::config(
                "length",
                format!(
                    "logical example {}: value position {p} outside the prompt",
                    e.logical_id
                ),
            ));
        }
    }
    Ok(Some(TextCorruption {
        value: value.to_string(),
        answers: q1.ids[q1.value.clone()].to_vec(),
        edits,
    }))
}

/// A pass key that differs from `v` in every digit (the first 1-9).
fn other_passkey(rng: &mut ChaCha8Rng, v: &str) -> String {
    v.bytes()
        .enumerate()
        .map(|(k, d)| {
            let lo = if k == 0 { b'1' } else { b'0' };
            loop {
                let x = rng.random_range(lo..=b'9');
                if x != d {
                    return char::from(x);
                }
            }
        })
        .collect()
}

/// The candidate corrupted values of `e`, in the order they are tried.
fn candidates(cfg: &TextNeedleConfig, e: &TextNeedleExample) -> TaskResult<Vec<String>> {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    rng.set_stream(STREAM + e.logical_id);
    Ok(match cfg.task {
        TextTask::Passkey => (0..PASSKEY_TRIES)
            .map(|_| other_passkey(&mut rng, &e.value))
            .collect(),
        TextTask::Needle => {
            let mut v: Vec<String> = fact_of(cfg, e)?
                .values
                .iter()
                .filter(|w| **w != e.value)
                .cloned()
                .collect();
            v.shuffle(&mut rng);
            v
        }
    })
}

/// The corrupted partner of `e` (rendered from `cfg` with `tok`): the first candidate
/// value that tokenizes in the clean value's frame. An error names `digits` (pass keys)
/// or `facts` (needles) when none does.
pub fn corrupt_text_example(
    tok: &Tokenizer,
    cfg: &TextNeedleConfig,
    e: &TextNeedleExample,
) -> TaskResult<TextCorruption> {
    let (sentence, question) = templates(cfg, e)?;
    let (n0, q0) = encode_pair(tok, &sentence, &question, &e.value)?;
    for value in candidates(cfg, e)? {
        if let Some(c) = edits_for(tok, (&sentence, &question), (&n0, &q0), e, &value)? {
            return Ok(c);
        }
    }
    Err(match cfg.task {
        TextTask::Passkey => TaskError::config(
            "digits",
            format!(
                "no pass key differing from {:?} in every digit tokenizes into the same tokens around it ({PASSKEY_TRIES} drawn): the tokenizer merges digits; patching needs one token per digit or fewer digits",
                e.value
            ),
        ),
        TextTask::Needle => TaskError::config(
            "facts",
            format!(
                "no other value of the fact of {:?} has as many tokens as {:?} with another first token (in the needle and the question): give the fact values of one length",
                e.needle_text, e.value
            ),
        ),
    })
}
