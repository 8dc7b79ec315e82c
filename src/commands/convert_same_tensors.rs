//! `pulsar convert` for the families whose converted layout is the source
//! GGUF's own tensor list (Gemma 4, Gemma 3n): per-layer head sizes and
//! MLP widths, KV sharing, per-layer token tables, fused experts and
//! stacked AltUp projections are all described by the source's metadata
//! and tensor names already, so the output keeps every key and every
//! tensor, in the source's order, and only changes how matrices are
//! stored: each one the engine packs is written in the kernels' row
//! blocks (the formats loading chooses, as for Gemma 1-3), under the
//! private type ids, so that `--mmap` uses it in place.
//!
//! A tensor holding several matrices (an expert stack, AltUp's stack) is
//! written as its matrices' row blocks one after the other; that is the
//! row-blocked layout of the whole tensor only when every piece is whole
//! row blocks, which is checked. Anything else (norms, routers, the
//! per-layer token table a token reads one row of, a matrix that stays in
//! its file type) is copied byte for byte.

use super::convert::{ALIGNMENT, Output};
use crate::engine::fast::WeightFormats;
use crate::engine::packed::{PackedMatrix, WeightFormat};
use crate::model::dtype::{DType, TensorView};
use crate::model::gguf::GgufFile;
use crate::model::gguf_write::{GgufWriter, RawTensor};
use crate::model::source::{ModelSource, Role};
use crate::model::weights::model_matrices;
use anyhow::{Result, bail};
use std::path::Path;

/// A matrix the engine packs, and where its bytes sit in its tensor.
struct Piece {
    role: Role,
    shape: [usize; 2],
    format: WeightFormat,
    at: usize,
    len: usize,
}

/// How one source tensor is written.
enum Plan {
    /// Byte for byte, in the file's type.
    Copy,
    /// Its matrices packed to `dtype`'s row blocks, in order.
    Pack { dtype: DType, pieces: Vec<Piece> },
}

impl Plan {
    fn bytes(&self, source_len: usize) -> usize {
        match self {
            Plan::Copy => source_len,
            Plan::Pack { pieces, .. } => pieces
                .iter()
                .map(|p| p.format.matrix_bytes(p.shape[0], p.shape[1]))
                .sum(),
        }
    }
}

/// Writes `src` (a GGUF) to `output` with its matrices in `formats`.
/// Returns the bytes written and how many matrices were packed.
pub(super) fn write(
    src: &ModelSource,
    input: &Path,
    output: &Path,
    formats: &WeightFormats,
) -> Result<(u64, usize)> {
    let Some(g) = src.gguf() else {
        bail!(
            "{}: `pulsar convert` writes a {:?} model from its GGUF file only (llama.cpp's \
             convert_hf_to_gguf.py makes one from this folder); or run the folder directly, \
             with `--dtype` to choose the weight format at load",
            input.display(),
            src.config.family
        );
    };
    let plans = plan_tensors(src, g, formats)?;
    let mut w = GgufWriter::new();
    w.set_alignment(ALIGNMENT);
    let mut keys: Vec<_> = g
        .metadata()
        .iter()
        .filter(|(k, _)| k.as_str() != "general.alignment")
        .collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in keys {
        w.add_value(k, v);
    }
    let mut order: Vec<usize> = (0..g.tensors().len()).collect();
    order.sort_by_key(|&i| g.tensors()[i].start);
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(order.len());
    for &i in &order {
        let t = &g.tensors()[i];
        let dtype = match &plans[i] {
            Plan::Copy => t.dtype,
            Plan::Pack { dtype, .. } => *dtype,
        };
        offset = offset.div_ceil(ALIGNMENT as u64) * ALIGNMENT as u64;
        offsets.push(offset);
        w.add_raw_tensor(RawTensor {
            name: t.name.clone(),
            dims: t.shape.iter().rev().map(|&d| d as u64).collect(),
            type_id: dtype.ggml_id(),
            offset: Some(offset),
            data: Vec::new(),
        });
        offset += plans[i].bytes(t.len) as u64;
    }
    let header = w.header_bytes(&offsets);

    let (mut out, bar) = Output::begin(output, &header, offset)?;
    let mut packed = 0;
    for (&i, &at) in order.iter().zip(&offsets) {
        crate::cancel::check()?;
        let info = &g.tensors()[i];
        bar.set_message(info.name.clone());
        out.pad_to(header.len() as u64 + at)?;
        let whole = g.tensor(&info.name).expect("listed tensor");
        match &plans[i] {
            Plan::Copy => out.write(whole.bytes)?,
            Plan::Pack { pieces, .. } => {
                for p in pieces {
                    let view = scanned_view(src, p.role, &p.shape)?;
                    debug_assert_eq!(view.bytes.len(), p.len);
                    out.write(PackedMatrix::convert(&view, p.format).raw())?;
                    packed += 1;
                }
            }
        }
        // Read once: keep the source's pages from piling up beside the
        // output's (a 26B-A4B file is most of this machine's memory).
        whole.release_pages();
        bar.set_position(at + plans[i].bytes(info.len) as u64);
    }
    let total = header.len() as u64 + offset.div_ceil(ALIGNMENT as u64) * ALIGNMENT as u64;
    out.pad_to(total)?;
    crate::cancel::check()?;
    out.commit()?;
    bar.finish_and_clear();
    Ok((total, packed))
}

/// A matrix's bytes with its blocks' scales checked, as loading reads it.
fn scanned_view<'a>(src: &'a ModelSource, role: Role, shape: &[usize]) -> Result<TensorView<'a>> {
    match role {
        Role::Expert(layer, e, which) => src.expert_tensor(layer, e, which),
        _ => src.tensor(role, shape),
    }
}

/// Each source tensor's plan, in `g.tensors()` order: the matrices the
/// engine packs are found by where their bytes lie, so fused and stacked
/// tensors need no naming rules of their own.
fn plan_tensors(src: &ModelSource, g: &GgufFile, formats: &WeightFormats) -> Result<Vec<Plan>> {
    let starts: Vec<(usize, usize)> = {
        let mut s: Vec<(usize, usize)> = g
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                (
                    g.tensor(&t.name).expect("listed").bytes.as_ptr() as usize,
                    i,
                )
            })
            .collect();
        s.sort_unstable();
        s
    };
    let mut pieces: Vec<Vec<Piece>> = (0..g.tensors().len()).map(|_| Vec::new()).collect();
    for (role, shape) in model_matrices(&src.config) {
        let view = src.matrix_unscanned(role, &shape)?;
        let addr = view.bytes.as_ptr() as usize;
        let k = starts.partition_point(|&(s, _)| s <= addr);
        let Some(&(start, i)) = k.checked_sub(1).map(|k| &starts[k]) else {
            continue;
        };
        pieces[i].push(Piece {
            role,
            shape,
            format: formats.of(role),
            at: addr - start,
            len: view.bytes.len(),
        });
    }
    Ok(pieces
        .into_iter()
        .zip(g.tensors())
        .map(|(mut ps, t)| {
            ps.sort_by_key(|p| p.at);
            packing(ps, t.dtype, &t.shape, t.len)
        })
        .collect())
}

/// Whether a tensor's pieces can be written as its row blocks: they cover
/// it exactly, share one format the file does not already store, and each
/// is whole row blocks of it (so an expert's rows are one run of bytes in
/// the output, as in the source).
fn packing(pieces: Vec<Piece>, dtype: DType, shape: &[usize], len: usize) -> Plan {
    let Some(first) = pieces.first() else {
        return Plan::Copy;
    };
    let format = first.format;
    let packed_dtype = format.row_blocked_dtype();
    let covers = pieces
        .iter()
        .try_fold(0usize, |end, p| (p.at == end).then_some(end + p.len))
        == Some(len);
    let one_format = pieces.iter().all(|p| p.format == format);
    // A matrix the engine keeps as Q5_0 with offsets has no row-block
    // type: it stays in the file's own (loading converts it).
    let has_row_blocks = !format.takes_offsets(dtype) && packed_dtype != dtype;
    let cols = shape.last().copied().unwrap_or(1);
    let rows = shape.iter().product::<usize>() / cols.max(1);
    let piece_bytes: usize = pieces
        .iter()
        .map(|p| format.matrix_bytes(p.shape[0], p.shape[1]))
        .sum();
    let stack_of_whole_blocks = match (shape, packed_dtype.rows_per_block()) {
        ([_, per, _], Some(block_rows)) => per % block_rows == 0,
        (_, _) => shape.len() == 2,
    };
    let whole_blocks = stack_of_whole_blocks
        && pieces.iter().all(|p| p.shape[1] == cols)
        && packed_dtype.row_blocked_len(rows, cols) == Some(piece_bytes);
    if covers && one_format && has_row_blocks && whole_blocks {
        Plan::Pack {
            dtype: packed_dtype,
            pieces,
        }
    } else {
        Plan::Copy
    }
}
