//! The attention handles: scores (the GEMM with the keys as f32 weights),
//! softmax, and the probability-weighted sum of V.

use super::gemm::{Gemm, GemmFn};
use super::{Compiled, Kernel, KernelError, shape};
use crate::jit::emit::gemv::WeightType;
use crate::jit::plan::KernelKind;

/// `(x, n)`, in place.
pub type SoftmaxFn = unsafe extern "sysv64" fn(*mut f32, usize);
/// `(p, ldp, v, n_keys, out, nq)`.
pub type WsumFn = unsafe extern "sysv64" fn(*const f32, usize, *const f32, usize, *mut f32, usize);

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
