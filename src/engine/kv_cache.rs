//! Keys and values of every cached position, per layer.

use crate::model::config::ModelConfig;

/// Row-major `[position][kv_head][head_dim]` keys and values per layer. The
/// reference engine keeps every position (sliding-window layers simply look
/// at fewer of them); its memory grows with the sequence.
pub struct KvCache {
    head_dim: usize,
    row: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(c: &ModelConfig) -> KvCache {
        KvCache {
            head_dim: c.head_dim,
            row: c.n_kv_heads * c.head_dim,
            keys: vec![Vec::new(); c.n_layers()],
            values: vec![Vec::new(); c.n_layers()],
            len: 0,
        }
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes the K and V rows of position `len()` for `layer`.
    pub fn store(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let at = self.len * self.row;
        for (cache, new) in [(&mut self.keys[layer], k), (&mut self.values[layer], v)] {
            cache.truncate(at);
            cache.extend_from_slice(new);
        }
    }

    /// Marks the position whose rows every layer has stored as cached.
    pub fn advance(&mut self) {
        self.len += 1;
    }

    /// Forgets positions from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        for cache in self.keys.iter_mut().chain(self.values.iter_mut()) {
            cache.truncate(self.len * self.row);
        }
    }

    pub fn key(&self, layer: usize, pos: usize, kv_head: usize) -> &[f32] {
        let at = pos * self.row + kv_head * self.head_dim;
        &self.keys[layer][at..at + self.head_dim]
    }

    pub fn value(&self, layer: usize, pos: usize, kv_head: usize) -> &[f32] {
        let at = pos * self.row + kv_head * self.head_dim;
        &self.values[layer][at..at + self.head_dim]
    }
}

/// The fast engine's keys and values, preallocated for the whole context:
/// f32 `[layer][kv_head][position][head_dim]`, so that one KV head's
/// positions are a dense run of rows (the attention kernels read them as a
/// matrix). Like [`KvCache`] it keeps every position, so forgetting the
/// last ones (`truncate`) is exact, sliding-window layers included.
pub struct FlatKv {
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
    pub capacity: usize,
    pub len: usize,
    head_dim: usize,
    n_kv_heads: usize,
}

impl FlatKv {
    /// Room for `capacity` positions; errors when that cannot be addressed.
    pub fn new(c: &ModelConfig, capacity: usize) -> anyhow::Result<FlatKv> {
        let kv_dim = c.n_kv_heads * c.head_dim;
        let per_layer = capacity
            .checked_mul(kv_dim)
            .filter(|&n| n <= 1 << 34)
            .ok_or_else(|| anyhow::anyhow!("context {capacity} is too large for memory"))?;
        Ok(FlatKv {
            keys: (0..c.n_layers()).map(|_| vec![0.0; per_layer]).collect(),
            values: (0..c.n_layers()).map(|_| vec![0.0; per_layer]).collect(),
            capacity,
            len: 0,
            head_dim: c.head_dim,
            n_kv_heads: c.n_kv_heads,
        })
    }

    /// Element offset of (kv head, position) inside one layer.
    pub fn at(&self, head: usize, pos: usize) -> usize {
        (head * self.capacity + pos) * self.head_dim
    }

    /// Holds `other`'s first `len` positions and nothing after: the same
    /// keys and values, copied (one run per layer and KV head).
    pub fn copy_prefix_from(&mut self, other: &FlatKv, len: usize) {
        assert!(
            len <= other.len && len <= self.capacity,
            "copying {len} positions of a cache holding {} into room for {}",
            other.len,
            self.capacity
        );
        let run = len * self.head_dim;
        for layer in 0..self.keys.len() {
            for head in 0..self.n_kv_heads {
                let (to, from) = (self.at(head, 0), other.at(head, 0));
                self.keys[layer][to..to + run]
                    .copy_from_slice(&other.keys[layer][from..from + run]);
                self.values[layer][to..to + run]
                    .copy_from_slice(&other.values[layer][from..from + run]);
            }
        }
        self.len = len;
    }

    /// Stores one position's K and V rows (`[kv_head][head_dim]` each) of
    /// layer `layer`.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        for head in 0..self.n_kv_heads {
            let at = self.at(head, pos);
            let from = head * hd;
            self.keys[layer][at..at + hd].copy_from_slice(&k[from..from + hd]);
            self.values[layer][at..at + hd].copy_from_slice(&v[from..from + hd]);
        }
    }
}
