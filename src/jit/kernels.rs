//! The kernel registry: emits and verifies every kernel of a plan, maps them
//! into one executable buffer (written while not executable, then flipped to
//! read+execute: never writable and executable at once), and hands out typed
//! entry points behind safe wrappers that check slice lengths.

use super::cpu::{CpuCaps, Isa};
use super::emit::gemv::WeightType;
use super::emit::{LANES, gemm, gemm_quant};
use super::plan::{KernelKind, KernelSpec, Plan};
use super::verify::{self, Policy, Verified};
use crate::model::quant_blocks::{self, QuantType};
use crate::model::row_blocks;
use anyhow::{Context, Result};
use dynasmrt::mmap::{ExecutableBuffer, MutableBuffer};
use std::ops::Range;
use std::time::{Duration, Instant};

/// Errors from a kernel call with arguments that do not fit the kernel.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("kernel {kernel}: {what}")]
    Shape { kernel: String, what: String },
}

fn shape(kernel: &str, what: String) -> KernelError {
    KernelError::Shape {
        kernel: kernel.to_string(),
        what,
    }
}

/// One emitted, verified kernel.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub spec: KernelSpec,
    pub code: Vec<u8>,
    pub verified: Verified,
    /// Offset of the kernel inside the executable buffer.
    pub offset: usize,
}

/// Emitted kernels before mapping, plus timings.
pub struct Emitted {
    pub kernels: Vec<Compiled>,
    pub emit_time: Duration,
    pub verify_time: Duration,
}

/// Emits and verifies every kernel of `plan`; stops at the first failure.
pub fn emit_and_verify(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<Emitted> {
    emit_and_verify_specs(&plan.kernels, caps, max_isa)
}

/// Emits and verifies the given kernels; stops at the first failure.
pub fn emit_and_verify_specs(
    specs: &[KernelSpec],
    caps: &CpuCaps,
    max_isa: Isa,
) -> Result<Emitted> {
    let policy = Policy::new(caps, max_isa);
    let t0 = Instant::now();
    let mut codes = Vec::with_capacity(specs.len());
    for spec in specs {
        codes.push(spec.kind.emit()?);
    }
    let emit_time = t0.elapsed();
    let t1 = Instant::now();
    let mut kernels = Vec::with_capacity(codes.len());
    let mut offset = 0;
    for (spec, code) in specs.iter().zip(codes) {
        let verified = verify::verify(
            &spec.name,
            &code,
            &policy.with_vector_bits(spec.kind.vector_bits()),
        )?;
        let len = code.len();
        kernels.push(Compiled {
            spec: spec.clone(),
            code,
            verified,
            offset,
        });
        offset += len;
    }
    Ok(Emitted {
        kernels,
        emit_time,
        verify_time: t1.elapsed(),
    })
}

/// Appends one line per kernel to `/tmp/perf-<pid>.map`, the file Linux
/// `perf report` reads to name samples in JIT code (`PULSAR_PERF_MAP=1`).
/// Profiling aid only: a failure to write is reported and otherwise ignored.
///
/// Not written through `fs_atomic`: the path is fixed by perf's protocol,
/// the file belongs to this one process (its pid is in the name) and is
/// appended to by design — each `KernelSet` of the process adds its lines,
/// which a rename-over would drop. A torn last line from a crash only
/// costs perf a symbol name; nobody keeps the file.
fn write_perf_map(base: usize, kernels: &[Compiled]) {
    use std::io::Write;
    let path = format!("/tmp/perf-{}.map", std::process::id());
    let lines: String = kernels
        .iter()
        .map(|k| format!("{:x} {:x} {}\n", base + k.offset, k.code.len(), k.spec.name))
        .collect();
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(lines.as_bytes()));
    if let Err(e) = written {
        eprintln!("pulsar: cannot write the perf map {path}: {e}");
    }
}

/// Executable kernels of one plan.
pub struct KernelSet {
    buf: ExecutableBuffer,
    kernels: Vec<Compiled>,
    /// Tells this set's [`KernelId`]s from another set's.
    serial: u64,
}

/// Where a kernel sits in one [`KernelSet`]: found once (when an engine
/// meets its weights), then used on every call without a search. Valid
/// only for the set that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelId {
    set: u64,
    index: u32,
}

/// A typed entry point to one kernel of a set, found by what its caller
/// knows (LIBXSMM's descriptor-keyed dispatch): each handle type says which
/// kernel kinds serve a key and binds their code to the function type its
/// emitter generated. [`KernelSet::get`] and [`KernelSet::resolve`] are the
/// one accessor for every kind.
pub trait Kernel<'a>: Sized {
    /// What a caller asks for, e.g. a GEMV's weight type and K.
    type Key: Copy + std::fmt::Debug;

    /// Whether a kernel of `kind` computes what `key` asks for.
    fn serves(kind: &KernelKind, key: Self::Key) -> bool;

    /// The handle of `compiled`, whose code starts at `entry`.
    ///
    /// # Safety
    /// `entry` must be the mapped, verified code of `compiled`, and its
    /// kind must serve `key`: its emitter then generated the signature
    /// this handle calls.
    unsafe fn bind(compiled: &'a Compiled, entry: *const u8, key: Self::Key) -> Self;
}

/// Numbers the sets of a process (see [`KernelId`]).
static NEXT_SET_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl KernelSet {
    /// Maps verified kernels. Only code that passed `verify` can get here.
    pub fn map(emitted: Emitted) -> Result<KernelSet> {
        let total: usize = emitted.kernels.iter().map(|k| k.code.len()).sum();
        let mut buf =
            MutableBuffer::new(total.max(1)).context("cannot allocate memory for JIT code")?;
        buf.set_len(total);
        for k in &emitted.kernels {
            buf[k.offset..k.offset + k.code.len()].copy_from_slice(&k.code);
        }
        let buf = buf
            .make_exec()
            .context("cannot make JIT code executable (mprotect failed)")?;
        if std::env::var_os("PULSAR_PERF_MAP").is_some() {
            write_perf_map(buf.as_ptr() as usize, &emitted.kernels);
        }
        Ok(KernelSet {
            buf,
            kernels: emitted.kernels,
            serial: NEXT_SET_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Emits, verifies and maps the kernels of `plan`.
    pub fn build(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<KernelSet> {
        KernelSet::map(emit_and_verify(plan, caps, max_isa)?)
    }

    /// Builds a set from explicit kernel kinds (tests, benchmarks).
    pub fn from_kinds(kinds: &[KernelKind], caps: &CpuCaps, max_isa: Isa) -> Result<KernelSet> {
        let specs: Vec<KernelSpec> = kinds
            .iter()
            .map(|k| KernelSpec {
                name: k.name(),
                kind: k.clone(),
                isa: Isa::Avx2,
                used_for: Vec::new(),
            })
            .collect();
        KernelSet::map(emit_and_verify_specs(&specs, caps, max_isa)?)
    }

    pub fn kernels(&self) -> &[Compiled] {
        &self.kernels
    }

    /// The kernel that serves `key` as a `K`, if the set has one: a
    /// search, for set-up code. Hot paths keep a [`KernelId`] from
    /// [`KernelSet::resolve`] and call [`KernelSet::bind`].
    pub fn get<'a, K: Kernel<'a>>(&'a self, key: K::Key) -> Option<K> {
        self.resolve::<K>(key).map(|id| self.bind(id, key))
    }

    /// Finds the kernel that serves `key`, once.
    pub fn resolve<'a, K: Kernel<'a>>(&'a self, key: K::Key) -> Option<KernelId> {
        let index = self
            .kernels
            .iter()
            .position(|c| K::serves(&c.spec.kind, key))?;
        Some(KernelId {
            set: self.serial,
            index: u32::try_from(index).expect("fewer than 2^32 kernels"),
        })
    }

    /// The kernel `id` as a `K` for `key`, without a search. Panics when
    /// `id` comes from another set or names a kernel that does not serve
    /// `key`: ids are resolved from the same keys at load, so either is a
    /// bug in the engine, and calling the code would be undefined.
    pub fn bind<'a, K: Kernel<'a>>(&'a self, id: KernelId, key: K::Key) -> K {
        assert_eq!(
            id.set, self.serial,
            "kernel id {id:?} belongs to another kernel set"
        );
        let c = &self.kernels[id.index as usize];
        assert!(
            K::serves(&c.spec.kind, key),
            "kernel {} does not serve {key:?}",
            c.spec.name
        );
        // SAFETY: `c` was verified before `map` copied it to `offset` in
        // the executable buffer, and its kind serves `key` (asserted).
        unsafe { K::bind(c, self.buf.as_ptr().wrapping_add(c.offset), key) }
    }
}

impl<'a> Kernel<'a> for Gemv<'a> {
    /// The weights' type and K.
    type Key = (WeightType, usize);
    fn serves(kind: &KernelKind, (wt, k): Self::Key) -> bool {
        matches!(kind, KernelKind::Gemv(g) if g.wt == wt && g.k == k)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (wt, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified GEMV code (see emit::gemv).
        let f = unsafe { std::mem::transmute::<*const u8, GemvFn>(entry) };
        Gemv {
            f,
            name: &c.spec.name,
            k,
            wt,
        }
    }
}

impl<'a> Kernel<'a> for GemvQuant<'a> {
    /// The weights' block type and K (the kernel takes K as an argument,
    /// the handle fixes it).
    type Key = (QuantType, usize);
    fn serves(kind: &KernelKind, (q, k): Self::Key) -> bool {
        quant_blocks::fits(k) && matches!(kind, KernelKind::GemvQuant(g) if g.q == q)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (q, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified integer GEMV code (see
        // emit::gemv_quant).
        let f = unsafe { std::mem::transmute::<*const u8, GemvQuantFn>(entry) };
        GemvQuant {
            f,
            name: &c.spec.name,
            q,
            k,
        }
    }
}

impl<'a> Kernel<'a> for GemmQuant<'a> {
    /// The weights' block type and K (an argument of the kernel, fixed by
    /// the handle).
    type Key = (QuantType, usize);
    fn serves(kind: &KernelKind, (q, k): Self::Key) -> bool {
        quant_blocks::fits(k) && matches!(kind, KernelKind::GemmQuant(g) if g.q == q)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (q, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified integer GEMM code (see
        // emit::gemm_quant).
        let f = unsafe { std::mem::transmute::<*const u8, GemmQuantFn>(entry) };
        GemmQuant {
            f,
            name: &c.spec.name,
            q,
            k,
        }
    }
}

impl<'a> Kernel<'a> for UnpackQuant<'a> {
    /// The packed block type and K (an argument of the kernel).
    type Key = (QuantType, usize);
    fn serves(kind: &KernelKind, (q, k): Self::Key) -> bool {
        quant_blocks::fits(k) && matches!(kind, KernelKind::UnpackQuant(u) if u.q == q)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (q, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified unpacking code (see
        // emit::unpack_quant).
        let f = unsafe { std::mem::transmute::<*const u8, UnpackQuantFn>(entry) };
        let KernelKind::UnpackQuant(params) = c.spec.kind else {
            unreachable!("serves() checked the kind")
        };
        UnpackQuant {
            f,
            name: &c.spec.name,
            q,
            into: params.into,
            k,
        }
    }
}

impl<'a> Kernel<'a> for Gemm<'a> {
    /// The weights' type and K.
    type Key = (WeightType, usize);
    fn serves(kind: &KernelKind, (wt, k): Self::Key) -> bool {
        matches!(kind, KernelKind::Gemm(g) if g.wt == wt && g.k == k)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (wt, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified GEMM code (see emit::gemm).
        let f = unsafe { std::mem::transmute::<*const u8, GemmFn>(entry) };
        Gemm {
            f,
            name: &c.spec.name,
            k,
            wt,
        }
    }
}

impl<'a> Kernel<'a> for RmsNorm<'a> {
    /// The vector length.
    type Key = usize;
    fn serves(kind: &KernelKind, dim: usize) -> bool {
        matches!(kind, KernelKind::RmsNorm { dim: d, .. } if *d == dim)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, dim: usize) -> Self {
        // SAFETY: the caller passes verified RMSNorm code.
        let f = unsafe { std::mem::transmute::<*const u8, RmsNormFn>(entry) };
        RmsNorm {
            f,
            name: &c.spec.name,
            dim,
        }
    }
}

impl<'a> Kernel<'a> for Geglu<'a> {
    /// The feed-forward width.
    type Key = usize;
    fn serves(kind: &KernelKind, width: usize) -> bool {
        matches!(kind, KernelKind::Geglu { width: w } if *w == width)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, width: usize) -> Self {
        // SAFETY: the caller passes verified GeGLU code.
        let f = unsafe { std::mem::transmute::<*const u8, GegluFn>(entry) };
        Geglu {
            f,
            name: &c.spec.name,
            width,
        }
    }
}

impl<'a> Kernel<'a> for AttnScores<'a> {
    /// The head dimension.
    type Key = usize;
    fn serves(kind: &KernelKind, head_dim: usize) -> bool {
        matches!(kind, KernelKind::AttnScores(g) if g.k == head_dim)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, head_dim: usize) -> Self {
        // SAFETY: the caller passes verified code of an f32 GEMM, the
        // GemmFn signature (the keys are its weight rows).
        let f = unsafe { std::mem::transmute::<*const u8, GemmFn>(entry) };
        AttnScores {
            gemm: Gemm {
                f,
                name: &c.spec.name,
                k: head_dim,
                wt: WeightType::F32,
            },
            name: &c.spec.name,
            head_dim,
        }
    }
}

impl<'a> Kernel<'a> for Softmax<'a> {
    /// One softmax serves every length.
    type Key = ();
    fn serves(kind: &KernelKind, (): ()) -> bool {
        matches!(kind, KernelKind::Softmax)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (): ()) -> Self {
        // SAFETY: the caller passes verified softmax code.
        let f = unsafe { std::mem::transmute::<*const u8, SoftmaxFn>(entry) };
        Softmax {
            f,
            name: &c.spec.name,
        }
    }
}

impl<'a> Kernel<'a> for AttnWsum<'a> {
    /// The head dimension.
    type Key = usize;
    fn serves(kind: &KernelKind, head_dim: usize) -> bool {
        matches!(kind, KernelKind::AttnWsum { head_dim: d } if *d == head_dim)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, head_dim: usize) -> Self {
        // SAFETY: the caller passes verified weighted-sum code.
        let f = unsafe { std::mem::transmute::<*const u8, WsumFn>(entry) };
        AttnWsum {
            f,
            name: &c.spec.name,
            head_dim,
        }
    }
}

/// `(w, x, y, r0, r1)`: `y[r] = sum_k W[r,k] x[k]`, r in `r0..r1`.
pub type GemvFn = unsafe extern "sysv64" fn(*const u16, *const f32, *mut f32, usize, usize);
/// `(w, x, y, r0, r1, tokens, ldy)`: `Y[t*ldy + r] = sum_k W[r,k] X[t*K + k]`.
pub type GemmFn =
    unsafe extern "sysv64" fn(*const u16, *const f32, *mut f32, usize, usize, usize, usize);
/// `(x, w, out, rows, eps)`.
pub type RmsNormFn = unsafe extern "sysv64" fn(*const f32, *const f32, *mut f32, usize, f32);
/// `(gate, up, out, rows)`.
pub type GegluFn = unsafe extern "sysv64" fn(*const f32, *const f32, *mut f32, usize);
/// `(x, n)`, in place.
pub type SoftmaxFn = unsafe extern "sysv64" fn(*mut f32, usize);
/// `(p, ldp, v, n_keys, out, nq)`.
pub type WsumFn = unsafe extern "sysv64" fn(*const f32, usize, *const f32, usize, *mut f32, usize);

/// Rows `r0..r1` of a row-block matrix of `k` columns must fit in `len`
/// values (padding rows included), with `r0` on a block boundary.
fn blocks_fit(len: usize, rows: &Range<usize>, k: usize) -> bool {
    rows.start.is_multiple_of(row_blocks::BLOCK_ROWS)
        && rows
            .end
            .next_multiple_of(row_blocks::BLOCK_ROWS)
            .checked_mul(row_blocks::padded_cols(k))
            .is_some_and(|need| need <= len)
}

/// Rows `r < r1` of a `stride`-element row matrix must fit in `len` elements
/// (the last row only needs `k`).
fn rows_fit(len: usize, r1: usize, stride: usize, k: usize) -> bool {
    r1 == 0
        || (r1 - 1)
            .checked_mul(stride)
            .and_then(|v| v.checked_add(k))
            .is_some_and(|need| need <= len)
}

#[derive(Clone, Copy)]
pub struct Gemv<'a> {
    f: GemvFn,
    pub name: &'a str,
    pub k: usize,
    pub wt: WeightType,
}

impl Gemv<'_> {
    /// `y[r] = sum_k W[r,k] x[k]` for r in `rows`; `w` is the whole matrix
    /// in the row-block layout (u16 bits of f16 or bf16, as planned) and
    /// `rows` starts on a block; `y` is indexed by row.
    pub fn run(
        &self,
        w: &[u16],
        x: &[f32],
        y: &mut [f32],
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        if x.len() != self.k {
            return Err(shape(
                self.name,
                format!("x has {} elements, K is {}", x.len(), self.k),
            ));
        }
        if rows.start > rows.end || y.len() < rows.end {
            return Err(shape(
                self.name,
                format!("rows {rows:?} do not fit y of {}", y.len()),
            ));
        }
        if !blocks_fit(w.len(), &rows, self.k) {
            return Err(shape(
                self.name,
                format!(
                    "W of {} values has fewer than {} rows of {} in 4-row blocks, or rows {rows:?} start inside a block",
                    w.len(),
                    rows.end,
                    self.k
                ),
            ));
        }
        // SAFETY: every row read is inside `w`, x has K elements, and only
        // y[rows] is written (checked above).
        unsafe { (self.f)(w.as_ptr(), x.as_ptr(), y.as_mut_ptr(), rows.start, rows.end) };
        Ok(())
    }

    /// Like `run`, but `y_part[i]` receives row `rows.start + i`, so threads
    /// can each own a disjoint piece of y (`split_at_mut` along `split_rows`).
    pub fn run_part(
        &self,
        w: &[u16],
        x: &[f32],
        y_part: &mut [f32],
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        if rows.start > rows.end || y_part.len() != rows.len() {
            return Err(shape(
                self.name,
                format!("y part of {} does not match rows {rows:?}", y_part.len()),
            ));
        }
        if x.len() != self.k || !blocks_fit(w.len(), &rows, self.k) {
            return Err(shape(
                self.name,
                format!(
                    "x {} or W {} too small for K {} and rows {rows:?}",
                    x.len(),
                    w.len(),
                    self.k
                ),
            ));
        }
        // The kernel writes y[r] for r in rows; shifting the base by -start
        // makes that y_part[r - start]. Only in-bounds addresses are written.
        let base = y_part.as_mut_ptr().wrapping_sub(rows.start);
        // SAFETY: as in `run`; writes land in y_part exactly.
        unsafe { (self.f)(w.as_ptr(), x.as_ptr(), base, rows.start, rows.end) };
        Ok(())
    }
}

type GemvQuantFn = unsafe extern "sysv64" fn(*const u8, *const u8, *mut f32, usize, usize, usize);

#[derive(Clone, Copy)]
pub struct GemvQuant<'a> {
    f: GemvQuantFn,
    pub name: &'a str,
    pub q: QuantType,
    pub k: usize,
}

impl GemvQuant<'_> {
    /// `y_part[i] = W[rows.start + i, :] · x` for quantized row blocks `w`
    /// (the whole matrix) and one token's 8-bit input `x` (K quants, K/32
    /// f32 scales, K/32 i32 sums); `rows` starts on a block.
    pub fn run_part(
        &self,
        w: &[u8],
        x: &[u8],
        y_part: &mut [f32],
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        let block_bytes = self.q.block_bytes(self.k);
        let x_bytes = self.k + self.k / quant_blocks::GROUP_COLS * 8;
        if rows.start > rows.end || y_part.len() != rows.len() {
            return Err(shape(
                self.name,
                format!("y part of {} does not match rows {rows:?}", y_part.len()),
            ));
        }
        let blocks_in_w = w.len() / block_bytes.max(1);
        if x.len() != x_bytes
            || !rows.start.is_multiple_of(quant_blocks::BLOCK_ROWS)
            || rows.end.div_ceil(quant_blocks::BLOCK_ROWS) > blocks_in_w
        {
            return Err(shape(
                self.name,
                format!(
                    "x of {} bytes (want {x_bytes}) or W of {} bytes too small for K {} and rows {rows:?}, or rows start inside a block",
                    x.len(),
                    w.len(),
                    self.k
                ),
            ));
        }
        // The kernel writes y[r] for r in rows; shifting the base by -start
        // makes that y_part[r - start]. Only in-bounds addresses are written.
        let base = y_part.as_mut_ptr().wrapping_sub(rows.start);
        // SAFETY: every block read is inside `w`, x holds the K quants and
        // scales, and only y_part is written (checked above).
        unsafe { (self.f)(w.as_ptr(), x.as_ptr(), base, rows.start, rows.end, self.k) };
        Ok(())
    }
}

type UnpackQuantFn = unsafe extern "sysv64" fn(*const u8, *mut u8, usize, usize, usize);

/// Unpacks Q5_0 or Q4_0 row blocks into Q8_0's (see `emit::unpack_quant`).
#[derive(Clone, Copy)]
pub struct UnpackQuant<'a> {
    f: UnpackQuantFn,
    pub name: &'a str,
    pub q: QuantType,
    /// Whose offset the unpacked bytes carry: the GEMM to run on them.
    pub into: QuantType,
    pub k: usize,
}

impl UnpackQuant<'_> {
    /// The layout of the output: Q8_0x16's 16-row blocks, whichever
    /// offset the bytes carry.
    fn out_layout(&self) -> QuantType {
        QuantType::Q8_0x16
    }

    /// Bytes the rows `rows` take once unpacked (whole row blocks).
    pub fn out_bytes(&self, rows: Range<usize>) -> usize {
        self.out_layout().matrix_bytes(rows.len(), self.k)
    }

    /// Rows `rows` (starting on a block of the output's layout) of W, the
    /// whole matrix in `q`'s row blocks, into `out` in the output's layout,
    /// the first block at `out[0]`. Rows of the output's last block past
    /// W's are zeros.
    pub fn run(&self, w: &[u8], rows: Range<usize>, out: &mut [u8]) -> Result<(), KernelError> {
        let block_bytes = self.q.block_bytes(self.k);
        let layout = self.out_layout();
        if rows.start > rows.end
            || !rows.start.is_multiple_of(layout.block_rows())
            || rows.end.div_ceil(quant_blocks::BLOCK_ROWS) > w.len() / block_bytes.max(1)
            || out.len() < self.out_bytes(rows.clone())
        {
            return Err(shape(
                self.name,
                format!(
                    "rows {rows:?} of W ({} bytes, K {}) into {} bytes, or rows start inside a block",
                    w.len(),
                    self.k,
                    out.len()
                ),
            ));
        }
        // The kernel writes W's 4-row blocks only: a 16-row block it ends
        // inside gets zeros (scale 0) for the rest.
        let whole_blocks = rows.len() / layout.block_rows() * layout.block_bytes(self.k);
        out[whole_blocks..self.out_bytes(rows.clone())].fill(0);
        // SAFETY: checked above: the blocks read are inside `w` and the
        // blocks written inside `out`.
        unsafe { self.run_unchecked(w.as_ptr(), rows, out.as_mut_ptr()) };
        Ok(())
    }

    /// Raw call.
    ///
    /// # Safety
    /// `w` must hold the row blocks up to `rows.end` (`rows.start` on a
    /// block) and `out` [`UnpackQuant::out_bytes`] writable bytes.
    pub unsafe fn run_unchecked(&self, w: *const u8, rows: Range<usize>, out: *mut u8) {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.f)(w, out, self.k, rows.start, rows.end) };
    }
}

/// The 8-bit input of a call over several tokens, for
/// [`check_tokens_call`].
struct TokensInput {
    /// What the input is called in an error.
    what: &'static str,
    bytes: usize,
    want: usize,
    ntok: usize,
    max_tokens: usize,
}

/// The checks of a call `fn(w, x, y, r0, r1, k, ldy, ntok)` over weights in
/// 16-row blocks of `layout` (Q8_0x16's whichever offset the bytes carry,
/// or Q5_0x16's): a whole
/// input of 1 to `max_tokens` tokens, rows starting on a block and inside
/// W, and every element written inside Y.
fn check_tokens_call(
    (name, k, layout): (&str, usize, QuantType),
    w: &[u8],
    x: &TokensInput,
    y: &[f32],
    ldy: usize,
    rows: &Range<usize>,
) -> Result<(), KernelError> {
    let ntok = x.ntok;
    if x.bytes != x.want || !(1..=x.max_tokens).contains(&ntok) {
        return Err(shape(
            name,
            format!(
                "{} of {} bytes (want {}) with {ntok} tokens (1 to {})",
                x.what, x.bytes, x.want, x.max_tokens
            ),
        ));
    }
    let block_bytes = layout.block_bytes(k);
    if rows.start > rows.end
        || !rows.start.is_multiple_of(layout.block_rows())
        || rows.end.div_ceil(layout.block_rows()) > w.len() / block_bytes.max(1)
        || rows.end > ldy
        || !rows_fit(y.len(), ntok, ldy, rows.end)
    {
        return Err(shape(
            name,
            format!(
                "rows {rows:?} of W ({} bytes, K {k}) into Y of {ntok} x {ldy} ({} elements), or rows start inside a block",
                w.len(),
                y.len()
            ),
        ));
    }
    Ok(())
}

type GemmQuantFn =
    unsafe extern "sysv64" fn(*const u8, *const u8, *mut f32, usize, usize, usize, usize, usize);

#[derive(Clone, Copy)]
pub struct GemmQuant<'a> {
    f: GemmQuantFn,
    pub name: &'a str,
    pub q: QuantType,
    pub k: usize,
}

impl GemmQuant<'_> {
    /// Bytes of one token tile for this K (see `emit::gemm_quant`).
    pub fn tile_bytes(&self) -> usize {
        gemm_quant::tile_bytes(self.k)
    }

    /// `y[t*ldy + r] = W[r, :] · x_t` for r in `rows` and the `ntok` (1..=8)
    /// tokens of one tile, W in Q8_0x16's 16-row blocks (a Q8_0 matrix, or
    /// a panel unpacked into them with the offset `q` names), `rows`
    /// starting on a block.
    pub fn run(
        &self,
        w: &[u8],
        tile: &[u8],
        ntok: usize,
        y: &mut [f32],
        ldy: usize,
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        let input = TokensInput {
            what: "a tile",
            bytes: tile.len(),
            want: self.tile_bytes(),
            ntok,
            max_tokens: gemm_quant::TOKENS,
        };
        let layout = if self.q.rows_are_lanes() {
            self.q
        } else {
            QuantType::Q8_0x16
        };
        check_tokens_call((self.name, self.k, layout), w, &input, y, ldy, &rows)?;
        // SAFETY: checked above: the blocks read are inside `w`, the tile
        // is whole, and every element written is inside `y`.
        unsafe { self.run_unchecked(w.as_ptr(), tile.as_ptr(), ntok, y.as_mut_ptr(), ldy, rows) };
        Ok(())
    }

    /// Raw call for a thread pool whose threads write disjoint row ranges
    /// of one Y.
    ///
    /// # Safety
    /// `w` must hold the row blocks up to `rows.end` (`rows.start` on a
    /// block), `tile` a whole tile for K, `ntok` in 1..=8, and `Y[t*ldy +
    /// r]` must be writable for t < ntok, r in `rows`, with no other thread
    /// touching those elements.
    pub unsafe fn run_unchecked(
        &self,
        w: *const u8,
        tile: *const u8,
        ntok: usize,
        y: *mut f32,
        ldy: usize,
        rows: Range<usize>,
    ) {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.f)(w, tile, y, rows.start, rows.end, self.k, ldy, ntok) };
    }
}

#[derive(Clone, Copy)]
pub struct Gemm<'a> {
    f: GemmFn,
    pub name: &'a str,
    pub k: usize,
    pub wt: WeightType,
}

impl Gemm<'_> {
    /// `Y[t*ldy + r] = sum_k W[r,k] X[t*K + k]` for r in `rows`, t < tokens.
    /// 16-bit W is in the row-block layout (`rows` starting on a block);
    /// f32 W is plain rows.
    pub fn run(
        &self,
        w: &[u16],
        x: &[f32],
        tokens: usize,
        y: &mut [f32],
        ldy: usize,
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        if tokens.checked_mul(self.k) != Some(x.len()) {
            return Err(shape(
                self.name,
                format!("X has {} elements, expected {tokens} x {}", x.len(), self.k),
            ));
        }
        if rows.start > rows.end || rows.end > ldy && tokens > 0 {
            return Err(shape(self.name, format!("rows {rows:?} exceed ldy {ldy}")));
        }
        if tokens > 0 && !rows_fit(y.len(), tokens, ldy, rows.end) {
            return Err(shape(
                self.name,
                format!(
                    "Y of {} elements is too small for {tokens} x {ldy}",
                    y.len()
                ),
            ));
        }
        let w_fits = match self.wt.bytes() {
            2 => blocks_fit(w.len(), &rows, self.k),
            _ => rows_fit(w.len(), rows.end, self.k, self.k),
        };
        if !w_fits {
            return Err(shape(
                self.name,
                format!(
                    "W of {} elements has fewer than {} rows, or rows {rows:?} start inside a 4-row block",
                    w.len(),
                    rows.end
                ),
            ));
        }
        // SAFETY: reads stay in W rows < rows.end and X; writes in Y[t*ldy + rows].
        unsafe { self.run_unchecked(w.as_ptr(), x.as_ptr(), tokens, y.as_mut_ptr(), ldy, rows) };
        Ok(())
    }

    /// Raw call for a thread pool whose threads write disjoint row ranges of
    /// one Y (not expressible as disjoint slices).
    ///
    /// # Safety
    /// `w` must hold rows `< rows.end` of K elements (16-bit: whole row
    /// blocks, `rows.start` on a block), `x` `tokens * K` floats, and `Y[t*ldy + r]` must be writable for t < tokens, r in
    /// `rows`, with no other thread touching those elements.
    pub unsafe fn run_unchecked(
        &self,
        w: *const u16,
        x: *const f32,
        tokens: usize,
        y: *mut f32,
        ldy: usize,
        rows: Range<usize>,
    ) {
        // Panels of rows keep the weights the kernel streams per token tile
        // in L2 (see emit::gemm); they start on tile boundaries of `rows`.
        let panel = gemm::panel_rows(self.k * self.wt.bytes());
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = rows.end.min(r0.saturating_add(panel));
            // SAFETY: guaranteed by the caller for all of `rows`.
            unsafe { (self.f)(w, x, y, r0, r1, tokens, ldy) };
            r0 = r1;
        }
    }
}

#[derive(Clone, Copy)]
pub struct RmsNorm<'a> {
    f: RmsNormFn,
    pub name: &'a str,
    pub dim: usize,
}

impl RmsNorm<'_> {
    /// Normalises each `dim`-vector of `x` into `out`; `w` already holds the
    /// final multiplier (Gemma's 1 + weight).
    pub fn run(&self, x: &[f32], w: &[f32], out: &mut [f32], eps: f32) -> Result<(), KernelError> {
        self.check(x.len(), w.len(), out.len())?;
        // SAFETY: lengths checked; x and out are distinct borrows.
        unsafe {
            (self.f)(
                x.as_ptr(),
                w.as_ptr(),
                out.as_mut_ptr(),
                x.len() / self.dim,
                eps,
            )
        };
        Ok(())
    }

    /// In-place variant.
    pub fn run_inplace(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<(), KernelError> {
        self.check(x.len(), w.len(), x.len())?;
        let p = x.as_mut_ptr();
        // SAFETY: the kernel reads each element of a row before writing it.
        unsafe { (self.f)(p, w.as_ptr(), p, x.len() / self.dim, eps) };
        Ok(())
    }

    fn check(&self, x: usize, w: usize, out: usize) -> Result<(), KernelError> {
        if !x.is_multiple_of(self.dim) || out != x || w != self.dim {
            return Err(shape(
                self.name,
                format!("x {x}, w {w}, out {out} do not fit dim {}", self.dim),
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
pub struct Geglu<'a> {
    f: GegluFn,
    pub name: &'a str,
    pub width: usize,
}

impl Geglu<'_> {
    /// out = gelu_tanh(gate) * up over rows of `width`.
    pub fn run(&self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
        let n = gate.len();
        if !n.is_multiple_of(self.width) || up.len() != n || out.len() != n || (n > 0 && n < LANES)
        {
            return Err(shape(
                self.name,
                format!(
                    "gate {n}, up {}, out {} vs width {}",
                    up.len(),
                    out.len(),
                    self.width
                ),
            ));
        }
        // SAFETY: lengths checked; out cannot alias the inputs (borrows).
        unsafe { (self.f)(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n / self.width) };
        Ok(())
    }
}

#[derive(Clone, Copy)]
pub struct AttnScores<'a> {
    /// The GEMM with the keys as its f32 weight rows (panels and all).
    gemm: Gemm<'a>,
    pub name: &'a str,
    pub head_dim: usize,
}

impl AttnScores<'_> {
    /// `scores[i*n_keys + j] = queries[i] . keys[j]` for every query row i
    /// and key row j (rows of `head_dim`, contiguous).
    pub fn run(
        &self,
        keys: &[f32],
        queries: &[f32],
        scores: &mut [f32],
    ) -> Result<(), KernelError> {
        let hd = self.head_dim;
        let (n_keys, nq) = (keys.len() / hd, queries.len() / hd);
        if !keys.len().is_multiple_of(hd)
            || !queries.len().is_multiple_of(hd)
            || scores.len() != nq * n_keys
        {
            return Err(shape(
                self.name,
                format!(
                    "keys {}, queries {}, scores {} (head_dim {hd})",
                    keys.len(),
                    queries.len(),
                    scores.len()
                ),
            ));
        }
        // SAFETY: the GEMM reads key rows < n_keys and nq query rows of
        // head_dim floats and writes scores[t*n_keys + r] (checked above).
        unsafe {
            self.gemm.run_unchecked(
                keys.as_ptr().cast(),
                queries.as_ptr(),
                nq,
                scores.as_mut_ptr(),
                n_keys,
                0..n_keys,
            )
        };
        Ok(())
    }
}

#[derive(Clone, Copy)]
pub struct Softmax<'a> {
    f: SoftmaxFn,
    pub name: &'a str,
}

impl Softmax<'_> {
    pub fn run(&self, x: &mut [f32]) {
        // SAFETY: the kernel touches exactly x[..len].
        unsafe { (self.f)(x.as_mut_ptr(), x.len()) };
    }
}

#[derive(Clone, Copy)]
pub struct AttnWsum<'a> {
    f: WsumFn,
    pub name: &'a str,
    pub head_dim: usize,
}

impl AttnWsum<'_> {
    /// `out[i] = sum_j p[i*ldp + j] * V[j]` for every query row i of `out`
    /// over the `values.len() / head_dim` rows of V.
    pub fn run(
        &self,
        p: &[f32],
        ldp: usize,
        values: &[f32],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let hd = self.head_dim;
        let (n_keys, nq) = (values.len() / hd, out.len() / hd);
        let p_fits = nq == 0
            || ((nq - 1) * ldp)
                .checked_add(n_keys)
                .is_some_and(|n| n <= p.len());
        if !values.len().is_multiple_of(hd)
            || !out.len().is_multiple_of(hd)
            || n_keys > ldp
            || !p_fits
        {
            return Err(shape(
                self.name,
                format!(
                    "p {} (ldp {ldp}), V {}, out {} (head_dim {hd})",
                    p.len(),
                    values.len(),
                    out.len()
                ),
            ));
        }
        // SAFETY: lengths checked; out cannot alias the inputs (borrows).
        unsafe {
            (self.f)(
                p.as_ptr(),
                ldp,
                values.as_ptr(),
                n_keys,
                out.as_mut_ptr(),
                nq,
            )
        };
        Ok(())
    }
}

/// Keeps the gemm tile constants visible to callers that split rows.
pub const GEMM_TILE: (usize, usize) = (gemm::ROWS, gemm::TOKENS);

// The engine shares one KernelSet across its thread pool.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<KernelSet>();
    send_sync::<Gemv<'static>>();
    send_sync::<Gemm<'static>>();
};
