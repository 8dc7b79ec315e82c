//! One row of logits turned into log-probabilities and the few numbers
//! that perplexity and KL need from it.

use anyhow::{Result, bail};

/// Replaces a row of logits by its log-softmax, `x - ln Σ exp(x)`.
///
/// The sum runs in f64 after subtracting the maximum: 262,144 f32 terms
/// summed in f32 would lose the small ones. A non-finite logit is an
/// engine fault, so it is an error rather than a silently infinite PPL.
pub fn log_softmax_in_place(row: &mut [f32]) -> Result<()> {
    let mut max = f32::NEG_INFINITY;
    for (i, &x) in row.iter().enumerate() {
        if !x.is_finite() {
            bail!("the engine produced a non-finite logit ({x}) for token {i}");
        }
        max = max.max(x);
    }
    if row.is_empty() {
        bail!("the engine produced an empty row of logits");
    }
    let sum: f64 = row.iter().map(|&x| f64::from((x - max).exp())).sum();
    let log_sum_exp = f64::from(max) + sum.ln();
    for x in row.iter_mut() {
        *x = (f64::from(*x) - log_sum_exp) as f32;
    }
    Ok(())
}

/// The `k` largest entries of `row` as `(token, value)`, largest first;
/// equal values in token order so that two runs on equal rows agree.
/// `scratch` is reused between calls to spare a vocabulary-sized
/// allocation per row.
pub fn top_k(row: &[f32], k: usize, scratch: &mut Vec<u32>) -> Vec<(u32, f32)> {
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    let larger_first =
        |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    scratch.clear();
    scratch.extend(0..row.len() as u32);
    scratch.select_nth_unstable_by(k - 1, larger_first);
    let top = &mut scratch[..k];
    top.sort_unstable_by(larger_first);
    top.iter().map(|&id| (id, row[id as usize])).collect()
}

/// The most likely token (the lowest id among equals).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// `ln` of the probability outside `ids`, for a log-softmax `row`.
///
/// Summed directly over the tokens not in `ids` rather than as
/// `1 - Σ p(ids)`, which would cancel to noise when the top tokens hold
/// nearly all the mass. Returns `-inf` when nothing is left outside.
pub fn log_mass_outside(row: &[f32], ids: &[u32]) -> f32 {
    let mut excluded: Vec<u32> = ids.to_vec();
    excluded.sort_unstable();
    let mut next_excluded = excluded.iter().peekable();
    let mut sum = 0.0f64;
    for (i, &lp) in row.iter().enumerate() {
        // `excluded` is sorted, so one pointer walks it beside `i`.
        while next_excluded.next_if(|&&e| (e as usize) < i).is_some() {}
        if next_excluded.next_if(|&&e| e as usize == i).is_some() {
            continue;
        }
        sum += f64::from(lp.exp());
    }
    sum.ln() as f32
}
