//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A path named `name` in a fresh folder under the system temp dir. The
/// folder, and whatever was written into it, is removed when this is
/// dropped: at the end of the test, pass or fail (a failed assertion
/// unwinds). Keep it alive until any child process given the path has
/// exited.
///
/// A folder rather than a `NamedTempFile`: the file is not created here,
/// so the code under test writes a new file as before (`fs_atomic` treats
/// an existing target differently: it keeps its permissions), and the
/// temporaries it writes beside the target, like files a test derives
/// from the path, stay inside the folder.
pub struct ScratchFile {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl ScratchFile {
    /// `prefix` names the folder (`pulsar-...-`) so a leftover is traceable.
    pub fn new(prefix: &str, name: &str) -> ScratchFile {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("create a temp folder");
        ScratchFile {
            path: dir.path().join(name),
            _dir: dir,
        }
    }
}

impl std::ops::Deref for ScratchFile {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for ScratchFile {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

/// `../shared/oracle` beside the repository: the HF reference data.
pub fn oracle_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/oracle");
    assert!(
        dir.is_dir(),
        "the oracle folder {} is missing: tests need ../shared/oracle beside the repository",
        dir.display()
    );
    dir
}

/// A raw little-endian f32 file.
pub fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{}: not whole f32s", path.display());
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// Largest |a - b| and where it occurs.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> (f32, usize) {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let mut worst = (0.0f32, 0);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = (x - y).abs();
        if d > worst.0 || d.is_nan() {
            worst = (if d.is_nan() { f32::INFINITY } else { d }, i);
        }
    }
    worst
}

/// `tests/data/fixtures`: the awkward-shape models made by
/// tools/make_fixtures.py, with their float64-oracle logits.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fixtures")
}

/// One awkward fixture: its folder, input ids and expected logits
/// `[tokens, vocab]` (row-major).
pub struct Fixture {
    pub dir: PathBuf,
    pub input: Vec<u32>,
    pub logits: Vec<f32>,
    pub vocab: usize,
}

pub fn load_fixture(name: &str) -> Fixture {
    let dir = fixtures_dir().join(name);
    let meta = read_json(&dir.join("expected.json"));
    let input = ids(&meta["input_ids"]);
    let shape = ids(&meta["logits_shape"]);
    assert_eq!(
        shape.len(),
        2,
        "{name}: logits_shape must be [tokens, vocab]"
    );
    assert_eq!(
        shape[0] as usize,
        input.len(),
        "{name}: one logits row per token"
    );
    let logits = read_f32(&dir.join("logits.bin"));
    assert_eq!(
        logits.len(),
        input.len() * shape[1] as usize,
        "{name}: logits.bin size"
    );
    Fixture {
        dir,
        input,
        logits,
        vocab: shape[1] as usize,
    }
}

/// A made-up K-quant tensor (GGUF bytes): random quants, scales and mins,
/// super-block scales of weights' size.
pub fn k_quant_file(
    q: pulsar::model::quant_blocks::QuantType,
    rows: usize,
    cols: usize,
    seed: u32,
) -> Vec<u8> {
    use pulsar::model::quant_blocks::QuantType;
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        s >> 8
    };
    let bytes = match q {
        QuantType::Q4Kx16 => 144,
        QuantType::Q5Kx16 => 176,
        _ => 210,
    };
    let mut out = vec![0u8; rows * cols / 256 * bytes];
    for block in out.chunks_exact_mut(bytes) {
        block.iter_mut().for_each(|b| *b = next() as u8);
        let mut scale = || half::f16::from_f32((next() % 1000) as f32 * 2e-6 + 1e-5).to_le_bytes();
        if q.has_k_mins() {
            block[0..2].copy_from_slice(&scale());
            block[2..4].copy_from_slice(&scale());
        } else {
            block[208..210].copy_from_slice(&scale());
        }
    }
    out
}

/// Checks that a short run of tokens is computed exactly as one-token
/// steps compute it (speculative decoding's verify steps rely on it): the
/// model at `path`, in `format` (None: the file's own types), two
/// sequences, runs of 2, 5 and 9 tokens against the same tokens one at a
/// time; every position's logits must have the same bits. The prompt's
/// ids are drawn below `ids.0`, the runs' from 7 to `7 + ids.1`.
/// A fast engine on 2 threads (JIT kernels, 64 positions, prompts in
/// chunks of `prefill_chunk`) holding `sequences` sequences.
#[allow(dead_code)]
pub fn fast_engine_with_sequences(
    path: &Path,
    format: Option<pulsar::engine::packed::WeightFormat>,
    prefill_chunk: usize,
    sequences: usize,
) -> pulsar::engine::fast::FastEngine {
    use pulsar::engine::fast::{FastEngine, FastOptions};
    use pulsar::engine::jit_kernels::JitKernels;
    use pulsar::model::source::ModelSource;
    let src = std::sync::Arc::new(ModelSource::open(path).unwrap());
    let opts = FastOptions {
        threads: 2,
        context: 64,
        format,
        prefill_chunk,
        in_place: false,
        native: false,
    };
    let formats = FastEngine::weight_formats(&src, &opts).unwrap();
    let kernels = Box::new(JitKernels::build(&src.config, formats, 2).unwrap());
    let mut e = FastEngine::load(&src, kernels, &opts).unwrap();
    e.set_sequences(sequences).unwrap();
    e
}

/// One step of `tokens` for sequence `seq` alone: every position's logits.
#[allow(dead_code)]
pub fn step_alone(
    e: &mut pulsar::engine::fast::FastEngine,
    seq: usize,
    tokens: &[u32],
) -> Vec<f32> {
    use pulsar::engine::LogitsWanted;
    use pulsar::engine::fast::SeqTokens;
    let batch = [SeqTokens {
        seq,
        tokens,
        wanted: Some(LogitsWanted::All),
    }];
    e.forward_batch(&batch).unwrap().remove(0)
}

#[allow(dead_code)]
pub fn assert_short_steps_equal_one_token_steps(
    path: &Path,
    format: Option<pulsar::engine::packed::WeightFormat>,
    ids: (u32, u32),
) {
    use pulsar::engine::Engine;
    let mut e = fast_engine_with_sequences(path, format, 16, 2);
    let vocab = e.config().vocab_size;
    let step = step_alone;
    let model = path.display();
    let prompt: Vec<u32> = (0..11).map(|i| 2 + (i * 37 + 5) % ids.0).collect();
    for seq in 0..2 {
        step(&mut e, seq, &prompt);
    }
    for m in [2, 5, 9] {
        let run: Vec<u32> = (0..m).map(|i| 7 + (i * 53 + m) % ids.1).collect();
        let together = step(&mut e, 0, &run);
        for (t, &token) in run.iter().enumerate() {
            let alone = step(&mut e, 1, &[token]);
            let row = &together[t * vocab..(t + 1) * vocab];
            let same = row
                .iter()
                .zip(&alone)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{model} {format:?}: m = {m}, token {t} differs");
        }
    }
}

/// `tests/data/gemma4-assistant`: the tiny Gemma 4 target + assistant pair.
pub fn assistant_data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gemma4-assistant")
}

/// A copy of a GGUF with row `row` of `token_embd.weight` (f32) scaled by
/// `factor`: the token's logit grows with it (the head is tied), so a
/// target scaled this way often samples it and an assistant scaled this
/// way often drafts it.
fn with_favoured_token(file: &str, row: usize, factor: f32, to: &Path) {
    use pulsar::model::dtype::DType;
    use pulsar::model::gguf::GgufFile;
    use pulsar::model::gguf_write::GgufWriter;
    let g = GgufFile::open(&assistant_data().join(file)).unwrap();
    let mut w = GgufWriter::new();
    let mut keys: Vec<&String> = g.metadata().keys().collect();
    keys.sort();
    for key in keys {
        w.add_value(key, &g.metadata()[key]);
    }
    for t in g.tensors() {
        let mut bytes = g.tensor(&t.name).unwrap().bytes.to_vec();
        if t.name == "token_embd.weight" {
            assert_eq!(t.dtype, DType::F32);
            let cols = t.shape[1];
            for v in bytes[row * cols * 4..(row + 1) * cols * 4].chunks_exact_mut(4) {
                let x = f32::from_le_bytes([v[0], v[1], v[2], v[3]]) * factor;
                v.copy_from_slice(&x.to_le_bytes());
            }
        }
        w.add_tensor(&t.name, &t.shape, t.dtype, bytes).unwrap();
    }
    w.write(to).unwrap();
}

/// The token the edited pair ([`favouring_pair`]) favours.
pub const FAVOURED_TOKEN: usize = 352;

/// The tiny GGUF pair edited so that drafts are often right, written into
/// `dir` (once): the target then samples [`FAVOURED_TOKEN`] at 58% of its
/// steps (temperature 1) and the full-head assistant drafts it nearly
/// always; about 1 in 6 drafted tokens is confirmed (1,173 of 7,330
/// measured). Returns (target, assistant).
pub fn favouring_pair(dir: &Path) -> (PathBuf, PathBuf) {
    let (target, assistant) = (dir.join("target.gguf"), dir.join("assistant.gguf"));
    if !target.exists() {
        with_favoured_token("tiny-g4a-target-f32.gguf", FAVOURED_TOKEN, 4.0, &target);
        with_favoured_token(
            "tiny-g4a-assistant-f32.gguf",
            FAVOURED_TOKEN,
            50.0,
            &assistant,
        );
    }
    (target, assistant)
}

/// One seeded, sampled continuation through the one token loop.
pub struct Continuation {
    /// The tokens chosen after the prompt (the last, chosen at the limit,
    /// unfed, included).
    pub tokens: Vec<u32>,
    pub generated: usize,
    pub drafted: usize,
    pub accepted: usize,
}

/// `n` tokens after `prompt`, which the engine's cache holds (`last`: the
/// logits after it), sampled with `seed`; checks that no draft is left
/// cached.
#[allow(clippy::too_many_arguments)]
pub fn continuation(
    engine: &mut dyn pulsar::engine::Engine,
    tok: &pulsar::tokenizer::Tokenizer,
    sampling: pulsar::sample::SamplerConfig,
    seed: u64,
    prompt: &[u32],
    last: Vec<f32>,
    n: usize,
    speculation: pulsar::speculative::Speculation,
) -> Continuation {
    use pulsar::generate::{self, Request};
    let mut history = prompt.to_vec();
    let mut sampler = pulsar::sample::Sampler::new(sampling, seed);
    let decoded = generate::decode(
        engine,
        tok,
        &mut sampler,
        last,
        &Request {
            prompt: &[],
            max_new: n,
            stop_ids: &[],
            stop_strings: &[],
            interrupted: &|| false,
            constraint: None,
            speculation,
        },
        &mut history,
        &mut |_| {},
    )
    .expect("decode");
    assert_eq!(engine.position(), history.len(), "no draft left cached");
    let (drafted, accepted) = decoded
        .stats
        .spec
        .map_or((0, 0), |s| (s.drafted, s.accepted));
    Continuation {
        tokens: [&history[prompt.len()..], &decoded.unfed[..]].concat(),
        generated: decoded.stats.generated,
        drafted,
        accepted,
    }
}

/// The (1 − a) quantile of χ² with `df` degrees of freedom, by the
/// Wilson–Hilferty cube-root normal approximation
/// χ²_q ≈ df (1 − 2/(9 df) + z_q sqrt(2/(9 df)))³, accurate to about 1% in
/// the upper tail for df ≥ 3 and conservative enough here: `z` is the
/// standard normal quantile of the level.
pub fn chi_square_quantile(df: usize, z: f64) -> f64 {
    let d = df as f64;
    let h = 2.0 / (9.0 * d);
    d * (1.0 - h + z * h.sqrt()).powi(3)
}

/// Two-sample chi-square statistic of two equally sized samples' counts
/// over categories, and its degrees of freedom. For equal sample sizes the
/// statistic Σ (a_i − b_i)² / (a_i + b_i) is asymptotically χ² with
/// (categories − 1) degrees of freedom when both samples come from one
/// distribution. Categories with fewer than 10 draws in the two samples
/// together are pooled into one, so that every expected count is at least
/// 5 and the χ² approximation holds.
pub fn two_sample_chi_square(a: &[u32], b: &[u32]) -> (f64, usize) {
    use std::collections::BTreeMap;
    let mut counts: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    for &x in a {
        counts.entry(x).or_default().0 += 1.0;
    }
    for &x in b {
        counts.entry(x).or_default().1 += 1.0;
    }
    let mut pooled = (0.0, 0.0);
    let mut cells = Vec::new();
    for (_, (x, y)) in counts {
        if x + y < 10.0 {
            pooled.0 += x;
            pooled.1 += y;
        } else {
            cells.push((x, y));
        }
    }
    if pooled.0 + pooled.1 > 0.0 {
        cells.push(pooled);
    }
    let stat = cells.iter().map(|(x, y)| (x - y).powi(2) / (x + y)).sum();
    (stat, cells.len().saturating_sub(1))
}

/// Asserts that at each of the first `len` positions the token
/// frequencies of samples `off` and `on` agree: each position's
/// two-sample χ² at most its (1 − a) quantile for the normal quantile `z`
/// of the per-position level. `what` names the change being tested.
pub fn assert_positions_agree(off: &[Vec<u32>], on: &[Vec<u32>], len: usize, z: f64, what: &str) {
    for t in 0..len {
        let a: Vec<u32> = off.iter().map(|s| s[t]).collect();
        let b: Vec<u32> = on.iter().map(|s| s[t]).collect();
        let (stat, df) = two_sample_chi_square(&a, &b);
        let limit = chi_square_quantile(df.max(1), z);
        println!("position {t}: chi-square {stat:.1} on {df} df (limit {limit:.1})");
        assert!(
            stat <= limit,
            "position {t}: token frequencies differ {what}: chi-square {stat:.1} > {limit:.1} on {df} df"
        );
    }
}
