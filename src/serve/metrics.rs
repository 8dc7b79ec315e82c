//! Counters the scheduler and the handlers update, and their Prometheus
//! text form for `GET /metrics`. Reading them never waits on the engine
//! thread: they are atomics (and one small map behind a mutex that only
//! handlers touch).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The largest batch (sequences in one step) counted in its own bucket;
/// larger ones share the last.
const BATCH_BUCKETS: usize = 16;

#[derive(Default)]
pub struct Metrics {
    /// Responses by (endpoint, HTTP status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Tokens drafted by speculative decoding, and of them, confirmed.
    pub drafted_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    /// Of the drafted tokens, those drafted in steps of several requests.
    pub batch_drafted_tokens: AtomicU64,
    /// Forward steps run, and the sequences and tokens they carried.
    pub steps: AtomicU64,
    pub step_sequences: AtomicU64,
    pub step_tokens: AtomicU64,
    /// The most sequences one step has carried.
    pub max_step_sequences: AtomicUsize,
    /// Steps by the number of sequences they carried (index 0 = 1).
    steps_by_batch: [AtomicU64; BATCH_BUCKETS],
    /// Seconds spent in forward steps, in microseconds.
    pub step_micros: AtomicU64,
    /// Generated tokens per second over the last few seconds, as f64 bits.
    decode_rate_bits: AtomicU64,
    pub queue_length: AtomicUsize,
    pub busy_slots: AtomicUsize,
    pub slots: AtomicUsize,
    pub kv_cells_used: AtomicUsize,
    pub kv_cells_total: AtomicUsize,
    /// Requests whose client went away before the end (freed slots).
    pub disconnects: AtomicU64,
    /// Requests ended because their client stopped reading.
    pub stalled: AtomicU64,
    /// Requests refused with 503 because the queue was full.
    pub rejected_busy: AtomicU64,
}

impl Metrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        // A poisoned lock only means a handler panicked mid-update of a
        // counter map; the counts are still usable.
        let mut map = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry((endpoint.to_string(), status)).or_insert(0) += 1;
    }

    /// Records one forward step over `sequences` sequences and `tokens`
    /// tokens.
    pub fn count_step(&self, sequences: usize, tokens: usize, micros: u64) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_sequences
            .fetch_add(sequences as u64, Ordering::Relaxed);
        self.step_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        self.step_micros.fetch_add(micros, Ordering::Relaxed);
        self.max_step_sequences
            .fetch_max(sequences, Ordering::Relaxed);
        let bucket = sequences.clamp(1, BATCH_BUCKETS) - 1;
        self.steps_by_batch[bucket].fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_decode_rate(&self, tokens_per_second: f64) {
        self.decode_rate_bits
            .store(tokens_per_second.to_bits(), Ordering::Relaxed);
    }

    pub fn decode_rate(&self) -> f64 {
        f64::from_bits(self.decode_rate_bits.load(Ordering::Relaxed))
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let getu = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        let mut metric = |name: &str, kind: &str, help: &str, lines: Vec<(String, String)>| {
            // Writing to a String cannot fail.
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in lines {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        let one = |v: String| vec![(String::new(), v)];
        let requests: Vec<(String, String)> = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|((endpoint, status), n)| {
                (
                    format!("{{endpoint=\"{endpoint}\",status=\"{status}\"}}"),
                    n.to_string(),
                )
            })
            .collect();
        metric(
            "pulsar_requests_total",
            "counter",
            "HTTP responses by endpoint and status.",
            requests,
        );
        metric(
            "pulsar_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            one(get(&self.prompt_tokens).to_string()),
        );
        metric(
            "pulsar_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens taken from a slot's KV cache instead of being fed.",
            one(get(&self.cached_prompt_tokens).to_string()),
        );
        metric(
            "pulsar_generated_tokens_total",
            "counter",
            "Tokens generated.",
            one(get(&self.generated_tokens).to_string()),
        );
        metric(
            "pulsar_drafted_tokens_total",
            "counter",
            "Tokens drafted by speculative decoding (fed and verified in a step).",
            one(get(&self.drafted_tokens).to_string()),
        );
        metric(
            "pulsar_batch_drafted_tokens_total",
            "counter",
            "Of the drafted tokens, those drafted in steps shared by several requests.",
            one(get(&self.batch_drafted_tokens).to_string()),
        );
        metric(
            "pulsar_accepted_tokens_total",
            "counter",
            "Drafted tokens the sampler confirmed (each saved a step).",
            one(get(&self.accepted_tokens).to_string()),
        );
        metric(
            "pulsar_decode_tokens_per_second",
            "gauge",
            "Tokens generated per second over the last 10 seconds, all streams together.",
            one(format!("{:.3}", self.decode_rate())),
        );
        metric(
            "pulsar_steps_total",
            "counter",
            "Forward steps run (each reads every weight once).",
            one(get(&self.steps).to_string()),
        );
        metric(
            "pulsar_step_sequences_total",
            "counter",
            "Sequences carried by forward steps, summed over steps.",
            one(get(&self.step_sequences).to_string()),
        );
        metric(
            "pulsar_step_tokens_total",
            "counter",
            "Tokens fed by forward steps, summed over steps.",
            one(get(&self.step_tokens).to_string()),
        );
        metric(
            "pulsar_step_seconds_total",
            "counter",
            "Seconds spent in forward steps.",
            one(format!("{:.6}", get(&self.step_micros) as f64 / 1e6)),
        );
        metric(
            "pulsar_step_batch_max",
            "gauge",
            "The most sequences one forward step has carried.",
            one(getu(&self.max_step_sequences).to_string()),
        );
        let by_batch = self
            .steps_by_batch
            .iter()
            .enumerate()
            .filter(|(_, n)| get(n) > 0)
            .map(|(i, n)| {
                let label = if i + 1 == BATCH_BUCKETS {
                    format!("{}+", i + 1)
                } else {
                    (i + 1).to_string()
                };
                (format!("{{sequences=\"{label}\"}}"), get(n).to_string())
            })
            .collect();
        metric(
            "pulsar_steps_by_batch_total",
            "counter",
            "Forward steps by the number of sequences they carried.",
            by_batch,
        );
        metric(
            "pulsar_queue_length",
            "gauge",
            "Requests waiting for a slot.",
            one(getu(&self.queue_length).to_string()),
        );
        metric(
            "pulsar_slots_busy",
            "gauge",
            "Slots (sequences) serving a request.",
            one(getu(&self.busy_slots).to_string()),
        );
        metric(
            "pulsar_slots",
            "gauge",
            "Slots (--parallel).",
            one(getu(&self.slots).to_string()),
        );
        metric(
            "pulsar_kv_cells_used",
            "gauge",
            "KV cache cells holding a token, over all slots (idle slots keep theirs for prefix reuse).",
            one(getu(&self.kv_cells_used).to_string()),
        );
        metric(
            "pulsar_kv_cells",
            "gauge",
            "KV cache cells, over all slots.",
            one(getu(&self.kv_cells_total).to_string()),
        );
        metric(
            "pulsar_disconnects_total",
            "counter",
            "Requests whose client went away before the end.",
            one(get(&self.disconnects).to_string()),
        );
        metric(
            "pulsar_stalled_total",
            "counter",
            "Requests ended because the client stopped reading.",
            one(get(&self.stalled).to_string()),
        );
        metric(
            "pulsar_rejected_busy_total",
            "counter",
            "Requests refused with 503 because the queue was full.",
            one(get(&self.rejected_busy).to_string()),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.count_step(3, 3, 1000);
        m.count_step(1, 40, 1000);
        let text = m.render();
        assert!(
            text.contains("pulsar_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2"),
            "{text}"
        );
        assert!(text.contains("pulsar_step_batch_max 3\n"), "{text}");
        assert!(text.contains("pulsar_steps_by_batch_total{sequences=\"3\"} 1\n"));
        assert!(text.contains("# TYPE pulsar_steps_total counter\npulsar_steps_total 2\n"));
    }
}
