//! The residual streams of a DeepSeek-V4 forward, whole or in blocks of positions (see
//! `deepseek_v4::token_blocks`).

use burn::tensor::{Int, Tensor};

use crate::error::{Error, Result};
use crate::model::layers::cat_dim1;
use crate::model::placement::to;

/// The residual streams `[b, t, hc_mult, d_model]` of a forward: whole, or in blocks of
/// positions (dimension 1), in order.
pub enum Streams {
    Whole(Box<Tensor<4>>),
    Blocks(Vec<Tensor<4>>),
}

impl Streams {
    /// The streams as one tensor.
    pub fn whole(self) -> Tensor<4> {
        match self {
            Streams::Whole(x) => *x,
            Streams::Blocks(v) => cat_dim1(v),
        }
    }

    /// The streams at the flat positions `rows` (indices into `[b * t]`) ->
    /// `[1, rows, hc_mult, d_model]`.
    pub fn rows(self, rows: Tensor<1, Int>) -> Result<Tensor<4>> {
        let blocks = match self {
            Streams::Whole(x) => {
                let [b, t, n, d] = x.dims();
                let k = rows.dims()[0];
                let here = x.device();
                return Ok(x
                    .reshape([b * t, n, d])
                    .select(0, to(rows, &here))
                    .reshape([1, k, n, d]));
            }
            Streams::Blocks(v) => v,
        };
        let [b, _, n, d] = blocks[0].dims();
        let lens: Vec<usize> = blocks.iter().map(|x| x.dims()[1]).collect();
        let t: usize = lens.iter().sum();
        let wanted: Vec<i64> = rows
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| Error::Other(format!("logit rows: {e:?}")))?;
        let picked = wanted
            .iter()
            .map(|&r| {
                let r = usize::try_from(r)
                    .ok()
                    .filter(|&r| r < b * t)
                    .ok_or_else(|| {
                        Error::Input(format!("logit row {r} out of range 0..{}", b * t))
                    })?;
                let (row, mut pos) = (r / t, r % t);
                let mut j = 0;
                while pos >= lens[j] {
                    pos -= lens[j];
                    j += 1;
                }
                Ok(blocks[j]
                    .clone()
                    .slice_dim(0, row..row + 1)
                    .slice_dim(1, pos..pos + 1))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(picked, 1).reshape([1, wanted.len(), n, d]))
    }
}
