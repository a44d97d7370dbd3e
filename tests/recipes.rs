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
