//! Gemma 4's mixture of experts in the fast engine: the router on both
//! threads, each step's tokens grouped by the experts they chose, and the
//! experts' products handed to the same parallel sections as the dense
//! MLP's (the experts read the residual, not the dense MLP's output, so
//! nothing orders them after it).

use super::FastEngine;
use super::matmul::Product;
use crate::engine::kernels::{MatKernels, SharedOut};
use crate::engine::ops;
use crate::engine::packed::PackedMatrix;
use crate::engine::pool::split_range;
use crate::model::config::MoeShape;
use crate::model::weights::{Mlp, MoeWeights};
use std::ops::Range;

/// Where an expert's input rows are: a run of the step's rows of the
/// experts' normed input (a decode step's one token, shared by every
/// chosen expert and so quantized once), or gathered into its own buffer.
enum ExpertInput {
    Rows(Range<usize>),
    Gathered(Vec<f32>),
}

/// One used expert of a step: its weights, its tokens with their routing
/// weights, and its products' buffers.
struct ExpertWork<'w> {
    mlp: &'w Mlp<PackedMatrix>,
    /// Rows of the step routed here, in order, with their weights.
    tokens: Vec<(usize, f32)>,
    /// How many of `tokens` are exact rows (they lead, as the step's do).
    exact: usize,
    input: ExpertInput,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    out: Vec<f32>,
}

/// A layer's mixture over one step, from its routing to its weighted sum.
pub(super) struct ExpertsStep<'w> {
    experts: Vec<ExpertWork<'w>>,
    hidden: usize,
}

impl FastEngine {
    /// Routes every row of `x` (the residual) to its experts and groups the
    /// step's rows by expert; `expert_in` receives the experts' normed
    /// input, which [`ExpertsStep`]'s products read.
    pub(super) fn route_step<'w>(
        &self,
        moe: &'w MoeWeights<PackedMatrix>,
        shape: MoeShape,
        exact: usize,
        x: &[f32],
        expert_in: &mut [f32],
    ) -> ExpertsStep<'w> {
        let h = self.config.hidden;
        // A prompt's rows split over the pool, as the layer's other norms.
        self.rms_norm_rows(x, &moe.norm, expert_in);
        let logits = self.router_logits(moe, shape.experts, x);
        let mut routed_to: Vec<Vec<(usize, f32)>> = vec![Vec::new(); shape.experts];
        for (t, row) in logits.chunks_exact(shape.experts).enumerate() {
            for (e, weight) in ops::route_experts(row, shape.top_k, &moe.expert_scale) {
                routed_to[e].push((t, weight));
            }
        }
        let experts = routed_to
            .into_iter()
            .enumerate()
            .filter(|(_, tokens)| !tokens.is_empty())
            .map(|(e, tokens)| {
                let rows = tokens.len();
                let (first, last) = (tokens[0].0, tokens[rows - 1].0);
                let input = if last + 1 - first == rows {
                    ExpertInput::Rows(first..last + 1)
                } else {
                    let gathered = tokens
                        .iter()
                        .flat_map(|&(t, _)| expert_in[t * h..(t + 1) * h].iter().copied())
                        .collect();
                    ExpertInput::Gathered(gathered)
                };
                let width = shape.width;
                ExpertWork {
                    mlp: &moe.experts[e],
                    exact: tokens.iter().filter(|&&(t, _)| t < exact).count(),
                    tokens,
                    input,
                    gate: vec![0.0; rows * width],
                    up: vec![0.0; rows * width],
                    act: vec![0.0; rows * width],
                    out: vec![0.0; rows * h],
                }
            })
            .collect();
        ExpertsStep { experts, hidden: h }
    }

    /// The router's logits of every row of `x`, `[tokens, experts]`: the
    /// router's rows split over the pool. It is small but f32 (1.4 MB a
    /// layer on the 26B-A4B); read by the main thread alone, it left the
    /// worker idle for about 2% of a decode step. Each logit is the one dot
    /// product the reference's `ops::route_token` takes.
    fn router_logits(&self, moe: &MoeWeights<PackedMatrix>, experts: usize, x: &[f32]) -> Vec<f32> {
        let (h, eps) = (self.config.hidden, self.config.rms_eps);
        let inputs: Vec<f32> = x
            .chunks_exact(h)
            .flat_map(|row| ops::router_input(row, &moe.router_input_scale, eps))
            .collect();
        let n = x.len() / h;
        let mut logits = vec![0.0; n * experts];
        let out = SharedOut::new(&mut logits, experts);
        let (router, threads) = (&moe.router.data, self.pool.threads());
        self.pool.run(|tid| {
            let (e0, e1) = split_range(experts, threads, tid, 1);
            for e in e0..e1 {
                let weights = &router[e * h..(e + 1) * h];
                for (t, input) in inputs.chunks_exact(h).enumerate() {
                    // SAFETY: expert e's column is this thread's alone.
                    let cell = unsafe { out.cells(t, e..e + 1) };
                    cell[0] = ops::dot(weights, input);
                }
            }
        });
        logits
    }
}

impl<'w> ExpertsStep<'w> {
    /// Every used expert's gate and up, reading `expert_in` (as
    /// [`FastEngine::route_step`] wrote it).
    pub(super) fn gate_up_products<'s>(
        &'s mut self,
        expert_in: &'s [f32],
    ) -> impl Iterator<Item = Product<'s>> {
        let h = self.hidden;
        self.experts.iter_mut().flat_map(move |e| {
            let x: &'s [f32] = match &e.input {
                ExpertInput::Rows(rows) => &expert_in[rows.start * h..rows.end * h],
                ExpertInput::Gathered(rows) => rows,
            };
            [
                (&e.mlp.gate, x, &mut e.gate[..], e.exact),
                (&e.mlp.up, x, &mut e.up[..], e.exact),
            ]
        })
    }

    /// GeGLU of every used expert's gate and up.
    pub(super) fn geglu(&mut self, kernels: &dyn MatKernels) {
        for e in &mut self.experts {
            kernels.geglu(&e.gate, &e.up, &mut e.act);
        }
    }

    /// Every used expert's down projection.
    pub(super) fn down_products(&mut self) -> impl Iterator<Item = Product<'_>> {
        self.experts
            .iter_mut()
            .map(|e| (&e.mlp.down, &e.act[..], &mut e.out[..], e.exact))
    }

    /// Each row's weighted sum of its experts' outputs into `routed`
    /// (`[tokens, hidden]`), added in expert order as the reference adds
    /// them, whatever else shares the step.
    pub(super) fn weighted_sum(&self, routed: &mut [f32]) {
        let h = self.hidden;
        routed.fill(0.0);
        for e in &self.experts {
            for (&(t, weight), y) in e.tokens.iter().zip(e.out.chunks_exact(h)) {
                for (r, v) in routed[t * h..(t + 1) * h].iter_mut().zip(y) {
                    *r += weight * v;
                }
            }
        }
    }
}
