//! Choosing the next token from logits.
//!
//! The pipeline, in order: repetition penalty → top-k → softmax at the
//! temperature → top-p → min-p → a seeded random draw. Temperature 0 means
//! greedy (argmax, ties to the lowest id).
//!
//! Reproducibility: the random generator is implemented here (xoshiro256**
//! seeded through splitmix64), and every filter is defined by a total order
//! (logit descending, then id ascending), so a seed gives the same tokens
//! whatever the Rust or crate versions — no result depends on how an
//! unstable sort or selection happens to arrange equal elements.

use anyhow::{Result, bail};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Sampling settings. Each filter has a value that turns it off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches
    /// this; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one; 0 = off.
    pub min_p: f32,
    /// Divide positive / multiply negative logits of recent tokens; 1 = off.
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalty looks at.
    pub repeat_last_n: usize,
}

impl Default for SamplerConfig {
    /// Common defaults for chat-style generation (llama.cpp's values).
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
        }
    }
}

impl SamplerConfig {
    /// Deterministic argmax decoding with every filter off.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
        }
    }

    /// Refuses settings that have no meaning, naming the setting and its range.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!(
                "temperature must be a number >= 0 (0 = greedy), got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top-p must be in (0, 1] (1 = off), got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min-p must be in [0, 1] (0 = off), got {}", self.min_p);
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            bail!(
                "repeat penalty must be a number > 0 (1 = off), got {}",
                self.repeat_penalty
            );
        }
        Ok(())
    }
}

/// xoshiro256** (Blackman & Vigna), seeded by splitmix64: small, fast, and
/// fixed forever because it lives here rather than in a dependency.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut st = seed;
        // splitmix64 never yields four zero words, the one state xoshiro cannot leave.
        Rng {
            s: [
                splitmix64(&mut st),
                splitmix64(&mut st),
                splitmix64(&mut st),
                splitmix64(&mut st),
            ],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[derive(Clone, Copy, Debug)]
struct Candidate {
    id: u32,
    logit: f32,
    /// Probability after the temperature softmax (normalized over the
    /// candidates that survived top-k).
    p: f32,
}

/// The total order every filter uses: more likely first, lower id on ties.
fn better(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// A candidate ordered so that "greater" means "more likely" (per [`better`]).
#[derive(Clone, Copy)]
struct Ranked(Candidate);

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Ranked {}
impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        better(&other.0, &self.0)
    }
}

/// Draws token ids from logits. Keeps its buffers between calls, so a
/// generation loop does not allocate per token.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Penalized logits, one per id (only when a penalty applies).
    work: Vec<f32>,
    /// Survivors of the filters.
    cands: Vec<Candidate>,
    /// Top-k selection: the worst kept candidate on top.
    heap: BinaryHeap<Reverse<Ranked>>,
    /// Distinct recent ids, for the penalty.
    recent: Vec<u32>,
    /// Per id, its candidate's index (or `NO_CANDIDATE`) while restoring
    /// id order.
    slots: Vec<u32>,
    /// The candidates in id order, being built.
    sorted: Vec<Candidate>,
}

/// A `slots` entry for an id with no candidate.
const NO_CANDIDATE: u32 = u32::MAX;

impl Sampler {
    /// A sampler with its own random stream. Call [`SamplerConfig::validate`]
    /// first on settings that come from a user.
    pub fn new(cfg: SamplerConfig, seed: u64) -> Sampler {
        Sampler {
            cfg,
            rng: Rng::new(seed),
            work: Vec::new(),
            cands: Vec::new(),
            heap: BinaryHeap::new(),
            recent: Vec::new(),
            slots: Vec::new(),
            sorted: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token. `recent_tokens` is the context so far (only its
    /// last `repeat_last_n` entries matter). NaN logits are treated as
    /// impossible. Panics on empty `logits`, which is a caller bug.
    pub fn sample(&mut self, logits: &[f32], recent_tokens: &[u32]) -> u32 {
        self.distribution(logits, recent_tokens).draw()
    }

    /// The distribution [`Sampler::sample`] would draw from for these
    /// logits and this context, after the penalty and every filter; drawing
    /// from it is exactly `sample` (the same random numbers are used).
    /// Panics on empty `logits`, which is a caller bug.
    pub fn distribution(&mut self, logits: &[f32], recent_tokens: &[u32]) -> Distribution<'_> {
        assert!(
            !logits.is_empty(),
            "Sampler::distribution called with no logits"
        );
        let certain = self.filter(logits, recent_tokens);
        Distribution {
            sampler: self,
            certain,
        }
    }

    /// Runs every filter, leaving the survivors (with probabilities) in
    /// `self.cands`. Returns the answer directly when no draw is needed.
    fn filter(&mut self, logits: &[f32], recent: &[u32]) -> Option<u32> {
        // Greedy with no penalty to apply reads the logits where they are:
        // the copy below is a megabyte for Gemma's vocabulary, per row of
        // every verify step (`distribution` took 3.5% of a greedy
        // summary's samples with speculation with the copy, 2.9% without:
        // what is left is the scan).
        let no_penalty = self.cfg.repeat_penalty == 1.0 || self.cfg.repeat_last_n == 0;
        if self.cfg.temperature == 0.0 && no_penalty {
            return Some(first_max(logits).0 as u32);
        }
        // With a penalty, a penalized copy of the logits; without one,
        // the logits where they are (the copy was a megabyte written and
        // read again per sampled token; with the scans below it was 7.6% of
        // a 4-stream server's samples at temperature 0.8).
        let penalized = !no_penalty;
        if penalized {
            self.work.clear();
            self.work.extend(logits.iter().map(|&l| finite_or_low(l)));
            self.penalize(recent);
        }
        let source: &[f32] = if penalized { &self.work } else { logits };

        let (best, max) = first_max(source);
        // Greedy, or a degenerate row (all -inf, or some +inf) where the
        // softmax is undefined: the best logit wins.
        if self.cfg.temperature == 0.0 || !max.is_finite() {
            return Some(best as u32);
        }

        self.cands.clear();
        let k = self.cfg.top_k;
        if k > 0 && k < source.len() {
            collect_top_k(source, k, &mut self.heap, &mut self.cands);
        } else {
            let all = source.iter().enumerate();
            self.cands.extend(all.map(|(i, &logit)| Candidate {
                id: i as u32,
                logit: finite_or_low(logit),
                p: 0.0,
            }));
        }

        self.softmax(max);
        if self.cfg.top_p < 1.0 {
            self.top_p();
        }
        if self.cfg.min_p > 0.0 {
            let p_max = self.cands.iter().map(|c| c.p).fold(0.0, f32::max);
            let threshold = self.cfg.min_p * p_max;
            self.cands.retain(|c| c.p >= threshold);
        }
        None
    }

    /// llama.cpp's repetition penalty, once per distinct recent id: a
    /// positive logit is divided by the penalty and a negative one
    /// multiplied, so a penalty above 1 always makes the token less likely.
    fn penalize(&mut self, recent: &[u32]) {
        // (`filter` skips the copy this works on when it would do nothing.)
        let penalty = self.cfg.repeat_penalty;
        if penalty == 1.0 || self.cfg.repeat_last_n == 0 {
            return;
        }
        let window = &recent[recent.len().saturating_sub(self.cfg.repeat_last_n)..];
        self.recent.clear();
        self.recent.extend_from_slice(window);
        self.recent.sort_unstable();
        self.recent.dedup();
        for &id in &self.recent {
            // Ids past the vocabulary (a caller's mistake) are ignored.
            if let Some(l) = self.work.get_mut(id as usize) {
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }

    fn softmax(&mut self, max: f32) {
        let inv_t = 1.0 / self.cfg.temperature;
        let mut total = 0.0f64;
        for c in &mut self.cands {
            c.p = ((c.logit - max) * inv_t).exp();
            total += f64::from(c.p);
        }
        let inv_total = (1.0 / total) as f32;
        for c in &mut self.cands {
            c.p *= inv_total;
        }
    }

    /// Keeps the shortest most-likely prefix (in the [`better`] order) whose
    /// probability reaches top-p, in expected O(n) without sorting: a
    /// quickselect that halves the range around its median and keeps the
    /// side where the cut must lie, judged by the mass on the better side.
    ///
    /// Probabilities are summed as integers (units of 2^-32), so every sum is
    /// exact and the cut cannot depend on the order in which selection
    /// happened to leave the elements.
    fn top_p(&mut self) {
        // Adding 0.5 and truncating rounds like .round() for these
        // non-negative values, without a libm call per element.
        let weight = |c: &Candidate| (f64::from(c.p) * 4_294_967_296.0 + 0.5) as u64;
        let total: u64 = self.cands.iter().map(weight).sum();
        let target = (f64::from(self.cfg.top_p) * total as f64).ceil() as u64;
        // Invariant: the cut lies in lo..=hi and cands[..lo] (all better than
        // cands[lo..]) hold `target - need` of the mass.
        let (mut lo, mut hi, mut need) = (0, self.cands.len(), target);
        let cut = loop {
            if hi - lo <= 32 {
                self.cands[lo..hi].sort_unstable_by(better);
                let mut acc = 0;
                let mut end = hi;
                for (i, c) in self.cands[lo..hi].iter().enumerate() {
                    acc += weight(c);
                    if acc >= need {
                        end = lo + i + 1;
                        break;
                    }
                }
                break end;
            }
            let mid = lo + (hi - lo) / 2;
            self.cands[lo..hi].select_nth_unstable_by(mid - lo, better);
            let left: u64 = self.cands[lo..mid].iter().map(weight).sum();
            let pivot = weight(&self.cands[mid]);
            if left >= need {
                hi = mid;
            } else if left + pivot >= need {
                break mid + 1;
            } else {
                need -= left + pivot;
                lo = mid + 1;
            }
        };
        self.cands.truncate(cut);
        self.canonical_order();
    }

    /// Puts the candidates in id order, which does not depend on how
    /// selection left them: a sort for small sets, and for large ones a pass
    /// over the vocabulary (O(n) instead of O(n log n)).
    fn canonical_order(&mut self) {
        if self.cands.len() <= 4096 {
            self.cands.sort_unstable_by_key(|c| c.id);
            return;
        }
        let ids = self.cands.iter().map(|c| c.id as usize + 1).max();
        self.slots.clear();
        self.slots.resize(ids.unwrap_or(0), NO_CANDIDATE);
        for (i, c) in self.cands.iter().enumerate() {
            self.slots[c.id as usize] = i as u32;
        }
        self.sorted.clear();
        let in_id_order = self.slots.iter().filter(|&&i| i != NO_CANDIDATE);
        self.sorted
            .extend(in_id_order.map(|&i| self.cands[i as usize]));
        std::mem::swap(&mut self.cands, &mut self.sorted);
    }

    fn draw(&mut self) -> u32 {
        let total: f64 = self.cands.iter().map(|c| f64::from(c.p)).sum();
        let mut u = self.rng.next_f64() * total;
        let mut last = self.cands[0].id;
        for c in &self.cands {
            if c.p <= 0.0 {
                continue;
            }
            let p = f64::from(c.p);
            if u < p {
                return c.id;
            }
            u -= p;
            last = c.id;
        }
        // Only reached through rounding at the very top of the range.
        last
    }
}

/// One step's final distribution, as [`Sampler::distribution`] computed
/// it. Holds the sampler so that [`Distribution::draw`] uses its random
/// stream.
pub struct Distribution<'s> {
    sampler: &'s mut Sampler,
    /// The token when no draw is needed: greedy decoding, or a row where
    /// the softmax is undefined.
    certain: Option<u32>,
}

impl Distribution<'_> {
    /// Sum of the survivors' weights: the filters leave them unnormalized,
    /// and the draw scales its random number by this sum.
    fn total(&self) -> f64 {
        self.sampler.cands.iter().map(|c| f64::from(c.p)).sum()
    }

    /// The token this step takes whatever the random draw, if any.
    pub fn certain(&self) -> Option<u32> {
        self.certain
    }

    /// The probability that [`Distribution::draw`] returns `id`.
    pub fn probability(&self, id: u32) -> f64 {
        match self.certain {
            Some(c) => f64::from(u8::from(c == id)),
            None => self
                .sampler
                .cands
                .iter()
                .find(|c| c.id == id)
                .map_or(0.0, |c| f64::from(c.p) / self.total()),
        }
    }

    /// Every token with a nonzero probability and that probability.
    pub fn support(&self) -> Vec<(u32, f64)> {
        match self.certain {
            Some(c) => vec![(c, 1.0)],
            None => {
                let total = self.total();
                self.sampler
                    .cands
                    .iter()
                    .filter(|c| c.p > 0.0)
                    .map(|c| (c.id, f64::from(c.p) / total))
                    .collect()
            }
        }
    }

    /// Draws a token, consuming one random number unless it is certain.
    pub fn draw(self) -> u32 {
        match self.certain {
            Some(id) => id,
            None => self.sampler.draw(),
        }
    }
}

/// Puts the k best of `logits` into `cands`, best first, NaN counting as
/// minus infinity. One pass with a bounded min-heap: after the first few
/// thousand logits nearly every one loses a single comparison against the
/// current k-th best, so this is much cheaper than building and selecting
/// 262k candidates; and whole chunks with nothing above the k-th best are
/// passed over with one vector comparison per 8 values.
fn collect_top_k(
    logits: &[f32],
    k: usize,
    heap: &mut BinaryHeap<Reverse<Ranked>>,
    cands: &mut Vec<Candidate>,
) {
    heap.clear();
    // The k-th best logit so far. Ids arrive in increasing order, so a
    // newcomer that only ties it ranks below it and can be skipped with
    // one float comparison.
    let mut floor = f32::NEG_INFINITY;
    for (c, chunk) in logits.chunks(SCAN_CHUNK).enumerate() {
        if heap.len() == k && !any_above(chunk, floor) {
            continue;
        }
        for (j, &logit) in chunk.iter().enumerate() {
            let logit = finite_or_low(logit);
            if heap.len() == k && logit <= floor {
                continue;
            }
            let c = Ranked(Candidate {
                id: (c * SCAN_CHUNK + j) as u32,
                logit,
                p: 0.0,
            });
            if heap.len() < k {
                heap.push(Reverse(c));
            } else if let Some(mut worst) = heap.peek_mut() {
                *worst = Reverse(c);
            }
            if heap.len() == k {
                floor = heap.peek().map_or(floor, |w| w.0.0.logit);
            }
        }
    }
    cands.extend(heap.drain().map(|r| r.0.0));
    // A canonical order, so sums and the draw do not depend on the heap's layout.
    cands.sort_unstable_by(better);
}

/// Values the scans over the vocabulary test at a time.
const SCAN_CHUNK: usize = 64;

/// Whether any value is above `floor` (NaN never is). A fold without an
/// early exit, so it compiles to vector compares.
#[inline(always)]
fn any_above(values: &[f32], floor: f32) -> bool {
    values.iter().fold(false, |any, &v| any | (v > floor))
}

/// NaN counts as impossible: minus infinity.
fn finite_or_low(l: f32) -> f32 {
    if l.is_nan() { f32::NEG_INFINITY } else { l }
}

/// The first maximum (the lowest id among ties) and its value, NaN
/// counting as impossible (minus infinity); id 0 when every value is.
/// Chunks with nothing above the maximum so far are passed over.
fn first_max(logits: &[f32]) -> (usize, f32) {
    let (mut best, mut max) = (0, finite_or_low(logits[0]));
    for (c, chunk) in logits.chunks(SCAN_CHUNK).enumerate() {
        if !any_above(chunk, max) {
            continue;
        }
        for (j, &l) in chunk.iter().enumerate() {
            if l > max {
                (best, max) = (c * SCAN_CHUNK + j, l);
            }
        }
    }
    (best, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SamplerConfig {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
        }
    }

    /// Logits whose softmax at temperature 1 is exactly `probs`.
    fn logits_for(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    /// Ids that survive the filters, sorted.
    fn survivors(c: SamplerConfig, logits: &[f32], recent: &[u32]) -> Vec<u32> {
        let mut s = Sampler::new(c, 0);
        assert_eq!(
            s.filter(logits, recent),
            None,
            "expected a draw, not a direct answer"
        );
        let mut ids: Vec<u32> = s.cands.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn validate_names_the_bad_setting() {
        assert!(cfg().validate().is_ok());
        assert!(SamplerConfig::default().validate().is_ok());
        assert!(SamplerConfig::greedy().validate().is_ok());
        let bad = |c: SamplerConfig, word: &str| {
            let e = c.validate().expect_err("should be refused").to_string();
            assert!(e.contains(word), "{e:?} should mention {word}");
        };
        bad(
            SamplerConfig {
                temperature: -0.1,
                ..cfg()
            },
            "temperature",
        );
        bad(
            SamplerConfig {
                temperature: f32::NAN,
                ..cfg()
            },
            "temperature",
        );
        bad(
            SamplerConfig {
                top_p: 0.0,
                ..cfg()
            },
            "top-p",
        );
        bad(
            SamplerConfig {
                top_p: 1.01,
                ..cfg()
            },
            "top-p",
        );
        bad(
            SamplerConfig {
                min_p: -0.01,
                ..cfg()
            },
            "min-p",
        );
        bad(
            SamplerConfig {
                min_p: 1.5,
                ..cfg()
            },
            "min-p",
        );
        bad(
            SamplerConfig {
                repeat_penalty: 0.0,
                ..cfg()
            },
            "repeat penalty",
        );
        bad(
            SamplerConfig {
                repeat_penalty: -1.0,
                ..cfg()
            },
            "repeat penalty",
        );
    }

    #[test]
    fn splitmix_and_xoshiro_are_pinned() {
        // First splitmix64 output for seed 0, a published reference value.
        assert_eq!(splitmix64(&mut 0), 0xE220_A839_7B1D_CDAF);
        // Golden values of this generator: changing them changes every seeded run.
        let mut r = Rng::new(42);
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, GOLDEN_SEED_42);
        let f = Rng::new(7).next_f64();
        assert!((0.0..1.0).contains(&f));
    }

    // Cross-checked against an independent Python transcription of the algorithm.
    const GOLDEN_SEED_42: [u64; 3] = [
        1546998764402558742,
        6990951692964543102,
        12544586762248559009,
    ];

    #[test]
    fn temperature_zero_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplerConfig::greedy(), 1);
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9], &[]), 1);
        assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, -1.0], &[]), 1);
        // Greedy ignores the other filters.
        let c = SamplerConfig {
            temperature: 0.0,
            top_k: 1,
            top_p: 0.1,
            ..cfg()
        };
        assert_eq!(Sampler::new(c, 9).sample(&[0.0, 0.5, 0.2], &[]), 1);
    }

    #[test]
    fn degenerate_rows_do_not_break() {
        let mut s = Sampler::new(cfg(), 3);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 4], &[]), 0);
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0], &[]), 1);
        for _ in 0..100 {
            assert_eq!(s.sample(&[f32::NEG_INFINITY, 0.0, f32::NAN], &[]), 1);
        }
    }

    #[test]
    fn top_k_keeps_exactly_k() {
        let logits = [0.5, 2.0, -1.0, 3.0, 1.0, 2.5, 0.0];
        let c = SamplerConfig { top_k: 3, ..cfg() };
        assert_eq!(survivors(c, &logits, &[]), vec![1, 3, 5]);
        // Ties at the boundary go to the lower id.
        let c = SamplerConfig { top_k: 2, ..cfg() };
        assert_eq!(survivors(c, &[1.0, 2.0, 1.0, 1.0], &[]), vec![0, 1]);
        // k at or above the vocabulary keeps everything.
        let c = SamplerConfig { top_k: 10, ..cfg() };
        assert_eq!(survivors(c, &logits, &[]).len(), 7);
    }

    #[test]
    fn top_k_on_a_large_vocabulary_matches_a_full_sort() {
        // Coarsely quantized logits so that many ties straddle the cut.
        let mut r = Rng::new(11);
        let logits: Vec<f32> = (0..5000)
            .map(|_| (r.next_f64() * 50.0).floor() as f32)
            .collect();
        for k in [1usize, 7, 100, 4999] {
            let got = survivors(SamplerConfig { top_k: k, ..cfg() }, &logits, &[]);
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            order.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            let mut want = order[..k].to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "k = {k}");
        }
    }

    #[test]
    fn top_p_cuts_at_the_first_prefix_reaching_p() {
        let logits = logits_for(&[0.05, 0.5, 0.15, 0.3]);
        let keep = |p: f32| survivors(SamplerConfig { top_p: p, ..cfg() }, &logits, &[]);
        assert_eq!(keep(0.4), vec![1]);
        assert_eq!(keep(0.75), vec![1, 3]);
        assert_eq!(keep(0.9), vec![1, 2, 3]);
        assert_eq!(keep(0.99), vec![0, 1, 2, 3]);
        assert_eq!(keep(1.0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn top_p_on_a_large_vocabulary_matches_a_full_sort() {
        // Logits from a fixed generator; 20000 flat ones make the kept set
        // large enough for the O(vocab) reordering path.
        for (n, spread) in [(5000usize, 8.0f64), (20_000, 1.0)] {
            let mut r = Rng::new(5);
            let logits: Vec<f32> = (0..n).map(|_| (r.next_f64() * spread) as f32).collect();
            for top_p in [0.1f32, 0.5, 0.9, 0.999] {
                let mut s = Sampler::new(SamplerConfig { top_p, ..cfg() }, 0);
                assert_eq!(s.filter(&logits, &[]), None);
                let got: Vec<u32> = s.cands.iter().map(|c| c.id).collect();
                assert!(got.windows(2).all(|w| w[0] < w[1]), "survivors in id order");
                // Reference: sort everything, accumulate in f64.
                let max = logits.iter().cloned().fold(f32::MIN, f32::max);
                let w: Vec<f64> = logits.iter().map(|&l| f64::from((l - max).exp())).collect();
                let z: f64 = w.iter().sum();
                let mut order: Vec<usize> = (0..logits.len()).collect();
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                let mut sum = 0.0;
                let mut want = Vec::new();
                for &i in &order {
                    want.push(i as u32);
                    sum += w[i] / z;
                    if sum >= f64::from(top_p) {
                        break;
                    }
                }
                want.sort_unstable();
                // Random logits put no cumulative sum within rounding of the target.
                assert_eq!(got, want, "n {n}, top_p {top_p}");
            }
        }
    }

    /// Top-k and the maximum over a vocabulary in many scan chunks: the k
    /// best by (logit, lower id) as a full sort has them, with NaN never
    /// chosen, ties at the cut and the best value in a late chunk; a
    /// penalty that changes nothing (ids past the vocabulary) takes the
    /// penalized copy's path and must agree.
    #[test]
    fn top_k_over_many_chunks_matches_a_full_sort() {
        let mut r = Rng::new(9);
        let n = 50 * SCAN_CHUNK + 17;
        let mut logits: Vec<f32> = (0..n)
            .map(|_| (r.next_f64() * 4.0).floor() as f32)
            .collect();
        for i in (3..n).step_by(97) {
            logits[i] = f32::NAN;
        }
        logits[n - 5] = 9.0;
        logits[40 * SCAN_CHUNK + 3] = f32::NAN;
        for k in [1usize, 7, 40, 200] {
            let mut order: Vec<usize> = (0..n).filter(|&i| !logits[i].is_nan()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let want: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
            for penalty in [1.0, 1.5] {
                let c = SamplerConfig {
                    top_k: k,
                    repeat_penalty: penalty,
                    ..cfg()
                };
                let mut s = Sampler::new(c, 0);
                assert_eq!(s.filter(&logits, &[n as u32 + 1]), None);
                let got: Vec<u32> = s.cands.iter().map(|c| c.id).collect();
                assert_eq!(got, want, "k {k}, penalty {penalty}");
            }
        }
        assert_eq!(first_max(&logits), (n - 5, 9.0));
        logits[n - 5] = 3.0;
        let first_three = logits.iter().position(|&l| l == 3.0).unwrap();
        assert_eq!(first_max(&logits), (first_three, 3.0));
    }

    #[test]
    fn min_p_threshold_is_relative_to_the_best() {
        let logits = logits_for(&[0.5, 0.3, 0.15, 0.05]);
        let keep = |m: f32| survivors(SamplerConfig { min_p: m, ..cfg() }, &logits, &[]);
        assert_eq!(keep(0.2), vec![0, 1, 2]); // threshold 0.1
        assert_eq!(keep(0.5), vec![0, 1]); // threshold 0.25
        assert_eq!(keep(0.61), vec![0]); // threshold 0.305
        assert_eq!(keep(1.0), vec![0]);
    }

    #[test]
    fn penalty_pushes_positive_and_negative_logits_down() {
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            ..cfg()
        };
        let mut s = Sampler::new(c, 0);
        s.filter(&[2.0, -2.0, 1.0, 0.5], &[0, 1, 0, 0]);
        let logit = |s: &Sampler, id: u32| s.cands.iter().find(|c| c.id == id).map(|c| c.logit);
        assert_eq!(
            logit(&s, 0),
            Some(1.0),
            "positive logit divided once, not per repeat"
        );
        assert_eq!(logit(&s, 1), Some(-4.0), "negative logit multiplied");
        assert_eq!(logit(&s, 2), Some(1.0), "unseen token untouched");
        // Only the last n tokens count.
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            repeat_last_n: 1,
            ..cfg()
        };
        let mut s = Sampler::new(c, 0);
        s.filter(&[2.0, -2.0, 1.0, 0.5], &[0, 1, 3]);
        assert_eq!(logit(&s, 0), Some(2.0));
        assert_eq!(logit(&s, 3), Some(0.25));
        // Ids past the vocabulary are ignored rather than panicking.
        s.filter(&[2.0, -2.0], &[99]);
    }

    #[test]
    fn penalty_changes_the_greedy_choice() {
        let c = SamplerConfig {
            repeat_penalty: 1.5,
            ..SamplerConfig::greedy()
        };
        let c = SamplerConfig {
            repeat_last_n: 8,
            ..c
        };
        let mut s = Sampler::new(c, 0);
        assert_eq!(s.sample(&[3.0, 2.5], &[]), 0);
        assert_eq!(s.sample(&[3.0, 2.5], &[0]), 1);
    }

    #[test]
    fn greedy_picks_the_first_maximum_and_never_a_nan() {
        // With and without a penalty that touches nothing (id 9 is past
        // these rows), the same answers: the copy-free path and the
        // penalized copy agree.
        let plain = SamplerConfig::greedy();
        let penalized = SamplerConfig {
            repeat_penalty: 1.5,
            repeat_last_n: 8,
            ..plain
        };
        for c in [plain, penalized] {
            let mut s = Sampler::new(c, 0);
            assert_eq!(s.sample(&[f32::NAN, 1.0, 3.0, 3.0], &[9]), 2);
            assert_eq!(s.sample(&[f32::NAN, f32::NAN], &[9]), 0);
            assert_eq!(s.sample(&[-1.0, f32::NAN, -0.5], &[9]), 2);
            assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY], &[9]), 0);
        }
    }

    fn draws(c: SamplerConfig, seed: u64, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(c, seed);
        (0..n).map(|_| s.sample(logits, &[])).collect()
    }

    #[test]
    fn same_seed_same_draws_different_seed_different_draws() {
        let logits = vec![0.0f32; 100];
        let a = draws(cfg(), 1234, &logits, 50);
        assert_eq!(a, draws(cfg(), 1234, &logits, 50));
        assert_ne!(a, draws(cfg(), 1235, &logits, 50));
        // Every draw is a valid id and the uniform row spreads them out.
        assert!(a.iter().all(|&i| i < 100));
        let mut distinct = a.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 30, "{distinct:?}");
    }

    fn frequency_of_zero(c: SamplerConfig, logits: &[f32], n: usize) -> f64 {
        let d = draws(c, 99, logits, n);
        d.iter().filter(|&&i| i == 0).count() as f64 / n as f64
    }

    #[test]
    fn empirical_frequencies_follow_the_distribution() {
        // sd of the estimate at n = 20000 is about 0.0032; allow ~5 sd.
        let logits = logits_for(&[0.7, 0.3]);
        let f = frequency_of_zero(cfg(), &logits, 20_000);
        assert!((f - 0.7).abs() < 0.016, "frequency {f}");
        // Temperature 0.5 squares the odds: 0.49 / (0.49 + 0.09).
        let f = frequency_of_zero(
            SamplerConfig {
                temperature: 0.5,
                ..cfg()
            },
            &logits,
            20_000,
        );
        assert!((f - 0.49 / 0.58).abs() < 0.016, "frequency {f}");
        // Temperature 2 flattens: sqrt(0.7) / (sqrt(0.7) + sqrt(0.3)).
        let want = 0.7f64.sqrt() / (0.7f64.sqrt() + 0.3f64.sqrt());
        let f = frequency_of_zero(
            SamplerConfig {
                temperature: 2.0,
                ..cfg()
            },
            &logits,
            20_000,
        );
        assert!((f - want).abs() < 0.016, "frequency {f}");
    }

    #[test]
    fn filters_compose_in_order() {
        // top-k 3 (ties to the lower id) renormalizes over {0,1,2}: 0.5,
        // 0.375, 0.125. min-p 0.3 then cuts at 0.15 → {0, 1}; top-p 0.6 needs
        // {0, 1}; top-p 0.45 only {0}. Without top-k the numbers differ.
        let logits = logits_for(&[0.4, 0.3, 0.1, 0.1, 0.1]);
        let c = SamplerConfig {
            top_k: 3,
            min_p: 0.3,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0, 1]);
        let c = SamplerConfig {
            top_k: 3,
            top_p: 0.6,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0, 1]);
        let c = SamplerConfig {
            top_k: 3,
            top_p: 0.45,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0]);
        // Without top-k, p(0) = 0.4 < 0.45, so top-p needs two tokens.
        let c = SamplerConfig {
            top_p: 0.45,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0, 1]);
    }

    #[test]
    fn drawing_from_the_distribution_is_sampling() {
        // The same seed through `sample` and through `distribution().draw()`
        // gives the same tokens: the split changes no random number.
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        let recent = [5u32, 17, 17, 250];
        let c = SamplerConfig {
            top_k: 50,
            top_p: 0.9,
            min_p: 0.02,
            repeat_penalty: 1.3,
            ..cfg()
        };
        let mut a = Sampler::new(c, 77);
        let mut b = Sampler::new(c, 77);
        for _ in 0..200 {
            assert_eq!(
                a.sample(&logits, &recent),
                b.distribution(&logits, &recent).draw()
            );
        }
    }

    #[test]
    fn distribution_probabilities_are_the_filtered_softmax() {
        // top-k 3 over p ∝ [0.4, 0.3, 0.1, 0.1, 0.1] keeps ids 0, 1, 2 with
        // 0.5, 0.375, 0.125 (as in filters_compose_in_order).
        let logits = logits_for(&[0.4, 0.3, 0.1, 0.1, 0.1]);
        let mut s = Sampler::new(SamplerConfig { top_k: 3, ..cfg() }, 0);
        let d = s.distribution(&logits, &[]);
        assert_eq!(d.certain(), None);
        for (id, want) in [(0, 0.5), (1, 0.375), (2, 0.125), (3, 0.0), (4, 0.0)] {
            assert!(
                (d.probability(id) - want).abs() < 1e-6,
                "p({id}) = {}",
                d.probability(id)
            );
        }
        let support = d.support();
        assert_eq!(support.len(), 3);
        assert!((support.iter().map(|s| s.1).sum::<f64>() - 1.0).abs() < 1e-9);
        // Greedy: the argmax with probability 1, and no random number used.
        let mut g = Sampler::new(SamplerConfig::greedy(), 0);
        let d = g.distribution(&logits, &[]);
        assert_eq!(d.certain(), Some(0));
        assert_eq!((d.probability(0), d.probability(1)), (1.0, 0.0));
        assert_eq!(d.support(), vec![(0, 1.0)]);
    }

    #[test]
    fn does_not_reallocate_between_calls() {
        let logits = vec![0.0f32; 1000];
        let mut s = Sampler::new(SamplerConfig { top_k: 10, ..cfg() }, 0);
        s.sample(&logits, &[1, 2, 3]);
        let before = (s.cands.as_ptr(), s.work.as_ptr(), s.heap.capacity());
        for _ in 0..10 {
            s.sample(&logits, &[1, 2, 3]);
        }
        assert_eq!(
            (s.cands.as_ptr(), s.work.as_ptr(), s.heap.capacity()),
            before
        );
    }
}
