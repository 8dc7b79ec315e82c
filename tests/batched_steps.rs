//! Steps over several tokens and several sequences on the default model:
//! a short run is computed exactly as one-token steps would be (bit for
//! bit), and a sequence's results do not depend on the others sharing its
//! step. Speculative decoding's greedy output and a server's determinism
//! rest on both.

use pulsar::engine::fast::{EXACT_STEP_MAX_TOKENS, FastEngine, FastOptions, SeqTokens};
use pulsar::engine::jit_kernels::JitKernels;
use pulsar::engine::q8_input::InputPrecision;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::source::ModelSource;
use std::sync::Arc;

fn engine(native: bool, sequences: usize) -> FastEngine {
    engine_with_context(native, sequences, 256)
}

fn engine_with_context(native: bool, sequences: usize, context: usize) -> FastEngine {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = Arc::new(ModelSource::open(&path).expect("default model opens"));
    let opts = FastOptions {
        threads: 2,
        context,
        format: None,
        prefill_chunk: 126,
        in_place: false,
        native,
    };
    let formats = FastEngine::weight_formats(&src, &opts).unwrap();
    let kernels = Box::new(JitKernels::build(&src.config, formats, 2).unwrap());
    let mut engine = FastEngine::load(&src, kernels, &opts).unwrap();
    engine.set_sequences(sequences).unwrap();
    engine
}

/// Token ids from a fixed pseudo-random walk over the first 20,000 ids
/// (ordinary text pieces), starting with BOS.
fn tokens(n: usize, seed: u32) -> Vec<u32> {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    std::iter::once(2)
        .chain((1..n).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            300 + state % 20_000
        }))
        .collect()
}

fn step(engine: &mut FastEngine, seq: usize, tokens: &[u32], wanted: LogitsWanted) -> Vec<f32> {
    let batch = [SeqTokens {
        seq,
        tokens,
        wanted: Some(wanted),
    }];
    engine.forward_batch(&batch).unwrap().remove(0)
}

/// Where two logit vectors first differ in their bits, if anywhere.
fn first_difference(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .enumerate()
        .find(|(_, (x, y))| x.to_bits() != y.to_bits())
        .map(|(i, (x, y))| (i, *x, *y))
}

/// Sequence 0 takes `run` in one step, sequence 1 (holding the same
/// tokens before it) one token at a time: every position's logits must
/// be the same bits.
fn run_matches_one_token_steps(e: &mut FastEngine, run: &[u32]) {
    let vocab = e.config().vocab_size;
    let together = step(e, 0, run, LogitsWanted::All);
    for (t, &token) in run.iter().enumerate() {
        let alone = step(e, 1, &[token], LogitsWanted::Last);
        let row = &together[t * vocab..(t + 1) * vocab];
        if let Some((k, x, y)) = first_difference(row, &alone) {
            let (m, pos) = (run.len(), e.sequence_len(1) - 1);
            panic!("m = {m}, position {pos}: logit {k} is {x} in the step and {y} alone");
        }
    }
}

/// Sequences 0 and 1 hold the same prompt; 0 takes m tokens in one step,
/// 1 one at a time: every position's logits are the same bits.
fn short_steps_are_exact(native: bool, inputs: InputPrecision) {
    let mut e = engine(native, 2);
    e.set_input_precision(inputs);
    let prompt = tokens(40, 1);
    for seq in 0..2 {
        step(&mut e, seq, &prompt, LogitsWanted::Last);
    }
    // 2 to 4: half a tile (VNNI's GEMM skips its second half); 9: a full
    // tile and a lone token, which Q8_0's GEMV takes.
    for m in [2, 3, 4, 5, 9, EXACT_STEP_MAX_TOKENS] {
        let run = tokens(m + 1, 100 + m as u32)[1..].to_vec();
        run_matches_one_token_steps(&mut e, &run);
    }
    assert_eq!(e.sequence_len(0), e.sequence_len(1));
}

#[test]
fn a_short_step_equals_one_token_steps_bit_for_bit_native() {
    short_steps_are_exact(true, InputPrecision::Bits8);
}

/// `--input-bits 16`: each token's two levels are two tokens of the
/// integer GEMM, and a step's pairs are added as a lone token's are.
#[test]
fn a_short_step_equals_one_token_steps_bit_for_bit_with_two_input_levels() {
    short_steps_are_exact(true, InputPrecision::TwoLevels);
}

#[test]
fn a_short_step_equals_one_token_steps_bit_for_bit_f16() {
    short_steps_are_exact(false, InputPrecision::Bits8);
}

/// Past the 512-position window of the default model's local layers, with
/// the keys split between the 2 threads: a verify step's tokens share the
/// units that read each part of the cache (where their split boundaries
/// agree) and still each get the bits of a one-token step. The runs start
/// at several offsets, so some of them straddle a moving boundary.
#[test]
fn steps_past_the_window_equal_one_token_steps_bit_for_bit() {
    let mut e = engine_with_context(true, 2, 1024);
    let prompt = tokens(600, 7);
    for seq in 0..2 {
        step(&mut e, seq, &prompt, LogitsWanted::Last);
    }
    for (i, m) in [8, 3, 16, 5, 8, 13].into_iter().enumerate() {
        let run = tokens(m + 1, 200 + i as u32)[1..].to_vec();
        run_matches_one_token_steps(&mut e, &run);
    }
    assert_eq!(e.sequence_len(0), 600 + 8 + 3 + 16 + 5 + 8 + 13);
}

/// Three sequences in one step (a decode token, a short exact run and a
/// prompt chunk in bulk) give each the bits it gets alone.
#[test]
fn sequences_sharing_a_step_get_what_they_get_alone() {
    let mut e = engine(true, 6);
    let prompts = [tokens(30, 7), tokens(20, 8), tokens(3, 9)];
    for (seq, p) in prompts.iter().enumerate() {
        for s in [seq, seq + 3] {
            step(&mut e, s, p, LogitsWanted::Last);
        }
    }
    let (one, short, bulk) = (
        tokens(2, 10)[1..].to_vec(),
        tokens(7, 11)[1..].to_vec(),
        tokens(60, 12),
    );
    let batch = [
        SeqTokens {
            seq: 2,
            tokens: &bulk,
            wanted: Some(LogitsWanted::All),
        },
        SeqTokens {
            seq: 0,
            tokens: &one,
            wanted: Some(LogitsWanted::Last),
        },
        SeqTokens {
            seq: 1,
            tokens: &short,
            wanted: Some(LogitsWanted::All),
        },
    ];
    let together = e.forward_batch(&batch).unwrap();
    let alone = [
        step(&mut e, 5, &bulk, LogitsWanted::All),
        step(&mut e, 3, &one, LogitsWanted::Last),
        step(&mut e, 4, &short, LogitsWanted::All),
    ];
    for ((entry, t), a) in batch.iter().zip(&together).zip(&alone) {
        if let Some((i, x, y)) = first_difference(t, a) {
            panic!(
                "sequence {}: logit {i} is {x} in the shared step and {y} alone",
                entry.seq
            );
        }
    }
    for seq in 0..3 {
        assert_eq!(e.sequence_len(seq), e.sequence_len(seq + 3));
    }
}

/// A step whose only entry wants no logits returns none and still
/// advances its sequence; a sequence named twice is refused.
#[test]
fn steps_without_logits_and_bad_batches() {
    let mut e = engine(true, 2);
    let prompt = tokens(10, 3);
    let out = e
        .forward_batch(&[SeqTokens {
            seq: 1,
            tokens: &prompt,
            wanted: None,
        }])
        .unwrap();
    assert!(out[0].is_empty());
    assert_eq!((e.sequence_len(0), e.sequence_len(1)), (0, 10));
    let twice = [
        SeqTokens {
            seq: 0,
            tokens: &prompt,
            wanted: None,
        },
        SeqTokens {
            seq: 0,
            tokens: &prompt,
            wanted: None,
        },
    ];
    let err = e.forward_batch(&twice).unwrap_err().to_string();
    assert!(err.contains("twice"), "{err}");
    let err = e
        .forward_batch(&[SeqTokens {
            seq: 2,
            tokens: &prompt,
            wanted: None,
        }])
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
}

/// The plan's blocking decides how work is cut, never what is computed:
/// with every block as small as it can be (4-row chunks, sub-chunks and
/// widened panels, 1-token attention blocks) the logits are the same bits.
/// Only the prefill step's length changes the GEMMs' rounding (measured
/// 0.13 at most over these 36 positions): same greedy token everywhere.
#[test]
fn the_blocking_changes_how_work_is_cut_not_the_results() {
    let prompt = tokens(36, 21);
    let run = tokens(6, 22)[1..].to_vec();
    let mut results = Vec::new();
    for variant in 0..3 {
        let mut e = engine(true, 1);
        let b = e.blocking().clone();
        let blocking = match variant {
            0 => b,
            1 => pulsar::jit::blocking::Blocking {
                min_chunk_bytes: 1,
                shared_rows_bytes: 1,
                widened_panel_bytes: 1,
                attention_token_block: 1,
                ..b
            },
            // Two bulk steps of 18 (16 or fewer would be exact steps).
            _ => pulsar::jit::blocking::Blocking {
                prefill_chunk: 18,
                ..b
            },
        };
        e.set_blocking(blocking);
        let prefill = e.forward(&prompt, LogitsWanted::All).unwrap();
        let exact = e.forward(&run, LogitsWanted::All).unwrap();
        results.push([prefill, exact]);
    }
    for (what, i) in [("prefill", 0), ("exact step", 1)] {
        if let Some((at, x, y)) = first_difference(&results[0][i], &results[1][i]) {
            panic!("{what}: logit {at} is {x} with the plan's blocking and {y} with tiny blocks");
        }
    }
    let vocab = 262_144;
    let argmax = |row: &[f32]| {
        (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap_or(0)
    };
    for (a, b) in results[0].iter().zip(&results[2]) {
        let (d, _) = max_abs_diff(a, b);
        assert!(d < 0.5, "prefill in steps of 18 moved a logit by {d}");
        for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
            assert_eq!(argmax(ra), argmax(rb));
        }
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> (f32, usize) {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold(
            (0.0, 0),
            |(m, at), (i, d)| if d > m { (d, i) } else { (m, at) },
        )
}

/// A run of more than `EXACT_STEP_MAX_TOKENS` tokens gives each token the
/// same bits however a prompt is cut into such runs and whatever else
/// shares the step. `pulsar serve` relies on this (with the exact steps
/// above) for replies that do not depend on their company or on what a
/// slot's cache held: it feeds every long prompt in bulk runs, whatever
/// prefix it reuses.
#[test]
fn bulk_runs_do_not_depend_on_how_a_prompt_is_cut() {
    let mut e = engine(true, 4);
    let prompt = tokens(150, 7);
    let feed = |e: &mut FastEngine, seq: usize, cuts: &[usize]| {
        let mut at = 0;
        let mut logits = Vec::new();
        for (i, &n) in cuts.iter().enumerate() {
            let wanted = (i + 1 == cuts.len()).then_some(LogitsWanted::Last);
            let batch = [SeqTokens {
                seq,
                tokens: &prompt[at..at + n],
                wanted,
            }];
            logits = e.forward_batch(&batch).unwrap().remove(0);
            at += n;
        }
        assert_eq!(at, prompt.len());
        logits
    };
    let whole = feed(&mut e, 0, &[64, 64, 22]);
    let cuts: [&[usize]; 3] = [&[50, 50, 50], &[17, 64, 69], &[126, 24]];
    for (seq, cuts) in (1..).zip(cuts) {
        let got = feed(&mut e, seq, cuts);
        if let Some((i, x, y)) = first_difference(&whole, &got) {
            panic!("cut {cuts:?}: logit {i} is {y}, against {x} cut 64+64+22");
        }
    }
    // A bulk run in a step with another sequence's bulk run and a decode
    // token gets what it gets alone.
    for seq in 0..4 {
        e.truncate_sequence(seq, 0);
    }
    let other = tokens(40, 9);
    let alone = feed(&mut e, 0, &[150]);
    step(&mut e, 1, &other[..20], LogitsWanted::Last);
    step(&mut e, 3, &other[..5], LogitsWanted::Last);
    let shared = e
        .forward_batch(&[
            SeqTokens {
                seq: 1,
                tokens: &other[20..],
                wanted: Some(LogitsWanted::Last),
            },
            SeqTokens {
                seq: 2,
                tokens: &prompt,
                wanted: Some(LogitsWanted::Last),
            },
            SeqTokens {
                seq: 3,
                tokens: &other[5..6],
                wanted: Some(LogitsWanted::Last),
            },
        ])
        .unwrap();
    if let Some((i, x, y)) = first_difference(&alone, &shared[1]) {
        panic!("logit {i} is {y} in a shared step and {x} alone");
    }
}

/// Logits handed back with `Engine::reuse_logits` are the memory the next
/// step writes its logits into, and every value of them is written over:
/// a buffer of NaNs given back changes nothing in the next step's logits.
#[test]
fn logits_handed_back_are_reused_and_written_over() {
    let mut e = engine(true, 1);
    let vocab = e.config().vocab_size;
    let prompt = tokens(30, 7);
    e.forward(&prompt, LogitsWanted::Last).unwrap();
    let run = tokens(4, 8)[1..].to_vec();
    let expected = e.forward(&run, LogitsWanted::All).unwrap();
    assert_eq!(expected.len(), run.len() * vocab);
    e.truncate(prompt.len());
    let junk = vec![f32::NAN; 8 * vocab];
    let junk_at = junk.as_ptr();
    e.reuse_logits(junk);
    let again = e.forward(&run, LogitsWanted::All).unwrap();
    assert_eq!(
        again.as_ptr(),
        junk_at,
        "the handed-back buffer was not used"
    );
    if let Some((i, x, y)) = first_difference(&again, &expected) {
        panic!("logit {i} is {x} in the reused buffer and {y} in a fresh one");
    }
}
