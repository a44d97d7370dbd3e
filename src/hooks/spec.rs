//! What a forward pass should capture and how it should intervene.
//!
//! A [`HookSpec`] is built once and passed to `forward`; the model calls
//! [`HookRun::apply`] at every hook point. An empty spec returns the tensor untouched
//! without formatting a name or allocating (`phaselens bench forward` measures that
//! dispatch per hook point, `src/cli/bench.rs`).

use std::sync::Arc;

use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::cache::{Act, ActivationCache};
use super::point::{HookPoint, PointPattern};
use crate::error::{Error, Result};

/// What an intervention does to the activation at its point.
#[derive(Debug, Clone)]
pub enum Action {
    /// Set to zero.
    Zero,
    /// Replace with a mean activation, broadcast to the point's shape (size-1 axes
    /// broadcast): e.g. `[1, pos, head, d_head]` per-position means.
    Mean(Act),
    /// Replace with an explicit tensor of the same (or broadcastable) shape.
    Replace(Act),
    /// Replace with the activation at the same point in another run's cache
    /// (activation patching).
    Patch(Arc<ActivationCache>),
    /// Replace batch row `i` with row `perm[i]` of another run's activation at the same
    /// point (resample ablation).
    Resample {
        /// The other run's cache.
        source: Arc<ActivationCache>,
        /// The source row of each batch row.
        perm: Vec<usize>,
    },
    /// Multiply by a factor.
    Scale(f32),
    /// Add a (broadcastable) tensor, e.g. a steering vector.
    Add(Act),
    /// Roll the activation by `shift` along `axis` (wrapping), e.g. shifting compressor
    /// gates across offsets (gate cycling: axis 2 of `hook_key_gate`).
    Roll {
        /// The axis.
        axis: usize,
        /// Positions to roll by, as `torch.roll` (element `i` moves to `i + shift`).
        shift: i64,
    },
}

/// Where, inside the point's tensor, an intervention applies. `None` = everywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// Batch rows.
    pub batch: Option<Vec<usize>>,
    /// Heads along the point's head axis (query or KV heads, see `Site::info`).
    pub heads: Option<Vec<usize>>,
    /// Positions along the point's position axis (tokens, or compressed entries).
    pub positions: Option<Vec<usize>>,
    /// Per batch row, its own heads and positions ([`Scope::rows`]); rows not listed
    /// are untouched. Not combined with the three fields above.
    pub rows: Option<Vec<RowScope>>,
}

/// One batch row of a per-row [`Scope`]: `None` = every head / position of the row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowScope {
    /// The batch row.
    pub row: usize,
    /// Heads of the row (along the point's head axis: query or KV heads).
    pub heads: Option<Vec<usize>>,
    /// Positions of the row along the point's position axis.
    pub positions: Option<Vec<usize>>,
}

impl Scope {
    /// Everywhere.
    pub fn all() -> Self {
        Self::default()
    }
    /// Only these heads.
    pub fn heads(heads: impl Into<Vec<usize>>) -> Self {
        Scope {
            heads: Some(heads.into()),
            ..Self::default()
        }
    }
    /// Each listed batch row with its own heads and positions (e.g. batched patching,
    /// where every row patches another head at its own answer position).
    pub fn rows(rows: Vec<RowScope>) -> Self {
        Scope {
            rows: Some(rows),
            ..Self::default()
        }
    }
    /// Restrict to batch rows.
    pub fn with_batch(mut self, rows: impl Into<Vec<usize>>) -> Self {
        self.batch = Some(rows.into());
        self
    }
    /// Restrict to positions.
    pub fn with_positions(mut self, pos: impl Into<Vec<usize>>) -> Self {
        self.positions = Some(pos.into());
        self
    }
    /// Restrict to heads.
    pub fn with_heads(mut self, heads: impl Into<Vec<usize>>) -> Self {
        self.heads = Some(heads.into());
        self
    }
    fn is_all(&self) -> bool {
        self.batch.is_none()
            && self.heads.is_none()
            && self.positions.is_none()
            && self.rows.is_none()
    }
}

/// One intervention: a target (name or glob), an action and a scope.
#[derive(Debug, Clone)]
pub struct Intervention {
    /// The hook point(s): a name or a glob (`blocks.*.attn.hook_z`).
    pub target: PointPattern,
    /// What to do there.
    pub action: Action,
    /// Where along the batch, head and position axes.
    pub scope: Scope,
}

/// Captures and interventions for one forward pass.
#[derive(Debug, Clone, Default)]
pub struct HookSpec {
    captures: Vec<PointPattern>,
    interventions: Vec<Intervention>,
    window: Option<std::ops::Range<usize>>,
}

impl HookSpec {
    /// Capture nothing, change nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also capture every point matching `pattern` (a name or a glob).
    pub fn capture(mut self, pattern: &str) -> Result<Self> {
        self.captures.push(PointPattern::new(pattern)?);
        Ok(self)
    }

    /// Also capture one point.
    pub fn capture_point(mut self, point: HookPoint) -> Self {
        self.captures
            .push(PointPattern::new(&point.to_string()).expect("a HookPoint's name is valid"));
        self
    }

    /// Also capture every site of `sites` at every layer of `layers`.
    pub fn capture_sites(
        mut self,
        layers: impl IntoIterator<Item = usize>,
        sites: &[super::point::Site],
    ) -> Self {
        for l in layers {
            for &s in sites {
                self = self.capture_point(HookPoint::block(l, s));
            }
        }
        self
    }

    /// Captures of per-token points (the residual stream, q / k / v / z, per-head
    /// results, sublayer outputs: `[batch, pos, ...]`) keep only token positions
    /// `positions` (`[batch, positions.len(), ...]`, a copy: the forward's full
    /// activation is freed as usual). Other points are captured whole. Interventions
    /// are unaffected. The patching runner's base run uses it when every cell runs as a
    /// suffix forward, which reads the base run at those positions only.
    pub fn capture_window(mut self, positions: std::ops::Range<usize>) -> Self {
        self.window = Some(positions);
        self
    }

    /// What a capture of `point` stores: `x`, or its window of positions (per-token
    /// points, [`capture_window`](Self::capture_window)).
    fn kept<const D: usize>(&self, point: &HookPoint, x: Tensor<D>) -> Result<Act> {
        let info = point.site.info();
        match &self.window {
            Some(w) if info.per_token && info.pos_axis == Some(1) && D >= 2 => {
                let t = x.dims()[1];
                if w.start >= w.end || w.end > t {
                    return Err(Error::hook(
                        point.to_string(),
                        format!(
                            "capture window {}..{} is not within the {t} positions of the activation",
                            w.start, w.end
                        ),
                    ));
                }
                // `select` copies: a narrowed view would keep the whole buffer alive.
                let idx = Tensor::<1, Int>::arange(w.start as i64..w.end as i64, &x.device());
                Ok(Act::new(x.select(1, idx)))
            }
            _ => Ok(Act::new(x)),
        }
    }

    /// Add an intervention on every point matching `target`.
    pub fn intervene(mut self, target: &str, action: Action, scope: Scope) -> Result<Self> {
        self.interventions.push(Intervention {
            target: PointPattern::new(target)?,
            action,
            scope,
        });
        Ok(self)
    }

    /// Add an intervention on one point.
    pub fn intervene_point(mut self, point: HookPoint, action: Action, scope: Scope) -> Self {
        self.interventions.push(Intervention {
            target: PointPattern::new(&point.to_string()).expect("a HookPoint's name is valid"),
            action,
            scope,
        });
        self
    }

    /// Whether the spec does nothing.
    pub fn is_empty(&self) -> bool {
        self.captures.is_empty() && self.interventions.is_empty()
    }

    /// The capture patterns.
    pub fn captures(&self) -> &[PointPattern] {
        &self.captures
    }

    /// The interventions.
    pub fn interventions(&self) -> &[Intervention] {
        &self.interventions
    }

    /// Whether `point` is captured.
    pub fn captures_point(&self, point: &HookPoint) -> bool {
        self.captures.iter().any(|p| p.matches_point(point))
    }

    /// Whether `point` is captured or intervened on: models compute optional
    /// activations (e.g. `hook_result`) only when this is true.
    pub fn touches(&self, point: &HookPoint) -> bool {
        !self.is_empty()
            && (self.captures_point(point)
                || self
                    .interventions
                    .iter()
                    .any(|i| i.target.matches_point(point)))
    }

    /// Start a forward pass with this spec.
    pub fn run(&self) -> HookRun<'_> {
        HookRun {
            spec: self,
            cache: ActivationCache::new(),
        }
    }
}

/// The per-forward state: the spec and the cache being filled.
#[derive(Debug)]
pub struct HookRun<'a> {
    spec: &'a HookSpec,
    cache: ActivationCache,
}

impl<'a> HookRun<'a> {
    /// The spec.
    pub fn spec(&self) -> &'a HookSpec {
        self.spec
    }

    /// Whether `point` is captured or intervened on.
    pub fn touches(&self, point: &HookPoint) -> bool {
        self.spec.touches(point)
    }

    /// Apply the interventions that target `point` (in the order they were added), then
    /// capture the result if asked. Returns the (possibly changed) activation.
    pub fn apply<const D: usize>(&mut self, point: HookPoint, x: Tensor<D>) -> Result<Tensor<D>> {
        if self.spec.is_empty() {
            return Ok(x);
        }
        let mut x = x;
        for iv in &self.spec.interventions {
            if iv.target.matches_point(&point) {
                x = intervene(&point, x, iv)?;
            }
        }
        if self.spec.captures_point(&point) {
            let act = self.spec.kept(&point, x.clone())?;
            self.cache.insert(point, act);
        }
        Ok(x)
    }

    /// [`HookRun::apply`] for a boolean choice (the kept blocks, chunks or entries of a
    /// selection): seen by interventions and captures as 1.0 (chosen) / 0.0, read back
    /// as chosen where the result is above 0.5, then restricted to `allowed` when given
    /// (an intervention cannot choose what the rule never could). Untouched points pass
    /// `mask` through as it is.
    pub fn apply_mask<const D: usize>(
        &mut self,
        point: HookPoint,
        mask: Tensor<D, Bool>,
        allowed: Option<Tensor<D, Bool>>,
    ) -> Result<Tensor<D, Bool>> {
        if !self.touches(&point) {
            return Ok(mask);
        }
        let chosen = self.apply(point, mask.float())?.greater_elem(0.5);
        Ok(match allowed {
            Some(a) => chosen.bool_and(a),
            None => chosen,
        })
    }

    /// Record an activation that the forward pass does not use further (e.g. indexer
    /// top-k choices), if it is captured.
    pub fn record<const D: usize>(&mut self, point: HookPoint, x: impl FnOnce() -> Tensor<D>) {
        if !self.spec.is_empty() && self.spec.captures_point(&point) {
            // Recorded points (indexer choices, router top-k) are not per-token stream
            // points, so no window applies; were one refused, the capture would be
            // missing, which its reader reports.
            if let Ok(act) = self.spec.kept(&point, x()) {
                self.cache.insert(point, act);
            }
        }
    }

    /// Take the cache filled so far.
    pub fn finish(&mut self) -> ActivationCache {
        std::mem::take(&mut self.cache)
    }
}

fn broadcast_to<const D: usize>(
    point: &HookPoint,
    src: &Act,
    dims: [usize; D],
    device: &burn::tensor::Device,
) -> Result<Tensor<D>> {
    let t = src
        .get::<D>()
        .map_err(|e| e.context(format!("hook `{point}`")))?;
    // A source captured on another device (a model placed over several devices
    // returns its captures on the home device) moves to the activation's.
    let t = if t.device() == *device {
        t
    } else {
        t.to_device(device)
    };
    let sd = t.dims();
    if sd == dims {
        return Ok(t);
    }
    if sd.iter().zip(dims.iter()).all(|(s, d)| s == d || *s == 1) {
        return Ok(t.expand(dims));
    }
    Err(Error::hook(
        point.to_string(),
        format!("source activation of shape {sd:?} does not fit the point's shape {dims:?}"),
    ))
}

fn source_at<'c>(point: &HookPoint, cache: &'c ActivationCache) -> Result<&'c Act> {
    cache.get(point).ok_or_else(|| {
        Error::hook(
            point.to_string(),
            "the source cache has no activation at this point (capture it in the source run)",
        )
    })
}

fn intervene<const D: usize>(
    point: &HookPoint,
    x: Tensor<D>,
    iv: &Intervention,
) -> Result<Tensor<D>> {
    let dims = x.dims();
    let device = x.device();
    let new = match &iv.action {
        Action::Zero => x.zeros_like(),
        Action::Mean(a) | Action::Replace(a) => broadcast_to(point, a, dims, &device)?,
        Action::Patch(cache) => broadcast_to(point, source_at(point, cache)?, dims, &device)?,
        Action::Resample { source, perm } => {
            if perm.len() != dims[0] {
                return Err(Error::hook(
                    point.to_string(),
                    format!(
                        "resample permutation has {} rows, batch has {}",
                        perm.len(),
                        dims[0]
                    ),
                ));
            }
            let picked = source_at(point, source)?.select_batch(perm)?;
            broadcast_to(point, &picked, dims, &device)?
        }
        Action::Scale(s) => x.clone().mul_scalar(*s),
        Action::Add(a) => x.clone() + broadcast_to(point, a, dims, &device)?,
        Action::Roll { axis, shift } => {
            if *axis >= D {
                return Err(Error::hook(
                    point.to_string(),
                    format!("roll axis {axis} out of range for rank {D}"),
                ));
            }
            x.clone().roll_dim(*shift, *axis)
        }
    };
    if iv.scope.is_all() {
        return Ok(new);
    }
    let mask = scope_mask(point, &iv.scope, dims, &x.device())?;
    Ok(x.mask_where(mask, new))
}

/// A boolean mask, true where the scope applies, broadcast to `dims`.
fn scope_mask<const D: usize>(
    point: &HookPoint,
    scope: &Scope,
    dims: [usize; D],
    device: &burn::tensor::Device,
) -> Result<Tensor<D, Bool>> {
    if let Some(rows) = &scope.rows {
        if scope.batch.is_some() || scope.heads.is_some() || scope.positions.is_some() {
            return Err(Error::hook(
                point.to_string(),
                "a per-row scope cannot be combined with batch, head or position scopes",
            ));
        }
        return row_scope_mask(point, rows, dims, device);
    }
    let axes = scoped_axes(point, scope)?;
    let mshape = mask_shape(point, &axes, dims)?;
    // Per-axis membership, then the outer product over the mask's shape.
    let mut member: Vec<Vec<bool>> = mshape.iter().map(|&n| vec![true; n]).collect();
    for (axis, idx) in &axes {
        let mut m = vec![false; dims[*axis]];
        for &i in idx.iter() {
            m[i] = true;
        }
        // Two scopes on the same axis (not possible today) would intersect.
        for (a, b) in member[*axis].iter_mut().zip(m) {
            *a = *a && b;
        }
    }
    let total: usize = mshape.iter().product();
    let mut values = vec![false; total];
    let mut idx = [0usize; D];
    for v in values.iter_mut() {
        *v = (0..D).all(|a| member[a][idx[a]]);
        for a in (0..D).rev() {
            idx[a] += 1;
            if idx[a] < mshape[a] {
                break;
            }
            idx[a] = 0;
        }
    }
    let mask = Tensor::<D, Bool>::from_data(TensorData::new(values, mshape), device);
    Ok(mask.expand(dims))
}

/// The axes a (non-row) scope restricts, with the indices it keeps there: batch (axis
/// 0), then the point's head and position axes; an error when the point lacks one.
fn scoped_axes<'s>(point: &HookPoint, scope: &'s Scope) -> Result<Vec<(usize, &'s Vec<usize>)>> {
    let info = point.site.info();
    let mut axes: Vec<(usize, &Vec<usize>)> = Vec::new();
    if let Some(rows) = &scope.batch {
        axes.push((0, rows));
    }
    if let Some(heads) = &scope.heads {
        let (axis, _) = info.head_axis.ok_or_else(|| {
            Error::hook(
                point.to_string(),
                "this point has no head axis; drop the head scope",
            )
        })?;
        axes.push((axis, heads));
    }
    if let Some(pos) = &scope.positions {
        let axis = info
            .pos_axis
            .ok_or_else(|| Error::hook(point.to_string(), "this point has no position axis"))?;
        axes.push((axis, pos));
    }
    Ok(axes)
}

/// The mask's shape: `dims` on the scoped `axes`, 1 elsewhere; an axis or index out of
/// range is an error.
fn mask_shape<const D: usize>(
    point: &HookPoint,
    axes: &[(usize, &Vec<usize>)],
    dims: [usize; D],
) -> Result<[usize; D]> {
    let pos_axis = point.site.info().pos_axis;
    let mut mshape = [1usize; D];
    for (axis, idx) in axes {
        if *axis >= D {
            return Err(Error::hook(
                point.to_string(),
                format!("axis {axis} out of range for rank {D}"),
            ));
        }
        let n = dims[*axis];
        if let Some(bad) = idx.iter().find(|&&i| i >= n) {
            let what = match axis {
                0 => "batch row",
                a if Some(*a) == pos_axis => "position",
                _ => "head",
            };
            return Err(Error::hook(
                point.to_string(),
                format!("{what} {bad} out of range 0..{n}"),
            ));
        }
        mshape[*axis] = n;
    }
    Ok(mshape)
}

/// The mask of a per-row scope: `[rows, pos?, head?]` over the point's batch, position
/// and head axes (size 1 where no row restricts that axis), broadcast to `dims`.
fn row_scope_mask<const D: usize>(
    point: &HookPoint,
    rows: &[RowScope],
    dims: [usize; D],
    device: &burn::tensor::Device,
) -> Result<Tensor<D, Bool>> {
    let info = point.site.info();
    let bad = |msg: String| Error::hook(point.to_string(), msg);
    let mut mshape = [1usize; D];
    mshape[0] = dims[0];
    let head_axis = info.head_axis.map(|(a, _)| a).filter(|&a| a < D);
    let pos_axis = info.pos_axis.filter(|&a| a < D);
    if rows.iter().any(|r| r.heads.is_some()) {
        let a = head_axis
            .ok_or_else(|| bad("this point has no head axis; drop the head scope".into()))?;
        mshape[a] = dims[a];
    }
    if rows.iter().any(|r| r.positions.is_some()) {
        let a = pos_axis.ok_or_else(|| bad("this point has no position axis".into()))?;
        mshape[a] = dims[a];
    }
    // The indices of one row along an axis: its own list, else the whole (mask) axis.
    let along = |sel: &Option<Vec<usize>>, axis: Option<usize>, what: &str| -> Result<Vec<usize>> {
        match (sel, axis) {
            (Some(v), Some(a)) => match v.iter().find(|&&i| i >= dims[a]) {
                Some(i) => Err(bad(format!("{what} {i} out of range 0..{}", dims[a]))),
                None => Ok(v.clone()),
            },
            (_, Some(a)) => Ok((0..mshape[a]).collect()),
            (_, None) => Ok(vec![0]),
        }
    };
    let mut strides = [0usize; D];
    let mut total = 1;
    for a in (0..D).rev() {
        strides[a] = total;
        total *= mshape[a];
    }
    let mut values = vec![false; total];
    for r in rows {
        if r.row >= dims[0] {
            return Err(bad(format!(
                "batch row {} out of range 0..{}",
                r.row, dims[0]
            )));
        }
        let positions = along(&r.positions, pos_axis, "position")?;
        let heads = along(&r.heads, head_axis, "head")?;
        for &p in &positions {
            for &h in &heads {
                let mut i = r.row * strides[0];
                if let Some(a) = pos_axis {
                    i += p * strides[a];
                }
                if let Some(a) = head_axis {
                    i += h * strides[a];
                }
                values[i] = true;
            }
        }
    }
    let mask = Tensor::<D, Bool>::from_data(TensorData::new(values, mshape), device);
    Ok(mask.expand(dims))
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::hooks::Site;
    use burn::tensor::Device;

    fn zeroed(point: HookPoint, scope: Scope, dims: [usize; 4]) -> Result<Vec<f32>> {
        let x = Tensor::<4>::ones(dims, &Device::flex());
        let spec = HookSpec::new().intervene_point(point, Action::Zero, scope);
        let y = spec.run().apply(point, x)?;
        Ok(y.into_data().try_into_vec::<f32>().unwrap())
    }

    #[test]
    fn a_per_row_scope_touches_exactly_its_rows_heads_and_positions() {
        let z = HookPoint::block(0, Site::AttnZ); // [batch, pos, head, d_head]
        let scope = Scope::rows(vec![
            RowScope {
                row: 0,
                heads: Some(vec![1]),
                positions: Some(vec![2, 4]),
            },
            RowScope {
                row: 2,
                heads: None,
                positions: Some(vec![0]),
            },
        ]);
        let v = zeroed(z, scope, [3, 5, 2, 4]).unwrap();
        let mut i = 0;
        for b in 0..3 {
            for p in 0..5 {
                for h in 0..2 {
                    for _ in 0..4 {
                        let hit = (b == 0 && h == 1 && (p == 2 || p == 4)) || (b == 2 && p == 0);
                        assert_eq!(v[i], if hit { 0.0 } else { 1.0 }, "b {b} p {p} h {h}");
                        i += 1;
                    }
                }
            }
        }
        // A row with no restriction at all: the whole row.
        let v = zeroed(
            z,
            Scope::rows(vec![RowScope {
                row: 1,
                ..RowScope::default()
            }]),
            [2, 3, 2, 2],
        )
        .unwrap();
        assert!(
            v[..12].iter().all(|&x| x == 1.0) && v[12..].iter().all(|&x| x == 0.0),
            "{v:?}"
        );
    }

    #[test]
    fn per_row_scopes_name_what_is_wrong() {
        let z = HookPoint::block(0, Site::AttnZ);
        let err = |p: HookPoint, s: Scope| zeroed(p, s, [2, 3, 2, 2]).unwrap_err().to_string();
        let row = |row, heads: Option<Vec<usize>>, positions: Option<Vec<usize>>| RowScope {
            row,
            heads,
            positions,
        };
        assert!(
            err(z, Scope::rows(vec![row(2, None, None)])).contains("batch row 2 out of range 0..2")
        );
        assert!(
            err(z, Scope::rows(vec![row(0, Some(vec![5]), None)]))
                .contains("head 5 out of range 0..2")
        );
        assert!(
            err(z, Scope::rows(vec![row(0, None, Some(vec![3]))]))
                .contains("position 3 out of range 0..3")
        );
        let combined = Scope {
            heads: Some(vec![0]),
            ..Scope::rows(vec![row(0, None, None)])
        };
        assert!(err(z, combined).contains("cannot be combined"));
        let resid = HookPoint::block(0, Site::ResidPre); // [batch, pos, d_model]: no head axis
        let x = Tensor::<3>::ones([2, 3, 4], &Device::flex());
        let spec = HookSpec::new().intervene_point(
            resid,
            Action::Zero,
            Scope::rows(vec![row(0, Some(vec![0]), None)]),
        );
        let e = spec.run().apply(resid, x).unwrap_err().to_string();
        assert!(e.contains("no head axis"), "{e}");
    }
}
