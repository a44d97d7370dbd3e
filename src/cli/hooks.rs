//! `phaselens hooks`: list every hook point with its shape; with `--model`, the points
//! that model exposes and their shapes on a short prompt (with `--compression`, under
//! that overlay: e.g. `evict`'s chunk scores and kept chunks).

use std::path::Path;

use anyhow::{Context, Result};
use burn::tensor::{Int, Tensor, TensorData};

use phaselens::hooks::{HookSpec, Site};
use phaselens::model::compression::Overlay;

pub fn run(markdown: bool, model: Option<&Path>, overlay: Option<&Overlay>) -> Result<()> {
    if let Some(dir) = model {
        return of_model(dir, overlay);
    }
    if markdown {
        print!("{}", phaselens::hooks::markdown_table());
        return Ok(());
    }
    println!("{:<40} {:<60} meaning", "name", "shape");
    for site in Site::ALL {
        let info = site.info();
        let name = if info.layered {
            format!("blocks.{{l}}.{}", info.suffix)
        } else {
            info.suffix.to_string()
        };
        println!("{name:<40} {:<60} {}", info.shape, info.doc);
    }
    Ok(())
}

/// The points `dir`'s model (under `overlay`, if any) fills on a forward of 4 tokens
/// (batch 1; an `evict` overlay: as many tokens as its observation window and decode
/// tokens plus two chunks, so that it has chunks to score; `pool` / `learned`: a window
/// plus a stride, so that two entries have closed and show their gates), grouped over
/// layers: `blocks.{0..29}.attn.hook_z  [1, 4, 9, 64]`.
fn of_model(dir: &Path, overlay: Option<&Overlay>) -> Result<()> {
    let device = phaselens::device::DeviceSpec::Cpu.device()?;
    let residency = phaselens::model::stored::Residency::default();
    let model = phaselens::model::load_model_as(dir, &device, residency, overlay)
        .with_context(|| format!("loading model {}", dir.display()))?;
    let info = model.info();
    let len = match overlay {
        Some(&Overlay::Evict {
            chunk,
            observe,
            decode,
            ..
        }) => observe + decode + 2 * chunk,
        Some(&Overlay::Pool { window, stride, .. } | &Overlay::Learned { window, stride, .. }) => {
            (window + stride).max(4)
        }
        _ => 4,
    };
    let ids: Vec<i64> = (0..len).map(|i| (i % info.vocab_size) as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, len]), &device);
    let spec = HookSpec::new().capture("**")?;
    let out = model.forward(tokens, &spec)?;
    // suffix -> (layers, shape), in first-seen order.
    let mut rows: Vec<(String, Vec<usize>, Vec<usize>)> = Vec::new();
    for (point, act) in out.cache.iter() {
        let name = point.to_string();
        let (layer, suffix) = match name.strip_prefix("blocks.").and_then(|r| r.split_once('.')) {
            Some((l, s)) => (l.parse::<usize>().ok(), s.to_string()),
            None => (None, name.clone()),
        };
        let shape = act.shape().to_vec();
        match rows
            .iter_mut()
            .find(|(s, _, sh)| *s == suffix && *sh == shape)
        {
            Some((_, layers, _)) => layers.extend(layer),
            None => rows.push((suffix, layer.into_iter().collect(), shape)),
        }
    }
    if let Some(o) = overlay {
        println!("under the overlay {o}");
    }
    println!(
        "{} ({} layers, {} heads, {} KV heads, d_head {}): {} hook points on a [1, {len}] prompt",
        info.arch,
        info.n_layers(),
        info.n_heads,
        info.n_kv_heads,
        info.d_head,
        out.cache.iter().count()
    );
    println!("{:<48} shape", "name");
    for (suffix, layers, shape) in rows {
        let name = match (layers.first(), layers.last()) {
            (Some(a), Some(b)) if a != b => format!("blocks.{{{a}..{b}}}.{suffix}"),
            (Some(a), _) => format!("blocks.{a}.{suffix}"),
            _ => suffix,
        };
        println!("{name:<48} {shape:?}");
    }
    Ok(())
}
