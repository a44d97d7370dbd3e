//! Greedy decoding: the argmax continuation of a prompt, one token at a time.
//!
//! Each step runs the model over the whole sequence so far and reads the LM head at the
//! last position only ([`LanguageModel::forward_logit_rows`]): O(n^2) in the length,
//! and for the lengths it serves (prompts of a few hundred tokens, 64 new tokens) the
//! same tokens as a cached decoder, since every model here is causal (the contract
//! tests check that earlier positions never depend on later ones, and that a suffix
//! forward over a base run's keys and values equals the full forward).

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::LanguageModel;
use crate::error::{Error, Result};

/// Up to `max_new` greedy tokens after `prompt` (batch of one), stopping after `eos`
/// when given. Ties go to the lower id (burn's argmax).
pub fn greedy(
    model: &dyn LanguageModel,
    prompt: &[u32],
    max_new: usize,
    eos: Option<u32>,
    device: &Device,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(Error::Input(
            "greedy decoding needs a prompt of at least one token".into(),
        ));
    }
    let mut ids: Vec<i64> = prompt.iter().map(|&i| i as i64).collect();
    let mut new = Vec::with_capacity(max_new);
    for _ in 0..max_new {
        let t = ids.len();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [1, t]), device);
        let last = Tensor::<1, Int>::from_data(TensorData::new(vec![t as i64 - 1], [1]), device);
        let next = model
            .forward_logit_rows(tokens, last)?
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| Error::Other(format!("reading the argmax back: {e:?}")))?[0];
        new.push(next as u32);
        ids.push(next);
        if eos == Some(next as u32) {
            break;
        }
    }
    Ok(new)
}
