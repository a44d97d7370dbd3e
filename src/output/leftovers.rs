//! No empty folders from failed work: [`NewDirs`] remembers which output folders did
//! not exist before a command and, when it ends, removes those still empty (a run
//! refused after taking its lock, a training stopped before its first checkpoint).
//! [`NewDirs::remove_all_unless_kept`] goes further for a folder a command made from
//! scratch and filled with generated files only (a grid's recipes and job scripts when
//! the submission fails): it is removed whole unless the command succeeded.

use std::path::{Path, PathBuf};

/// Folders created by this command (deepest first when removed).
#[derive(Debug, Default)]
pub struct NewDirs {
    empty_only: Vec<PathBuf>,
    whole: Vec<PathBuf>,
    kept: bool,
}

/// `path` and its ancestors that do not exist yet, deepest first.
fn missing(path: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut p = Some(path);
    while let Some(d) = p.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        out.push(d.to_path_buf());
        p = d.parent();
    }
    out
}

impl NewDirs {
    /// Remember which of `paths` (and their ancestors) do not exist yet; those still
    /// empty when this is dropped are removed.
    pub fn note(paths: &[&Path]) -> Self {
        let mut d = NewDirs::default();
        for p in paths {
            d.empty_only.extend(missing(p));
        }
        d
    }

    /// Also remove `path` whole (with the files the command generated in it) when
    /// this is dropped without [`NewDirs::keep`], if it does not exist yet.
    pub fn remove_all_unless_kept(mut self, path: &Path) -> Self {
        let m = missing(path);
        if let Some(top) = m.last() {
            self.whole.push(top.clone());
        }
        self.empty_only.extend(m);
        self
    }

    /// The command succeeded: keep what it made (empty folders still go).
    pub fn keep(&mut self) {
        self.kept = true;
    }
}

impl Drop for NewDirs {
    fn drop(&mut self) {
        if !self.kept {
            for d in &self.whole {
                let _ = std::fs::remove_dir_all(d);
            }
        }
        // Deepest first; remove_dir leaves a folder that holds anything.
        let mut dirs = self.empty_only.clone();
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_new_empty_folders_go_and_whole_ones_only_on_failure() {
        let t = tempfile::tempdir().unwrap();
        let old = t.path().join("old");
        std::fs::create_dir(&old).unwrap();
        let (a, b) = (t.path().join("a/b/c"), t.path().join("x/y"));
        {
            let _d = NewDirs::note(&[a.as_path(), b.as_path(), old.as_path()]);
            std::fs::create_dir_all(&a).unwrap();
            std::fs::create_dir_all(&b).unwrap();
            std::fs::write(b.join("f"), "1").unwrap();
        }
        assert!(!t.path().join("a").exists() && b.join("f").exists() && old.exists());
        let g = t.path().join("grid");
        {
            let _d = NewDirs::note(&[]).remove_all_unless_kept(&g);
            std::fs::create_dir_all(g.join("d")).unwrap();
            std::fs::write(g.join("d/recipe.toml"), "x").unwrap();
        }
        assert!(!g.exists());
        {
            let mut d = NewDirs::note(&[]).remove_all_unless_kept(&g);
            std::fs::create_dir_all(g.join("d")).unwrap();
            std::fs::write(g.join("d/recipe.toml"), "x").unwrap();
            d.keep();
        }
        assert!(g.join("d/recipe.toml").exists());
    }
}
