//! The packed format of each of an engine's matrices, decided once per
//! model: the 16-bit format, the quantized types kept as they are, and
//! the types converted to the nearest one a kernel family reads.

use super::packed::WeightFormat;
use crate::jit::plan::{QuantLayouts, QuantizedMatrix};
use crate::model::config::ModelConfig;
use crate::model::dtype::DType;
use crate::model::quant_blocks;
use crate::model::source::Role;
use crate::model::weights::{matrix_name, model_matrices};
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
}

/// The format a quantized type becomes where no kernel family reads it
/// (Q5_K), or where its family does not fit the plan's code budget beside
/// the model's other types (Q4_K and Q6_K, `jit::emit::gemm_kquant`, on
/// the default model). Q4_K and Q5_K: Q5_0 with an offset per 32 values,
/// which moves a value by at most q times FP16's rounding of its scale
/// (`model::k_quant_as_q5_0`). Q6_K, whose scales change every 16
/// values: Q8_0, whose 8-bit grid holds its values to within half a step
/// of max/127 per 32, far below their own rounding.
pub(super) fn nearest_with_kernel(dtype: DType) -> Option<WeightFormat> {
    match dtype {
        DType::Q4K | DType::Q5K => Some(WeightFormat::Q5_0),
        DType::Q6K => Some(WeightFormat::Q8_0),
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
            .any(|c| matches!(c.from, DType::Q4K | DType::Q6K));
        let why = if over_budget {
            "the Q4_K and Q6_K kernels do not fit the JIT's code budget beside this model's other types"
        } else {
            "no integer kernel reads these types yet"
        };
        Some(format!(
            "{why}, so they were converted: {}",
            parts.join(", ")
        ))
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
