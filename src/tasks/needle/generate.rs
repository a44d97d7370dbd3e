//! Building a [`TextNeedleSet`]: per logical example a value, its needle and query
//! (tokenized in context), a filler stream of whole sentences and the needle's base
//! position; then one rendering per phase.

use super::*;

/// A filler stream: its sentences as tokens, in order; `cut` when the last one is
/// cut short to hit the budget exactly.
struct Stream {
    pieces: Vec<Vec<u32>>,
    cut: bool,
}

/// What a logical example says, tokenized.
struct Content {
    value: String,
    needle_text: String,
    /// `" " + needle sentence`, with the value's token range.
    needle: Encoded,
    /// `"\n" + question + " " + value`, with the value's token range.
    query: Encoded,
    wrong_first: Vec<u32>,
}

/// The pieces every logical example shares.
struct Shared<'a> {
    tok: &'a Tokenizer,
    specials: TextTokens,
    intro: Vec<u32>,
    pool: Vec<Vec<u32>>,
}

fn check_config(cfg: &TextNeedleConfig) -> TaskResult<()> {
    if cfg.length == 0 || cfg.length > MAX_TEXT_LEN {
        return Err(TaskError::config(
            "length",
            format!("must be in 1..={MAX_TEXT_LEN} tokens (got {})", cfg.length),
        ));
    }
    let [d0, d1] = cfg.depth;
    if !(d0.is_finite() && d1.is_finite() && 0.0 <= d0 && d0 <= d1 && d1 <= 1.0) {
        return Err(TaskError::config(
            "depth",
            format!("must be [lo, hi] with 0 <= lo <= hi <= 1 (got [{d0}, {d1}])"),
        ));
    }
    if cfg.n_logical == 0 {
        return Err(TaskError::config("n_logical", "must be at least 1"));
    }
    match cfg.task {
        TextTask::Passkey if !(1..=18).contains(&cfg.digits) => Err(TaskError::config(
            "digits",
            format!("must be in 1..=18 (got {})", cfg.digits),
        )),
        TextTask::Needle => check_facts(&cfg.facts),
        TextTask::Passkey => Ok(()),
    }
}

fn check_facts(facts: &[Fact]) -> TaskResult<()> {
    if facts.is_empty() {
        return Err(TaskError::config("facts", "give at least one fact"));
    }
    for (i, f) in facts.iter().enumerate() {
        split_slot(&format!("facts[{i}].sentence"), &f.sentence)?;
        if f.question.contains(VALUE_SLOT) || f.question.trim().is_empty() {
            return Err(TaskError::config(
                format!("facts[{i}].question"),
                "must be non-empty text without {value} (the prompt continues with the value)",
            ));
        }
        if f.values.len() < 2 || f.values.iter().any(|v| v.trim().is_empty()) {
            return Err(TaskError::config(
                format!("facts[{i}].values"),
                "give at least two non-empty values (the others are the wrong answers)",
            ));
        }
    }
    Ok(())
}

/// `"\n" + question + " " + value`, tokenized, with the value's range.
fn encode_query(tok: &Tokenizer, question: &str, value: &str) -> TaskResult<Encoded> {
    encode_with_value(tok, "question", &format!("\n{question} "), value, "")
}

/// First query tokens of `wrong` values that differ from the right one's.
fn wrong_firsts(
    tok: &Tokenizer,
    question: &str,
    right: u32,
    wrong: impl Iterator<Item = String>,
) -> TaskResult<Vec<u32>> {
    let mut out = Vec::new();
    for w in wrong {
        let q = encode_query(tok, question, &w)?;
        let first = q.ids[q.value.start];
        if first != right && !out.contains(&first) {
            out.push(first);
        }
    }
    Ok(out)
}

fn content(
    tok: &Tokenizer,
    sentence: &str,
    question: &str,
    value: String,
    wrong: Vec<String>,
) -> TaskResult<Content> {
    let (before, after) = split_slot("sentence", sentence)?;
    let needle = encode_with_value(tok, "needle", &format!(" {before}"), &value, after)?;
    let query = encode_query(tok, question, &value)?;
    let right = query.ids[query.value.start];
    let wrong_first = wrong_firsts(tok, question, right, wrong.into_iter())?;
    if wrong_first.is_empty() {
        return Err(TaskError::config(
            "facts",
            format!(
                "every other value of {value:?} starts with its first token: no wrong value to compare"
            ),
        ));
    }
    Ok(Content {
        needle_text: format!("{before}{value}{after}"),
        value,
        needle,
        query,
        wrong_first,
    })
}

/// A pass key of `digits` digits (first 1-9) and its content; the wrong values
/// differ in the first digit.
fn passkey_content(tok: &Tokenizer, rng: &mut ChaCha8Rng, digits: usize) -> TaskResult<Content> {
    let mut v = vec![rng.random_range(1..=9u8)];
    v.extend((1..digits).map(|_| rng.random_range(0..=9u8)));
    let text: String = v.iter().map(|d| char::from(b'0' + d)).collect();
    let rest = &text[1..];
    let wrong = (0..=9u8)
        .filter(|&d| d != v[0])
        .map(|d| format!("{}{rest}", char::from(b'0' + d)))
        .collect();
    content(tok, PASSKEY_SENTENCE, PASSKEY_QUESTION, text, wrong)
}

/// A fact drawn from `facts`, one of its values, and its content.
fn needle_content(tok: &Tokenizer, rng: &mut ChaCha8Rng, facts: &[Fact]) -> TaskResult<Content> {
    let f = &facts[rng.random_range(0..facts.len())];
    let k = rng.random_range(0..f.values.len());
    let wrong = f
        .values
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != k)
        .map(|(_, w)| w.clone())
        .collect();
    content(tok, &f.sentence, &f.question, f.values[k].clone(), wrong)
}

/// Tokens the first part of the stream leaves for an exact finish.
const RESERVE: usize = 32;

/// A subset of `cands` (pool indices) whose lengths sum to exactly `rest`, in
/// `cands`' order (0/1 subset sum over the lengths).
fn exact_fill(pool: &[Vec<u32>], cands: &[usize], rest: usize) -> Option<Vec<usize>> {
    let mut from: Vec<Option<(usize, usize)>> = vec![None; rest + 1];
    let mut reach = vec![false; rest + 1];
    reach[0] = true;
    for &k in cands {
        let l = pool[k].len();
        for sum in (l..=rest).rev() {
            if reach[sum - l] && !reach[sum] {
                reach[sum] = true;
                from[sum] = Some((sum - l, k));
            }
        }
        if reach[rest] {
            break;
        }
    }
    let mut out = Vec::new();
    let mut at = rest;
    while at > 0 {
        let (prev, k) = from[at]?;
        out.push(k);
        at = prev;
    }
    out.reverse();
    Some(out)
}

/// Whole sentences of `pool` in a shuffled order up to `RESERVE` tokens before
/// `budget` (a sentence repeats only after a full pass through the pool), then unused
/// sentences of this pass whose lengths sum to exactly the rest; when none do, the
/// sentences that fit and the first tokens of one more (a cut sentence, last).
fn filler_stream(rng: &mut ChaCha8Rng, pool: &[Vec<u32>], budget: usize) -> Stream {
    let mut order: Vec<usize> = (0..pool.len()).collect();
    order.shuffle(rng);
    let (mut next, mut used) = (0, 0);
    let mut pieces: Vec<Vec<u32>> = Vec::new();
    loop {
        if next == order.len() {
            order.shuffle(rng);
            next = 0;
        }
        let l = pool[order[next]].len();
        if used + l + RESERVE > budget {
            break;
        }
        pieces.push(pool[order[next]].clone());
        used += l;
        next += 1;
    }
    let cands = &order[next..];
    let rest = budget - used;
    let finish = exact_fill(pool, cands, rest);
    let cut = finish.is_none();
    for k in finish.unwrap_or_else(|| fit_then_cut(pool, cands, rest)) {
        let r = budget - used;
        let take = pool[k].len().min(r);
        pieces.push(pool[k][..take].to_vec());
        used += take;
    }
    Stream { pieces, cut }
}

/// The sentences of `cands` that fit `rest` in turn, then one more to be cut.
fn fit_then_cut(pool: &[Vec<u32>], cands: &[usize], mut rest: usize) -> Vec<usize> {
    let mut out = Vec::new();
    for &k in cands {
        if pool[k].len() <= rest {
            out.push(k);
            rest -= pool[k].len();
        }
    }
    if rest > 0
        && let Some(&k) = cands.iter().find(|k| !out.contains(k)).or(cands.first())
    {
        out.push(k);
    }
    out
}

/// Sentence starts (token offsets) of `pieces`, and the end.
fn bounds(pieces: &[Vec<u32>]) -> Vec<usize> {
    let mut b = vec![0];
    for p in pieces {
        b.push(b.last().unwrap() + p.len());
    }
    b
}

/// The needle's boundary in the stream: a sentence start at a depth in `cfg.depth`
/// (under in-sequence padding, at least P-1 tokens before the end) whose value
/// position `lead_voff + b` has residue `want`; when no boundary has it, one sentence
/// before the boundary trades places with one after it so that one does (the
/// phase groups' mean positions then match exactly); else any boundary in range.
fn choose_boundary(
    rng: &mut ChaCha8Rng,
    cfg: &TextNeedleConfig,
    s: &mut Stream,
    lead_voff: usize,
    want: usize,
) -> TaskResult<usize> {
    let p = cfg.period.len();
    let mut cands = boundary_candidates(cfg, s);
    if cands.is_empty() {
        return Err(TaskError::config(
            "length",
            format!("{} tokens leave no room for the needle", cfg.length),
        ));
    }
    cands.shuffle(rng);
    let bs = bounds(&s.pieces);
    let hits = |k: usize, bs: &[usize]| (lead_voff + bs[k]) % p == want;
    if let Some(&k) = cands.iter().find(|&&k| hits(k, &bs)) {
        return Ok(bs[k]);
    }
    // Movable: every sentence but a cut last one.
    let movable = s.pieces.len() - usize::from(s.cut);
    for &k in cands.iter().filter(|&&k| k > 0) {
        for j in k..movable {
            let sum = bs[k] - s.pieces[k - 1].len() + s.pieces[j].len();
            if (lead_voff + sum) % p == want {
                s.pieces.swap(k - 1, j);
                return Ok(sum);
            }
        }
    }
    Ok(bs[cands[0]])
}

/// Indices into [`bounds`] where the needle may go.
fn boundary_candidates(cfg: &TextNeedleConfig, s: &Stream) -> Vec<usize> {
    let p = cfg.period.len();
    let bs = bounds(&s.pieces);
    let len = *bs.last().unwrap();
    let room = match cfg.protocol {
        Protocol::PrefixPadding => len,
        Protocol::InSequencePadding => len.saturating_sub(p - 1),
    };
    let last = s.pieces.len() - usize::from(s.cut);
    let ok = |k: usize| bs[k] <= room && k <= last;
    let in_depth = |k: usize| {
        let d = bs[k] as f64 / len.max(1) as f64;
        cfg.depth[0] <= d && d <= cfg.depth[1]
    };
    let v: Vec<usize> = (0..bs.len()).filter(|&k| ok(k) && in_depth(k)).collect();
    if v.is_empty() {
        (0..bs.len()).filter(|&k| ok(k)).collect()
    } else {
        v
    }
}

/// One logical example: its content, filler stream and needle boundary.
struct Logical {
    id: u64,
    c: Content,
    /// The filler stream's tokens.
    stream: Vec<u32>,
    b: usize,
}

/// Tokens before the intro's end (BOS and the intro), without pads.
fn lead_len(sh: &Shared) -> usize {
    usize::from(sh.specials.bos.is_some()) + sh.intro.len()
}

fn logical(sh: &Shared, cfg: &TextNeedleConfig, i: usize) -> TaskResult<Logical> {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    rng.set_stream(i as u64 + 1);
    let c = match cfg.task {
        TextTask::Passkey => passkey_content(sh.tok, &mut rng, cfg.digits)?,
        TextTask::Needle => needle_content(sh.tok, &mut rng, &cfg.facts)?,
    };
    let p = cfg.period.len();
    let pads = match cfg.protocol {
        Protocol::PrefixPadding => p - 1,
        Protocol::InSequencePadding => 0,
    };
    let fixed = lead_len(sh) + c.needle.ids.len() + c.query.ids.len() + pads;
    if fixed >= cfg.length {
        return Err(TaskError::config(
            "length",
            format!(
                "{} tokens leave no filler: the prompt without filler takes {fixed}",
                cfg.length
            ),
        ));
    }
    let mut stream = filler_stream(&mut rng, &sh.pool, cfg.length - fixed);
    let lead_voff = lead_len(sh) + c.needle.value.start;
    let b = choose_boundary(&mut rng, cfg, &mut stream, lead_voff, i % p)?;
    Ok(Logical {
        id: i as u64,
        c,
        stream: stream.pieces.concat(),
        b,
    })
}

/// Logical example `l` rendered at phase `r`.
fn render(sh: &Shared, cfg: &TextNeedleConfig, l: &Logical, r: usize) -> TextNeedleExample {
    let p = cfg.period.len();
    let base = lead_len(sh) + l.b + l.c.needle.value.start;
    let s = (r + p - base % p) % p;
    let (lead, cut, tail) = match cfg.protocol {
        Protocol::PrefixPadding => (s, l.b, p - 1 - s),
        Protocol::InSequencePadding => (0, l.b + s, 0),
    };
    let mut t = Vec::with_capacity(cfg.length);
    t.extend(sh.specials.bos);
    t.extend(std::iter::repeat_n(sh.specials.pad, lead));
    t.extend_from_slice(&sh.intro);
    let filler_start = t.len();
    t.extend_from_slice(&l.stream[..cut]);
    let needle_start = t.len();
    t.extend_from_slice(&l.c.needle.ids);
    let needle_end = t.len();
    t.extend_from_slice(&l.stream[cut..]);
    let query_start = t.len();
    t.extend_from_slice(&l.c.query.ids);
    t.extend(std::iter::repeat_n(sh.specials.pad, tail));
    let q = &l.c.query;
    let v = needle_start + l.c.needle.value.start;
    TextNeedleExample {
        logical_id: l.id,
        protocol: cfg.protocol,
        shift: s,
        value: l.c.value.clone(),
        needle_text: l.c.needle_text.clone(),
        needle_span: (needle_start, needle_end),
        value_span: (v, needle_start + l.c.needle.value.end),
        filler_span: (filler_start, query_start),
        phase: Phase::of(v, cfg.period),
        target_positions: q.value.clone().map(|k| query_start + k - 1).collect(),
        answers: q.ids[q.value.clone()].to_vec(),
        wrong_first: l.c.wrong_first.clone(),
        tokens: t,
    }
}

/// The pieces every logical example shares: the intro and the filler pool, tokenized.
fn shared<'a>(
    tok: &'a Tokenizer,
    specials: TextTokens,
    cfg: &TextNeedleConfig,
) -> TaskResult<Shared<'a>> {
    let intro_text = match cfg.task {
        TextTask::Passkey => PASSKEY_INTRO,
        TextTask::Needle => NEEDLE_INTRO,
    };
    let intro = encode(tok, "intro", intro_text)?.get_ids().to_vec();
    let mut pool = Vec::with_capacity(FILLER_SENTENCES.len());
    for s in FILLER_SENTENCES {
        let ids = encode(tok, "filler", &format!(" {s}"))?.get_ids().to_vec();
        if !ids.is_empty() {
            pool.push(ids);
        }
    }
    Ok(Shared {
        tok,
        specials,
        intro,
        pool,
    })
}

/// Generate a phase-controlled passkey or needle set with `tok` (any Hugging Face
/// tokenizer; pieces are encoded without special tokens and concatenated).
///
/// Each of `n_logical` logical examples is rendered `P` times, once per phase `r` of
/// its needle's first value token. Every prompt has exactly `length` tokens; the
/// logical example (value, filler, depth) is the same at every phase; the base
/// residue of logical example `i` is `i mod P` whenever a sentence boundary in the
/// depth range allows it, so with `n_logical` a multiple of `P` every phase group has
/// the same mean value position (see `docs/prompt_format.md`).
pub fn generate_text_needle_set(
    tok: &Tokenizer,
    specials: TextTokens,
    cfg: &TextNeedleConfig,
) -> TaskResult<TextNeedleSet> {
    check_config(cfg)?;
    let sh = shared(tok, specials, cfg)?;
    let p = cfg.period.len();
    let mut examples = Vec::with_capacity(cfg.n_logical * p);
    for i in 0..cfg.n_logical {
        let l = logical(&sh, cfg, i)?;
        for r in 0..p {
            let ex = render(&sh, cfg, &l, r);
            debug_assert_eq!(ex.tokens.len(), cfg.length);
            debug_assert_eq!(ex.phase.residue() as usize, r);
            examples.push(ex);
        }
    }
    Ok(TextNeedleSet {
        config: cfg.clone(),
        prompt_len: cfg.length,
        examples,
    })
}
