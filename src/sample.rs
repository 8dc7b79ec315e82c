//! Samplers (in progress).
