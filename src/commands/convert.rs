//! `pulsar convert`: writes a model in exactly the fast engine's layout —
//! a GGUF v3 file whose matrices are in the kernels' row blocks and whose
//! norms are f32 final multipliers — so that it later loads zero-copy with
//! mmap. Matrices are FP16 or BF16 row blocks, or with `--dtype q8_0|q4_0`
//! quantized row blocks (`model::quant_blocks`) wherever the rows are whole
//! 32-value blocks, FP16 elsewhere: the formats `--dtype q8_0|q4_0` gives
//! at load, so a converted file computes the very same numbers; with
//! `--dtype native`, the source's own types as `run --dtype native` keeps
//! them (Q5_0's rows in pairs, Q8_0 in this CPU's blocks, Q6_K
//! requantized to Q8_0, Q4_K and Q5_K in their own type, which loading
//! keeps as Q5_0 with an offset per 32 values). The
//! row-block matrices (padding included) have Pulsar-private GGML types
//! (`F16_R4X8`, `BF16_R4X8`, `Q8_0_R4`, `Q4_0_R4`), so other GGUF readers
//! refuse the file rather than misread it. Metadata GGUF has no key for
//! (query_pre_attn_scalar, the local RoPE base, which layers are global)
//! goes under `pulsar.*` keys.
//!
//! Gemma 4 and Gemma 3n keep the source GGUF's keys and tensor list
//! instead, their matrices in the same row blocks
//! (`convert_same_tensors`): their layers differ from one another in ways
//! only that description carries.

use crate::engine::fast::{FastEngine, FastOptions, WeightFormats};
use crate::engine::packed::{PackedMatrix, WeightFormat};
use crate::fs_atomic::AtomicFile;
use crate::model::config::{Family, ModelConfig};
use crate::model::dequant;
use crate::model::dtype::DType;
use crate::model::gguf::Value;
use crate::model::gguf_write::{GgufWriter, RawTensor};
use crate::model::source::{LayerRole, ModelSource, Role, gguf_name};
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::path::Path;

/// Data alignment of converted files: a cache line, so kernels may assume
/// every matrix starts on one.
pub(super) const ALIGNMENT: u32 = 64;

/// One tensor to write: its role, shape and whether it is a norm (f32).
struct Planned {
    role: Role,
    shape: Vec<usize>,
    norm: bool,
}

fn plan(c: &ModelConfig) -> Vec<Planned> {
    let mut out = vec![
        Planned {
            role: Role::Embedding,
            shape: vec![c.vocab_size, c.hidden],
            norm: false,
        },
        Planned {
            role: Role::FinalNorm,
            shape: vec![c.hidden],
            norm: true,
        },
    ];
    let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    for i in 0..c.n_layers() {
        let mut add = |r: LayerRole, shape: Vec<usize>, norm: bool| {
            out.push(Planned {
                role: Role::Layer(i, r),
                shape,
                norm,
            });
        };
        add(LayerRole::AttnNorm, vec![c.hidden], true);
        add(LayerRole::FfnNorm, vec![c.hidden], true);
        if c.has_post_norms() {
            add(LayerRole::AttnPostNorm, vec![c.hidden], true);
            add(LayerRole::FfnPostNorm, vec![c.hidden], true);
        }
        if c.has_qk_norm() {
            add(LayerRole::QNorm, vec![c.head_dim], true);
            add(LayerRole::KNorm, vec![c.head_dim], true);
        }
        add(LayerRole::Q, vec![q, c.hidden], false);
        add(LayerRole::K, vec![kv, c.hidden], false);
        add(LayerRole::V, vec![kv, c.hidden], false);
        add(LayerRole::O, vec![c.hidden, q], false);
        add(LayerRole::Gate, vec![c.intermediate, c.hidden], false);
        add(LayerRole::Up, vec![c.intermediate, c.hidden], false);
        add(LayerRole::Down, vec![c.hidden, c.intermediate], false);
    }
    out
}

/// The architecture metadata, in llama.cpp's keys plus Pulsar's own.
fn write_config(w: &mut GgufWriter, c: &ModelConfig, format: WeightFormat) {
    let arch = match c.family {
        Family::Gemma1 => "gemma",
        Family::Gemma2 => "gemma2",
        Family::Gemma3 => "gemma3",
        Family::Gemma4 => "gemma4",
        Family::Gemma3n => "gemma3n",
    };
    let key = |k: &str| format!("{arch}.{k}");
    w.add_str("general.architecture", arch);
    // llama.cpp's file types: mostly F16, Q4_0, Q8_0, BF16.
    let file_type = match format {
        WeightFormat::F16 => 1,
        WeightFormat::Q4_0 => 2,
        WeightFormat::Q8_0 | WeightFormat::Q8_0x16 => 7,
        WeightFormat::Q5_0 | WeightFormat::Q5_0x16 => 8,
        WeightFormat::BF16 => 32,
        // MOSTLY_Q4_K_M, MOSTLY_Q5_K_M and MOSTLY_Q6_K.
        WeightFormat::Q4Kx16 => 15,
        WeightFormat::Q5Kx16 => 17,
        WeightFormat::Q6Kx16 => 18,
    };
    w.add_u32("general.file_type", file_type);
    w.add_u32(&key("context_length"), c.max_context as u32);
    w.add_u32(&key("embedding_length"), c.hidden as u32);
    w.add_u32(&key("block_count"), c.n_layers() as u32);
    w.add_u32(&key("feed_forward_length"), c.intermediate as u32);
    w.add_u32(&key("attention.head_count"), c.n_heads as u32);
    w.add_u32(&key("attention.head_count_kv"), c.n_kv_heads as u32);
    w.add_u32(&key("attention.key_length"), c.head_dim as u32);
    w.add_u32(&key("attention.value_length"), c.head_dim as u32);
    w.add_f32(&key("attention.layer_norm_rms_epsilon"), c.rms_eps);
    if let Some(global) = c.layers.iter().find(|l| l.window.is_none()) {
        w.add_f32(&key("rope.freq_base"), global.rope_base);
        if global.rope_scale != 1.0 {
            w.add_str(&key("rope.scaling.type"), "linear");
            w.add_f32(&key("rope.scaling.factor"), global.rope_scale);
        }
    }
    if let Some(local) = c.layers.iter().find(|l| l.window.is_some()) {
        w.add_u32(
            &key("attention.sliding_window"),
            local.window.unwrap_or(0) as u32,
        );
        w.add_f32("pulsar.rope.local_freq_base", local.rope_base);
    }
    if let Some(cap) = c.attn_softcap {
        w.add_f32(&key("attn_logit_softcapping"), cap);
    }
    if let Some(cap) = c.final_softcap {
        w.add_f32(&key("final_logit_softcapping"), cap);
    }
    let global: Vec<i32> = c
        .layers
        .iter()
        .map(|l| i32::from(l.window.is_none()))
        .collect();
    w.add_i32_array("pulsar.attention.global_layers", &global);
    // The multiplier itself, so that no rounding separates the converted
    // model from the original.
    w.add_f32("pulsar.attention.query_scale", c.query_scale);
}

/// What `convert --dtype` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The source's own types where an integer kernel reads them, as `run
    /// --dtype native` keeps them at load.
    Native,
    /// One format for every matrix (quantized ones where the rows are
    /// whole blocks).
    Format(WeightFormat),
}

/// Without `--dtype` a file keeps its own types (`native`): a quantized
/// file is never widened to 16 bits unasked.
pub fn run(input: &Path, output: &Path, target: Option<Target>) -> Result<()> {
    let target = target.unwrap_or(Target::Native);
    let src = ModelSource::open(input)?;
    let c = src.config.clone();
    // Each matrix's format, as `--dtype` gives them at load: Q8_0 in the
    // layout this CPU's kernels read (16-row blocks with VNNI), so that
    // `--mmap` uses it in place here; a CPU whose kernels read the other
    // layout regroups the same blocks at load.
    let uniform = |format: WeightFormat| {
        let formats = WeightFormats::for_shape(&c, format)
            .with_layouts(&crate::engine::jit_kernels::quant_layouts());
        (formats, format)
    };
    let (formats, format) = match target {
        Target::Native => {
            // Only the formats are read from these options.
            let opts = FastOptions {
                threads: 1,
                context: 1,
                format: None,
                prefill_chunk: 0,
                native: true,
                in_place: false,
            };
            let formats = FastEngine::weight_formats(&src, &opts)?;
            let head = formats.of(Role::Embedding);
            (formats, head)
        }
        Target::Format(format) => uniform(format),
    };
    if output.exists() && output.canonicalize().ok() == input.canonicalize().ok() {
        bail!("{}: the output would overwrite the input", output.display());
    }
    if matches!(c.family, Family::Gemma4 | Family::Gemma3n) {
        let (total, packed) = super::convert_same_tensors::write(&src, input, output, &formats)?;
        return report(
            output,
            total,
            &formats,
            target,
            format,
            &format!(
                "{packed} matrices in the kernels' row blocks, the other tensors as the source has them"
            ),
        );
    }
    let mut w = GgufWriter::new();
    w.set_alignment(ALIGNMENT);
    write_config(&mut w, &c, format);
    match src.gguf() {
        Some(g) => {
            // Keep the tokenizer and descriptive keys of a GGUF source.
            let mut keys: Vec<(&String, &Value)> = g
                .metadata()
                .iter()
                .filter(|(k, _)| k.starts_with("tokenizer.") || k.as_str() == "general.name")
                .collect();
            keys.sort_by(|a, b| a.0.cmp(b.0));
            for (k, v) in keys {
                w.add_value(k, v);
            }
        }
        None => eprintln!(
            "convert: note: the tokenizer of a Hugging Face folder is not copied; keep the folder to tokenize"
        ),
    }

    let planned = plan(&c);
    let mut offset = 0u64;
    for p in &planned {
        let (dtype, bytes) = if p.norm {
            (DType::F32, p.shape.iter().product::<usize>() * 4)
        } else {
            let f = formats.of(p.role);
            let t = src.tensor_unscanned(p.role, &p.shape)?;
            if stays_in_file_type(f, t.dtype) {
                (t.dtype, t.bytes.len())
            } else {
                (
                    f.row_blocked_dtype(),
                    f.matrix_bytes(p.shape[0], p.shape[1]),
                )
            }
        };
        offset = offset.div_ceil(ALIGNMENT as u64) * ALIGNMENT as u64;
        w.add_raw_tensor(RawTensor {
            name: gguf_name(p.role),
            dims: p.shape.iter().rev().map(|&d| d as u64).collect(),
            type_id: dtype.ggml_id(),
            offset: Some(offset),
            data: Vec::new(),
        });
        offset += bytes as u64;
    }
    let offsets: Vec<u64> = w.tensors.iter().map(|t| t.offset.unwrap_or(0)).collect();
    let header = w.header_bytes(&offsets);

    let (mut out, bar) = Output::begin(output, &header, offset)?;
    for (p, &at) in planned.iter().zip(&offsets) {
        crate::cancel::check()?;
        let name = gguf_name(p.role);
        bar.set_message(name.clone());
        let t = src.tensor(p.role, &p.shape)?;
        let bytes: Vec<u8> = if p.norm {
            dequant::to_f32(&t)
                .into_iter()
                .flat_map(|v| (v + c.norm_weight_offset).to_le_bytes())
                .collect()
        } else if stays_in_file_type(formats.of(p.role), t.dtype) {
            t.bytes.to_vec()
        } else {
            PackedMatrix::convert(&t, formats.of(p.role)).raw().to_vec()
        };
        out.pad_to(header.len() as u64 + at)?;
        out.write(&bytes)?;
        bar.set_position(at + bytes.len() as u64);
    }
    let total = header.len() as u64 + offset.div_ceil(ALIGNMENT as u64) * ALIGNMENT as u64;
    out.pad_to(total)?;
    crate::cancel::check()?;
    out.commit()?;
    bar.finish_and_clear();
    report(
        output,
        total,
        &formats,
        target,
        format,
        &format!("{} tensors", planned.len()),
    )
}

/// What `convert` says once the file is written.
fn report(
    output: &Path,
    total: u64,
    formats: &WeightFormats,
    target: Target,
    format: WeightFormat,
    tensors: &str,
) -> Result<()> {
    let weights = match target {
        Target::Native => formats.describe(),
        _ => format!("{} weights", format.name()),
    };
    eprintln!(
        "convert: wrote {} ({:.1} MB, {weights}, {tensors})",
        output.display(),
        total as f64 / 1e6,
    );
    // Said after the write, so that a failed one stays a single line.
    if let Some(note) = formats.conversion_note() {
        eprintln!("convert: {note}");
    }
    let named_for_pulsar = output
        .file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with(".pulsar.gguf"));
    if !named_for_pulsar {
        eprintln!(
            "convert: note: the file uses Pulsar's own tensor layouts, which llama.cpp and other GGUF readers refuse; a name ending in .pulsar.gguf says so"
        );
    }
    Ok(())
}

/// Whether a matrix is written in its file's own type rather than the
/// kernels' layout: a Q4_K or Q5_K matrix the engine keeps as Q5_0 with an
/// offset per 32 values (`model::k_quant_as_q5_0`), which a row-block
/// tensor has no room for. Loading converts it as it converts the source
/// (so the logits are the same), from fewer bytes than Q5_0 takes.
fn stays_in_file_type(format: WeightFormat, dtype: DType) -> bool {
    format.takes_offsets(dtype)
}

/// The converted file as it is written: in order, in chunks between which
/// Ctrl-C is checked (the embedding alone is hundreds of MB).
pub(super) struct Output {
    file: AtomicFile,
    written: u64,
}

impl Output {
    const CHUNK: usize = 1 << 20;

    /// The file at `output` with `header` written, and a progress bar
    /// over the `data` bytes to follow; Ctrl-C stops the write from here.
    pub(super) fn begin(output: &Path, header: &[u8], data: u64) -> Result<(Output, ProgressBar)> {
        crate::cancel::install_ctrl_c_flag()?;
        let mut out = Output {
            file: AtomicFile::create(output)?,
            written: 0,
        };
        out.write(header)?;
        let bar = ProgressBar::new(data).with_style(
            ProgressStyle::with_template("convert [{bar:40}] {bytes}/{total_bytes} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        Ok((out, bar))
    }

    /// Renames the finished file into place.
    pub(super) fn commit(self) -> Result<()> {
        self.file.commit()
    }

    pub(super) fn write(&mut self, bytes: &[u8]) -> Result<()> {
        for chunk in bytes.chunks(Self::CHUNK) {
            crate::cancel::check()?;
            self.file
                .write_all(chunk)
                .map_err(|e| self.file.write_error(e))?;
            self.written += chunk.len() as u64;
        }
        Ok(())
    }

    /// Zeros up to `at`: the alignment padding between tensors.
    pub(super) fn pad_to(&mut self, at: u64) -> Result<()> {
        let gap = at.checked_sub(self.written).with_context(|| {
            format!(
                "{}: tensor data overlaps (at {at}, {} written); this is a bug in convert",
                self.file.target().display(),
                self.written
            )
        })?;
        self.write(&vec![0u8; gap as usize])
    }
}
