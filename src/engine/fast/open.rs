//! Loading a fast engine: its weights in the formats decided for them
//! (`engine::formats`), converted into one huge-page arena or used in
//! place from the mapped file.

use super::{FastEngine, FastOptions};
use crate::engine::kernels::MatKernels;
use crate::engine::packed::{PackedMatrix, WeightArena};
use crate::model::source::ModelSource;
use crate::model::weights::{ModelWeights, RowTable, model_matrices};
use anyhow::Result;
use std::sync::Arc;

impl FastEngine {
    /// Loads weights in the kernels' layout: converted (or copied) into one
    /// huge-page arena, or, with `in_place`, used zero-copy from the mapping
    /// where the file already stores them in the packed format. The
    /// formats are decided here ([`FastEngine::weight_formats`]); `kernels`
    /// must be planned for them.
    pub fn load(
        src: &Arc<ModelSource>,
        kernels: Box<dyn MatKernels>,
        opts: &FastOptions,
    ) -> Result<Self> {
        let owner: Arc<dyn Send + Sync> = src.clone();
        let formats = Self::weight_formats(src, opts)?;
        let c = &src.config;
        // One arena for every matrix that needs converting.
        let arena_bytes = model_matrices(c)
            .into_iter()
            .map(|(role, [rows, cols])| WeightArena::footprint(formats.of(role), rows, cols))
            .sum();
        let arena = WeightArena::new(arena_bytes);
        let table_owner = owner.clone();
        let weights = ModelWeights::load_with(
            src,
            |role, t| {
                let format = formats.of(role);
                if opts.in_place && t.dtype == format.row_blocked_dtype() {
                    PackedMatrix::borrowed(owner.clone(), &t)
                } else {
                    Ok(PackedMatrix::convert_into(&t, format, &arena))
                }
            },
            // A token reads one row of the per-layer table: it stays in
            // the mapped file, in the file's type. Its pages, read once
            // for the scale check, are dropped; rows fault back in as
            // tokens need them.
            |t| {
                t.release_pages();
                Ok(RowTable::mapped(table_owner, &t))
            },
        )?;
        Self::new(src.config.clone(), weights, kernels, opts)
    }
}
