//! Log-probabilities as the OpenAI API reports them: a token's text and
//! bytes, its log-probability under the model's raw distribution and the
//! most likely alternatives, for generated tokens and for a prompt's own.

use crate::tokenizer::{SPACE_MARK, TokenKind, Tokenizer, parse_byte_piece};
use serde::Serialize;

/// One alternative in `top_logprobs`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One generated token's log-probability (chat's `logprobs.content[i]`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// A token as the API shows it: its text (`▁` as a space, a byte token as
/// its byte, a control token as its name) and that text's bytes.
pub fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let (Some(kind), Some(piece)) = (tok.token_kind(id), tok.token_text(id)) else {
        return (String::new(), Vec::new());
    };
    let bytes = match kind {
        TokenKind::Byte => parse_byte_piece(piece).map_or_else(Vec::new, |b| vec![b]),
        TokenKind::Normal | TokenKind::UserDefined => piece.replace(SPACE_MARK, " ").into_bytes(),
        TokenKind::Control | TokenKind::Unknown | TokenKind::Unused => piece.as_bytes().to_vec(),
    };
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The log-probabilities of the prompt tokens a run predicts: the run fed
/// tokens `from..` and `rows` are its logits, `width` wide (row r: after
/// token `from + r`, so for token `from + r + 1`), each entry with its
/// `top` alternatives. A run from 0 also gives token 0's entry, unscored
/// (no context precedes it). In the echoed prompt a control token (BOS)
/// writes no text, so its entry's text is empty and the entries' texts add
/// up to the echoed text.
pub fn prompt_logprobs(
    tok: &Tokenizer,
    prompt: &[u32],
    from: usize,
    rows: &[f32],
    width: usize,
    top: usize,
) -> Vec<TokenLogprob> {
    let shown = |mut entry: TokenLogprob, id: u32| {
        if tok.token_kind(id) == Some(TokenKind::Control) {
            entry.token.clear();
            entry.bytes.clear();
        }
        entry
    };
    let mut out = Vec::new();
    if from == 0
        && let Some(&id) = prompt.first()
    {
        let (token, bytes) = token_text(tok, id);
        let unscored = TokenLogprob {
            token,
            logprob: f32::NAN,
            bytes,
            top_logprobs: Vec::new(),
        };
        out.push(shown(unscored, id));
    }
    for (r, row) in rows.chunks_exact(width.max(1)).enumerate() {
        let Some(&id) = prompt.get(from + r + 1) else {
            break;
        };
        out.push(shown(token_logprob(tok, row, id, top), id));
    }
    out
}

/// The sampled token's log-probability and the `top` most likely tokens',
/// from the log-softmax of the raw logits (NaN counts as impossible).
pub fn token_logprob(tok: &Tokenizer, raw: &[f32], token: u32, top: usize) -> TokenLogprob {
    let clean = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = raw
        .iter()
        .copied()
        .map(clean)
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = raw.iter().map(|&l| f64::from(clean(l) - max).exp()).sum();
    let log_norm = f64::from(max) + sum.ln();
    let logprob = |id: u32| {
        raw.get(id as usize).map_or(f32::NEG_INFINITY, |&l| {
            (f64::from(clean(l)) - log_norm) as f32
        })
    };
    // The `top` best ids, best first, lower id on ties.
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (id, &l) in raw.iter().enumerate() {
            let l = clean(l);
            if best.len() == top && best.last().is_some_and(|&(worst, _)| l <= worst) {
                continue;
            }
            let at = best.partition_point(|&(b, _)| b >= l);
            best.insert(at, (l, id as u32));
            best.truncate(top);
        }
    }
    let (text, bytes) = token_text(tok, token);
    TokenLogprob {
        token: text,
        logprob: logprob(token),
        bytes,
        top_logprobs: best
            .into_iter()
            .map(|(_, id)| {
                let (token, bytes) = token_text(tok, id);
                TopLogprob {
                    token,
                    logprob: logprob(id),
                    bytes,
                }
            })
            .collect(),
    }
}
