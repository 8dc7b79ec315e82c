//! The packed format of each of an engine's matrices, decided once per
//! model: the 16-bit format, the quantized types kept as they are, and
//! the types converted to the nearest one a kernel family reads.
//!
//! The decision ([`FastEngine::weight_formats`]) is made here and nowhere
//! else: opening an engine, `pulsar convert` and `pulsar dump` all ask it,
//! so the formats a listing shows are the formats a run loads. It is also
//! the one reader of `PULSAR_K_QUANTS`, the documented override of whether
//! Q4_K, Q5_K and Q6_K keep kernels of their own.

use super::fast::{FastEngine, FastOptions};
use super::jit_kernels::{kernels_fit, quant_layouts};
use super::packed::WeightFormat;
use crate::jit::plan::{QuantLayouts, QuantizedMatrix};
use crate::model::config::{ModelConfig, MoeShape};
use crate::model::dtype::DType;
use crate::model::quant_blocks;
use crate::model::source::{LayerRole, ModelSource, Role};
use crate::model::weights::{matrix_name, matrix_shape, model_matrices};
use anyhow::Result;
use std::collections::HashMap;

/// The packed format of each of an engine's matrices, decided once per
/// model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightFormats {
    /// The 16-bit format of every matrix not kept quantized (the 16-bit
    /// kernels are planned for one).
    pub wide: WeightFormat,
    /// The tied embedding and LM head.
    pub head: WeightFormat,
    /// Every other matrix's format (`model::weights::model_matrices`);
    /// empty when every one is `wide`.
    pub matrices: HashMap<Role, WeightFormat>,
    /// Quantized types no kernel family reads yet, converted to the
    /// nearest one that has one (never silently to FP16).
    pub converted: Vec<Conversion>,
}

/// Matrices of one name and file type converted to another format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conversion {
    pub tensor: &'static str,
    pub from: DType,
    pub to: WeightFormat,
    pub count: usize,
    pub file_bytes: usize,
    pub bytes: usize,
    /// Matrices of a mixture's experts (a decode step reads `top_k` of
    /// each layer's).
    pub experts: bool,
}

/// The format a quantized type becomes where its family does not fit the
/// plan's code budget beside the model's other types (Q4_K, Q5_K and
/// Q6_K, `jit::emit::gemm_kquant`, on the default model; Q5_0 beside
/// them), or where the CPU or `PULSAR_K_QUANTS` asks for it. Q4_K and Q5_K: Q5_0 with an offset per 32 values,
/// which moves a value by at most q times FP16's rounding of its scale
/// (`model::k_quant_as_q5_0`). Q6_K, whose scales change every 16
/// values: Q8_0, whose 8-bit grid holds its values to within half a step
/// of max/127 per 32, far below their own rounding.
pub(super) fn nearest_with_kernel(dtype: DType) -> Option<WeightFormat> {
    match dtype {
        DType::Q4K | DType::Q5K => Some(WeightFormat::Q5_0),
        // Q5_0 where its family does not fit: Q8_0 holds its values exactly.
        DType::Q6K | DType::Q5_0 => Some(WeightFormat::Q8_0),
        _ => None,
    }
}

/// Bytes a `rows x cols` matrix of file type `dtype` takes as `to`: its
/// blocks, and the offsets of a K-quant kept as Q5_0.
pub(super) fn converted_bytes(dtype: DType, to: WeightFormat, rows: usize, cols: usize) -> usize {
    let offsets = if to.takes_offsets(dtype) {
        WeightFormat::offsets_len(rows, cols) * 4
    } else {
        0
    };
    to.matrix_bytes(rows, cols) + offsets
}

/// Where the format decision lives; see the module notes.
impl FastEngine {
    /// The packed format of each matrix, decided once: with `native`, a
    /// matrix the file stores in a type a kernel family reads stays in it;
    /// every other one gets the 16-bit format of
    /// [`FastEngine::weight_format_for`]. Q4_K, Q5_K and Q6_K keep kernels of
    /// their own where this CPU's kernels favour it (or `PULSAR_K_QUANTS`
    /// says so) and those kernels fit the plan's code budget beside the
    /// model's other types; otherwise they are converted.
    pub fn weight_formats(src: &ModelSource, opts: &FastOptions) -> Result<WeightFormats> {
        // Each quantized type in the layout this CPU's kernels read.
        let layouts = quant_layouts();
        let k_quants_native = k_quants_override().unwrap_or(layouts.k_quants_native);
        let kept = if k_quants_native {
            FamiliesKept::ALL
        } else {
            FamiliesKept::NO_K_QUANTS
        };
        let native = Self::weight_formats_in_file_layouts(src, opts, kept)?.with_layouts(&layouts);
        if !native.has_k_quants() || kernels_fit(&src.config, &native) {
            return Ok(native);
        }
        // Q4_K and Q6_K beside two other kernel families (Q8_0 and Q5_0:
        // the default model, a Gemma 3 1B whose K of 1,152 is not whole
        // super-blocks, a Gemma 4 26B-A4B whose 704-wide experts are not)
        // are more code than the plan's budget. Leave out the families
        // whose conversion adds the fewest bytes a token reads, among the
        // choices that fit: Q5_0 widened to Q8_0 exactly, Q6_K requantized
        // to Q8_0, Q4_K as Q5_0 with offsets (both K-quants converted,
        // the choice before they had kernels, is one of them).
        let moe = src.config.features.moe;
        let mut best: Option<(usize, WeightFormats)> = None;
        for kept in FamiliesKept::FALLBACKS {
            let formats =
                Self::weight_formats_in_file_layouts(src, opts, kept)?.with_layouts(&layouts);
            let cost = formats.per_token_growth(moe);
            if best.as_ref().is_some_and(|(c, _)| *c <= cost) || !kernels_fit(&src.config, &formats)
            {
                continue;
            }
            best = Some((cost, formats));
        }
        match best {
            Some((_, formats)) => Ok(formats),
            None => Ok(
                Self::weight_formats_in_file_layouts(src, opts, FamiliesKept::NO_K_QUANTS)?
                    .with_layouts(&layouts),
            ),
        }
    }

    /// The formats as the file's types have them, but for the K-quant
    /// families not `kept`, converted to the types of the other kernels.
    fn weight_formats_in_file_layouts(
        src: &ModelSource,
        opts: &FastOptions,
        kept: FamiliesKept,
    ) -> Result<WeightFormats> {
        // `--dtype q8_0`: that type wherever the rows are whole blocks,
        // quantized at load; FP16 elsewhere and for prefill's panels.
        if let Some(format) = opts.format.filter(|f| !f.is_16bit()) {
            return Ok(WeightFormats::for_shape(&src.config, format));
        }
        let wide = Self::weight_format_for(src, opts)?;
        let c = &src.config;
        let mut converted: Vec<Conversion> = Vec::new();
        let mut keep =
            |role: Role, name: &'static str, shape: [usize; 2]| -> Result<WeightFormat> {
                if !opts.native || !quant_blocks::fits(shape[1]) {
                    return Ok(wide);
                }
                let t = src.matrix_unscanned(role, &shape)?;
                // A file already in the K-quant layouts (`pulsar convert`)
                // keeps them whatever the choice: nothing converts back.
                if let Some(format) = WeightFormat::native(t.dtype).filter(|_| kept.keeps(t.dtype))
                {
                    return Ok(format);
                }
                let Some(to) = nearest_with_kernel(t.dtype) else {
                    return Ok(wide);
                };
                let bytes = converted_bytes(t.dtype, to, shape[0], shape[1]);
                match converted
                    .iter_mut()
                    .find(|c| c.tensor == name && c.from == t.dtype)
                {
                    Some(c) => {
                        c.count += 1;
                        c.file_bytes += t.bytes.len();
                        c.bytes += bytes;
                    }
                    None => converted.push(Conversion {
                        tensor: name,
                        from: t.dtype,
                        to,
                        count: 1,
                        file_bytes: t.bytes.len(),
                        bytes,
                        experts: matches!(role, Role::Expert(..)),
                    }),
                }
                Ok(to)
            };
        let head = keep(Role::Embedding, "output(lm_head)", [c.vocab_size, c.hidden])?;
        let mut matrices = HashMap::new();
        for (role, shape) in model_matrices(c) {
            if role != Role::Embedding {
                matrices.insert(role, keep(role, matrix_name(role), shape)?);
            }
        }
        Ok(WeightFormats {
            wide,
            head,
            matrices,
            converted,
        })
    }

    /// The one packed format all matrices get (the kernels are planned for
    /// one): the requested one, else BF16 for a BF16 checkpoint (lossless)
    /// and FP16 for everything else, judged by the first layer's Q.
    pub fn weight_format_for(src: &ModelSource, opts: &FastOptions) -> Result<WeightFormat> {
        if let Some(f) = opts.format.filter(|f| f.is_16bit()) {
            return Ok(f);
        }
        let c = &src.config;
        let q = src.tensor_unscanned(
            Role::Layer(0, LayerRole::Q),
            &matrix_shape(Role::Layer(0, LayerRole::Q), c),
        )?;
        Ok(WeightFormat::default_for(q.dtype))
    }
}

/// Which of the optional kernel families a model's matrices keep (the
/// rest are converted to the types of the other kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FamiliesKept {
    q4_k: bool,
    q5_k: bool,
    q6_k: bool,
    q5_0: bool,
}

impl FamiliesKept {
    const ALL: FamiliesKept = FamiliesKept::new(true, true, true, true);
    const NO_K_QUANTS: FamiliesKept = FamiliesKept::new(false, false, false, true);
    /// The choices tried when every family does not fit, `NO_K_QUANTS`
    /// also being the one left when none fits: every other subset of the
    /// four families. (Q4_K or Q5_K converted needs Q5_0's family, so a
    /// choice that leaves out Q5_0 and one of them costs what keeping
    /// Q5_0 does; the cheapest that fits wins.)
    const FALLBACKS: [FamiliesKept; 15] = {
        let mut out = [FamiliesKept::NO_K_QUANTS; 15];
        let mut i = 0;
        while i < 15 {
            // The families kept as bits (Q4_K 8, Q5_K 4, Q6_K 2, Q5_0
            // 1), the subsets that leave out the fewest first.
            let kept = [7u8, 11, 13, 14, 3, 5, 6, 9, 10, 12, 1, 2, 4, 8, 0][i];
            out[i] = FamiliesKept::new(kept & 8 != 0, kept & 4 != 0, kept & 2 != 0, kept & 1 != 0);
            i += 1;
        }
        out
    };

    const fn new(q4_k: bool, q5_k: bool, q6_k: bool, q5_0: bool) -> FamiliesKept {
        FamiliesKept {
            q4_k,
            q5_k,
            q6_k,
            q5_0,
        }
    }

    /// Whether a matrix of file type `dtype` keeps its type.
    fn keeps(self, dtype: DType) -> bool {
        match dtype {
            DType::Q4K => self.q4_k,
            DType::Q5K => self.q5_k,
            DType::Q6K => self.q6_k,
            DType::Q5_0 => self.q5_0,
            _ => true,
        }
    }
}

/// `PULSAR_K_QUANTS=native|convert`: whether Q4_K, Q5_K and Q6_K keep kernels of
/// their own, overriding the CPU's choice (to measure one against the
/// other, or run the AVX2 kernel); `None` when unset or unreadable (said
/// on stderr).
fn k_quants_override() -> Option<bool> {
    const VAR: &str = "PULSAR_K_QUANTS";
    match std::env::var(VAR).as_deref() {
        Err(std::env::VarError::NotPresent) => None,
        Ok("native") => Some(true),
        Ok("convert") => Some(false),
        Ok(other) => {
            eprintln!("pulsar: {VAR}={other}: expected native or convert; ignored");
            None
        }
        Err(e) => {
            eprintln!("pulsar: {VAR}: {e}; ignored");
            None
        }
    }
}

impl WeightFormats {
    /// The formats of a shape without a file: `format` for every matrix,
    /// or for a quantized `format`, that type wherever the rows are whole
    /// blocks and FP16 elsewhere (the widened panels of prefill are FP16).
    pub fn for_shape(c: &ModelConfig, format: WeightFormat) -> WeightFormats {
        if format.is_16bit() {
            return WeightFormats::uniform(format);
        }
        let fit = |k: usize| {
            if quant_blocks::fits(k) {
                format
            } else {
                WeightFormat::F16
            }
        };
        WeightFormats {
            wide: WeightFormat::F16,
            head: fit(c.hidden),
            matrices: model_matrices(c)
                .into_iter()
                .filter(|&(role, _)| role != Role::Embedding)
                .map(|(role, [_, k])| (role, fit(k)))
                .collect(),
            converted: Vec::new(),
        }
    }

    /// The same formats with each quantized type in its layout for the
    /// kernels, whichever layout the file has.
    pub fn with_layouts(mut self, layouts: &QuantLayouts) -> WeightFormats {
        let swap = |f: &mut WeightFormat| {
            if let Some(q) = f.quant() {
                *f = WeightFormat::of_quant(layouts.of(q));
            }
        };
        swap(&mut self.head);
        self.matrices.values_mut().for_each(swap);
        self.converted.iter_mut().for_each(|c| swap(&mut c.to));
        self
    }

    /// All matrices in one 16-bit format.
    pub fn uniform(format: WeightFormat) -> WeightFormats {
        WeightFormats {
            wide: format,
            head: format,
            matrices: HashMap::new(),
            converted: Vec::new(),
        }
    }

    /// One line naming the converted tensors, types and the size change.
    pub fn conversion_note(&self) -> Option<String> {
        if self.converted.is_empty() {
            return None;
        }
        let parts: Vec<String> = self
            .converted
            .iter()
            .map(|c| {
                let to = if c.to.takes_offsets(c.from) {
                    "q5_0 with an offset per 32"
                } else {
                    c.to.name()
                };
                // No "->": "> " is the chat prompt a terminal waits for.
                format!(
                    "{} x{} {} to {to} ({:.1} MB to {:.1} MB)",
                    c.tensor,
                    c.count,
                    c.from,
                    c.file_bytes as f64 / 1e6,
                    c.bytes as f64 / 1e6
                )
            })
            .collect();
        let over_budget = self
            .converted
            .iter()
            .any(|c| matches!(c.from, DType::Q4K | DType::Q5K | DType::Q6K | DType::Q5_0));
        let why = if over_budget {
            "this model's types need more kernel families than the JIT's code budget holds"
        } else {
            "no integer kernel reads these types yet"
        };
        Some(format!(
            "{why}, so they were converted: {}",
            parts.join(", ")
        ))
    }

    /// The conversion in a few words, for the "loaded" line: the file's
    /// types that were converted and what it cost ("Q4_K and Q6_K
    /// converted, +8.8 MB"); `--verbose` names the tensors.
    pub fn conversion_brief(&self) -> Option<String> {
        if self.converted.is_empty() {
            return None;
        }
        let mut types: Vec<String> = Vec::new();
        for c in &self.converted {
            let name = c.from.to_string();
            if !types.contains(&name) {
                types.push(name);
            }
        }
        let names = match types.as_slice() {
            [one] => one.clone(),
            [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
            [] => return None,
        };
        let grown: usize = self.converted.iter().map(|c| c.bytes).sum();
        let file: usize = self.converted.iter().map(|c| c.file_bytes).sum();
        let change = (grown as f64 - file as f64) / 1e6;
        Some(format!("{names} converted, {change:+.1} MB"))
    }

    /// Bytes the conversions add to what a decode step reads: an expert's
    /// matrices count `top_k / experts` of theirs.
    fn per_token_growth(&self, moe: Option<MoeShape>) -> usize {
        self.converted
            .iter()
            .map(|c| {
                let grown = c.bytes.saturating_sub(c.file_bytes);
                match moe {
                    Some(m) if c.experts => grown * m.top_k / m.experts,
                    _ => grown,
                }
            })
            .sum()
    }

    /// Whether any matrix is kept in a K-quant layout.
    pub fn has_k_quants(&self) -> bool {
        std::iter::once(&self.head)
            .chain(self.matrices.values())
            .any(|f| f.quant().is_some_and(|q| q.is_k_quant()))
    }

    /// The format of a matrix.
    pub fn of(&self, role: Role) -> WeightFormat {
        match role {
            Role::Embedding => self.head,
            _ => self.matrices.get(&role).copied().unwrap_or(self.wide),
        }
    }

    /// The quantized matrices by the plan's name, type and K, once each.
    pub fn quantized(&self, c: &ModelConfig) -> Vec<QuantizedMatrix> {
        let mut out: Vec<QuantizedMatrix> = Vec::new();
        for (role, [_, k]) in model_matrices(c) {
            if let Some(q) = self.of(role).quant() {
                let m = QuantizedMatrix {
                    tensor: matrix_name(role),
                    q,
                    k,
                };
                if !out.contains(&m) {
                    out.push(m);
                }
            }
        }
        out
    }

    /// The plan's names of the matrices kept in the 16-bit format in at
    /// least one place.
    pub fn wide_tensors(&self, c: &ModelConfig) -> Vec<&'static str> {
        let mut out = Vec::new();
        for (role, _) in model_matrices(c) {
            let name = matrix_name(role);
            if self.of(role).is_16bit() && !out.contains(&name) {
                out.push(name);
            }
        }
        out
    }

    /// "f16", or "f16 + q8_0 LM head + q5_0 (126 of 126 layer matrices)".
    pub fn describe(&self) -> String {
        let mut text = self.wide.name().to_string();
        if self.head != self.wide {
            text += &format!(" + {} LM head", self.head.name());
        }
        let mut counts: Vec<(WeightFormat, usize)> = Vec::new();
        for &f in self.matrices.values().filter(|&&f| f != self.wide) {
            match counts.iter_mut().find(|(g, _)| *g == f) {
                Some((_, n)) => *n += 1,
                None => counts.push((f, 1)),
            }
        }
        counts.sort_by_key(|(f, _)| f.name());
        let total = self.matrices.len();
        for (f, n) in counts {
            text += &format!(" + {} ({n} of {total} layer matrices)", f.name());
        }
        text
    }
}
