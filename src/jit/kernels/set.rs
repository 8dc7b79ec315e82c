//! The executable set of one plan's kernels and its one accessor: a handle
//! type's key finds the kernel that serves it, once, and binds its code to
//! the handle's function type.

use super::build::{Compiled, Emitted, emit_and_verify, emit_and_verify_specs};
use super::perf_map::write_perf_map;
use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::plan::{KernelKind, KernelSpec, Plan};
use anyhow::{Context, Result};
use dynasmrt::mmap::{ExecutableBuffer, MutableBuffer};

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

    /// What kernel `id` computes (panics for another set's id, as `bind`).
    pub fn kind(&self, id: KernelId) -> &KernelKind {
        assert_eq!(
            id.set, self.serial,
            "kernel id {id:?} belongs to another kernel set"
        );
        &self.kernels[id.index as usize].spec.kind
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
