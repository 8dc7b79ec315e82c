//! Applying a token mask to logits before sampling.

use toktrie::SimpleVob;

/// Sets the logit of every token the mask does not allow to -inf, so that
/// any sampler (greedy included) can only pick an allowed one. Logits past
/// the mask's end (a model whose output rows outnumber the tokenizer's
/// vocabulary) are disallowed too.
pub fn mask_logits(logits: &mut [f32], allowed: &SimpleVob) {
    let words = allowed.as_slice();
    for (chunk_index, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(chunk_index).copied().unwrap_or(0);
        // Most words of a mask are all-off (or, inside a JSON string,
        // all-on): one fill instead of 32 tests keeps this ~4x quicker.
        if bits == 0 {
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        if bits == u32::MAX && chunk.len() == 32 {
            continue;
        }
        for (bit, logit) in chunk.iter_mut().enumerate() {
            let id = chunk_index * 32 + bit;
            if bits & (1 << bit) == 0 || id >= allowed.len() {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_allowed_ids_keep_their_logits() {
        let mut allowed = SimpleVob::alloc(70);
        for id in [0, 33, 69] {
            allowed.allow_token(id);
        }
        let mut logits: Vec<f32> = (0..75).map(|i| i as f32).collect();
        mask_logits(&mut logits, &allowed);
        for (id, &l) in logits.iter().enumerate() {
            if [0, 33, 69].contains(&id) {
                assert_eq!(l, id as f32);
            } else {
                assert_eq!(l, f32::NEG_INFINITY, "id {id}");
            }
        }
    }

    #[test]
    fn full_words_are_left_alone() {
        let allowed = SimpleVob::alloc_ones(64);
        let mut logits = vec![1.5f32; 64];
        mask_logits(&mut logits, &allowed);
        assert!(logits.iter().all(|&l| l == 1.5));
    }
}
