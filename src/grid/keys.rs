//! Recipe keys: dotted paths into an organism TOML (`model.compression.window`), the
//! short aliases a grid file may use for them (`W`, `S`, `kv_heads`, `seed`, ...), and
//! design names built from key values.

use std::fmt::Write as _;

/// One short name for one or more recipe keys.
pub struct Alias {
    /// The name used in grid files and as the merged table's column.
    pub name: &'static str,
    /// The recipe keys it sets (all to the same value); the first one is read back.
    pub paths: &'static [&'static str],
    /// Prefix of a design name part (`w` + `8` = `w8`).
    pub label: &'static str,
    /// What it means (for `docs/grid.md` and `--help`).
    pub doc: &'static str,
}

/// Every alias. Any other key is a dotted path into the recipe (`train.lr`,
/// `model.compression.gate`, `task.train.prompt.n_bindings`, ...).
pub const ALIASES: &[Alias] = &[
    Alias {
        name: "W",
        paths: &["model.compression.window"],
        label: "w",
        doc: "compression window W",
    },
    Alias {
        name: "S",
        paths: &["model.compression.stride"],
        label: "s",
        doc: "compression stride S (set `period` to S or a multiple of it too)",
    },
    Alias {
        name: "tail",
        paths: &["model.compression.local_tail"],
        label: "tail",
        doc: "raw (uncompressed) local tail length",
    },
    Alias {
        name: "gate",
        paths: &["model.compression.gate"],
        label: "gate-",
        doc: "gate mode: scalar, vector or uniform",
    },
    Alias {
        name: "gate_bias",
        paths: &["model.compression.gate_bias"],
        label: "bias-",
        doc: "learned per-offset gate bias",
    },
    Alias {
        name: "kv_heads",
        paths: &["model.n_kv_heads"],
        label: "kv",
        doc: "number of KV heads",
    },
    Alias {
        name: "rope",
        paths: &["model.rope"],
        label: "rope-",
        doc: "RoPE on all / partial / none of the head dims",
    },
    Alias {
        name: "rope_dims",
        paths: &["model.rope_dims"],
        label: "ropedims",
        doc: "rotated dims when rope = \"partial\"",
    },
    Alias {
        name: "seed",
        paths: &["train.seed", "task.train.seed"],
        label: "seed",
        doc: "init seed and training-data seed together",
    },
    Alias {
        name: "steps",
        paths: &["train.steps"],
        label: "steps",
        doc: "optimiser steps",
    },
    Alias {
        name: "lr",
        paths: &["train.lr"],
        label: "lr",
        doc: "peak learning rate",
    },
    Alias {
        name: "period",
        paths: &["task.train.period"],
        label: "p",
        doc: "phase period P of training pads and of the evaluation",
    },
    Alias {
        name: "query_sampling",
        paths: &["task.train.prompt.query_sampling"],
        label: "q-",
        doc: "distinct or with_replacement (docs/prompt_format.md)",
    },
];

/// The alias called `name`, if any.
pub fn alias(name: &str) -> Option<&'static Alias> {
    ALIASES.iter().find(|a| a.name == name)
}

/// The recipe paths a grid key sets.
pub fn paths_of(key: &str) -> Vec<String> {
    match alias(key) {
        Some(a) => a.paths.iter().map(|p| p.to_string()).collect(),
        None => vec![key.to_string()],
    }
}

/// Set the dotted `path` in `table` to `value`, creating intermediate tables.
/// Errors say which segment is not a table.
pub fn set_path(table: &mut toml::Table, path: &str, value: toml::Value) -> Result<(), String> {
    let parts: Vec<&str> = path.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("`{path}` is not a dotted key path"));
    }
    let (last, parents) = parts.split_last().expect("split gives at least one part");
    let mut cur = table;
    for (i, p) in parents.iter().enumerate() {
        let entry = cur
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(format!(
                    "`{}` is a value, not a table, so `{path}` cannot be set",
                    parts[..=i].join(".")
                ));
            }
        };
    }
    cur.insert(last.to_string(), value);
    Ok(())
}

/// The value at the dotted `path`, if present.
pub fn get_path<'a>(table: &'a toml::Table, path: &str) -> Option<&'a toml::Value> {
    let mut parts = path.split('.');
    let mut v = table.get(parts.next()?)?;
    for p in parts {
        v = v.as_table()?.get(p)?;
    }
    Some(v)
}

/// A value as a design-name fragment: `8`, `with_replacement` -> `with-replacement`,
/// `true` -> `on`.
pub fn value_slug(v: &toml::Value) -> String {
    let raw = match v {
        toml::Value::Boolean(true) => "on".to_string(),
        toml::Value::Boolean(false) => "off".to_string(),
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => format!("{f}"),
        other => other.to_string(),
    };
    let mut out = String::new();
    for c in raw.chars() {
        match c {
            'a'..='z' | '0'..='9' | '.' => out.push(c),
            'A'..='Z' => out.push(c.to_ascii_lowercase()),
            _ => {
                if !out.ends_with('-') {
                    out.push('-');
                }
            }
        }
    }
    out.trim_matches('-').to_string()
}

/// The design-name part of `key = value`: `w8`, `kv2`, `seed3`, `bias-off`, or for a
/// dotted path its last segment (`local-tail4`).
pub fn name_part(key: &str, v: &toml::Value) -> String {
    let label = match alias(key) {
        Some(a) => a.label.to_string(),
        None => key
            .rsplit('.')
            .next()
            .unwrap_or(key)
            .to_ascii_lowercase()
            .replace('_', "-"),
    };
    let value = value_slug(v);
    let mut s = label.clone();
    if !label.ends_with('-') && value.starts_with(|c: char| !c.is_ascii_digit()) {
        s.push('-');
    }
    let _ = write!(s, "{value}");
    s
}

/// True for a usable design name: `a-z 0-9 - _ .`, starting with a letter or digit.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_path_creates_tables_and_refuses_to_descend_into_values() {
        let mut t: toml::Table = toml::from_str("[model]\nd_model = 8\n").unwrap();
        set_path(&mut t, "model.compression.window", 12.into()).unwrap();
        assert_eq!(
            get_path(&t, "model.compression.window"),
            Some(&toml::Value::Integer(12))
        );
        let e = set_path(&mut t, "model.d_model.x", 1.into()).unwrap_err();
        assert!(e.contains("`model.d_model` is a value"), "{e}");
        assert!(set_path(&mut t, "model..x", 1.into()).is_err());
    }

    #[test]
    fn name_parts_read_as_the_paper_writes_designs() {
        assert_eq!(name_part("W", &8.into()), "w8");
        assert_eq!(name_part("kv_heads", &2.into()), "kv2");
        assert_eq!(name_part("seed", &3.into()), "seed3");
        assert_eq!(name_part("gate_bias", &false.into()), "bias-off");
        assert_eq!(name_part("gate", &"uniform".into()), "gate-uniform");
        assert_eq!(
            name_part("model.compression.local_tail", &0.into()),
            "local-tail0"
        );
        assert_eq!(name_part("model.qk_norm", &false.into()), "qk-norm-off");
        assert_eq!(name_part("lr", &0.003.into()), "lr0.003");
        assert!(valid_name("w8s8-seed0"));
        assert!(!valid_name("W8") && !valid_name("-a") && !valid_name("a/b"));
    }
}
