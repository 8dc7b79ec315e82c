//! Plain-Rust f32 building blocks of the forward pass. They are the oracle
//! the JIT kernels are tested against, so they favour clarity; the dot
//! product keeps eight partial sums only so that LLVM can vectorize it.

/// Σ a[i]·b[i] in f32.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (a8, a_tail) = a.split_at(a.len() / 8 * 8);
    let (b8, b_tail) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (x, y) in a_tail.iter().zip(b_tail) {
        sum += x * y;
    }
    sum
}

/// out[r] = W[r,:]·x for a row-major `[rows, x.len()]` matrix.
pub fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    debug_assert_eq!(w.len(), out.len() * cols);
    for (o, row) in out.iter_mut().zip(w.chunks_exact(cols)) {
        *o = dot(row, x);
    }
}

/// RMSNorm with `weight` already the final multiplier:
/// x / sqrt(mean(x²) + eps) · weight.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

/// In-place RMSNorm.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let mean_sq = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = *v * inv * w;
    }
}

/// RMS normalisation without a weight (Gemma 4's V norm and router
/// input): x / sqrt(mean(x²) + eps).
pub fn rms_normalize(x: &mut [f32], eps: f32) {
    let mean_sq = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Gemma 4's per-layer inputs of one token, in place: `projected` holds
/// the projection of its scaled embedding (`[layers x P]`), `token_row`
/// its row of the per-layer table. Each layer's part becomes
/// `(norm(projected * hidden^-1/2) + token_row * sqrt(P)) * 2^-1/2`.
pub fn combine_per_layer_inputs(
    projected: &mut [f32],
    token_row: &[f32],
    norm: &[f32],
    hidden: usize,
    eps: f32,
) {
    let p = norm.len();
    let inv_sqrt_hidden = (hidden as f32).powf(-0.5);
    let token_scale = (p as f32).sqrt();
    for (part, tok) in projected.chunks_exact_mut(p).zip(token_row.chunks_exact(p)) {
        part.iter_mut().for_each(|v| *v *= inv_sqrt_hidden);
        rms_norm_in_place(part, norm, eps);
        for (v, &t) in part.iter_mut().zip(tok) {
            *v = (*v + t * token_scale) * std::f32::consts::FRAC_1_SQRT_2;
        }
    }
}

/// The experts Gemma 4's router sends the residual `x` to, with their
/// weights: `router` (`[experts, hidden]`, row-major) applied to
/// `rms(x) * input_scale`, then [`route_experts`].
pub fn route_token(
    router: &[f32],
    input_scale: &[f32],
    expert_scale: &[f32],
    x: &[f32],
    top_k: usize,
    eps: f32,
) -> Vec<(usize, f32)> {
    let input = router_input(x, input_scale, eps);
    let mut logits = vec![0.0; expert_scale.len()];
    matvec(router, &input, &mut logits);
    route_experts(&logits, top_k, expert_scale)
}

/// What Gemma 4's router multiplies: `rms(x) * input_scale`.
pub fn router_input(x: &[f32], input_scale: &[f32], eps: f32) -> Vec<f32> {
    let mut input = x.to_vec();
    rms_normalize(&mut input, eps);
    for (v, s) in input.iter_mut().zip(input_scale) {
        *v *= s;
    }
    input
}

/// The experts a router sends a token to, with their weights: the
/// softmax of `logits`, its `top_k` largest (the lower index first on
/// ties), renormalised to sum to 1, each times its expert's scale.
pub fn route_experts(logits: &[f32], top_k: usize, expert_scale: &[f32]) -> Vec<(usize, f32)> {
    let mut probs = logits.to_vec();
    softmax(&mut probs);
    let mut order: Vec<usize> = (0..probs.len()).collect();
    // A stable sort keeps equal probabilities in index order.
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    order.truncate(top_k);
    let total: f32 = order.iter().map(|&e| probs[e]).sum();
    order
        .into_iter()
        .map(|e| (e, probs[e] / total * expert_scale[e]))
        .collect()
}

/// Gemma 3n's AltUp router on one stream `v`: `tanh(router · (rms(v) ⊙
/// input_scale))`, one weight per stream (`router` is `[streams, hidden]`
/// row-major; `input_scale` holds the router norm times `1 / hidden`).
pub fn altup_route(router: &[f32], input_scale: &[f32], v: &[f32], eps: f32) -> Vec<f32> {
    let mut input = vec![0.0; v.len()];
    rms_norm(v, input_scale, eps, &mut input);
    let mut m = vec![0.0; router.len() / v.len()];
    matvec(router, &input, &mut m);
    m.iter_mut().for_each(|w| *w = w.tanh());
    m
}

/// AltUp's prediction, in place on one token's streams (`[streams][hidden]`):
/// stream j becomes `s_j + Σ_k C[j,k] s_k`, where `C` (`[streams,
/// streams]`, row-major) is the prediction coefficients `predict`
/// (`[streams², streams]`) applied to the router's weights `m`.
pub fn altup_predict(streams: &mut [f32], hidden: usize, predict: &[f32], m: &[f32]) {
    let n = m.len();
    let mut coefs = vec![0.0; n * n];
    matvec(predict, m, &mut coefs);
    let old = streams.to_vec();
    for (j, out) in streams.chunks_exact_mut(hidden).enumerate() {
        for (k, s) in old.chunks_exact(hidden).enumerate() {
            let c = coefs[j * n + k];
            for (o, &v) in out.iter_mut().zip(s) {
                *o += c * v;
            }
        }
    }
}

/// AltUp's correction, in place on one token's predicted streams: with
/// `x` what the layer made of the active stream's prediction, stream j
/// gains `(correct · m + 1)_j · (x - prediction_active)` (`correct` is
/// `[streams, streams]`, `m` the router's weights for `x`).
pub fn altup_correct(
    streams: &mut [f32],
    hidden: usize,
    correct: &[f32],
    m: &[f32],
    x: &[f32],
    active: usize,
) {
    let mut coefs = vec![0.0; m.len()];
    matvec(correct, m, &mut coefs);
    let innovation: Vec<f32> = x
        .iter()
        .zip(&streams[active * hidden..(active + 1) * hidden])
        .map(|(x, p)| x - p)
        .collect();
    for (s, c) in streams.chunks_exact_mut(hidden).zip(&coefs) {
        let c = c + 1.0;
        for (v, d) in s.iter_mut().zip(&innovation) {
            *v += c * d;
        }
    }
}

/// The root mean square of `x`, without an epsilon.
pub fn rms(x: &[f32]) -> f32 {
    (dot(x, x) / x.len() as f32).sqrt()
}

/// Rescales `y` in place to the root mean square `target` (AltUp's
/// streams beside stream 0): `y · target / sqrt(max(mean(y²), 1e-5))`.
pub fn match_rms(y: &mut [f32], target: f32) {
    let mean_sq = (dot(y, y) / y.len() as f32).max(1e-5);
    let scale = target / mean_sq.sqrt();
    y.iter_mut().for_each(|v| *v *= scale);
}

/// Gemma 3n's activation sparsity on one token's gate pre-activations:
/// `relu(g - (mean(g) + cut · std(g)))`, the population statistics over
/// the row (the mean and variance summed in f64, in eight partial sums so
/// that the additions need not wait for each other).
pub fn gaussian_top_k(g: &mut [f32], cut: f32) {
    fn sum_f64(g: &[f32], term: impl Fn(f32) -> f64) -> f64 {
        let mut acc = [0.0f64; 8];
        let whole = g.len() / 8 * 8;
        for chunk in g[..whole].chunks_exact(8) {
            for (a, &v) in acc.iter_mut().zip(chunk) {
                *a += term(v);
            }
        }
        acc.iter().sum::<f64>() + g[whole..].iter().map(|&v| term(v)).sum::<f64>()
    }
    let n = g.len() as f64;
    let mean = sum_f64(g, f64::from) / n;
    let var = sum_f64(g, |v| (f64::from(v) - mean).powi(2)) / n;
    let cutoff = (mean + var.sqrt() * f64::from(cut)) as f32;
    g.iter_mut().for_each(|v| *v = (*v - cutoff).max(0.0));
}

/// Gemma 3n's residual after attention with LAuReL beside it:
/// `x = (x + attn + laurel) / √2`.
pub fn laurel_residual(x: &mut [f32], attn: &[f32], laurel: &[f32]) {
    for ((v, a), l) in x.iter_mut().zip(attn).zip(laurel) {
        *v = (*v + a + l) * std::f32::consts::FRAC_1_SQRT_2;
    }
}

/// GELU, tanh approximation (what Gemma was trained with, whatever its
/// config calls it).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// cap · tanh(x / cap).
pub fn softcap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// RoPE angles for one position: cos and sin of `pos / scale · base^(-2i/d)`
/// for i in 0..d/2, computed in f32 the way the HF reference does.
pub fn rope_angles(pos: usize, head_dim: usize, base: f32, scale: f32) -> (Vec<f32>, Vec<f32>) {
    rope_angles_partial(pos, head_dim, base, scale, head_dim / 2)
}

/// [`rope_angles`] where only the first `rotated` pairs turn (frequencies
/// still over the whole head, as Gemma 4's proportional RoPE has them);
/// the others get angle 0, so they pass through unchanged.
pub fn rope_angles_partial(
    pos: usize,
    head_dim: usize,
    base: f32,
    scale: f32,
    rotated: usize,
) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = vec![1.0; half];
    let mut sin = vec![0.0; half];
    for i in 0..rotated.min(half) {
        let inv_freq = 1.0 / base.powf((2 * i) as f32 / head_dim as f32) / scale;
        let angle = pos as f32 * inv_freq;
        cos[i] = angle.cos();
        sin[i] = angle.sin();
    }
    (cos, sin)
}

/// Split-half RoPE on one head: element i pairs with element i + d/2.
pub fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (lo, hi) = head.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (lo[i], hi[i]);
        lo[i] = a * cos[i] - b * sin[i];
        hi[i] = b * cos[i] + a * sin[i];
    }
}

/// Index of the largest value (the lowest index on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}
