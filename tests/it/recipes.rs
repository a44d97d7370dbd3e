//! Every shipped organism recipe parses, validates and builds its task sampler.

use phaselens::tasks::KvTrainSampler;
use phaselens::train::OrganismFile;

#[test]
fn shipped_organism_recipes_are_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/experiments/organisms");
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "toml") {
            let f = OrganismFile::load(&p).unwrap_or_else(|e| panic!("{e}"));
            let space = f.task.vocab.build().unwrap();
            assert!(
                space.vocab_size() <= f.model.vocab_size(),
                "{}",
                p.display()
            );
            KvTrainSampler::new(&space, f.task.train.clone()).unwrap();
            assert_eq!(
                p.file_stem().unwrap().to_str().unwrap(),
                f.organism.name,
                "{}",
                p.display()
            );
            n += 1;
        }
    }
    assert!(n >= 4, "found {n} recipes");
}

#[test]
fn shipped_recipes_keep_their_config_hash() {
    // New recipe keys default to the old behaviour and are not serialised then, so
    // the shipped recipes hash as before (their checkpoints still resume). Pinned
    // before `query_sampling` was added. (kvc-w8s8 and kvc-w8s4's training.json hold
    // older hashes: their recipes' serialised form changed after they were trained.)
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/experiments/organisms");
    for (name, hash) in [
        ("kvc-w8s8", "cdef6b1a1f4c66b4"),
        ("kvc-w8s4", "5dc5d8da42313c4f"),
        ("kvc-w4s4", "03dc867385f8c690"),
        ("full-attn", "ad4d3421135e14a7"),
        ("v4pro-mini", "3d4f9fbb6d6502b6"),
    ] {
        let f =
            OrganismFile::load(&std::path::Path::new(dir).join(format!("{name}.toml"))).unwrap();
        assert_eq!(phaselens::train::config_hash(&f), hash, "{name}");
    }
}
