//! The file `--save-logits` writes and `--kl-base` reads.
//!
//! Storing every scored position's full distribution would cost
//! vocab × 4 bytes per position (1 MiB for Gemma's 262,144 tokens; 3.5 GB
//! for the 3,570 positions of a 7,562-token text at `-c 512`), so each
//! position keeps only the base's top-K log-probabilities with their token
//! ids and the log of the mass outside them; [`super::kl`] states what KL
//! that allows and its error bound. Layout, all little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `PPLK` |
//! | 4 | u32 format version, 1 |
//! | 4 | u32 `n_ctx` (`-c`) |
//! | 4 | u32 vocabulary size |
//! | 4 | u32 K, log-probabilities kept per position |
//! | 4 | u32 number of tokens, windows × `n_ctx` |
//! | 4 | u32 number of scored positions |
//! | 4 × tokens | u32 token ids of the windows, as the text has them (before BOS replaces each window's first) |
//! | per position | f32 NLL of the true next token, f32 ln(mass outside the top K) (`-inf` if none), K × u32 token ids, K × f32 log-probabilities, most likely first |

use crate::fs_atomic::AtomicFile;
use anyhow::{Context, Result, bail};
use std::io::Write;
use std::path::Path;

use super::logprobs::{log_mass_outside, top_k};

const MAGIC: &[u8; 4] = b"PPLK";
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 7 * 4;

/// Log-probabilities kept per position. For Gemma 3 270M on English prose
/// the top 128 tokens hold all but a few percent of the probability (the
/// `--kl-base` report prints the measured tail), at 1 KiB per position:
/// 3.7 MB for 3,570 positions, where llama.cpp's full-vocabulary uint16
/// file would take 1.9 GB.
pub const DEFAULT_TOP_K: usize = 128;

/// What identifies the run a base file belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseHeader {
    pub n_ctx: usize,
    pub vocab: usize,
    pub top_k: usize,
    /// The windows' tokens as the text has them.
    pub tokens: Vec<u32>,
    pub n_positions: usize,
}

/// One scored position of the base run.
#[derive(Clone, Debug, PartialEq)]
pub struct BasePosition {
    /// The base's negative log-likelihood of the true next token.
    pub nll: f32,
    /// ln of the probability outside `top`.
    pub log_rest: f32,
    /// The K most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl BasePosition {
    /// Summarizes a log-softmax row whose true next token is `target`.
    pub fn of_row(row: &[f32], target: u32, k: usize, scratch: &mut Vec<u32>) -> BasePosition {
        let top = top_k(row, k, scratch);
        let ids: Vec<u32> = top.iter().map(|&(id, _)| id).collect();
        BasePosition {
            nll: -row[target as usize],
            log_rest: log_mass_outside(row, &ids),
            top,
        }
    }
}

/// Streams a base file: the header first, then one position at a time, so
/// an unwritable path fails before the long run rather than after it.
pub struct BaseWriter {
    file: AtomicFile,
    top_k: usize,
    expected: usize,
    written: usize,
}

impl BaseWriter {
    pub fn create(path: &Path, header: &BaseHeader) -> Result<BaseWriter> {
        let mut file = AtomicFile::create(path)?;
        let mut bytes = Vec::with_capacity(HEADER_BYTES + 4 * header.tokens.len());
        bytes.extend_from_slice(MAGIC);
        for field in [
            VERSION as usize,
            header.n_ctx,
            header.vocab,
            header.top_k,
            header.tokens.len(),
            header.n_positions,
        ] {
            let field = u32::try_from(field)
                .with_context(|| format!("{}: {field} does not fit the format", path.display()))?;
            bytes.extend_from_slice(&field.to_le_bytes());
        }
        for &token in &header.tokens {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        file.write_all(&bytes).map_err(|e| file.write_error(e))?;
        Ok(BaseWriter {
            file,
            top_k: header.top_k,
            expected: header.n_positions,
            written: 0,
        })
    }

    pub fn push(&mut self, position: &BasePosition) -> Result<()> {
        if position.top.len() != self.top_k {
            bail!(
                "{}: a position has {} top entries, the header says {}",
                self.file.target().display(),
                position.top.len(),
                self.top_k
            );
        }
        let mut bytes = Vec::with_capacity(8 + 8 * self.top_k);
        bytes.extend_from_slice(&position.nll.to_le_bytes());
        bytes.extend_from_slice(&position.log_rest.to_le_bytes());
        for &(id, _) in &position.top {
            bytes.extend_from_slice(&id.to_le_bytes());
        }
        for &(_, lp) in &position.top {
            bytes.extend_from_slice(&lp.to_le_bytes());
        }
        self.file
            .write_all(&bytes)
            .map_err(|e| self.file.write_error(e))?;
        self.written += 1;
        Ok(())
    }

    /// Puts the file in place once every position announced is written.
    pub fn finish(self) -> Result<()> {
        if self.written != self.expected {
            bail!(
                "{}: {} of {} positions were written; the file was not saved",
                self.file.target().display(),
                self.written,
                self.expected
            );
        }
        self.file.commit()
    }
}

/// A base file read back.
#[derive(Clone, Debug, PartialEq)]
pub struct BaseLogits {
    pub header: BaseHeader,
    pub positions: Vec<BasePosition>,
}

impl BaseLogits {
    pub fn load(path: &Path) -> Result<BaseLogits> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("{}: cannot read the --kl-base file", path.display()))?;
        parse(&bytes).map_err(|e| {
            anyhow::anyhow!(
                "{}: {e}; make it with `pulsar perplexity --save-logits`",
                path.display()
            )
        })
    }

    /// The base run's perplexity, from the NLLs it stored.
    pub fn perplexity(&self) -> f64 {
        let sum: f64 = self.positions.iter().map(|p| f64::from(p.nll)).sum();
        (sum / self.positions.len().max(1) as f64).exp()
    }
}

/// Reads little-endian u32s and f32s off the front of a byte slice.
struct Reader<'a> {
    rest: &'a [u8],
}

impl Reader<'_> {
    fn u32(&mut self) -> u32 {
        let (head, tail) = self.rest.split_at(4);
        self.rest = tail;
        u32::from_le_bytes([head[0], head[1], head[2], head[3]])
    }

    fn f32(&mut self) -> f32 {
        f32::from_bits(self.u32())
    }
}

/// Parses a whole file; every size is checked against the file's length
/// before anything is read or allocated, so a damaged header cannot ask
/// for gigabytes.
fn parse(bytes: &[u8]) -> std::result::Result<BaseLogits, String> {
    if bytes.len() < HEADER_BYTES || &bytes[..4] != MAGIC {
        return Err("not a perplexity base file (no PPLK header)".to_string());
    }
    let mut r = Reader { rest: &bytes[4..] };
    let version = r.u32();
    if version != VERSION {
        return Err(format!(
            "format version {version}; this pulsar reads version {VERSION}"
        ));
    }
    let n_ctx = r.u32() as usize;
    let vocab = r.u32() as usize;
    let top_k = r.u32() as usize;
    let n_tokens = r.u32() as usize;
    let n_positions = r.u32() as usize;
    // In u128 the sizes of any u32 header cannot overflow.
    let position_bytes = 8 + 8 * top_k as u128;
    let expected =
        HEADER_BYTES as u128 + 4 * n_tokens as u128 + n_positions as u128 * position_bytes;
    if expected != bytes.len() as u128 {
        return Err(format!(
            "{} bytes where the header ({n_tokens} tokens, {n_positions} positions of top {top_k}) needs {expected}; the file is truncated or damaged",
            bytes.len()
        ));
    }
    let per_window = n_ctx.saturating_sub(1 + n_ctx / 2);
    if n_ctx == 0
        || !n_tokens.is_multiple_of(n_ctx)
        || n_positions != (n_tokens / n_ctx) * per_window
    {
        return Err(format!(
            "{n_tokens} tokens and {n_positions} positions do not make whole windows of {n_ctx}; the file is damaged"
        ));
    }
    if top_k == 0 || top_k > vocab {
        return Err(format!("top K {top_k} for a vocabulary of {vocab}"));
    }
    let check_id = |id: u32| {
        if (id as usize) < vocab {
            Ok(id)
        } else {
            Err(format!("token id {id} outside the vocabulary ({vocab})"))
        }
    };
    let tokens = (0..n_tokens)
        .map(|_| check_id(r.u32()))
        .collect::<std::result::Result<Vec<u32>, String>>()?;
    let mut positions = Vec::with_capacity(n_positions);
    for _ in 0..n_positions {
        let nll = r.f32();
        let log_rest = r.f32();
        let ids = (0..top_k)
            .map(|_| check_id(r.u32()))
            .collect::<std::result::Result<Vec<u32>, String>>()?;
        let top = ids.into_iter().map(|id| (id, r.f32())).collect();
        positions.push(BasePosition { nll, log_rest, top });
    }
    Ok(BaseLogits {
        header: BaseHeader {
            n_ctx,
            vocab,
            top_k,
            tokens,
            n_positions,
        },
        positions,
    })
}

/// Why a base file does not fit this run, or `None` when it does. The
/// message names the file and the flag that differs.
pub fn mismatch(path: &Path, base: &BaseHeader, run: &BaseHeader) -> Option<String> {
    let file = path.display();
    if base.vocab != run.vocab {
        return Some(format!(
            "{file}: saved with a {}-token vocabulary, this model has {}; compare runs of the same model family",
            base.vocab, run.vocab
        ));
    }
    if base.n_ctx != run.n_ctx {
        return Some(format!(
            "{file}: saved with -c {}, this run has -c {}; use the same -c",
            base.n_ctx, run.n_ctx
        ));
    }
    if base.tokens.len() != run.tokens.len() {
        return Some(format!(
            "{file}: saved over {} windows, this run has {}; use the same -f and --chunks",
            base.tokens.len() / base.n_ctx.max(1),
            run.tokens.len() / run.n_ctx.max(1)
        ));
    }
    if let Some(at) = base
        .tokens
        .iter()
        .zip(&run.tokens)
        .position(|(a, b)| a != b)
    {
        return Some(format!(
            "{file}: token {at} differs (saved {}, this text {}); use the same -f and tokenizer",
            base.tokens[at], run.tokens[at]
        ));
    }
    None
}
