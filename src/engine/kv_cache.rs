//! Keys and values of every cached position, per layer.

use crate::model::config::ModelConfig;

/// Row-major `[position][kv_head][head_dim]` keys and values per layer. The
/// reference engine keeps every position (sliding-window layers simply look
/// at fewer of them); its memory grows with the sequence.
pub struct KvCache {
    /// Each layer's (head dim, row width); a layer that reads another's
    /// cache stores nothing.
    dims: Vec<(usize, usize)>,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(c: &ModelConfig) -> KvCache {
        KvCache {
            dims: (0..c.n_layers())
                .map(|i| {
                    let s = c.shape(i);
                    (s.head_dim, s.n_kv_heads * s.head_dim)
                })
                .collect(),
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
        let at = self.len * self.dims[layer].1;
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
        for (layer, &(_, row)) in self.dims.iter().enumerate() {
            self.keys[layer].truncate(self.len * row);
            self.values[layer].truncate(self.len * row);
        }
    }

    pub fn key(&self, layer: usize, pos: usize, kv_head: usize) -> &[f32] {
        let (hd, row) = self.dims[layer];
        let at = pos * row + kv_head * hd;
        &self.keys[layer][at..at + hd]
    }

    pub fn value(&self, layer: usize, pos: usize, kv_head: usize) -> &[f32] {
        let (hd, row) = self.dims[layer];
        let at = pos * row + kv_head * hd;
        &self.values[layer][at..at + hd]
    }
}

/// The fast engine's keys and values, preallocated for the whole context:
/// f32 `[layer][kv_head][position][head_dim]`, so that one KV head's
/// positions are a dense run of rows (the attention kernels read them as a
/// matrix). Like [`KvCache`] it keeps every position, so forgetting the
/// last ones (`truncate`) is exact, sliding-window layers included.
///
/// A layer that attends over an earlier layer's keys (KV sharing) keeps
/// none: its vectors are empty, and the cache is smaller by that much.
pub struct FlatKv {
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
    pub capacity: usize,
    pub len: usize,
    /// Each layer's (head dim, KV heads).
    dims: Vec<(usize, usize)>,
}

impl FlatKv {
    /// Room for `capacity` positions; errors when that cannot be addressed.
    pub fn new(c: &ModelConfig, capacity: usize) -> anyhow::Result<FlatKv> {
        let mut sizes = Vec::with_capacity(c.n_layers());
        for i in 0..c.n_layers() {
            let s = c.shape(i);
            let size = if c.keeps_kv(i) {
                capacity
                    .checked_mul(s.n_kv_heads * s.head_dim)
                    .filter(|&n| n <= 1 << 34)
                    .ok_or_else(|| anyhow::anyhow!("context {capacity} is too large for memory"))?
            } else {
                0
            };
            sizes.push(size);
        }
        Ok(FlatKv {
            keys: sizes.iter().map(|&n| vec![0.0; n]).collect(),
            values: sizes.iter().map(|&n| vec![0.0; n]).collect(),
            capacity,
            len: 0,
            dims: (0..c.n_layers())
                .map(|i| (c.shape(i).head_dim, c.shape(i).n_kv_heads))
                .collect(),
        })
    }

    /// Element offset of (kv head, position) inside layer `layer`.
    pub fn at(&self, layer: usize, head: usize, pos: usize) -> usize {
        (head * self.capacity + pos) * self.dims[layer].0
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
        for layer in 0..self.keys.len() {
            if self.keys[layer].is_empty() {
                continue;
            }
            let (hd, heads) = self.dims[layer];
            let run = len * hd;
            for head in 0..heads {
                let (to, from) = (self.at(layer, head, 0), other.at(layer, head, 0));
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
        let (hd, heads) = self.dims[layer];
        for head in 0..heads {
            let at = self.at(layer, head, pos);
            let from = head * hd;
            self.keys[layer][at..at + hd].copy_from_slice(&k[from..from + hd]);
            self.values[layer][at..at + hd].copy_from_slice(&v[from..from + hd]);
        }
    }
}
