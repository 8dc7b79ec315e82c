//! The fast engine's batch API: several sequences, each with its own KV
//! cache, fed in one step that reads each weight once for all of them
//! (`forward_batch`), and the calls that manage the sequences (count,
//! length, truncation, copying a prefix) and hand back a step's buffers.

use super::{EXACT_STEP_MAX_TOKENS, FastEngine, Part, SeqTokens};
use crate::engine::LogitsWanted;
use crate::engine::kv_cache::FlatKv;
use crate::engine::step_logits::StepLogits;
use anyhow::{Result, bail};

impl FastEngine {
    /// Independent sequences (KV caches) the engine holds.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Holds `count` sequences (at least 1), each with room for the
    /// engine's context; sequences added start empty, sequences beyond
    /// `count` are dropped.
    pub fn set_sequences(&mut self, count: usize) -> Result<()> {
        let capacity = self.seqs[0].capacity;
        self.seqs.truncate(count.max(1));
        while self.seqs.len() < count {
            self.seqs.push(FlatKv::new(&self.config, capacity)?);
        }
        Ok(())
    }

    /// Tokens sequence `seq` has cached.
    pub fn sequence_len(&self, seq: usize) -> usize {
        self.seqs[seq].len
    }

    /// Forgets sequence `seq`'s cached tokens from `len` on (exact: the
    /// cache keeps every position).
    pub fn truncate_sequence(&mut self, seq: usize, len: usize) {
        let kv = &mut self.seqs[seq];
        kv.len = kv.len.min(len);
    }

    /// Makes sequence `to` hold sequence `from`'s first `len` cached
    /// positions, copied, and nothing after: for a sequence about to read
    /// a prompt another one has read already. Positions computed the same
    /// way hold the same bits, so this is what feeding them would give
    /// wherever `forward_batch` would compute them alike (see its notes).
    pub fn copy_prefix(&mut self, from: usize, to: usize, len: usize) -> Result<()> {
        let count = self.seqs.len();
        if from >= count || to >= count || from == to {
            bail!("cannot copy sequence {from} into {to} (the engine holds {count})");
        }
        if len > self.seqs[from].len {
            bail!(
                "sequence {from} holds {} positions, not {len}",
                self.seqs[from].len
            );
        }
        let (source, target) = if from < to {
            let (head, tail) = self.seqs.split_at_mut(to);
            (&head[from], &mut tail[0])
        } else {
            let (head, tail) = self.seqs.split_at_mut(from);
            (&tail[0], &mut head[to])
        };
        target.copy_prefix_from(source, len);
        Ok(())
    }

    /// The final hidden states (after the final norm, the LM head's input)
    /// of entry `entry` of the last [`FastEngine::forward_batch`]: one row
    /// of `hidden` values per token it fed, whether or not logits were
    /// wanted; empty for an entry that step did not have.
    pub fn last_hidden(&self, entry: usize) -> &[f32] {
        let hidden = self.config.hidden;
        self.last_hidden_rows.get(entry).map_or(&[][..], |rows| {
            &self.last_hidden[rows.start * hidden..rows.end * hidden]
        })
    }

    /// One forward step over several sequences' tokens: each weight is read
    /// once for all of them. A sequence's run of at most
    /// [`EXACT_STEP_MAX_TOKENS`] is computed exactly as one-token steps
    /// would; longer runs in bulk, by the GEMMs (callers bound them, e.g. to
    /// a prefill chunk). Returns each entry's logits (empty where none were
    /// wanted), in the order of `batch`.
    pub fn forward_batch(&mut self, batch: &[SeqTokens]) -> Result<Vec<Vec<f32>>> {
        Ok(self.forward_batch_logits(batch)?.into_entries())
    }

    /// Takes back a step's logits once they are read: the next step writes
    /// its logits over the same memory.
    /// A buffer of more rows than a decode step's
    /// ([`EXACT_STEP_MAX_TOKENS`], e.g. a scored prompt's) is dropped
    /// rather than kept for the life of the process.
    pub fn recycle_logits(&self, logits: StepLogits) {
        self.keep_logits_buffer(logits.into_buffer());
    }

    /// Keeps `buffer` for the next step's logits, unless it is larger
    /// than a decode step's (see [`FastEngine::recycle_logits`]).
    pub(super) fn keep_logits_buffer(&self, buffer: Vec<f32>) {
        if buffer.capacity() <= EXACT_STEP_MAX_TOKENS * self.config.vocab_size {
            *self.spare_logits.lock().unwrap_or_else(|e| e.into_inner()) = buffer;
        }
    }

    /// [`FastEngine::forward_batch`], with the entries' logits left in one
    /// buffer ([`StepLogits`]).
    pub fn forward_batch_logits(&mut self, batch: &[SeqTokens]) -> Result<StepLogits> {
        for (i, entry) in batch.iter().enumerate() {
            if entry.seq >= self.seqs.len() {
                bail!(
                    "sequence {} does not exist (the engine holds {})",
                    entry.seq,
                    self.seqs.len()
                );
            }
            if batch[..i].iter().any(|e| e.seq == entry.seq) {
                bail!("sequence {} appears twice in one step", entry.seq);
            }
            let kv = &self.seqs[entry.seq];
            if kv.len + entry.tokens.len() > kv.capacity {
                bail!(
                    "context full: {} cached + {} new tokens exceed the context size {} (raise -c)",
                    kv.len,
                    entry.tokens.len(),
                    kv.capacity
                );
            }
        }
        self.last_hidden_rows.clear();
        let is_exact = |e: &SeqTokens| e.tokens.len() <= EXACT_STEP_MAX_TOKENS;
        // Exact runs first: the products take them as the leading rows.
        let order: Vec<usize> = (0..batch.len())
            .filter(|&i| is_exact(&batch[i]))
            .chain((0..batch.len()).filter(|&i| !is_exact(&batch[i])))
            .filter(|&i| !batch[i].tokens.is_empty())
            .collect();
        let mut tokens = Vec::new();
        let mut parts = Vec::with_capacity(order.len());
        for &i in &order {
            let e = &batch[i];
            tokens.extend_from_slice(e.tokens);
            parts.push(Part {
                seq: e.seq,
                start: self.seqs[e.seq].len,
                n: e.tokens.len(),
                exact: is_exact(e),
            });
        }
        if tokens.is_empty() {
            let none = vec![Vec::new(); batch.len()];
            return Ok(StepLogits::new(Vec::new(), 0, &none));
        }
        let normed = self.forward_parts(&parts, &tokens)?;

        // The rows whose logits are wanted: every exact one and the last
        // row of a bulk run first (computed exactly), then the bulk runs'
        // other rows. `wanted_rows[i]` lists entry i's rows in `picked`.
        let hidden = self.config.hidden;
        let mut first_row = vec![0; batch.len()];
        let mut row = 0;
        for &i in &order {
            first_row[i] = row;
            row += batch[i].tokens.len();
        }
        let mut picked: Vec<usize> = Vec::new();
        let mut wanted_rows: Vec<Vec<usize>> = vec![Vec::new(); batch.len()];
        for bulk_rows in [false, true] {
            for &i in &order {
                let (e, r0) = (&batch[i], first_row[i]);
                let n = e.tokens.len();
                let rows = match (e.wanted, bulk_rows, is_exact(e)) {
                    (None, ..) => 0..0,
                    (Some(LogitsWanted::Last), false, _) => n - 1..n,
                    (Some(LogitsWanted::All), false, true) => 0..n,
                    (Some(LogitsWanted::All), false, false) => n - 1..n,
                    (Some(LogitsWanted::All), true, false) => 0..n - 1,
                    (_, true, _) => 0..0,
                };
                for r in rows {
                    wanted_rows[i].push(picked.len());
                    picked.push(r0 + r);
                }
            }
        }
        let exact_rows = picked.len()
            - batch
                .iter()
                .filter(|e| e.wanted == Some(LogitsWanted::All) && !is_exact(e))
                .map(|e| e.tokens.len() - 1)
                .sum::<usize>();
        let mut rows = Vec::with_capacity(picked.len() * hidden);
        for &r in &picked {
            rows.extend_from_slice(&normed[r * hidden..(r + 1) * hidden]);
        }
        let vocab = self.config.vocab_size;
        let logits = self.logits_of(&rows, exact_rows);
        self.last_hidden_rows = (0..batch.len())
            .map(|i| first_row[i]..first_row[i] + batch[i].tokens.len())
            .collect();
        self.last_hidden = normed;
        // The assistant's next round reads these (after any cut back).
        for (&i, part) in order.iter().zip(&parts) {
            self.keep_for_drafts(part.seq, part.start, i);
        }
        // Each entry's rows in its own order (a bulk run's last row was
        // computed before its other rows).
        for rows in &mut wanted_rows {
            rows.sort_by_key(|&p| picked[p]);
        }
        Ok(StepLogits::new(logits, vocab, &wanted_rows))
    }
}
