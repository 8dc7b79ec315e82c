//! Every JIT kernel against a scalar f64 reference over many shapes: odd
//! tails, K and rows not multiples of 8/16/32, misaligned pointers, single
//! row and single token. Error bounds are the usual n*eps forward bounds.

use pulsar::jit::cpu::{CpuCaps, Isa};
use pulsar::jit::emit::gemm::GemmParams;
use pulsar::jit::emit::gemv::{GemvParams, WeightType};
use pulsar::jit::kernels::{AttnScores, AttnWsum, Geglu, Gemm, Gemv, KernelSet, RmsNorm, Softmax};
use pulsar::jit::plan::KernelKind;
use pulsar::model::row_blocks;

const EPS: f64 = f32::EPSILON as f64;

/// Small deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

fn caps() -> CpuCaps {
    let c = CpuCaps::detect();
    assert!(
        c.has_jit_baseline(),
        "these tests need AVX2+F16C+FMA; CPU: {c}"
    );
    c
}

/// Builds under both --max-isa levels: the code must verify under each and
/// be identical (only AVX2 kernels exist so far), and the AVX2 build is used.
fn set(kinds: &[KernelKind]) -> KernelSet {
    let avx2 = KernelSet::from_kinds(kinds, &caps(), Isa::Avx2).expect("emit+verify (avx2)");
    let wide = KernelSet::from_kinds(kinds, &caps(), Isa::Avx512).expect("emit+verify (avx512)");
    for (a, b) in avx2.kernels().iter().zip(wide.kernels()) {
        assert_eq!(a.code, b.code, "{}", a.spec.name);
    }
    avx2
}

fn to_u16(wt: WeightType, v: f32) -> u16 {
    match wt {
        WeightType::F16 => half::f16::from_f32(v).to_bits(),
        WeightType::Bf16 => half::bf16::from_f32(v).to_bits(),
        WeightType::F32 => unreachable!(),
    }
}

fn from_u16(wt: WeightType, b: u16) -> f64 {
    match wt {
        WeightType::F16 => half::f16::from_bits(b).to_f64(),
        WeightType::Bf16 => half::bf16::from_bits(b).to_f64(),
        WeightType::F32 => unreachable!(),
    }
}

/// Checks `got` against `exact` with bound k*eps*magnitude (+ tiny floor).
fn close(got: f32, exact: f64, magnitude: f64, k: usize, what: &str) {
    let tol = (k as f64 + 2.0) * EPS * magnitude + 1e-30;
    let err = (got as f64 - exact).abs();
    assert!(
        err <= tol,
        "{what}: got {got}, exact {exact}, err {err:e} > tol {tol:e}"
    );
}

/// `close` for a sum of `terms`: the exact value is their sum and the
/// error bound scales with the sum of their magnitudes.
fn close_to_sum(got: f32, terms: &[f64], k: usize, what: &str) {
    let magnitude = terms.iter().map(|v| v.abs()).sum();
    close(got, terms.iter().sum(), magnitude, k, what);
}

/// K values of the GEMV sweeps: tails of every length, unrolled loops
/// with and without whole groups left over.
const GEMV_KS: [usize; 12] = [8, 9, 13, 16, 17, 31, 33, 40, 63, 100, 640, 1001];

/// The GEMV kernels of every K in `GEMV_KS`.
fn gemv_kinds(wt: WeightType, unroll: usize, zmm: bool) -> Vec<KernelKind> {
    GEMV_KS
        .iter()
        .map(|&k| KernelKind::Gemv(GemvParams { wt, k, unroll, zmm }))
        .collect()
}

#[test]
fn gemv_matches_reference() {
    let mut rng = Rng(0x1234_5678);
    for wt in [WeightType::F16, WeightType::Bf16] {
        for unroll in [1usize, 2, 4] {
            let kinds = gemv_kinds(wt, unroll, false);
            check_gemv(&set(&kinds), wt, &mut rng);
        }
    }
}

/// The GEMV on zmm registers (`emit::gemv_wide`), F16 and BF16, against
/// the same f64 reference and bound as the ymm form: only the order of
/// the f32 sums differs. Under AVX2 the verifier refuses it; on a CPU
/// without AVX-512 it is refused under either ISA.
#[test]
fn zmm_gemv_matches_reference() {
    let c = caps();
    let mut rng = Rng(0x2718_2818);
    for wt in [WeightType::F16, WeightType::Bf16] {
        for unroll in [1usize, 2, 4] {
            let kinds = gemv_kinds(wt, unroll, true);
            assert!(KernelSet::from_kinds(&kinds, &c, Isa::Avx2).is_err());
            if !c.has_avx512() {
                assert!(KernelSet::from_kinds(&kinds, &c, Isa::Avx512).is_err());
                println!("{wt:?} u{unroll}: this CPU lacks AVX-512; refused by the verifier");
                continue;
            }
            let s = KernelSet::from_kinds(&kinds, &c, Isa::Avx512).expect("emit + verify");
            check_gemv(&s, wt, &mut rng);
        }
    }
}

/// Every GEMV of `s` (one per K of `GEMV_KS`) over 1-17 rows, misaligned
/// and aligned, on ranges that start on 4-row blocks: rows outside the
/// range untouched, the rest within the n*eps bound of the f64 sums.
fn check_gemv(s: &KernelSet, wt: WeightType, rng: &mut Rng) {
    for &k in &GEMV_KS {
        let g = s.get::<Gemv>((wt, k)).expect("kernel present");
        for rows in [1usize, 2, 3, 4, 5, 7, 9, 17] {
            // One extra element in front makes pointers misaligned.
            for misalign in [0usize, 1] {
                let w: Vec<u16> = (0..rows * k).map(|_| to_u16(wt, rng.f())).collect();
                let wbuf = blocked(&w, rows, k, misalign);
                let xbuf = rng.vec(k + misalign, 2.0);
                let x = &xbuf[misalign..];
                // Ranges start on 4-row blocks.
                for range in [0..rows, ((rows / 2) & !3)..rows, 0..(rows - rows / 3)] {
                    let mut ybuf = vec![f32::NAN; rows + misalign];
                    let y = &mut ybuf[misalign..];
                    g.run(&wbuf[misalign..], x, y, range.clone())
                        .expect("shape ok");
                    for r in 0..rows {
                        if !range.contains(&r) {
                            assert!(y[r].is_nan(), "row {r} outside {range:?} was written");
                            continue;
                        }
                        let (mut exact, mut mag) = (0f64, 0f64);
                        for i in 0..k {
                            let p = from_u16(wt, w[r * k + i]) * x[i] as f64;
                            exact += p;
                            mag += p.abs();
                        }
                        close(
                            y[r],
                            exact,
                            mag,
                            k,
                            &format!("{} rows {rows} r {r} mis {misalign}", g.name),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gemv_rows_split_across_threads_match_one_call() {
    use pulsar::jit::plan::split_rows;
    let (wt, k, rows) = (WeightType::Bf16, 203usize, 61usize);
    let s = set(&[KernelKind::Gemv(GemvParams {
        wt,
        k,
        unroll: 2,
        zmm: false,
    })]);
    let g = s.get::<Gemv>((wt, k)).unwrap();
    let mut rng = Rng(4242);
    let w: Vec<u16> = (0..rows * k).map(|_| to_u16(wt, rng.f())).collect();
    let w = blocked(&w, rows, k, 0);
    let x = rng.vec(k, 1.0);
    let mut whole = vec![0f32; rows];
    g.run(&w, &x, &mut whole, 0..rows).unwrap();
    for threads in [1usize, 2, 3, 5] {
        let mut y = vec![f32::NAN; rows];
        std::thread::scope(|sc| {
            let mut rest: &mut [f32] = &mut y;
            for r in split_rows(rows, threads, 4) {
                let (part, tail) = rest.split_at_mut(r.len());
                rest = tail;
                let (w, x) = (&w, &x);
                sc.spawn(move || g.run_part(w, x, part, r).unwrap());
            }
        });
        assert_eq!(y, whole, "threads {threads}");
    }
    let mut short = vec![0f32; 3];
    assert!(g.run_part(&w, &x, &mut short, 4..8).is_err());
}

#[test]
fn gemv_rejects_bad_shapes() {
    let s = set(&[KernelKind::Gemv(GemvParams {
        wt: WeightType::F16,
        k: 16,
        unroll: 1,
        zmm: false,
    })]);
    let g = s.get::<Gemv>((WeightType::F16, 16)).unwrap();
    let w = vec![0u16; 16 * 4];
    let mut y = vec![0f32; 4];
    assert!(g.run(&w, &[0.0; 15], &mut y, 0..4).is_err());
    assert!(g.run(&w, &[0.0; 16], &mut y, 0..5).is_err());
    assert!(g.run(&w[..63], &[0.0; 16], &mut y, 0..4).is_err());
    // A range must start on a 4-row block.
    assert!(g.run(&w, &[0.0; 16], &mut y, 1..4).is_err());
    assert!(g.run(&w, &[0.0; 16], &mut y, 0..4).is_ok());
}

/// One accessor for every kind: a key finds the kernel that serves it, an
/// id resolved once binds it again without a search, and an id is refused
/// by another set or for another key (calling the code would be undefined).
#[test]
fn kernels_are_found_by_key_and_bound_by_id() {
    let kinds = [
        KernelKind::Gemv(GemvParams {
            wt: WeightType::F16,
            k: 16,
            unroll: 1,
            zmm: false,
        }),
        KernelKind::Softmax,
    ];
    let s = set(&kinds);
    assert!(s.get::<Gemv>((WeightType::F16, 32)).is_none());
    assert!(s.get::<Gemv>((WeightType::Bf16, 16)).is_none());
    assert!(s.get::<Gemm>((WeightType::F16, 16)).is_none());
    let id = s.resolve::<Gemv>((WeightType::F16, 16)).expect("planned");
    let bound: Gemv = s.bind(id, (WeightType::F16, 16));
    assert_eq!(
        bound.name,
        s.get::<Gemv>((WeightType::F16, 16)).unwrap().name
    );
    let softmax: Softmax = s.bind(s.resolve::<Softmax>(()).unwrap(), ());
    assert_eq!(softmax.name, "softmax");

    let other = set(&kinds);
    let from_another_set =
        std::panic::catch_unwind(|| other.bind::<Gemv>(id, (WeightType::F16, 16)).name.len());
    assert!(from_another_set.is_err(), "an id of another set was bound");
    let for_another_key =
        std::panic::catch_unwind(|| s.bind::<Gemv>(id, (WeightType::F16, 32)).name.len());
    assert!(for_another_key.is_err(), "an id was bound for another K");
}

/// A row-major matrix in the kernels' row-block layout, after `misalign`
/// leading values.
fn blocked(w: &[u16], rows: usize, k: usize, misalign: usize) -> Vec<u16> {
    let mut out = vec![0u16; misalign];
    out.extend(row_blocks::from_row_major(w, rows, k));
    out
}

/// Checks `Y[t*ldy + r] = W[r] . x[t]` for r in `rows` against float64 and
/// that no element outside `rows` was written (Y starts as NaN).
fn check_gemm(
    y: &[f32],
    ldy: usize,
    rows: &std::ops::Range<usize>,
    (w, x, wt, k): (&[u16], &[f32], WeightType, usize),
    name: &str,
) {
    for t in 0..y.len() / ldy {
        for r in 0..ldy {
            let got = y[t * ldy + r];
            if !rows.contains(&r) {
                assert!(got.is_nan(), "{name}: Y[{t},{r}] outside rows was written");
                continue;
            }
            let p: Vec<f64> = (0..k)
                .map(|i| from_u16(wt, w[r * k + i]) * x[t * k + i] as f64)
                .collect();
            close_to_sum(got, &p, k, &format!("{name} t{t} r{r}"));
        }
    }
}

#[test]
fn gemm_matches_reference() {
    let mut rng = Rng(0xfeed);
    let ks = [8usize, 11, 16, 24, 37, 64, 130];
    for wt in [WeightType::F16, WeightType::Bf16] {
        let kinds: Vec<KernelKind> = ks
            .iter()
            .map(|&k| KernelKind::Gemm(GemmParams { wt, k }))
            .collect();
        let s = set(&kinds);
        for &k in &ks {
            let g = s.get::<Gemm>((wt, k)).unwrap();
            for rows in [1usize, 3, 4, 6, 9] {
                for tokens in [1usize, 2, 3, 4, 5, 6, 7, 12, 13] {
                    let misalign = (rows + tokens) % 2;
                    let w: Vec<u16> = (0..rows * k).map(|_| to_u16(wt, rng.f())).collect();
                    let wbuf = blocked(&w, rows, k, misalign);
                    let xbuf = rng.vec(tokens * k + misalign, 1.5);
                    let x = &xbuf[misalign..];
                    let ldy = rows + 3;
                    let range = ((rows / 2) & !3)..rows;
                    let mut y = vec![f32::NAN; tokens * ldy];
                    g.run(&wbuf[misalign..], x, tokens, &mut y, ldy, range.clone())
                        .unwrap();
                    check_gemm(&y, ldy, &range, (&w, x, wt, k), g.name);
                }
            }
        }
    }
}

/// Row ranges longer than one panel (`gemm::panel_rows`) reach the kernel as
/// several calls; every row must still be written once and only its own.
#[test]
fn gemm_spans_several_panels() {
    let mut rng = Rng(0xbeef);
    let (wt, k, tokens) = (WeightType::F16, 1001usize, 5usize);
    let panel = pulsar::jit::emit::gemm::panel_rows(k * 2);
    let rows = 2 * panel + 7;
    let s = set(&[KernelKind::Gemm(GemmParams { wt, k })]);
    let g = s.get::<Gemm>((wt, k)).unwrap();
    let w: Vec<u16> = (0..rows * k).map(|_| to_u16(wt, rng.f())).collect();
    let x = rng.vec(tokens * k, 1.0);
    let ldy = rows + 1;
    let range = 4..rows;
    let mut y = vec![f32::NAN; tokens * ldy];
    g.run(
        &blocked(&w, rows, k, 0),
        &x,
        tokens,
        &mut y,
        ldy,
        range.clone(),
    )
    .unwrap();
    check_gemm(&y, ldy, &range, (&w, &x, wt, k), g.name);
}

fn rms_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(&a, &b)| a as f64 * s * b as f64)
        .collect()
}

#[test]
fn rmsnorm_matches_reference() {
    let mut rng = Rng(7);
    let dims = [8usize, 9, 15, 16, 17, 33, 100, 256, 640, 1001];
    for unroll in [1usize, 2, 4] {
        let kinds: Vec<KernelKind> = dims
            .iter()
            .map(|&dim| KernelKind::RmsNorm { dim, unroll })
            .collect();
        let s = set(&kinds);
        for &dim in &dims {
            let k = s.get::<RmsNorm>(dim).unwrap();
            for rows in [1usize, 2, 3] {
                let xbuf = rng.vec(rows * dim + 1, 3.0);
                let x = &xbuf[1..];
                let w = rng.vec(dim, 2.0);
                let mut out = vec![0f32; rows * dim];
                k.run(x, &w, &mut out, 1e-6).unwrap();
                let mut inplace = x.to_vec();
                k.run_inplace(&mut inplace, &w, 1e-6).unwrap();
                for r in 0..rows {
                    let exact = rms_ref(&x[r * dim..(r + 1) * dim], &w, 1e-6);
                    for i in 0..dim {
                        let mag = exact[i].abs();
                        close(
                            out[r * dim + i],
                            exact[i],
                            mag,
                            dim.min(64) + 8,
                            &format!("{} r{r} i{i}", k.name),
                        );
                        close(
                            inplace[r * dim + i],
                            exact[i],
                            mag,
                            dim.min(64) + 8,
                            "inplace",
                        );
                    }
                }
            }
        }
    }
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

#[test]
fn geglu_matches_reference() {
    let mut rng = Rng(5);
    let widths = [1usize, 8, 9, 13, 64, 1001, 2048];
    let kinds: Vec<KernelKind> = widths
        .iter()
        .map(|&width| KernelKind::Geglu { width })
        .collect();
    let s = set(&kinds);
    for &w in &widths {
        let k = s.get::<Geglu>(w).unwrap();
        for rows in [1usize, 2, 3, 8, 9] {
            let n = rows * w;
            if n < 8 {
                let g = vec![0f32; n];
                let mut o = vec![0f32; n];
                assert!(k.run(&g, &g, &mut o).is_err(), "n < 8 must be rejected");
                continue;
            }
            let gbuf = rng.vec(n + 1, 12.0);
            let gate = &gbuf[1..];
            let up = rng.vec(n, 2.0);
            let mut out = vec![f32::NAN; n];
            k.run(gate, &up, &mut out).unwrap();
            for i in 0..n {
                let exact = gelu_tanh(gate[i] as f64) * up[i] as f64;
                let mag = (gate[i] as f64 * up[i] as f64).abs();
                let err = (out[i] as f64 - exact).abs();
                // The tanh/exp approximation is held to 2e-6 relative to |x*up|.
                assert!(
                    err <= 2e-6 * mag + 1e-30,
                    "{} i{i} x={} got {} exact {exact} err {err:e}",
                    k.name,
                    gate[i],
                    out[i]
                );
            }
        }
    }
}

#[test]
fn attention_scores_match_reference() {
    let mut rng = Rng(21);
    for hd in [8usize, 16, 24, 20, 256] {
        let s = set(&[KernelKind::AttnScores(GemmParams {
            wt: WeightType::F32,
            k: hd,
        })]);
        let k = s.get::<AttnScores>(hd).unwrap();
        for (n_keys, nq) in [
            (1usize, 1usize),
            (2, 4),
            (3, 5),
            (5, 2),
            (17, 8),
            (33, 13),
            (150, 7),
        ] {
            // Offset by one float: the kernel must not assume alignment.
            let kbuf = rng.vec(n_keys * hd + 1, 1.0);
            let keys = &kbuf[1..];
            let queries = rng.vec(nq * hd, 1.0);
            let mut sc = vec![f32::NAN; nq * n_keys];
            k.run(keys, &queries, &mut sc).unwrap();
            for i in 0..nq {
                for j in 0..n_keys {
                    let terms: Vec<f64> = (0..hd)
                        .map(|d| keys[j * hd + d] as f64 * queries[i * hd + d] as f64)
                        .collect();
                    close_to_sum(
                        sc[i * n_keys + j],
                        &terms,
                        hd + 1,
                        &format!("{} q{i} key{j}", k.name),
                    );
                }
            }
        }
        let mut short = vec![0.0; 3];
        assert!(
            k.run(&vec![0.0; 2 * hd], &vec![0.0; 2 * hd], &mut short)
                .is_err()
        );
    }
}

#[test]
fn softmax_matches_reference() {
    let mut rng = Rng(3);
    let s = set(&[KernelKind::Softmax]);
    let k = s.get::<Softmax>(()).unwrap();
    for n in [1usize, 2, 7, 8, 9, 15, 16, 17, 100, 1000] {
        let xbuf = rng.vec(n + 1, 20.0);
        let mut x = xbuf[1..].to_vec();
        let orig = x.clone();
        k.run(&mut x);
        let m = orig.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = orig.iter().map(|&v| (v as f64 - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for i in 0..n {
            let exact = e[i] / sum;
            let err = (x[i] as f64 - exact).abs();
            // f32 rounding of x - max alone costs |x - max| * eps relative.
            let tol = exact * (2e-6 + (orig[i] as f64 - m).abs() * EPS) + 1e-30;
            assert!(err <= tol, "softmax n{n} i{i}: {} vs {exact}", x[i]);
        }
    }
}

#[test]
fn attention_weighted_sum_matches_reference() {
    let mut rng = Rng(77);
    for hd in [8usize, 16, 64, 72, 136, 256] {
        let s = set(&[KernelKind::AttnWsum { head_dim: hd }]);
        let k = s.get::<AttnWsum>(hd).unwrap();
        // Query counts around the 6-query tile; key counts incl. none.
        for (n_keys, nq) in [(0usize, 1usize), (1, 1), (5, 6), (33, 7), (9, 13), (4, 2)] {
            let ldp = n_keys + 3;
            let vbuf = rng.vec(n_keys * hd + 1, 1.0);
            let v = &vbuf[1..];
            let p: Vec<f32> = (0..nq * ldp).map(|_| rng.f().abs()).collect();
            let mut out = vec![f32::NAN; nq * hd + 5];
            k.run(&p, ldp, v, &mut out[..nq * hd]).unwrap();
            for i in 0..nq {
                for d in 0..hd {
                    let terms: Vec<f64> = (0..n_keys)
                        .map(|j| p[i * ldp + j] as f64 * v[j * hd + d] as f64)
                        .collect();
                    close_to_sum(
                        out[i * hd + d],
                        &terms,
                        n_keys,
                        &format!("{} q{i} keys{n_keys} d{d}", k.name),
                    );
                }
            }
            // Rows past nq are never written.
            assert!(out[nq * hd..].iter().all(|x| x.is_nan()), "{}", k.name);
        }
        assert!(
            k.run(&[0.0; 4], 2, &vec![0.0; 3 * hd], &mut vec![0.0; hd])
                .is_err()
        );
    }
}

/// A decode step's weighted sum, read V row by row in Rust
/// (`engine::decode_wsum`), gives the JIT kernel's very bits: both sum
/// each output key after key with one FMA from zero, so a token's
/// attention does not depend on which of the two computed it.
#[test]
fn decode_weighted_sum_by_rows_equals_the_jit_kernel_bit_for_bit() {
    use pulsar::engine::decode_wsum::{MAX_QUERIES, weighted_sum_by_rows};
    let mut rng = Rng(78);
    for hd in [8usize, 64, 256] {
        let s = set(&[KernelKind::AttnWsum { head_dim: hd }]);
        let k = s.get::<AttnWsum>(hd).unwrap();
        for (n_keys, nq) in [(0usize, 1usize), (1, 1), (5, 4), (33, 3), (300, 4), (17, 2)] {
            assert!(nq <= MAX_QUERIES);
            let ldp = n_keys + 3;
            let v = rng.vec(n_keys * hd, 1.0);
            let p: Vec<f32> = (0..nq * ldp).map(|_| rng.f().abs()).collect();
            let mut jit = vec![f32::NAN; nq * hd];
            k.run(&p, ldp, &v, &mut jit).unwrap();
            let mut rows = vec![f32::NAN; nq * hd];
            weighted_sum_by_rows(&p, ldp, &v, hd, &mut rows);
            let same = jit
                .iter()
                .zip(&rows)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "head_dim {hd}, {n_keys} keys, {nq} queries");
        }
    }
}

/// A verify step's dozens of query rows, summed in zmm tiles of 4 queries
/// x 64 dims on CPUs with AVX-512 (`decode_wsum::weighted_sum_tiled`),
/// give the JIT kernel's bits too, for whole and partial tiles; elsewhere
/// the function falls back to the row-by-row sum, checked the same way.
#[test]
fn tiled_weighted_sum_equals_the_jit_kernel_bit_for_bit() {
    use pulsar::engine::decode_wsum::{tiled_available, weighted_sum_tiled};
    if !tiled_available(256) {
        println!("this CPU has no AVX-512: the tiled sum's fallback is checked");
    }
    let mut rng = Rng(91);
    for hd in [64usize, 256] {
        let s = set(&[KernelKind::AttnWsum { head_dim: hd }]);
        let k = s.get::<AttnWsum>(hd).unwrap();
        for (n_keys, nq) in [(1usize, 5usize), (275, 32), (33, 7), (300, 64), (8, 13)] {
            let ldp = n_keys + 5;
            let v = rng.vec(n_keys * hd, 1.0);
            // Some probabilities exactly 0, as masked keys are.
            let p: Vec<f32> = (0..nq * ldp)
                .map(|i| if i % 7 == 3 { 0.0 } else { rng.f().abs() })
                .collect();
            let mut jit = vec![f32::NAN; nq * hd];
            k.run(&p, ldp, &v, &mut jit).unwrap();
            let mut tiled = vec![f32::NAN; nq * hd];
            weighted_sum_tiled(&p, ldp, &v, hd, &mut tiled);
            let same = jit
                .iter()
                .zip(&tiled)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "head_dim {hd}, {n_keys} keys, {nq} queries");
        }
    }
}

/// The kernels the planner actually ships for the two reference shapes,
/// under each ISA this CPU allows (AVX2, and AVX-512's 16-bit GEMM where
/// it has it), each checked once against the reference (the shape sweeps
/// above cover the emitters in general).
#[test]
fn planned_kernels_match_reference() {
    use pulsar::engine::wide_input::WideInput;
    use pulsar::jit::dims::ModelDims;
    use pulsar::jit::emit::gemm_wide::WideProducts;
    use pulsar::jit::kernels::GemmWide;
    use pulsar::jit::plan::{PlanOptions, plan};
    let gemma_2b = ModelDims::from(&pulsar::model::presets::gemma_2b());
    let mut rng = Rng(2024);
    let c = caps();
    let mut isas = vec![Isa::Avx2];
    if c.has_avx512() {
        isas.push(Isa::Avx512);
    }
    let cases = isas.into_iter().flat_map(|max_isa| {
        [WeightType::F16, WeightType::Bf16]
            .into_iter()
            .flat_map(move |weights| {
                [ModelDims::GEMMA3_270M, gemma_2b].map(|dims| (dims, max_isa, weights))
            })
    });
    for (dims, max_isa, weights) in cases {
        let opts = PlanOptions {
            max_isa,
            weights,
            ..PlanOptions::default()
        };
        let p = plan(&dims, &c, &opts).unwrap();
        let s = KernelSet::build(&p, &c, max_isa).unwrap();
        for spec in &p.kernels {
            match &spec.kind {
                KernelKind::GemmWide(g) => {
                    let k = dims.hidden;
                    let gemm = s.get::<GemmWide>((g.wt, k)).unwrap();
                    let (rows, tokens) = (21, 7);
                    let w: Vec<u16> = (0..rows * k).map(|_| to_u16(g.wt, rng.f())).collect();
                    let x = rng.vec(tokens * k, 1.0);
                    let tiles = WideInput::new(&x, k, g);
                    let mut y = vec![0f32; tokens * rows];
                    let wb = blocked(&w, rows, k, 0);
                    gemm.run(&wb, tiles.bytes(), tokens, &mut y, rows, 0..rows)
                        .unwrap();
                    for t in 0..tokens {
                        for r in 0..rows {
                            let v: Vec<f64> = (0..k)
                                .map(|i| from_u16(g.wt, w[r * k + i]) * x[t * k + i] as f64)
                                .collect();
                            let got = y[t * rows + r];
                            if g.products == WideProducts::Bf16Dot {
                                // Inputs rounded to bf16 (see the test above).
                                let mag: f64 = v.iter().map(|p| p.abs()).sum();
                                let err = (got as f64 - v.iter().sum::<f64>()).abs();
                                assert!(err <= mag / 256.0, "{} {err:e}", spec.name);
                            } else {
                                close_to_sum(got, &v, k, &spec.name);
                            }
                        }
                    }
                }
                KernelKind::Gemv(g) => {
                    let gemv = s.get::<Gemv>((g.wt, g.k)).unwrap();
                    let rows = 7;
                    let w: Vec<u16> = (0..rows * g.k).map(|_| to_u16(g.wt, rng.f())).collect();
                    let x = rng.vec(g.k, 1.0);
                    let mut y = vec![0f32; rows];
                    gemv.run(&blocked(&w, rows, g.k, 0), &x, &mut y, 0..rows)
                        .unwrap();
                    for r in 0..rows {
                        let t: Vec<f64> = (0..g.k)
                            .map(|i| from_u16(g.wt, w[r * g.k + i]) * x[i] as f64)
                            .collect();
                        close_to_sum(y[r], &t, g.k, &spec.name);
                    }
                }
                KernelKind::Gemm(g) => {
                    let gemm = s.get::<Gemm>((g.wt, g.k)).unwrap();
                    let (rows, tokens) = (5, 4);
                    let w: Vec<u16> = (0..rows * g.k).map(|_| to_u16(g.wt, rng.f())).collect();
                    let x = rng.vec(tokens * g.k, 1.0);
                    let mut y = vec![0f32; tokens * rows];
                    gemm.run(
                        &blocked(&w, rows, g.k, 0),
                        &x,
                        tokens,
                        &mut y,
                        rows,
                        0..rows,
                    )
                    .unwrap();
                    for t in 0..tokens {
                        for r in 0..rows {
                            let v: Vec<f64> = (0..g.k)
                                .map(|i| from_u16(g.wt, w[r * g.k + i]) * x[t * g.k + i] as f64)
                                .collect();
                            close_to_sum(y[t * rows + r], &v, g.k, &spec.name);
                        }
                    }
                }
                KernelKind::RmsNorm { dim, .. } => {
                    let k = s.get::<RmsNorm>(*dim).unwrap();
                    let x = rng.vec(*dim, 2.0);
                    let w = rng.vec(*dim, 1.0);
                    let mut out = vec![0f32; *dim];
                    k.run(&x, &w, &mut out, 1e-6).unwrap();
                    let exact = rms_ref(&x, &w, 1e-6);
                    for i in 0..*dim {
                        close(out[i], exact[i], exact[i].abs(), 72, &spec.name);
                    }
                }
                KernelKind::Geglu { width } => {
                    let k = s.get::<Geglu>(*width).unwrap();
                    let (g, u) = (rng.vec(*width, 6.0), rng.vec(*width, 1.0));
                    let mut out = vec![0f32; *width];
                    k.run(&g, &u, &mut out).unwrap();
                    for i in 0..*width {
                        let exact = gelu_tanh(g[i] as f64) * u[i] as f64;
                        assert!(
                            (out[i] as f64 - exact).abs()
                                <= 2e-6 * (g[i] * u[i]).abs() as f64 + 1e-30,
                            "{}",
                            spec.name
                        );
                    }
                }
                // Scores, softmax and wsum have no shape beyond head_dim,
                // which the sweeps above already include (256).
                _ => {}
            }
        }
    }
}

/// The 16-bit GEMM on zmm registers (`emit::gemm_wide`) in each form:
/// F16 and BF16 widened with f32 inputs, held to the f32 bound as the
/// AVX2 GEMM; BF16 dot products, whose inputs are rounded to bf16 (round
/// to nearest even) before exact products summed in f32: held to the same
/// bound against the products with the rounded inputs, and to 2^-8 of
/// the products' magnitude against the f32 inputs (the rounding's 2^-9
/// per input, with room for the f32 sums).
#[test]
fn wide_gemm_matches_reference_in_each_form() {
    use pulsar::engine::wide_input::{WideInput, bf16_round};
    use pulsar::jit::emit::gemm_wide::{GemmWideParams, WideProducts};
    use pulsar::jit::kernels::GemmWide;
    let c = caps();
    let forms = [
        (WeightType::F16, WideProducts::Fma),
        (WeightType::Bf16, WideProducts::Fma),
        (WeightType::Bf16, WideProducts::Bf16Dot),
    ];
    let mut rng = Rng(0x5eed);
    for (wt, products) in forms {
        let params = GemmWideParams { wt, products };
        let kinds = [KernelKind::GemmWide(params)];
        // Only the AVX-512 ISA admits it: under AVX2 the verifier refuses.
        assert!(KernelSet::from_kinds(&kinds, &c, Isa::Avx2).is_err());
        let needs_bf16 = products == WideProducts::Bf16Dot;
        if !c.has_avx512() || needs_bf16 && !c.avx512_bf16 {
            let built = KernelSet::from_kinds(&kinds, &c, Isa::Avx512);
            assert!(built.is_err(), "{params:?} verified on a CPU without it");
            println!("{params:?}: this CPU lacks it; refused by the verifier");
            continue;
        }
        let s = KernelSet::from_kinds(&kinds, &c, Isa::Avx512).expect("emit + verify");
        for k in [8usize, 11, 16, 37, 64, 130, 640] {
            let g = s.get::<GemmWide>((wt, k)).expect("one kernel for every K");
            for rows in [1usize, 4, 7, 16, 21, 37] {
                for tokens in [2usize, 5, 6, 7, 13] {
                    let w: Vec<u16> = (0..rows * k).map(|_| to_u16(wt, rng.f())).collect();
                    let x = rng.vec(tokens * k, 1.5);
                    let tiles = WideInput::new(&x, k, &params);
                    let ldy = rows + 3;
                    let range = 0..rows;
                    let mut y = vec![f32::NAN; tokens * ldy];
                    let wb = blocked(&w, rows, k, 0);
                    g.run(&wb, tiles.bytes(), tokens, &mut y, ldy, range.clone())
                        .unwrap();
                    let name = format!("{} k{k} rows{rows} tokens{tokens}", g.name);
                    if !needs_bf16 {
                        check_gemm(&y, ldy, &range, (&w, &x, wt, k), &name);
                        continue;
                    }
                    let rounded: Vec<f32> = x
                        .iter()
                        .map(|&v| half::bf16::from_bits(bf16_round(v)).to_f32())
                        .collect();
                    check_gemm(&y, ldy, &range, (&w, &rounded, wt, k), &name);
                    for t in 0..tokens {
                        for r in 0..rows {
                            let p: Vec<f64> = (0..k)
                                .map(|i| from_u16(wt, w[r * k + i]) * x[t * k + i] as f64)
                                .collect();
                            let mag: f64 = p.iter().map(|v| v.abs()).sum();
                            let err = (y[t * ldy + r] as f64 - p.iter().sum::<f64>()).abs();
                            assert!(err <= mag / 256.0, "{name} t{t} r{r}: {err:e} of {mag:e}");
                        }
                    }
                }
            }
            // Rows must start on the register tile's rows.
            let mut y = vec![0f32; 4 * k];
            let tiles = WideInput::new(&vec![0.0; 2 * k], k, &params);
            let w = vec![0u16; 8 * row_blocks::padded_cols(k)];
            assert!(g.run(&w, tiles.bytes(), 2, &mut y, 8, 4..8).is_err());
            assert!(g.run(&w, &tiles.bytes()[1..], 2, &mut y, 8, 0..8).is_err());
        }
    }
}
