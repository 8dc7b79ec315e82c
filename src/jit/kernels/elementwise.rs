//! The element-wise handles: RMSNorm and the GeGLU activation.

use super::{Compiled, Kernel, KernelError, shape};
use crate::jit::emit::LANES;
use crate::jit::plan::KernelKind;

/// `(x, w, out, rows, eps)`.
pub type RmsNormFn = unsafe extern "sysv64" fn(*const f32, *const f32, *mut f32, usize, f32);
/// `(gate, up, out, rows)`.
pub type GegluFn = unsafe extern "sysv64" fn(*const f32, *const f32, *mut f32, usize);

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
