//! Tests of the prompt generators.

use super::*;

fn syn() -> TokenSpace {
    TokenSpace::default_synthetic()
}

fn eval_cfg(p: u32, protocol: Protocol, n_logical: usize) -> KvEvalConfig {
    KvEvalConfig {
        period: Period::new(p).unwrap(),
        protocol,
        n_logical,
        ..KvEvalConfig::default()
    }
}

fn field_of(err: TaskError) -> String {
    match err {
        TaskError::Config { field, .. } => field,
        other => panic!("expected a config error, got {other}"),
    }
}

/// Everything the brief requires of a matched evaluation set, checked exactly.
fn check_matching(set: &KvEvalSet, space: &TokenSpace) {
    let p = set.period().len();
    let n = set.n_logical();
    assert_eq!(set.examples.len(), n * p);
    let mut sums = Vec::new();
    let mut sumsq = Vec::new();
    let mut qpos_multisets = Vec::new();
    for r in 0..p {
        let group: Vec<&KvExample> = set.group(r as u32).collect();
        assert_eq!(group.len(), n, "group {r} size");
        let mut sum: u128 = 0;
        let mut sq: u128 = 0;
        let mut qpos = Vec::new();
        for (i, e) in group.iter().enumerate() {
            // Same logical examples, same bindings and queries in every group.
            assert_eq!(e.logical_id, i as u64);
            let e0 = set.example(i, 0);
            let kv = |e: &KvExample| {
                e.bindings
                    .iter()
                    .map(|b| (b.key.clone(), b.value.clone()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(kv(e), kv(e0));
            let qb = |e: &KvExample| e.queries.iter().map(|q| q.binding).collect::<Vec<_>>();
            assert_eq!(qb(e), qb(e0));
            // Same prompt length everywhere.
            assert_eq!(e.tokens.len(), set.prompt_len);
            // The group is the phase of the target key.
            assert_eq!(e.phase.residue() as usize, r);
            assert_eq!(e.phase.period() as usize, p);
            assert_eq!(e.target_key_pos % p, r);
            assert_eq!(e.scored, e.queries.len() - 1);
            let sq_ = e.scored_query();
            assert_eq!(e.target_key_pos, e.bindings[sq_.binding].key_pos);
            assert_eq!(e.target_positions, sq_.target_positions);
            assert_eq!(e.answers, sq_.answer);
            // Keys sit where they are said to sit; answers are read where they are.
            for b in &e.bindings {
                assert_eq!(&e.tokens[b.key_pos..b.key_pos + b.key.len()], &b.key[..]);
            }
            for q in &e.queries {
                assert_eq!(q.answer, e.bindings[q.binding].value);
                assert_eq!(q.target_key_pos, e.bindings[q.binding].key_pos);
                assert_eq!(q.phase.residue() as usize, q.target_key_pos % p);
                assert_eq!(q.target_positions.len(), q.answer.len());
                for (k, &pos) in q.target_positions.iter().enumerate() {
                    assert_eq!(e.tokens[pos + 1], q.answer[k]);
                }
                assert!(q.query_pos > e.bindings.last().unwrap().key_pos);
            }
            assert!(e.tokens.iter().all(|&t| (t as usize) < space.vocab_size()));
            let t = e.target_key_pos as u128;
            sum += t;
            sq += t * t;
            qpos.push(sq_.query_pos);
        }
        qpos.sort_unstable();
        sums.push(sum);
        sumsq.push(sq);
        qpos_multisets.push(qpos);
    }
    // Equal sums and sums of squares over equal-size groups: exactly equal mean and
    // variance of the absolute target position.
    assert!(sums.iter().all(|&s| s == sums[0]), "sums differ: {sums:?}");
    assert!(
        sumsq.iter().all(|&s| s == sumsq[0]),
        "sums of squares differ: {sumsq:?}"
    );
    // Identical multisets of the query position.
    assert!(qpos_multisets.iter().all(|q| *q == qpos_multisets[0]));
    // The design spreads the target over several windows, not one position per group.
    let distinct: std::collections::BTreeSet<usize> =
        set.group(0).map(|e| e.target_key_pos).collect();
    assert!(distinct.len() >= 2);
}

#[test]
fn eval_groups_are_matched_default_recipe_both_protocols() {
    let space = syn();
    for protocol in Protocol::ALL {
        let set = generate_eval_set(&space, &eval_cfg(8, protocol, 256)).unwrap();
        // 82 unpadded tokens + 1 alignment pad + 7 shift pads.
        assert_eq!(set.prompt_len, 82 + 1 + 7);
        assert_eq!(set.align_pads, 1);
        check_matching(&set, &space);
    }
}

#[test]
fn eval_groups_are_matched_for_other_formats_and_periods() {
    let space = syn();
    let prompts = [
        KvPromptConfig {
            n_bindings: 10,
            n_queries: 3,
            key_len: 2,
            value_len: 2,
            assign: true,
            binding_sep: true,
            query_marker: QueryMarker::EachQuery,
            pad_before_bos: false,
            ..KvPromptConfig::default()
        },
        KvPromptConfig {
            n_bindings: 7,
            n_queries: 1,
            bos: false,
            query_marker: QueryMarker::None,
            distinct_values: true,
            ..KvPromptConfig::default()
        },
    ];
    for prompt in prompts {
        for (p, n) in [(1, 4), (2, 16), (3, 36), (4, 64), (5, 50), (6, 72)] {
            for protocol in Protocol::ALL {
                let cfg = KvEvalConfig {
                    prompt: prompt.clone(),
                    ..eval_cfg(p, protocol, n)
                };
                let set = generate_eval_set(&space, &cfg).unwrap();
                check_matching(&set, &space);
            }
        }
    }
}

#[test]
fn long_periods_get_extra_alignment_padding_and_stay_matched() {
    // P = 24 with 24 two-token bindings: the haystack (48 tokens) is shorter than the
    // 3P - 1 positions the design needs, so alignment pads make up the difference.
    let space = syn();
    let cfg = eval_cfg(24, Protocol::InSequencePadding, 1152);
    let set = generate_eval_set(&space, &cfg).unwrap();
    assert!(set.align_pads > 1);
    check_matching(&set, &space);
    assert_eq!(matched_block_size(Period::new(24).unwrap()), 1152);
    assert_eq!(
        KvEvalConfig::round_n_logical(Period::new(24).unwrap(), 256),
        1152
    );
    assert_eq!(
        KvEvalConfig::round_n_logical(Period::new(8).unwrap(), 300),
        384
    );
}

#[test]
fn prefix_padding_shifts_every_position() {
    let space = syn();
    let set = generate_eval_set(&space, &eval_cfg(8, Protocol::PrefixPadding, 128)).unwrap();
    let p = 8;
    let core = set.prompt_len - (p - 1);
    for i in 0..set.n_logical() {
        let renders: Vec<&KvExample> = (0..p as u32).map(|r| set.example(i, r)).collect();
        let base = renders.iter().find(|e| e.shift == 0).unwrap();
        let mut shifts: Vec<usize> = renders.iter().map(|e| e.shift).collect();
        shifts.sort_unstable();
        assert_eq!(shifts, (0..p).collect::<Vec<_>>());
        for e in &renders {
            let s = e.shift;
            assert_eq!(e.protocol, Some(Protocol::PrefixPadding));
            assert!(e.tokens[..s].iter().all(|&t| t == space.pad()));
            assert_eq!(&e.tokens[s..s + core], &base.tokens[..core]);
            assert!(e.tokens[s + core..].iter().all(|&t| t == space.pad()));
            assert_eq!(e.target_key_pos, base.target_key_pos + s);
            for (b, b0) in e.bindings.iter().zip(&base.bindings) {
                assert_eq!(b.key_pos, b0.key_pos + s);
            }
            for (q, q0) in e.queries.iter().zip(&base.queries) {
                assert_eq!(q.query_pos, q0.query_pos + s);
                let shifted: Vec<usize> = q0.target_positions.iter().map(|x| x + s).collect();
                assert_eq!(q.target_positions, shifted);
            }
        }
    }
}

#[test]
fn in_sequence_padding_shifts_only_the_target() {
    let space = syn();
    let cfg = KvEvalConfig {
        prompt: KvPromptConfig {
            key_len: 2,
            assign: true,
            ..KvPromptConfig::default()
        },
        ..eval_cfg(8, Protocol::InSequencePadding, 128)
    };
    let set = generate_eval_set(&space, &cfg).unwrap();
    let p = 8;
    let w = cfg.prompt.binding_width(&space);
    assert_eq!(w, 4);
    for i in 0..set.n_logical() {
        let renders: Vec<&KvExample> = (0..p as u32).map(|r| set.example(i, r)).collect();
        let base = renders.iter().find(|e| e.shift == 0).unwrap();
        let target = base.scored_query().binding;
        let t0 = base.target_key_pos;
        for e in &renders {
            let s = e.shift;
            assert_eq!(e.protocol, Some(Protocol::InSequencePadding));
            assert_eq!(e.target_key_pos, t0 + s);
            for (j, (b, b0)) in e.bindings.iter().zip(&base.bindings).enumerate() {
                if j == target {
                    assert_eq!(b.key_pos, b0.key_pos + s);
                } else {
                    assert_eq!(b.key_pos, b0.key_pos, "binding {j} moved");
                }
            }
            for (q, q0) in e.queries.iter().zip(&base.queries) {
                assert_eq!(q.query_pos, q0.query_pos);
                assert_eq!(q.target_positions, q0.target_positions);
            }
            // Before the inserted pads and after the compensating pads: identical.
            assert_eq!(&e.tokens[..t0], &base.tokens[..t0]);
            let after = t0 + w + (p - 1);
            assert_eq!(&e.tokens[after..], &base.tokens[after..]);
            // In between: s pads, the target binding, P-1-s pads.
            assert!(e.tokens[t0..t0 + s].iter().all(|&t| t == space.pad()));
            assert_eq!(&e.tokens[t0 + s..t0 + s + w], &base.tokens[t0..t0 + w]);
            assert!(
                e.tokens[t0 + s + w..after]
                    .iter()
                    .all(|&t| t == space.pad())
            );
        }
    }
}

#[test]
fn eval_sets_are_deterministic_and_seed_dependent() {
    let space = syn();
    let a = generate_eval_set(&space, &eval_cfg(4, Protocol::PrefixPadding, 64)).unwrap();
    let b = generate_eval_set(&space, &eval_cfg(4, Protocol::PrefixPadding, 64)).unwrap();
    assert_eq!(a, b);
    let other = KvEvalConfig {
        seed: 1,
        ..eval_cfg(4, Protocol::PrefixPadding, 64)
    };
    let c = generate_eval_set(&space, &other).unwrap();
    assert_ne!(a.examples, c.examples);
    let differing = a
        .examples
        .iter()
        .zip(&c.examples)
        .filter(|(x, y)| x.tokens != y.tokens)
        .count();
    assert!(differing > a.examples.len() / 2);
    // Same seed, other protocol: the same logical examples (bindings and targets).
    let d = generate_eval_set(&space, &eval_cfg(4, Protocol::InSequencePadding, 64)).unwrap();
    for (x, y) in a.examples.iter().zip(&d.examples) {
        assert_eq!(x.logical_id, y.logical_id);
        assert_eq!(x.phase, y.phase);
        assert_eq!(x.target_key_pos, y.target_key_pos);
        assert_eq!(x.answers, y.answers);
        let kv = |e: &KvExample| {
            e.bindings
                .iter()
                .map(|b| (b.key.clone(), b.value.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(kv(x), kv(y));
    }
}

#[test]
fn keys_are_distinct_within_a_prompt() {
    let space = syn();
    let cfg = KvEvalConfig {
        prompt: KvPromptConfig {
            n_bindings: 48,
            n_queries: 48,
            ..KvPromptConfig::default()
        },
        ..eval_cfg(2, Protocol::PrefixPadding, 8)
    };
    let set = generate_eval_set(&space, &cfg).unwrap();
    for e in &set.examples {
        let keys: std::collections::HashSet<_> = e.bindings.iter().map(|b| &b.key).collect();
        assert_eq!(keys.len(), 48);
        let queried: std::collections::HashSet<_> = e.queries.iter().map(|q| q.binding).collect();
        assert_eq!(queried.len(), 48);
    }
}

#[test]
fn training_batches_are_padded_deterministic_and_labelled() {
    let space = syn();
    let cfg = KvTrainConfig::default();
    let sampler = KvTrainSampler::new(&space, cfg.clone()).unwrap();
    // 82 tokens + up to 7 prefix pads: the ORGANISM_NOTES shape (~90 tokens).
    assert_eq!(sampler.seq_len(), 89);
    let batch = sampler.batch(3, 256);
    assert_eq!(batch, sampler.batch(3, 256));
    assert_ne!(batch.examples, sampler.batch(4, 256).examples);
    let other = KvTrainSampler::new(&space, KvTrainConfig { seed: 9, ..cfg }).unwrap();
    assert_ne!(batch.examples, other.batch(3, 256).examples);
    let mut seen_shift = [false; 8];
    for e in &batch.examples {
        assert_eq!(e.tokens.len(), 89);
        assert_eq!(e.protocol, None);
        seen_shift[e.shift] = true;
        assert!(e.tokens[..e.shift].iter().all(|&t| t == space.pad()));
        assert_eq!(e.tokens[e.shift], space.bos().unwrap());
        assert_eq!(e.queries.len(), 16);
        for q in &e.queries {
            assert_eq!(q.phase.residue() as usize, q.target_key_pos % 8);
            assert_eq!(e.tokens[q.target_positions[0] + 1], q.answer[0]);
        }
    }
    assert!(
        seen_shift.iter().all(|&s| s),
        "every prefix pad 0..=7 occurs"
    );
    let ids = batch.input_ids();
    let labels = batch.labels();
    let mask = batch.loss_mask();
    assert_eq!(ids.len(), 256 * 89);
    assert_eq!(labels.len(), ids.len());
    assert_eq!(mask.iter().filter(|&&m| m).count(), 256 * 16);
    for (i, (&l, &m)) in labels.iter().zip(&mask).enumerate() {
        if m {
            assert_eq!(l, ids[i + 1] as i64, "label = next token");
        } else {
            assert_eq!(l, IGNORE_INDEX);
        }
    }
}

#[test]
fn training_inner_pads_keep_length_and_vary() {
    let space = syn();
    let cfg = KvTrainConfig {
        inner_pad_max: 5,
        prompt: KvPromptConfig {
            key_len: 2,
            value_len: 2,
            ..KvPromptConfig::default()
        },
        ..KvTrainConfig::default()
    };
    let sampler = KvTrainSampler::new(&space, cfg).unwrap();
    let batch = sampler.batch(0, 64);
    let mut inner_counts = std::collections::BTreeSet::new();
    for e in &batch.examples {
        assert_eq!(e.tokens.len(), sampler.seq_len());
        let first_query = e.queries.iter().map(|q| q.query_pos).min().unwrap();
        let inside = e.tokens[e.shift + 1..first_query]
            .iter()
            .filter(|&&t| t == space.pad())
            .count();
        assert!(inside <= 5);
        inner_counts.insert(inside);
        for q in &e.queries {
            for (k, &pos) in q.target_positions.iter().enumerate() {
                assert_eq!(e.tokens[pos + 1], q.answer[k]);
            }
        }
    }
    assert!(inner_counts.len() > 2);
}

#[test]
fn impossible_configs_name_the_field() {
    let space = syn();
    // More bindings than distinct keys (48 single-token keys).
    let cfg = KvEvalConfig {
        prompt: KvPromptConfig {
            n_bindings: 49,
            n_queries: 1,
            ..KvPromptConfig::default()
        },
        ..KvEvalConfig::default()
    };
    let err = generate_eval_set(&space, &cfg).unwrap_err();
    assert!(err.to_string().contains("prompt.n_bindings"), "{err}");
    assert_eq!(field_of(err), "prompt.n_bindings");
    // Two-token keys make 48^2 keys available.
    let ok = KvEvalConfig {
        prompt: KvPromptConfig {
            n_bindings: 49,
            n_queries: 1,
            key_len: 2,
            ..KvPromptConfig::default()
        },
        ..eval_cfg(2, Protocol::PrefixPadding, 8)
    };
    generate_eval_set(&space, &ok).unwrap();
    // More queries than bindings.
    let cfg = KvTrainConfig {
        prompt: KvPromptConfig {
            n_bindings: 4,
            n_queries: 5,
            ..KvPromptConfig::default()
        },
        ..KvTrainConfig::default()
    };
    assert_eq!(
        field_of(KvTrainSampler::new(&space, cfg).unwrap_err()),
        "prompt.n_queries"
    );
    // Distinct values beyond the value space.
    let cfg = KvTrainConfig {
        prompt: KvPromptConfig {
            n_bindings: 40,
            distinct_values: true,
            value_len: 1,
            ..KvPromptConfig::default()
        },
        ..KvTrainConfig::default()
    };
    KvTrainSampler::new(&space, cfg).unwrap();
    let tiny = TokenSpace::synthetic(&SyntheticVocabConfig {
        values: TokenRange::new(64, 70),
        vocab_size: 70,
        ..SyntheticVocabConfig::default()
    })
    .unwrap();
    let cfg = KvTrainConfig {
        prompt: KvPromptConfig {
            n_bindings: 7,
            n_queries: 1,
            distinct_values: true,
            ..KvPromptConfig::default()
        },
        ..KvTrainConfig::default()
    };
    assert_eq!(
        field_of(KvTrainSampler::new(&tiny, cfg).unwrap_err()),
        "prompt.n_bindings"
    );
    // Period 0.
    assert_eq!(field_of(Period::new(0).unwrap_err()), "period");
    // Prompt longer than max_len.
    let cfg = KvEvalConfig {
        prompt: KvPromptConfig {
            max_len: Some(89),
            ..KvPromptConfig::default()
        },
        ..KvEvalConfig::default()
    };
    let err = generate_eval_set(&space, &cfg).unwrap_err();
    assert!(err.to_string().contains("90"), "{err}");
    assert_eq!(field_of(err), "prompt.max_len");
    let cfg = KvTrainConfig {
        prompt: KvPromptConfig {
            max_len: Some(88),
            ..KvPromptConfig::default()
        },
        ..KvTrainConfig::default()
    };
    assert_eq!(
        field_of(KvTrainSampler::new(&space, cfg).unwrap_err()),
        "prompt.max_len"
    );
    // n_logical not a multiple of 2 P^2.
    let err = generate_eval_set(&space, &eval_cfg(8, Protocol::PrefixPadding, 200)).unwrap_err();
    assert!(err.to_string().contains("256"), "{err}");
    assert_eq!(field_of(err), "n_logical");
    assert_eq!(
        field_of(generate_eval_set(&space, &eval_cfg(8, Protocol::PrefixPadding, 0)).unwrap_err()),
        "n_logical"
    );
    // Zero-sized formats.
    for (prompt, field) in [
        (
            KvPromptConfig {
                n_bindings: 0,
                ..KvPromptConfig::default()
            },
            "prompt.n_bindings",
        ),
        (
            KvPromptConfig {
                n_queries: 0,
                ..KvPromptConfig::default()
            },
            "prompt.n_queries",
        ),
        (
            KvPromptConfig {
                key_len: 0,
                ..KvPromptConfig::default()
            },
            "prompt.key_len",
        ),
        (
            KvPromptConfig {
                value_len: 0,
                ..KvPromptConfig::default()
            },
            "prompt.value_len",
        ),
    ] {
        let cfg = KvEvalConfig {
            prompt,
            ..KvEvalConfig::default()
        };
        assert_eq!(
            field_of(generate_eval_set(&space, &cfg).unwrap_err()),
            field
        );
    }
}

#[test]
fn synthetic_vocab_validation() {
    assert!(SyntheticVocabConfig::default().validate().is_ok());
    let bad = |c: SyntheticVocabConfig| field_of(TokenSpace::synthetic(&c).unwrap_err());
    let d = SyntheticVocabConfig::default;
    assert_eq!(
        bad(SyntheticVocabConfig {
            keys: TokenRange::new(16, 70),
            ..d()
        }),
        "values"
    );
    assert_eq!(
        bad(SyntheticVocabConfig {
            vocab_size: 100,
            ..d()
        }),
        "values"
    );
    assert_eq!(bad(SyntheticVocabConfig { bos: 0, ..d() }), "bos");
    assert_eq!(
        bad(SyntheticVocabConfig {
            filler: TokenRange::new(3, 16),
            ..d()
        }),
        "filler"
    );
    assert_eq!(
        bad(SyntheticVocabConfig {
            keys: TokenRange::new(16, 16),
            ..d()
        }),
        "keys"
    );
    assert_eq!(bad(SyntheticVocabConfig { pad: 500, ..d() }), "pad");
    // A larger vocabulary with disjoint ranges is fine.
    let big = SyntheticVocabConfig {
        vocab_size: 256,
        keys: TokenRange::new(16, 128),
        values: TokenRange::new(128, 256),
        ..d()
    };
    let s = TokenSpace::synthetic(&big).unwrap();
    assert_eq!(s.key_atoms().len(), 112);
    assert_eq!(s.value_atoms().len(), 128);
    assert_eq!(s.vocab_size(), 256);
    let space = syn();
    assert_eq!(
        space.render(&[1, 16, 64, 3, 0, 8]),
        "<bos> k0 v0 ? <pad> f0"
    );
    assert!(space.is_synthetic());
    assert!(space.tokenizer().is_none());
}

#[test]
fn configs_deserialize_with_defaults_and_reject_unknown_fields() {
    let cfg: KvEvalConfig = toml::from_str(
        "period = 4\nprotocol = \"in_sequence_padding\"\nn_logical = 32\n[prompt]\nn_bindings = 12\n",
    )
    .unwrap();
    assert_eq!(cfg.period.get(), 4);
    assert_eq!(cfg.protocol, Protocol::InSequencePadding);
    assert_eq!(cfg.prompt.n_bindings, 12);
    assert_eq!(cfg.prompt.n_queries, 16);
    let err = toml::from_str::<KvEvalConfig>("periods = 4\n").unwrap_err();
    assert!(err.to_string().contains("periods"), "{err}");
    let err = toml::from_str::<KvEvalConfig>("[prompt]\nn_binding = 4\n").unwrap_err();
    assert!(err.to_string().contains("n_binding"), "{err}");
    let err = toml::from_str::<KvEvalConfig>("period = 0\n").unwrap_err();
    assert!(err.to_string().contains("period"), "{err}");
    let cfg: KvTrainConfig = toml::from_str("inner_pad_max = 3\nseed = 5\n").unwrap();
    assert_eq!(cfg.period.get(), 8);
    assert_eq!(cfg.inner_pad_max, 3);
    assert!(toml::from_str::<KvTrainConfig>("bogus = 1\n").is_err());

    let space: TokenSpaceConfig = toml::from_str(
        "kind = \"synthetic\"\nvocab_size = 256\nvalues = { start = 64, end = 256 }\n",
    )
    .unwrap();
    let space = space.build().unwrap();
    assert_eq!(space.value_atoms().len(), 192);
    let err = toml::from_str::<TokenSpaceConfig>("kind = \"synthetic\"\nvocab = 3\n").unwrap_err();
    assert!(err.to_string().contains("vocab"), "{err}");
    let hf: TokenSpaceConfig = toml::from_str(
        "kind = \"hugging_face\"\ntokenizer = \"t.json\"\npad = \"<pad>\"\nsep = \";\"\n",
    )
    .unwrap();
    match hf {
        TokenSpaceConfig::HuggingFace(c) => {
            assert_eq!(c.sep, ";");
            assert_eq!(c.assign, ":");
            assert_eq!(c.key_words.len(), 64);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        toml::from_str::<TokenSpaceConfig>("kind = \"hugging_face\"\ntokenizer = \"t.json\"\n")
            .is_err(),
        "pad is required"
    );
    let probe: BindingProbeConfig = toml::from_str("lengths = { min = 0, max = 15 }\n").unwrap();
    assert_eq!(probe.lengths.iter().count(), 16);
    assert!(toml::from_str::<TextProbeConfig>("filler = \"=\"\n").is_err());
    assert_eq!(
        "in_sequence".parse::<Protocol>().unwrap(),
        Protocol::InSequencePadding
    );
    assert_eq!(Protocol::PrefixPadding.to_string(), "prefix_padding");
    assert_eq!(
        field_of("sideways".parse::<Protocol>().unwrap_err()),
        "protocol"
    );
    let json = serde_json::to_string(&Phase::of(13, Period::new(8).unwrap())).unwrap();
    assert_eq!(json, r#"{"residue":5,"period":8}"#);
}

#[test]
fn binding_filler_probe_moves_the_context_with_l() {
    let space = syn();
    let cfg = BindingProbeConfig {
        n_instances: 3,
        n_other_bindings: 4,
        ..BindingProbeConfig::default()
    };
    let items = binding_filler_probe(&space, &cfg).unwrap();
    assert_eq!(items.len(), 3 * 16);
    for inst in 0..3 {
        let its: Vec<&FillerProbeItem> = items.iter().filter(|i| i.instance == inst).collect();
        let ls: Vec<usize> = its.iter().map(|i| i.filler_len).collect();
        assert_eq!(ls, (24..=39).collect::<Vec<_>>());
        for w in its.windows(2) {
            assert_eq!(w[1].tokens.len(), w[0].tokens.len() + 1);
            assert_eq!(
                w[1].correct_key_pos.unwrap(),
                w[0].correct_key_pos.unwrap() + 1
            );
            assert_eq!(w[1].correct, w[0].correct);
            assert_eq!(w[1].distractor, w[0].distractor);
        }
        for it in its {
            assert_eq!(it.read_pos, it.tokens.len() - 1);
            assert_eq!(it.filler_span.1 - it.filler_span.0, it.filler_len);
            assert_eq!(it.filler_span.0, 1, "filler right after BOS");
            let f = space.filler_atoms()[0];
            assert!(
                it.tokens[it.filler_span.0..it.filler_span.1]
                    .iter()
                    .all(|&t| t == f)
            );
            assert_ne!(it.correct[0], it.distractor[0]);
            // The correct binding is in the context; the query asks its key.
            let k = it.correct_key_pos.unwrap();
            let key = it.tokens[k];
            assert_eq!(it.tokens[k + 1], it.correct[0]);
            assert_eq!(it.tokens[it.read_pos], key);
            assert_eq!(it.tokens[it.read_pos - 1], space.query_marker()[0]);
            let d = it.distractor_key_pos.unwrap();
            assert_eq!(it.tokens[d + 1], it.distractor[0]);
        }
    }
    assert_eq!(items, binding_filler_probe(&space, &cfg).unwrap());
    let other = binding_filler_probe(&space, &BindingProbeConfig { seed: 1, ..cfg }).unwrap();
    assert_ne!(items, other);

    // Filler before the query: the context stays put, only the query moves.
    let cfg = BindingProbeConfig {
        filler_position: FillerPosition::BeforeQuery,
        filler_style: FillerStyle::Random,
        lengths: LengthRange::new(0, 9),
        assign: true,
        ..BindingProbeConfig::default()
    };
    let items = binding_filler_probe(&space, &cfg).unwrap();
    assert_eq!(items.len(), 10);
    for w in items.windows(2) {
        assert_eq!(w[0].correct_key_pos, w[1].correct_key_pos);
        assert_eq!(w[1].read_pos, w[0].read_pos + 1);
        // Random filler: length L + 1 extends length L.
        let (a0, a1) = w[0].filler_span;
        let (b0, _) = w[1].filler_span;
        assert_eq!(&w[0].tokens[a0..a1], &w[1].tokens[b0..b0 + (a1 - a0)]);
    }
    assert_eq!(items[0].filler_span.0, items[0].filler_span.1);
    assert_eq!(*items[0].tokens.last().unwrap(), space.assign()[0]);
}

#[test]
fn filler_probe_errors() {
    let space = syn();
    let err = binding_filler_probe(
        &space,
        &BindingProbeConfig {
            lengths: LengthRange::new(5, 4),
            ..BindingProbeConfig::default()
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "lengths");
    let err = binding_filler_probe(
        &space,
        &BindingProbeConfig {
            n_other_bindings: 47,
            ..BindingProbeConfig::default()
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "n_other_bindings");
    let err = binding_filler_probe(
        &space,
        &BindingProbeConfig {
            max_len: Some(30),
            ..BindingProbeConfig::default()
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "max_len");
    let no_filler = TokenSpace::synthetic(&SyntheticVocabConfig {
        filler: TokenRange::new(8, 8),
        ..SyntheticVocabConfig::default()
    })
    .unwrap();
    let err = binding_filler_probe(&no_filler, &BindingProbeConfig::default()).unwrap_err();
    assert_eq!(field_of(err), "filler_style");
}

// ---------------------------------------------------------------------------------
// Hugging Face tokenizer path, with a tiny WordLevel tokenizer.json written by hand.

const WORDS: &[&str] = &[
    "<pad>", "<s>", "<unk>", ":", ";", "Query", "=", "apple", "river", "stone", "cloud", "tiger",
    "red", "blue", "green", "black", "x", "y", "8", "32", "is",
];

fn write_tokenizer(dir: &std::path::Path) -> std::path::PathBuf {
    let vocab: serde_json::Map<String, serde_json::Value> = WORDS
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
        .collect();
    let added = |id: usize, content: &str| {
        serde_json::json!({
            "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        })
    };
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added(0, "<pad>"), added(1, "<s>"), added(2, "<unk>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}
            ],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}}
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    path
}

fn hf_config(path: &std::path::Path) -> HfVocabConfig {
    HfVocabConfig {
        bos: Some("<s>".into()),
        sep: ";".into(),
        key_words: [
            "apple",
            "river",
            "stone",
            "cloud",
            "tiger",
            "banana",
            "apple river",
            "apple",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        value_words: [" red", " blue", " green", " black"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        filler_words: vec!["=".into()],
        ..HfVocabConfig::new(path, "<pad>")
    }
}

#[test]
fn hf_token_space_resolves_pieces_and_drops_bad_words() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_tokenizer(dir.path());
    let space = TokenSpace::huggingface(&hf_config(&path)).unwrap();
    let id = |w: &str| WORDS.iter().position(|x| *x == w).unwrap() as u32;
    assert!(!space.is_synthetic());
    assert!(space.tokenizer().is_some());
    assert_eq!(space.pad(), id("<pad>"));
    assert_eq!(space.bos(), Some(id("<s>")));
    assert_eq!(space.sep(), &[id(";")]);
    assert_eq!(space.assign(), &[id(":")]);
    assert_eq!(space.query_marker(), &[id("Query"), id(":")]);
    assert_eq!(
        space.key_atoms(),
        &["apple", "river", "stone", "cloud", "tiger"].map(id)
    );
    assert_eq!(
        space.value_atoms(),
        &["red", "blue", "green", "black"].map(id)
    );
    assert_eq!(space.filler_atoms(), &[id("=")]);
    // "banana" is unknown (-> <unk>), "apple river" is two tokens, "apple" repeats.
    assert_eq!(space.dropped_words(), &["banana", "apple river", "apple"]);
    assert_eq!(space.vocab_size(), WORDS.len());

    // The same config through the serde enum.
    let via_cfg = TokenSpaceConfig::HuggingFace(hf_config(&path))
        .build()
        .unwrap();
    assert_eq!(via_cfg.key_atoms(), space.key_atoms());

    // Errors: missing file, pad not one token, no usable key word.
    let err = TokenSpace::huggingface(&hf_config(&dir.path().join("missing.json"))).unwrap_err();
    assert!(matches!(err, TaskError::TokenizerLoad { .. }), "{err}");
    let mut c = hf_config(&path);
    c.pad = "x y".into();
    assert_eq!(field_of(TokenSpace::huggingface(&c).unwrap_err()), "pad");
    let mut c = hf_config(&path);
    c.key_words = vec!["banana".into()];
    assert_eq!(
        field_of(TokenSpace::huggingface(&c).unwrap_err()),
        "key_words"
    );
    let mut c = hf_config(&path);
    c.bos = None;
    let no_bos = TokenSpace::huggingface(&c).unwrap();
    let small = KvEvalConfig {
        prompt: KvPromptConfig {
            n_bindings: 4,
            n_queries: 2,
            ..KvPromptConfig::default()
        },
        ..KvEvalConfig::default()
    };
    let err = generate_eval_set(&no_bos, &small).unwrap_err();
    assert_eq!(field_of(err), "prompt.bos");
}

#[test]
fn hf_eval_sets_are_matched_and_readable() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_tokenizer(dir.path());
    let space = TokenSpace::huggingface(&hf_config(&path)).unwrap();
    let prompt = KvPromptConfig {
        n_bindings: 8,
        n_queries: 2,
        key_len: 2,
        assign: true,
        binding_sep: true,
        pad_before_bos: false,
        ..KvPromptConfig::default()
    };
    // 25 two-word keys exist; 26 bindings do not fit.
    let too_many = KvEvalConfig {
        prompt: KvPromptConfig {
            n_bindings: 26,
            ..prompt.clone()
        },
        ..eval_cfg(4, Protocol::PrefixPadding, 32)
    };
    assert_eq!(
        field_of(generate_eval_set(&space, &too_many).unwrap_err()),
        "prompt.n_bindings"
    );
    for protocol in Protocol::ALL {
        let cfg = KvEvalConfig {
            prompt: prompt.clone(),
            ..eval_cfg(4, protocol, 32)
        };
        let set = generate_eval_set(&space, &cfg).unwrap();
        check_matching(&set, &space);
        let e = &set.examples[0];
        assert_eq!(e.tokens[0], space.bos().unwrap(), "BOS stays first");
        let text = space.render(&e.tokens);
        assert!(text.starts_with("<s>"), "{text}");
        assert!(text.contains("Query :"), "{text}");
        let b = &e.bindings[0];
        let binding_text = space.render(&e.tokens[b.key_pos..b.key_pos + 5]);
        assert_eq!(binding_text.split(' ').count(), 5, "{binding_text}");
        assert!(
            binding_text.contains(" : ") && binding_text.ends_with(';'),
            "{binding_text}"
        );
    }
    // The synthetic-analogue filler probe runs on the HF space too.
    let items = binding_filler_probe(&space, &BindingProbeConfig::default()).unwrap();
    assert_eq!(items.len(), 16);
    let text = space.render(&items[0].tokens);
    assert!(text.starts_with("<s> = ="), "{text}");
}

#[test]
fn hf_text_filler_probe() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_tokenizer(dir.path());
    let tok = tokenizers::Tokenizer::from_file(&path).unwrap();
    let cfg = TextProbeConfig {
        template: "x = 8 ; y = 32 ; {filler}; x is".into(),
        filler_unit: "= ".into(),
        lengths: LengthRange::new(0, 12),
        correct: " 8".into(),
        distractor: " 32".into(),
        add_special_tokens: true,
    };
    let items = text_filler_probe(&tok, &cfg).unwrap();
    assert_eq!(items.len(), 13);
    // <s> x = 8 ; y = 32 ; [L x =] ; x is
    for (l, it) in items.iter().enumerate() {
        assert_eq!(it.filler_len, l);
        assert_eq!(it.tokens.len(), 1 + 8 + l + 3);
        assert_eq!(it.tokens[0], 1, "BOS added by the post-processor");
        assert_eq!(it.filler_span, (9, 9 + l));
        assert_eq!(it.read_pos, it.tokens.len() - 1);
        assert_eq!(it.correct, vec![18]);
        assert_eq!(it.distractor, vec![19]);
        assert!(it.tokens[9..9 + l].iter().all(|&t| t == 6));
    }
    let no_special = text_filler_probe(
        &tok,
        &TextProbeConfig {
            add_special_tokens: false,
            ..cfg.clone()
        },
    )
    .unwrap();
    assert_eq!(no_special[3].tokens, items[3].tokens[1..]);
    assert_eq!(no_special[3].filler_span, (8, 11));

    let err = text_filler_probe(
        &tok,
        &TextProbeConfig {
            template: "no hole".into(),
            ..cfg.clone()
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "template");
    let err = text_filler_probe(
        &tok,
        &TextProbeConfig {
            template: "{filler} {filler}".into(),
            ..cfg.clone()
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "template");
    let err = text_filler_probe(
        &tok,
        &TextProbeConfig {
            distractor: "8 32".into(),
            ..cfg.clone()
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "distractor");
    let err = text_filler_probe(
        &tok,
        &TextProbeConfig {
            correct: "  ".into(),
            ..cfg
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "correct");
    // The default template parses and has one placeholder.
    let d = TextProbeConfig::default();
    assert_eq!(d.template.matches("{filler}").count(), 1);
    assert_eq!(d.lengths, LengthRange::new(24, 39));
}

#[test]
fn curriculum_grows_the_binding_count_at_a_fixed_length() {
    let space = syn();
    let plain = KvTrainSampler::new(&space, KvTrainConfig::default()).unwrap();
    let cfg = KvTrainConfig {
        curriculum: Some(Curriculum {
            start_bindings: 4,
            steps: 100,
        }),
        ..KvTrainConfig::default()
    };
    let sampler = KvTrainSampler::new(&space, cfg.clone()).unwrap();
    assert_eq!(sampler.seq_len(), plain.seq_len());
    for (step, bindings, queries) in [
        (0, 4, 4),
        (50, 14, 14),
        (99, 23, 16),
        (100, 24, 16),
        (5000, 24, 16),
    ] {
        assert_eq!(sampler.prompt_at(step).n_bindings, bindings, "step {step}");
        let batch = sampler.batch(step, 16);
        assert_eq!(batch, sampler.batch(step, 16), "deterministic");
        for e in &batch.examples {
            assert_eq!(e.tokens.len(), 89);
            assert_eq!(e.bindings.len(), bindings, "step {step}");
            assert_eq!(e.queries.len(), queries, "step {step}");
            for q in &e.queries {
                assert_eq!(e.tokens[q.target_positions[0] + 1], q.answer[0]);
                let b = &e.bindings[q.binding];
                assert_eq!(e.tokens[b.key_pos], b.key[0]);
                assert_eq!(
                    e.tokens[b.key_pos + 1],
                    q.answer[0],
                    "the answer is the key's value"
                );
            }
            // The spare positions are pads after the last query.
            let last = e
                .queries
                .iter()
                .map(|q| q.target_positions[0] + 1)
                .max()
                .unwrap();
            assert!(e.tokens[last + 1..].iter().all(|&t| t == space.pad()));
        }
        assert_eq!(
            batch.loss_mask().iter().filter(|&&m| m).count(),
            16 * queries
        );
    }
    // After the ramp the batches are the plain sampler's.
    assert_eq!(sampler.batch(100, 8), plain.batch(100, 8));
    for (start, steps, key) in [
        (0, 10, "curriculum.start_bindings"),
        (25, 10, "curriculum.start_bindings"),
        (4, 0, "curriculum.steps"),
    ] {
        let bad = KvTrainConfig {
            curriculum: Some(Curriculum {
                start_bindings: start,
                steps,
            }),
            ..KvTrainConfig::default()
        };
        let err = KvTrainSampler::new(&space, bad).unwrap_err().to_string();
        assert!(err.contains(key), "{err}");
    }
}

fn with_replacement(n_bindings: usize, n_queries: usize) -> KvPromptConfig {
    KvPromptConfig {
        n_bindings,
        n_queries,
        query_sampling: QuerySampling::WithReplacement,
        ..KvPromptConfig::default()
    }
}

#[test]
fn distinct_sampling_is_the_default_and_is_not_serialised() {
    // Recipes without the key keep their config hash (and so their checkpoints).
    let json = serde_json::to_string(&KvPromptConfig::default()).unwrap();
    assert!(!json.contains("query_sampling"), "{json}");
    let json = serde_json::to_string(&with_replacement(24, 16)).unwrap();
    assert!(
        json.contains(r#""query_sampling":"with_replacement""#),
        "{json}"
    );
    let parsed: KvPromptConfig = toml::from_str("query_sampling = \"with_replacement\"").unwrap();
    assert_eq!(parsed.query_sampling, QuerySampling::WithReplacement);
    assert!(toml::from_str::<KvPromptConfig>("query_sampling = \"sometimes\"").is_err());
}

#[test]
fn queries_with_replacement_carry_no_elimination_signal() {
    let space = syn();
    let cfg = KvTrainConfig {
        prompt: with_replacement(24, 16),
        ..KvTrainConfig::default()
    };
    let sampler = KvTrainSampler::new(&space, cfg).unwrap();
    assert_eq!(sampler.seq_len(), 89, "same shape as the distinct recipe");
    let batch = sampler.batch(7, 2000);
    assert_eq!(batch, sampler.batch(7, 2000), "deterministic");
    // The last query's binding is uniform over all 24 whatever was asked before: it
    // repeats an earlier query with probability 1 - (23/24)^15 = 0.47, and the
    // distinct sampler never does that.
    let repeats = batch
        .examples
        .iter()
        .filter(|e| {
            let (last, earlier) = e.queries.split_last().unwrap();
            earlier.iter().any(|q| q.binding == last.binding)
        })
        .count();
    let rate = repeats as f64 / 2000.0;
    assert!((0.42..0.52).contains(&rate), "repeat rate {rate}");
    let mut counts = [0usize; 24];
    for e in &batch.examples {
        counts[e.queries.last().unwrap().binding] += 1;
        for q in &e.queries {
            assert_eq!(e.tokens[q.target_positions[0] + 1], q.answer[0]);
            assert_eq!(q.answer, e.bindings[q.binding].value);
        }
    }
    // Every binding index is asked last (2000 draws, 24 bins: ~83 expected each).
    assert!(counts.iter().all(|&c| c > 40), "{counts:?}");
    // Every query still carries loss.
    assert_eq!(batch.loss_mask().iter().filter(|&&m| m).count(), 2000 * 16);

    let distinct = KvTrainSampler::new(&space, KvTrainConfig::default()).unwrap();
    for e in &distinct.batch(7, 200).examples {
        let mut b: Vec<usize> = e.queries.iter().map(|q| q.binding).collect();
        b.sort_unstable();
        b.dedup();
        assert_eq!(b.len(), 16, "distinct sampling asks 16 distinct bindings");
    }
}

#[test]
fn with_replacement_allows_more_queries_than_bindings() {
    let space = syn();
    let err = KvTrainSampler::new(
        &space,
        KvTrainConfig {
            prompt: KvPromptConfig {
                n_bindings: 4,
                n_queries: 6,
                ..KvPromptConfig::default()
            },
            ..KvTrainConfig::default()
        },
    )
    .unwrap_err();
    assert_eq!(field_of(err), "prompt.n_queries");
    let sampler = KvTrainSampler::new(
        &space,
        KvTrainConfig {
            prompt: with_replacement(4, 6),
            ..KvTrainConfig::default()
        },
    )
    .unwrap();
    for e in &sampler.batch(0, 8).examples {
        assert_eq!(e.queries.len(), 6);
    }
    // A curriculum keeps every query (the distinct sampler caps them at the bindings).
    let c = KvTrainSampler::new(
        &space,
        KvTrainConfig {
            prompt: with_replacement(24, 16),
            curriculum: Some(Curriculum {
                start_bindings: 4,
                steps: 100,
            }),
            ..KvTrainConfig::default()
        },
    )
    .unwrap();
    assert_eq!(c.prompt_at(0).n_queries, 16);
    assert_eq!(c.batch(0, 4).examples[0].queries.len(), 16);
    assert_eq!(c.batch(0, 4).seq_len, 89);
}

#[test]
fn eval_with_replacement_asks_the_target_once_at_the_end() {
    let space = syn();
    for protocol in Protocol::ALL {
        let cfg = KvEvalConfig {
            prompt: with_replacement(24, 16),
            ..eval_cfg(8, protocol, 128)
        };
        let set = generate_eval_set(&space, &cfg).unwrap();
        check_matching(&set, &space);
        let mut repeats = 0;
        for e in &set.examples {
            let (last, earlier) = e.queries.split_last().unwrap();
            assert!(earlier.iter().all(|q| q.binding != last.binding));
            let mut b: Vec<usize> = earlier.iter().map(|q| q.binding).collect();
            b.sort_unstable();
            b.dedup();
            repeats += usize::from(b.len() < earlier.len());
        }
        assert!(repeats > 0, "earlier queries repeat bindings");
    }
    let one = KvEvalConfig {
        prompt: with_replacement(1, 2),
        ..eval_cfg(8, Protocol::PrefixPadding, 128)
    };
    let err = generate_eval_set(&space, &one).unwrap_err();
    assert_eq!(field_of(err), "prompt.n_bindings");
}

#[test]
fn the_default_training_stream_is_unchanged() {
    // sha256 (first 8 bytes) of the ids of batch 5 x 8 prompts of the default recipe,
    // pinned before `query_sampling` existed: the shipped recipes train on exactly the
    // batches they were trained on.
    use sha2::Digest;
    let s = KvTrainSampler::new(&syn(), KvTrainConfig::default()).unwrap();
    let bytes: Vec<u8> = s
        .batch(5, 8)
        .input_ids()
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let d = sha2::Sha256::digest(&bytes);
    let hex: String = d.iter().take(8).map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, "93467cff434f4bf5");
}
