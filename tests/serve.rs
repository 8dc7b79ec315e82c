//! `pulsar serve` through the real binary on the default model: each test
//! starts a server on an ephemeral loopback port (`--port 0`, the address
//! read from its stdout) and drives it over HTTP.
//!
//! Generation is greedy (temperature 0) or seeded wherever a test compares
//! texts, and token counts are bounded by `max_tokens`, so nothing depends
//! on timing; the few time bounds are liveness bounds, far above what is
//! expected.

mod common;

use reqwest::blocking::{Client, Response};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Gemma's `<eos>` and `<end_of_turn>`: banned with `logit_bias` where a
/// test needs a generation that runs to `max_tokens`.
const EOS: &str = "1";
const END_OF_TURN: &str = "106";

struct Server {
    child: Child,
    base: String,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let model = pulsar::model::fetch::default_model_path().expect("default model");
        Server::start_model(&model, args, env)
    }

    /// A server on `model` rather than the default one.
    fn start_model(model: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pulsar"));
        cmd.arg("serve")
            .arg("-m")
            .arg(model)
            .args(["--port", "0", "--threads", "2"])
            .args(args)
            .env_remove("PULSAR_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("pulsar serve starts");
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut err) = child.stderr.take() {
            let log = stderr.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = err.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    log.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("reading the server's stdout");
        let Some(addr) = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
        else {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no address on stdout: {line:?}; stderr: {}",
                stderr.lock().unwrap()
            );
        };
        assert!(addr.starts_with("127.0.0.1:"), "{line}");
        let server = Server {
            base: format!("http://{addr}"),
            child,
            stderr,
        };
        server.wait_until_loaded();
        server
    }

    /// The port is open before the model is loaded; meanwhile every
    /// answer is 503 "loading" (never a refused connection), then /health
    /// says 200.
    fn wait_until_loaded(&self) {
        let start = Instant::now();
        loop {
            let r = client().get(self.url("/health")).send().expect("health");
            if r.status().as_u16() == 200 {
                return;
            }
            assert_eq!(r.status().as_u16(), 503);
            let b: Value = r.json().expect("JSON");
            assert_eq!(b["error"]["code"], "loading", "{b}");
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "not loaded after 120 s; stderr: {}",
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What the server wrote on stderr so far.
    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        client()
            .post(self.url(path))
            .json(body)
            .send()
            .expect("request sent")
    }

    /// POSTs and returns (status, JSON body).
    fn call(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.post(path, body);
        let status = r.status().as_u16();
        let text = r.text().expect("body read");
        let value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
        (status, value)
    }

    fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, value) = self.call(path, body);
        assert_eq!(status, 200, "{value}");
        value
    }

    fn metrics(&self) -> String {
        client()
            .get(self.url("/metrics"))
            .send()
            .and_then(|r| r.text())
            .expect("metrics")
    }

    fn metric(&self, name: &str) -> f64 {
        metric(&self.metrics(), name)
    }

    /// Waits (at most `limit`) for a metric to satisfy `ok`.
    fn wait_metric(&self, name: &str, limit: Duration, ok: impl Fn(f64) -> bool) -> f64 {
        let start = Instant::now();
        loop {
            let v = self.metric(name);
            if ok(v) {
                return v;
            }
            assert!(
                start.elapsed() < limit,
                "{name} is still {v} after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit status (within a liveness bound).
    fn terminate(mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(killed.is_ok_and(|s| s.success()), "kill -TERM {pid}");
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the server did not exit after SIGTERM; stderr: {}",
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("HTTP client")
}

/// A sample's value in Prometheus text (`name value` or `name{...} value`).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            (key == name).then(|| value.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

/// Reads SSE `data:` payloads from a streaming response.
struct Sse {
    lines: std::io::Lines<BufReader<Response>>,
}

impl Sse {
    fn new(r: Response) -> Sse {
        assert_eq!(r.status().as_u16(), 200);
        let kind = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        assert!(kind.starts_with("text/event-stream"), "{kind}");
        Sse {
            lines: BufReader::new(r).lines(),
        }
    }

    /// The next `data:` payload, or None at the end of the stream.
    fn next_data(&mut self) -> Option<String> {
        for line in self.lines.by_ref() {
            let line = line.expect("stream read");
            if let Some(data) = line.strip_prefix("data: ") {
                return Some(data.to_string());
            }
        }
        None
    }

    /// Every payload to the end; `[DONE]` must be the last.
    fn all(mut self) -> Vec<Value> {
        let mut out = Vec::new();
        let mut done = false;
        while let Some(data) = self.next_data() {
            assert!(!done, "data after [DONE]: {data}");
            if data == "[DONE]" {
                done = true;
                continue;
            }
            out.push(serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}")));
        }
        assert!(done, "the stream ended without [DONE]");
        out
    }
}

fn stream(server: &Server, path: &str, body: &Value) -> Sse {
    Sse::new(server.post(path, body))
}

fn chat_text(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {v}"))
        .to_string()
}

/// Choice `i`'s text of a completion reply.
fn completion_text_of(v: &Value, i: usize) -> String {
    v["choices"][i]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("choices[{i}].text: {v}"))
        .to_string()
}

fn completion_text(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {v}"))
        .to_string()
}

fn user(text: &str) -> Value {
    json!([{ "role": "user", "content": text }])
}

fn assert_error(status: u16, body: &Value, want_status: u16, param: Option<&str>, words: &[&str]) {
    assert_eq!(status, want_status, "{body}");
    let e = &body["error"];
    let message = e["message"].as_str().unwrap_or_else(|| panic!("{body}"));
    assert!(e["type"].is_string(), "{body}");
    assert!(
        e.get("code").is_some() && e.get("param").is_some(),
        "{body}"
    );
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{body}");
    }
    for w in words {
        assert!(message.contains(w), "{w:?} not in {message:?}");
    }
}

fn pulsar_cmd(args: &[&str]) -> String {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(args)
        .arg("-m")
        .arg(model)
        .output()
        .expect("pulsar runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

#[test]
fn chat_and_completions_reply_in_openai_shapes() {
    let s = Server::start(&["-c", "1024"]);
    let health = client().get(s.url("/health")).send().expect("health");
    assert_eq!(health.status().as_u16(), 200);
    let models: Value = client()
        .get(s.url("/v1/models"))
        .send()
        .and_then(|r| r.json())
        .expect("models");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "gemma-3-270m-q4_k_m");

    // Non-streaming chat.
    let body = json!({
        "model": "gemma-3-270m-q4_k_m.gguf",
        "messages": user("What is the capital of France?"),
        "temperature": 0,
        "max_tokens": 40,
        "some_future_field": {"ignored": true},
    });
    let v = s.ok("/v1/chat/completions", &body);
    assert_eq!(v["object"], "chat.completion");
    assert!(
        v["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-"))
    );
    assert_eq!(v["model"], "gemma-3-270m-q4_k_m");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let text = chat_text(&v);
    assert!(text.contains("Paris"), "{text}");
    // The dialogue format's "\nUser:" ended the reply and is not shown.
    assert_eq!(choice["finish_reason"], "stop");
    assert!(!text.contains("User:") && text == text.trim(), "{text:?}");
    let usage = &v["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        )
    );

    // The same request streamed: the role first, the same text, a finish
    // chunk, the usage chunk, then [DONE].
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = stream(&s, "/v1/chat/completions", &streamed).all();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let n = chunks.len();
    let content: String = chunks[1..n - 2]
        .iter()
        .map(|c| {
            assert!(c["choices"][0]["finish_reason"].is_null(), "{c}");
            assert!(c["usage"].is_null(), "{c}");
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert!(n > 4, "{chunks:?}");
    assert_eq!(content, text);
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert_eq!(
        chunks[n - 1]["usage"]["completion_tokens"],
        usage["completion_tokens"]
    );
    assert_eq!(
        chunks[n - 1]["usage"]["prompt_tokens"],
        usage["prompt_tokens"]
    );
    // Without include_usage there is no usage chunk.
    streamed["stream_options"] = json!(null);
    let chunks = stream(&s, "/v1/chat/completions", &streamed).all();
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "{chunks:?}"
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    // Completions: text prompt with BOS, exact prompt count, max_tokens
    // reached, streamed pieces adding up to the same text.
    let prompt = "The capital of France is";
    let ids = pulsar_cmd(&["tokenize", "-p", prompt]);
    let prompt_tokens = ids.split_whitespace().count();
    let body = json!({"prompt": prompt, "temperature": 0, "max_tokens": 12,
                      "logit_bias": {EOS: -100}});
    let v = s.ok("/v1/completions", &body);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 12);
    let whole = completion_text(&v);
    let run = pulsar_cmd(&[
        "run",
        "-p",
        prompt,
        "-n",
        "12",
        "-t",
        "0",
        "--raw",
        "--threads",
        "2",
    ]);
    assert_eq!(
        format!("{whole}\n"),
        run,
        "the server and `pulsar run` agree"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&s, "/v1/completions", &streamed).all();
    let joined: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(joined, whole);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    // A token-id prompt counts exactly its ids.
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": [2, 818, 5279, 529, 7001, 563], "temperature": 0, "max_tokens": 3}),
    );
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 3);
}

#[test]
fn greedy_chat_matches_pulsar_run_and_logprobs_are_reported() {
    let s = Server::start(&["-c", "1024"]);
    let question = "Name three colors.";
    let v = s.ok(
        "/v1/chat/completions",
        &json!({"messages": user(question), "temperature": 0, "max_tokens": 48}),
    );
    let run = pulsar_cmd(&[
        "run",
        "--chat",
        "-p",
        question,
        "-n",
        "48",
        "-t",
        "0",
        "--threads",
        "2",
    ]);
    assert_eq!(chat_text(&v), run.trim_end(), "server vs pulsar run -t 0");
    // A system message opens the first user turn, as --system does.
    let system = "Answer with a single word.";
    let v = s.ok(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": [{"type": "text", "text": question}]}],
                "temperature": 0, "max_tokens": 24}),
    );
    let run = pulsar_cmd(&[
        "run",
        "--chat",
        "-p",
        question,
        "--system",
        system,
        "-n",
        "24",
        "-t",
        "0",
        "--threads",
        "2",
    ]);
    assert_eq!(chat_text(&v), run.trim_end(), "with a system message");

    // Logprobs of a greedy reply: the chosen token is the most likely one
    // of the raw distribution, alternatives come best first.
    let v = s.ok(
        "/v1/chat/completions",
        &json!({"messages": user("Count from one to ten."), "temperature": 0,
                "max_tokens": 6, "logprobs": true, "top_logprobs": 3}),
    );
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"));
    assert!(!content.is_empty());
    assert!(content.len() <= v["usage"]["completion_tokens"].as_u64().unwrap() as usize);
    let mut joined = String::new();
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        assert_eq!(top[0]["token"], entry["token"], "{entry}");
        let lp: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lp[0] <= 0.0 && lp[0] >= lp[1] && lp[1] >= lp[2], "{entry}");
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            entry["token"].as_str().unwrap()
        );
        joined.push_str(entry["token"].as_str().unwrap());
    }
    assert!(joined.contains(chat_text(&v).as_str()), "{joined:?} vs {v}");
    // Completions' legacy shape.
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": "One, two,", "temperature": 0, "max_tokens": 4, "logprobs": 2,
                "logit_bias": {EOS: -100}}),
    );
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4, "{v}");
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    let tokens: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens, completion_text(&v));
}

#[test]
fn a_stop_string_split_across_tokens_is_caught_and_not_returned() {
    let s = Server::start(&["-c", "512"]);
    let body = json!({"prompt": "Here is a short story about a dragon:", "temperature": 0,
                      "max_tokens": 40, "logprobs": 0, "logit_bias": {EOS: -100}});
    let v = s.ok("/v1/completions", &body);
    let text = completion_text(&v);
    let tokens: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens.concat(), text);
    // A stop string made of the end of one token and the start of the
    // next, where it first occurs in the text.
    let mut offset = 0;
    let mut found = None;
    for i in 0..tokens.len() - 1 {
        offset += tokens[i].len();
        let (a, b) = (&tokens[i], &tokens[i + 1]);
        if a.len() >= 3 && b.len() >= 3 && a.is_ascii() && b.is_ascii() {
            let stop = format!("{}{}", &a[a.len() - 2..], &b[..2]);
            if text.find(&stop) == Some(offset - 2) {
                found = Some((i, stop, offset - 2));
                break;
            }
        }
    }
    let (i, stop, at) = found.unwrap_or_else(|| panic!("no usable token pair in {tokens:?}"));
    for streaming in [false, true] {
        let mut body = body.clone();
        body["stop"] = json!([stop.clone(), "never appears"]);
        let (got, finish, usage) = if streaming {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
            let chunks = stream(&s, "/v1/completions", &body).all();
            let text: String = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["text"].as_str())
                .collect();
            let n = chunks.len();
            (
                text,
                chunks[n - 2]["choices"][0]["finish_reason"].clone(),
                chunks[n - 1]["usage"].clone(),
            )
        } else {
            let v = s.ok("/v1/completions", &body);
            (
                completion_text(&v),
                v["choices"][0]["finish_reason"].clone(),
                v["usage"].clone(),
            )
        };
        assert_eq!(got, text[..at], "stop {stop:?} (streaming: {streaming})");
        assert_eq!(finish, "stop");
        // Tokens 0..=i+1 were generated: the last one completed the stop.
        assert_eq!(usage["completion_tokens"], i + 2, "{usage}");
    }
}

#[test]
fn requests_share_steps_and_replies_do_not_depend_on_company() {
    let s = Server::start(&["-c", "1024", "--parallel", "4"]);
    // A short prompt (fed token-exact) and a long one (fed in bulk), greedy
    // and seeded.
    let requests = [
        (
            "/v1/completions",
            json!({"prompt": "Once upon a time", "temperature": 0, "max_tokens": 40}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("Explain in two sentences why the sky is blue, and mention Rayleigh scattering."), "temperature": 0, "max_tokens": 40}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "The best thing about summer is", "temperature": 0.9, "seed": 42, "max_tokens": 40}),
        ),
    ];
    let text = |path: &str, v: &Value| {
        if path == "/v1/completions" {
            completion_text(v)
        } else {
            chat_text(v)
        }
    };
    let alone: Vec<String> = requests.iter().map(|(p, b)| text(p, &s.ok(p, b))).collect();
    // Again alone: a slot now holds each prompt (prefix reuse).
    let again: Vec<String> = requests.iter().map(|(p, b)| text(p, &s.ok(p, b))).collect();
    assert_eq!(alone, again, "greedy and seeded replies repeat");
    assert_eq!(s.metric("pulsar_step_batch_max"), 1.0);

    // All together, with a fourth request that starts a long prompt while
    // the others decode.
    let long = "Tell me about the history of the printing press. ".repeat(12);
    let together: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .map(|(p, b)| {
                let s = &s;
                scope.spawn(move || text(p, &s.ok(p, b)))
            })
            .collect();
        let extra = scope.spawn(|| {
            s.ok(
                "/v1/completions",
                &json!({"prompt": long, "temperature": 0.7, "max_tokens": 30}),
            )
        });
        extra.join().unwrap();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        alone, together,
        "replies do not depend on what shares their steps"
    );
    let metrics = s.metrics();
    assert!(
        metric(&metrics, "pulsar_step_batch_max") >= 2.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "pulsar_cached_prompt_tokens_total") > 0.0,
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "pulsar_slots_busy"), 0.0);
    assert!(metric(&metrics, "pulsar_kv_cells_used") > 0.0);
}

/// `--spec ngram` (the default) drafts while a request decodes alone and
/// changes no reply: greedy and seeded texts equal those of `--spec off`,
/// and drafts copied from the prompt are confirmed.
#[test]
fn speculation_drafts_for_a_lone_request_and_changes_no_reply() {
    let requests = [
        (
            "/v1/completions",
            json!({"prompt": "red, green, blue, red, green, blue, red, green, blue, red,",
                   "temperature": 0, "max_tokens": 40}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("Repeat this sentence three times: the quick brown fox jumps over the lazy dog."),
                   "temperature": 0.8, "seed": 7, "max_tokens": 60}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9,", "temperature": 0,
                   "max_tokens": 30, "response_format": {"type": "json_object"}}),
        ),
    ];
    let replies = |spec: &str| -> (Vec<Value>, String) {
        // A fixed step cost in the draft policy: drafts are made whatever
        // the machine's timings say.
        let s = Server::start_with_env(
            &["-c", "512", "--parallel", "2", "--spec", spec],
            &[("PULSAR_SPEC_STEP_COST", "0.02")],
        );
        let out = requests.iter().map(|(p, b)| s.ok(p, b)).collect();
        (out, s.metrics())
    };
    let (off, off_metrics) = replies("off");
    let (on, on_metrics) = replies("ngram");
    for ((path, _), (a, b)) in requests.iter().zip(off.iter().zip(&on)) {
        let text = |v: &Value| {
            if *path == "/v1/completions" {
                completion_text(v)
            } else {
                chat_text(v)
            }
        };
        assert_eq!(
            text(a),
            text(b),
            "{path}: the reply differs with --spec ngram"
        );
        assert_eq!(a["usage"], b["usage"], "{path}: usage differs");
    }
    assert_eq!(metric(&off_metrics, "pulsar_drafted_tokens_total"), 0.0);
    assert!(
        metric(&on_metrics, "pulsar_accepted_tokens_total") > 0.0,
        "{on_metrics}"
    );
    assert!(
        metric(&on_metrics, "pulsar_steps_total") < metric(&off_metrics, "pulsar_steps_total"),
        "speculation saved no step: {on_metrics}"
    );
}

/// Requests decoding together draft too, their draft lengths chosen
/// together, and still change no reply: greedy and seeded texts equal
/// those of `--spec off`.
#[test]
fn speculation_drafts_in_steps_shared_by_several_requests() {
    let requests = [
        json!({"prompt": "red, green, blue, red, green, blue, red, green, blue, red,",
               "temperature": 0, "max_tokens": 40}),
        json!({"prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,",
               "temperature": 0, "max_tokens": 40}),
        json!({"prompt": "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,",
               "temperature": 0.8, "seed": 3, "max_tokens": 40}),
    ];
    let replies = |spec: &str| -> (Vec<String>, String) {
        // A fixed step cost: drafts are made whatever the timings say.
        let s = Server::start_with_env(
            &["-c", "512", "--parallel", "3", "--spec", spec],
            &[("PULSAR_SPEC_STEP_COST", "0.02")],
        );
        let texts = std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .iter()
                .map(|b| {
                    let s = &s;
                    scope.spawn(move || completion_text(&s.ok("/v1/completions", b)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (texts, s.metrics())
    };
    let (off, off_metrics) = replies("off");
    let (on, on_metrics) = replies("ngram");
    assert_eq!(off, on, "a reply differs with --spec ngram in shared steps");
    assert!(
        metric(&on_metrics, "pulsar_step_batch_max") >= 2.0,
        "{on_metrics}"
    );
    assert_eq!(
        metric(&off_metrics, "pulsar_batch_drafted_tokens_total"),
        0.0
    );
    assert!(
        metric(&on_metrics, "pulsar_batch_drafted_tokens_total") > 0.0,
        "nothing was drafted in a shared step: {on_metrics}"
    );
    assert!(
        metric(&on_metrics, "pulsar_accepted_tokens_total") > 0.0,
        "{on_metrics}"
    );
}

/// `--spec mtp` with a Gemma 4 assistant (`--draft`) drafts per sequence,
/// alone and in steps shared by several requests, and changes no reply:
/// greedy and seeded texts equal those of `--spec off`. On the tiny pair
/// edited so that drafts are often right (tests/common `favouring_pair`).
#[test]
fn an_assistant_drafts_per_sequence_and_changes_no_reply() {
    let dir = tempfile::tempdir().unwrap();
    let (target, assistant) = common::favouring_pair(dir.path());
    let requests = [
        json!({"prompt": "the cat sat on the mat", "temperature": 0, "max_tokens": 30}),
        json!({"prompt": "a b c d e f", "temperature": 1.0, "seed": 5, "max_tokens": 30}),
        json!({"prompt": "one two three", "temperature": 0.7, "seed": 11, "max_tokens": 30}),
    ];
    let replies = |spec: &str| -> (Vec<String>, String, String) {
        // A fixed step cost: drafts are made whatever the timings say.
        let s = Server::start_model(
            &target,
            &[
                "-c",
                "256",
                "--parallel",
                "3",
                "--spec",
                spec,
                "--draft",
                assistant.to_str().expect("a UTF-8 path"),
            ],
            &[("PULSAR_SPEC_STEP_COST", "0.02")],
        );
        // One request alone, then all three together.
        let mut texts = vec![completion_text(&s.ok("/v1/completions", &requests[0]))];
        texts.extend(std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .iter()
                .map(|b| {
                    let s = &s;
                    scope.spawn(move || completion_text(&s.ok("/v1/completions", b)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        }));
        (texts, s.metrics(), s.stderr())
    };
    let (off, off_metrics, _) = replies("off");
    let (on, on_metrics, stderr) = replies("mtp");
    assert_eq!(off, on, "a reply differs with --spec mtp");
    assert_eq!(
        off[0], off[1],
        "the lone request's reply equals its shared one"
    );
    assert!(stderr.contains("drafts from"), "{stderr}");
    assert!(!stderr.contains("internal error"), "{stderr}");
    assert_eq!(metric(&off_metrics, "pulsar_drafted_tokens_total"), 0.0);
    assert!(
        metric(&on_metrics, "pulsar_batch_drafted_tokens_total") > 0.0,
        "nothing was drafted in a shared step: {on_metrics}"
    );
    let (drafted, accepted) = (
        metric(&on_metrics, "pulsar_drafted_tokens_total"),
        metric(&on_metrics, "pulsar_accepted_tokens_total"),
    );
    assert!(
        accepted > 0.0 && accepted < drafted,
        "{accepted} of {drafted} accepted: {on_metrics}"
    );
}

#[test]
fn the_next_turn_of_a_conversation_reuses_the_cache() {
    let s = Server::start(&["-c", "1024", "--parallel", "2"]);
    let first = "I am planning a trip to Italy next spring and would like to see Rome, Florence and Venice.";
    let turn1 = json!({"messages": user(first), "temperature": 0, "max_tokens": 30});
    let v1 = s.ok("/v1/chat/completions", &turn1);
    let p1 = v1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = chat_text(&v1);
    let turn2 = json!({"messages": [
        {"role": "user", "content": first},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Which city should I visit first?"},
    ], "temperature": 0, "max_tokens": 30});
    let v2 = s.ok("/v1/chat/completions", &turn2);
    let p2 = v2["usage"]["prompt_tokens"].as_u64().unwrap();
    // The whole first prompt comes from the cache; the reply, fed token by
    // token when it was generated, is fed again in bulk (see the
    // scheduler's notes on what a reply depends on).
    assert_eq!(
        v2["usage"]["prompt_tokens_details"]["cached_tokens"], p1,
        "{v2}"
    );
    assert!(p2 > p1 + 17);
    // And the cache changed nothing: a fresh server gives the same reply.
    drop(s);
    let fresh = Server::start(&["-c", "1024", "--parallel", "1"]);
    let v3 = fresh.ok("/v1/chat/completions", &turn2);
    assert_eq!(v3["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(chat_text(&v3), chat_text(&v2));
}

/// `/tokenize` gives `pulsar tokenize`'s ids, `/detokenize` the text back,
/// pieces (bytes where a token is no character alone) join up to the text,
/// and `/v1/models/ID` finds the model by its id only.
/// `n` choices: each is the reply a request with the seed plus its index
/// gets alone; the prompt is read once (the other choices copy its cache,
/// bulk runs' worth) and counted once, the choices' tokens added up; a
/// stream carries every choice, each with its role and its end.
#[test]
fn several_choices_per_request() {
    let s = Server::start(&["-c", "512", "--parallel", "4"]);
    // Long enough for several bulk runs (about 200 tokens).
    let prompt = format!(
        "{}The best thing about summer is",
        "Summer brings long evenings, open windows, fruit from the market and swims in the lake. "
            .repeat(10)
    );
    let completion = |seed: u64, n: u32| {
        s.ok(
            "/v1/completions",
            &json!({"prompt": prompt, "temperature": 0.9, "seed": seed, "max_tokens": 24, "n": n}),
        )
    };
    let together = completion(42, 3);
    // A fresh server: whatever came from a cache was copied from the
    // choice that read the prompt, all but the last bulk run (at most 2 x
    // 16 tokens plus one) for each of the other two.
    let prompt_tokens = together["usage"]["prompt_tokens"].as_u64().expect("count");
    assert!(prompt_tokens > 150, "{together}");
    let shared = s.metric("pulsar_cached_prompt_tokens_total");
    assert!(
        shared >= 2.0 * (prompt_tokens - 33) as f64,
        "{shared} prompt tokens shared of 2 x {prompt_tokens}"
    );
    let choices = together["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{together}");
    let mut completion_tokens = 0;
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{together}");
        assert!(choice["finish_reason"].is_string(), "{together}");
        let alone = completion(42 + i as u64, 1);
        assert_eq!(choice["text"], alone["choices"][0]["text"], "choice {i}");
        assert_eq!(
            together["usage"]["prompt_tokens"],
            alone["usage"]["prompt_tokens"]
        );
        completion_tokens += alone["usage"]["completion_tokens"].as_u64().expect("count");
    }
    assert_eq!(together["usage"]["completion_tokens"], completion_tokens);
    let texts: std::collections::BTreeSet<&str> =
        choices.iter().filter_map(|c| c["text"].as_str()).collect();
    assert!(
        texts.len() > 1,
        "seeds 42..44 drew the same text: {together}"
    );

    // A list of prompts, n each: choice i of prompt p is at index p * n +
    // i and is what a request with that prompt alone gets; each prompt is
    // counted once in usage; echo starts each choice with its own prompt.
    let short = ["The capital of France is", "Two plus two is"];
    let batch = s.ok(
        "/v1/completions",
        &json!({"prompt": short, "n": 2, "temperature": 0.9, "seed": 7,
                "max_tokens": 6, "echo": true}),
    );
    let choices = batch["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4, "{batch}");
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (p, text) in short.iter().enumerate() {
        let alone = s.ok(
            "/v1/completions",
            &json!({"prompt": text, "n": 2, "temperature": 0.9, "seed": 7, "max_tokens": 6}),
        );
        for i in 0..2 {
            let choice = &choices[p * 2 + i];
            assert_eq!(choice["index"], p * 2 + i, "{batch}");
            assert_eq!(
                choice["text"].as_str().expect("text"),
                format!("{text}{}", completion_text_of(&alone, i)),
                "prompt {p} choice {i}"
            );
        }
        prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().expect("count");
        completion_tokens += alone["usage"]["completion_tokens"].as_u64().expect("count");
    }
    assert_eq!(batch["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(batch["usage"]["completion_tokens"], completion_tokens);
    // Streamed, each chunk names its choice; the usage is the same.
    let streamed_body = json!({"prompt": short, "n": 2, "temperature": 0.9, "seed": 7,
                                   "max_tokens": 6, "echo": true, "stream": true,
                                   "stream_options": {"include_usage": true}});
    let chunks = stream(&s, "/v1/completions", &streamed_body).all();
    let mut texts = vec![String::new(); 4];
    for c in &chunks[..chunks.len() - 1] {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().expect("index") as usize;
        texts[i].push_str(choice["text"].as_str().unwrap_or(""));
    }
    for (i, text) in texts.iter().enumerate() {
        assert_eq!(
            Some(text.as_str()),
            choices[i]["text"].as_str(),
            "choice {i}"
        );
    }
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["completion_tokens"], completion_tokens);

    // Streamed chat, greedy: both choices are the one greedy reply.
    let body = json!({"messages": user("Name a fruit."), "temperature": 0, "max_tokens": 16});
    let single = s.ok("/v1/chat/completions", &body);
    let mut streamed = body.clone();
    streamed["n"] = json!(2);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = stream(&s, "/v1/chat/completions", &streamed).all();
    let mut text = [String::new(), String::new()];
    let mut roles = [0; 2];
    let mut finishes = [0; 2];
    for c in &chunks[..chunks.len() - 1] {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().expect("index") as usize;
        assert!(i < 2, "{c}");
        if choice["delta"]["role"] == "assistant" {
            roles[i] += 1;
        }
        if let Some(piece) = choice["delta"]["content"].as_str() {
            text[i].push_str(piece);
        }
        if choice["finish_reason"].is_string() {
            finishes[i] += 1;
        }
    }
    assert_eq!(roles, [1, 1], "one role chunk per choice");
    assert_eq!(finishes, [1, 1], "one finish per choice");
    assert_eq!(text[0], chat_text(&single));
    assert_eq!(text[1], chat_text(&single));
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(usage["prompt_tokens"], single["usage"]["prompt_tokens"]);
    assert_eq!(
        usage["completion_tokens"].as_u64(),
        single["usage"]["completion_tokens"].as_u64().map(|n| 2 * n)
    );
}

/// `echo` returns the prompt's text before the reply's; with `logprobs`
/// each prompt token's log-probability too (the first unscored, null), the
/// very values generation reports for the same token after the same text.
#[test]
fn echo_scores_the_prompt() {
    let s = Server::start(&["-c", "1024"]);
    let path = "/v1/completions";
    let logprobs = |v: &Value| v["choices"][0]["logprobs"].clone();
    // Generated: the greedy token after a short prompt and its logprob.
    let prompt = "The capital of France is";
    let generated = s.ok(
        path,
        &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}),
    );
    let token = logprobs(&generated)["tokens"][0]
        .as_str()
        .expect("token")
        .to_string();
    let score = logprobs(&generated)["token_logprobs"][0]
        .as_f64()
        .expect("logprob");
    // Echoed: that token as the prompt's last, scored from the same row
    // (a short prompt is one exact run, as decoding is).
    let text = format!("{prompt}{token}");
    let echoed = s.ok(
        path,
        &json!({"prompt": text, "max_tokens": 0, "echo": true, "logprobs": 1}),
    );
    assert_eq!(completion_text(&echoed), text);
    assert_eq!(echoed["usage"]["completion_tokens"], 0);
    let lp = logprobs(&echoed);
    let n = echoed["usage"]["prompt_tokens"].as_u64().expect("count") as usize;
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(n), "{echoed}");
    assert!(
        lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
        "{lp}"
    );
    assert_eq!(lp["tokens"][n - 1], token.as_str());
    let last = lp["token_logprobs"][n - 1].as_f64().expect("scored");
    assert!(
        (last - score).abs() < 1e-5,
        "echo {last} against generation {score}"
    );
    // The texts of the entries add up to the echoed text.
    let joined: String = lp["tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(joined, text);
    for k in 1..n {
        let offset = |k: usize| lp["text_offset"][k].as_u64().expect("offset") as usize;
        let len = lp["tokens"][k - 1].as_str().map_or(0, str::len);
        assert_eq!(offset(k), offset(k - 1) + len, "{lp}");
    }

    // A long prompt goes in several bulk runs of logits; the first new
    // token's logprob is what a plain request gets after it.
    let long = format!(
        "{}{prompt}",
        "Paris is a city of bridges, museums and cafes by the Seine. ".repeat(12)
    );
    let plain = s.ok(
        path,
        &json!({"prompt": long, "max_tokens": 1, "temperature": 0, "logprobs": 1}),
    );
    let echoed = s.ok(
        path,
        &json!({"prompt": long, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true}),
    );
    let n = echoed["usage"]["prompt_tokens"].as_u64().expect("count") as usize;
    assert!(n > 100, "{n}");
    let lp = logprobs(&echoed);
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(n + 1));
    assert!(
        lp["token_logprobs"]
            .as_array()
            .into_iter()
            .flatten()
            .skip(1)
            .all(Value::is_number)
    );
    assert_eq!(lp["tokens"][n], logprobs(&plain)["tokens"][0]);
    let (a, b) = (
        lp["token_logprobs"][n].as_f64().expect("scored"),
        logprobs(&plain)["token_logprobs"][0]
            .as_f64()
            .expect("scored"),
    );
    assert!((a - b).abs() < 1e-5, "{a} against {b}");
    assert_eq!(
        completion_text(&echoed),
        format!("{long}{}", completion_text(&plain))
    );
    // Without echo, no new token is still refused.
    let (st, b) = s.call(path, &json!({"prompt": prompt, "max_tokens": 0}));
    assert_error(st, &b, 400, Some("max_tokens"), &["only with echo"]);
}

/// `system_fingerprint` changes with what decides a reply's bits (here the
/// prompt chunk, the inputs' precision) and not with what does not (the
/// context size).
#[test]
fn system_fingerprint_follows_the_settings_that_decide_bits() {
    let fingerprint = |args: &[&str]| {
        let s = Server::start(args);
        let v = s.ok(
            "/v1/completions",
            &json!({"prompt": "Hi", "max_tokens": 1, "temperature": 0}),
        );
        let f = v["system_fingerprint"]
            .as_str()
            .expect("a fingerprint")
            .to_string();
        assert!(f.starts_with("fp_") && f.len() == 15, "{f}");
        f
    };
    let base = fingerprint(&["-c", "256"]);
    assert_eq!(fingerprint(&["-c", "512"]), base);
    assert_ne!(fingerprint(&["-c", "256", "--prefill-chunk", "32"]), base);
    assert_ne!(fingerprint(&["-c", "256", "--input-bits", "16"]), base);
}

/// An embedding from a reply: its `float` values.
fn embedding_of(v: &Value, index: usize) -> Vec<f32> {
    v["data"][index]["embedding"]
        .as_array()
        .unwrap_or_else(|| panic!("data[{index}].embedding is a list: {v}"))
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

#[test]
fn embeddings_pool_the_final_hidden_states() {
    // Prompt chunks of 32 tokens: the long input is read in several bulk
    // runs, the short one in one exact run.
    let s = Server::start(&["-c", "256", "--prefill-chunk", "32"]);
    let path = "/v1/embeddings";
    let short = "The cat sat on the mat.";
    let long = "A lighthouse keeper kept a log of every ship that passed the rocks, \
                the weather each morning, and the oil burned each night; after forty \
                years the log filled a shelf, and the harbour museum now shows it \
                beside his lamp, his boots and a photograph of the storm of 1953.";
    let tokens = |text: &str| -> Vec<u32> {
        let v = s.ok("/tokenize", &json!({"content": text, "add_special": true}));
        v["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    let (short_ids, long_ids) = (tokens(short), tokens(long));
    assert!(
        short_ids.len() < 17 && long_ids.len() > 48,
        "{short_ids:?} {long_ids:?}"
    );
    let reply = s.ok(
        path,
        &json!({"model": "gemma-3-270m-q4_k_m", "input": [short, long], "user": "ignored"}),
    );
    assert_eq!(reply["object"], "list");
    assert_eq!(reply["data"][1]["object"], "embedding");
    assert_eq!(reply["data"][1]["index"], 1);
    let total = short_ids.len() + long_ids.len();
    assert_eq!(reply["usage"]["prompt_tokens"], total);
    assert_eq!(reply["usage"]["total_tokens"], total);
    let got = [embedding_of(&reply, 0), embedding_of(&reply, 1)];

    // The oracle: the reference engine (f32 throughout, the file's weights
    // dequantized) on the same tokens, each position's final hidden state
    // averaged and scaled to length 1.
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let src = pulsar::model::source::ModelSource::open(&model).expect("model opens");
    let mut reference = pulsar::engine::reference::ReferenceEngine::load(&src).expect("loads");
    for (ids, got) in [&short_ids, &long_ids].into_iter().zip(&got) {
        use pulsar::engine::Engine;
        reference.truncate(0);
        let rows = reference.final_hidden(ids).expect("reference runs");
        let width = reference.config().hidden;
        let mut mean = vec![0.0f64; width];
        for row in rows.chunks_exact(width) {
            for (m, &v) in mean.iter_mut().zip(row) {
                *m += f64::from(v);
            }
        }
        let norm = mean.iter().map(|v| v * v).sum::<f64>().sqrt();
        let want: Vec<f32> = mean.iter().map(|v| (v / norm) as f32).collect();
        assert_eq!(got.len(), want.len());
        assert!(
            (dot(got, got) - 1.0).abs() < 1e-5,
            "length {}",
            dot(got, got).sqrt()
        );
        // The kernels round each matrix input to 8 bits: 0.99965 (8
        // tokens) and 0.99976 (62) measured. Wrong poolings measured: the
        // last row alone 0.82 and 0.73, the first half of the rows (a
        // missed bulk run) 0.90 and 0.978, all but BOS 0.9953 on the short
        // input.
        let cosine = dot(got, &want);
        assert!(
            cosine > 0.999,
            "{} tokens: cosine {cosine} with the reference",
            ids.len()
        );
    }
    // `pulsar embed` computes the same vector (the short text is one exact
    // run in both, so the same bits).
    let cli: Vec<f32> =
        serde_json::from_str(&pulsar_cmd(&["embed", "-p", short])).expect("a JSON list");
    assert_eq!(cli, got[0]);
    // Related sentences are nearer than unrelated ones.
    let v = s.ok(
        path,
        &json!({"input": ["A kitten rested on the rug.", "Stock prices fell sharply today."]}),
    );
    let (near, far) = (embedding_of(&v, 0), embedding_of(&v, 1));
    assert!(dot(&got[0], &near) > dot(&got[0], &far) + 0.1);

    // Token ids give what their text gives; base64 the same values, as
    // little-endian f32.
    let by_ids = s.ok(
        path,
        &json!({"input": [short_ids.clone()], "encoding_format": "float"}),
    );
    assert_eq!(embedding_of(&by_ids, 0), got[0]);
    let b64 = s.ok(path, &json!({"input": short, "encoding_format": "base64"}));
    let text = b64["data"][0]["embedding"]
        .as_str()
        .expect("a base64 string");
    let bytes = base64_decode(text);
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(values, got[0]);

    // Refusals name the field.
    let (st, b) = s.call(path, &json!({"input": short, "dimensions": 64}));
    assert_error(st, &b, 400, Some("dimensions"), &["640"]);
    let (st, b) = s.call(path, &json!({"input": short, "encoding_format": "hex"}));
    assert_error(st, &b, 400, Some("encoding_format"), &["base64"]);
    let (st, b) = s.call(path, &json!({"input": [short, ""]}));
    assert_error(st, &b, 400, Some("input[1]"), &["empty"]);
    let (st, b) = s.call(path, &json!({"input": [[2, 3], []]}));
    assert_error(st, &b, 400, Some("input[1]"), &["no tokens"]);
    let (st, b) = s.call(path, &json!({"input": [[2, 9_999_999]]}));
    assert_error(st, &b, 400, Some("input[0][1]"), &["vocabulary"]);
    let (st, b) = s.call(path, &json!({"input": long.repeat(8)}));
    assert_error(st, &b, 400, Some("input"), &["256"]);
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    let (st, b) = s.call(path, &json!({"input": {"text": short}}));
    assert_error(st, &b, 400, Some("input"), &["expected"]);
    let many: Vec<&str> = vec![short; 100];
    let (st, b) = s.call(path, &json!({"input": many}));
    assert_error(st, &b, 400, Some("input"), &["--queue"]);
    // The slots are free again: a generation runs as before.
    let after = s.ok(
        "/v1/completions",
        &json!({"prompt": short, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(after["usage"]["completion_tokens"], 4);
}

/// Standard base64 (with padding), as OpenAI's clients decode it.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let mut out = Vec::new();
    for quad in text.as_bytes().chunks(4) {
        let digits: Vec<u8> = quad.iter().copied().filter(|&c| c != b'=').collect();
        let mut n = 0u32;
        for &c in &digits {
            n = (n << 6) | value(c);
        }
        n <<= 6 * (4 - digits.len() as u32);
        out.extend_from_slice(&n.to_be_bytes()[1..digits.len()]);
    }
    out
}

#[test]
fn tokenize_detokenize_and_model_retrieval() {
    let s = Server::start(&["-c", "256"]);
    // A control token, a character outside the pieces (byte tokens) and
    // one inside.
    let text = "Hello <start_of_turn>user \u{13000} \u{65e5}\n";
    let cli: Vec<u64> = pulsar_cmd(&["tokenize", "-p", text])
        .split_whitespace()
        .map(|t| t.parse().expect("an id"))
        .collect();
    let with_bos = s.ok("/tokenize", &json!({"content": text, "add_special": true}));
    let ids: Vec<u64> = with_bos["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|v| v.as_u64().expect("an id"))
        .collect();
    assert_eq!(ids, cli);
    let plain = s.ok("/tokenize", &json!({"content": text}));
    assert_eq!(
        plain["tokens"].as_array().map(Vec::len),
        Some(ids.len() - 1)
    );
    assert_eq!(s.ok("/detokenize", &plain)["content"], text);
    // Control-token text stays characters when asked.
    let spelled = s.ok(
        "/tokenize",
        &json!({"content": text, "parse_special": false}),
    );
    let start_of_turn = ids[3];
    assert_eq!(start_of_turn, 105, "{ids:?}");
    assert!(
        spelled["tokens"]
            .as_array()
            .is_some_and(|t| !t.contains(&json!(start_of_turn)))
    );
    // Pieces: text, or byte values where a token is part of a character.
    let pieces = s.ok("/tokenize", &json!({"content": text, "with_pieces": true}));
    let mut bytes = Vec::new();
    let mut byte_pieces = 0;
    for p in pieces["tokens"].as_array().expect("tokens") {
        match &p["piece"] {
            Value::String(t) => bytes.extend_from_slice(t.as_bytes()),
            Value::Array(b) => {
                byte_pieces += 1;
                bytes.extend(b.iter().map(|v| v.as_u64().expect("a byte") as u8));
            }
            other => panic!("piece {other}"),
        }
    }
    assert_eq!(String::from_utf8(bytes).expect("UTF-8"), text);
    assert_eq!(byte_pieces, 4, "{pieces}");
    let (status, v) = s.call("/detokenize", &json!({"tokens": [2, 262_144]}));
    assert_error(
        status,
        &v,
        400,
        Some("tokens[1]"),
        &["262144", "vocabulary"],
    );
    let (status, v) = s.call("/tokenize", &json!({"content": 5}));
    assert_error(status, &v, 400, Some("content"), &["string"]);

    let get = |path: &str| {
        let r = client().get(s.url(path)).send().expect("sent");
        let status = r.status().as_u16();
        (status, r.json::<Value>().expect("JSON"))
    };
    let (status, v) = get("/v1/models/gemma-3-270m-q4_k_m");
    assert_eq!(status, 200);
    assert_eq!(v["id"], "gemma-3-270m-q4_k_m");
    assert_eq!(v["object"], "model");
    let (status, v) = get("/v1/models/gpt-4");
    assert_error(status, &v, 404, None, &["gpt-4", "gemma-3-270m-q4_k_m"]);
    assert_eq!(v["error"]["code"], "model_not_found");
}

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let s = Server::start(&["-c", "256", "--max-body", "200000"]);
    let chat = "/v1/chat/completions";
    let (st, b) = s.call(chat, &json!({"messages": user("Hi"), "n": 0}));
    assert_error(st, &b, 400, Some("n"), &["n = 0", "1 to 16"]);
    let (st, b) = s.call(chat, &json!({"messages": user("Hi"), "n": 17}));
    assert_error(st, &b, 400, Some("n"), &["n = 17", "1 to 16"]);
    // The default model's format (dialogue) has no thinking switch.
    let (st, b) = s.call(
        chat,
        &json!({"messages": user("Hi"), "chat_template_kwargs": {"enable_thinking": true}}),
    );
    assert_error(
        st,
        &b,
        400,
        Some("chat_template_kwargs.enable_thinking"),
        &["no thinking switch"],
    );
    let (st, b) = s.call(
        "/v1/completions",
        &json!({"prompt": "Hi", "n": 2, "best_of": 3}),
    );
    assert_error(st, &b, 400, Some("best_of"), &["best_of = 3", "n (2)"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": user("Hi"), "temperature": "warm"}),
    );
    assert_error(st, &b, 400, Some("temperature"), &["invalid type"]);
    let (st, b) = s.call(chat, &json!({"messages": user("Hi"), "max_tokens": -5}));
    assert_error(st, &b, 400, Some("max_tokens"), &["max_tokens"]);
    let (st, b) = s.call(chat, &json!({"messages": [{"role": "user", "content": 7}]}));
    assert_error(st, &b, 400, Some("messages[0].content"), &["string"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": [{"role": "tool", "content": "x"}]}),
    );
    assert_error(
        st,
        &b,
        400,
        Some("messages[0].tool_call_id"),
        &["needs tool_call_id"],
    );
    let (st, b) = s.call(
        chat,
        &json!({"messages": [{"role": "narrator", "content": "x"}]}),
    );
    assert_error(st, &b, 400, Some("messages[0].role"), &["narrator", "tool"]);
    let (st, b) = s.call(chat, &json!({"messages": user("Hi"), "stop": 5}));
    assert_error(
        st,
        &b,
        400,
        Some("stop"),
        &["a string or a list of strings"],
    );
    let (st, b) = s.call(chat, &json!({"messages": user("Hi"), "top_p": 0}));
    assert_error(st, &b, 400, Some("top_p"), &["top_p"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": user("Hi"), "logit_bias": {"x": 1}}),
    );
    assert_error(st, &b, 400, Some("logit_bias.x"), &["token id"]);
    let (st, b) = s.call(chat, &json!({"temperature": 0}));
    assert_error(st, &b, 400, None, &["messages"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": user("Hi"), "tools": [{"type": "function"}]}),
    );
    assert_error(
        st,
        &b,
        400,
        Some("tools[0].function"),
        &["needs `function`"],
    );
    let (st, b) = s.call("/v1/completions", &json!({"prompt": "x", "suffix": "y"}));
    assert_error(st, &b, 400, Some("suffix"), &["not supported"]);
    let (st, b) = s.call("/v1/completions", &json!({"prompt": [1, 2, 99999999]}));
    assert_error(st, &b, 400, Some("prompt[2]"), &["99999999", "vocabulary"]);
    // A list of prompts: each is checked and named by its place.
    let (st, b) = s.call(
        "/v1/completions",
        &json!({"prompt": [[2, 818], [2, 99999999]]}),
    );
    assert_error(st, &b, 400, Some("prompt[1][1]"), &["vocabulary"]);
    let (st, b) = s.call(
        "/v1/completions",
        &json!({"prompt": ["a", "word ".repeat(300)]}),
    );
    assert_error(st, &b, 400, Some("prompt[1]"), &["256"]);
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    let (st, b) = s.call("/v1/completions", &json!({"prompt": vec!["a"; 33], "n": 2}));
    assert_error(st, &b, 400, Some("prompt"), &["66 sequences", "--queue"]);
    let (st, b) = s.call("/v1/completions", &json!({"prompt": []}));
    assert_error(st, &b, 400, Some("prompt"), &["no tokens"]);

    // Malformed JSON.
    let r = client()
        .post(s.url(chat))
        .header("content-type", "application/json")
        .body("{\"messages\": [")
        .send()
        .expect("sent");
    assert_eq!(r.status().as_u16(), 400);
    let b: Value = r.json().expect("JSON error");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"),
        "{b}"
    );

    // A body over --max-body.
    let big = json!({"prompt": "x".repeat(300_000)});
    let (st, b) = s.call("/v1/completions", &big);
    assert_error(st, &b, 413, None, &["200000"]);

    // A prompt over the context names both counts; max_tokens is capped.
    let (st, b) = s.call(
        "/v1/completions",
        &json!({"prompt": vec![818; 300], "max_tokens": 5}),
    );
    assert_error(st, &b, 400, Some("prompt"), &["300 tokens", "256 tokens"]);
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    let (st, b) = s.call("/v1/completions", &json!({"prompt": vec![818; 256]}));
    assert_error(st, &b, 400, Some("prompt"), &["256 tokens"]);
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": vec![818; 250], "max_tokens": 100, "temperature": 0,
                "logit_bias": {EOS: -100, END_OF_TURN: -100}}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // response_format: unknown type, a schema that cannot compile.
    let (st, b) = s.call(
        chat,
        &json!({"messages": user("Hi"), "response_format": {"type": "xml"}}),
    );
    assert_error(st, &b, 400, Some("response_format.type"), &["xml"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": user("Hi"), "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}),
    );
    assert_error(
        st,
        &b,
        400,
        Some("response_format.json_schema.schema"),
        &["strnig"],
    );
    let (st, b) = s.call(
        chat,
        &json!({"messages": user("Hi"), "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "oneOf": [{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}]}}}}),
    );
    assert_eq!(st, 400, "{b}");

    // Unknown paths and methods.
    let r = client().get(s.url("/v1/nothing")).send().expect("sent");
    assert_eq!(r.status().as_u16(), 404);
    let b: Value = r.json().expect("JSON error");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/nothing")
    );
    let r = client().get(s.url(chat)).send().expect("sent");
    assert_eq!(r.status().as_u16(), 405);

    // The server is still fine, and counted all of this by status.
    let v = s.ok(chat, &json!({"messages": user("Hi"), "max_tokens": 2}));
    assert_eq!(v["object"], "chat.completion");
    let m = s.metrics();
    assert!(
        metric(
            &m,
            r#"pulsar_requests_total{endpoint="/v1/chat/completions",status="400"}"#
        ) >= 10.0
    );
    assert_eq!(
        metric(
            &m,
            r#"pulsar_requests_total{endpoint="/v1/completions",status="413"}"#
        ),
        1.0
    );
}

#[test]
fn response_format_constrains_the_reply() {
    let s = Server::start(&["-c", "512"]);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": false,
    });
    let validator = jsonschema::validator_for(&schema).expect("schema");
    for seed in [1, 2, 3] {
        let v = s.ok(
            "/v1/chat/completions",
            &json!({"messages": user("Describe a person."), "temperature": 0.8, "seed": seed,
                    "max_tokens": 120, "response_format": {"type": "json_schema",
                    "json_schema": {"name": "person", "schema": schema, "strict": true}}}),
        );
        let text = chat_text(&v);
        let parsed: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
        assert!(validator.is_valid(&parsed), "{text}");
        // The constraint ended the reply, not max_tokens.
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    }
    // Any JSON object. Its strings are unbounded, so a small model can
    // run on inside one until max_tokens: this prompt gives an example.
    let v = s.ok(
        "/v1/chat/completions",
        &json!({"messages": user("Example: {\"name\": \"Alice\", \"age\": 30}. Another person as JSON:"),
                "temperature": 0, "max_tokens": 60, "response_format": {"type": "json_object"}}),
    );
    let text = chat_text(&v);
    let parsed: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    assert!(parsed.is_object(), "{text}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
}

/// Two functions for the tool tests: one strict-style with an enum, one
/// that takes any city.
fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "Local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"], "additionalProperties": false}}},
    ])
}

/// Checks a reply's `tool_calls` against the tools: each names one of
/// them and its arguments (JSON text) follow that one's schema. Returns
/// the (name, arguments) pairs.
fn checked_calls(message: &Value, tools: &Value) -> Vec<(String, Value)> {
    let calls = message["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls: {message}"));
    assert!(message["content"].is_null(), "{message}");
    calls
        .iter()
        .map(|call| {
            assert_eq!(call["type"], "function", "{call}");
            assert!(
                call["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("call_")),
                "{call}"
            );
            let name = call["function"]["name"]
                .as_str()
                .expect("a name")
                .to_string();
            let tool = tools
                .as_array()
                .and_then(|t| t.iter().find(|t| t["function"]["name"] == name.as_str()))
                .unwrap_or_else(|| panic!("{name} is not one of the tools"));
            let text = call["function"]["arguments"]
                .as_str()
                .expect("arguments as text");
            let arguments: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
            let schema = &tool["function"]["parameters"];
            let validator = jsonschema::validator_for(schema).expect("schema");
            assert!(validator.is_valid(&arguments), "{name}({text})");
            (name, arguments)
        })
        .collect()
}

#[test]
fn tool_calls_name_a_given_function_with_arguments_that_follow_its_schema() {
    let s = Server::start(&["-c", "1024"]);
    let tools = weather_tools();
    let chat = "/v1/chat/completions";
    let question = user("What is the weather in Paris, in celsius?");
    // A named function, greedy: one call of it; streamed, the same call.
    let named = json!({"messages": question, "tools": tools, "temperature": 0, "max_tokens": 60,
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let v = s.ok(chat, &named);
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let calls = checked_calls(&choice["message"], &tools);
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0].0, "get_weather");
    let mut streamed = named.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&s, chat, &streamed).all();
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    // The call's id and name first, then its arguments as they are written,
    // in more than one piece; put together, the whole reply's call.
    assert!(deltas.len() > 2, "{chunks:?}");
    assert!(deltas.iter().all(|d| d["index"] == 0), "{chunks:?}");
    let whole_call = &v["choices"][0]["message"]["tool_calls"][0];
    assert!(
        deltas[0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")),
        "{chunks:?}"
    );
    assert_eq!(deltas[0]["type"], "function");
    assert_eq!(deltas[0]["function"]["name"], "get_weather");
    let arguments: String = deltas
        .iter()
        .filter_map(|d| d["function"]["arguments"].as_str())
        .collect();
    assert_eq!(
        arguments,
        whole_call["function"]["arguments"]
            .as_str()
            .unwrap_or_default()
    );
    assert!(
        chunks.iter().all(|c| c["choices"][0]["delta"]["content"]
            .as_str()
            .is_none_or(str::is_empty)),
        "no text besides the calls: {chunks:?}"
    );
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{last}");
    // Required, one call per reply, sampled: every seed's call is valid.
    for seed in [1, 2, 3] {
        let v = s.ok(
            chat,
            &json!({"messages": question, "tools": tools, "tool_choice": "required",
                    "parallel_tool_calls": false, "temperature": 0.8, "seed": seed, "max_tokens": 60}),
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        assert_eq!(
            checked_calls(&v["choices"][0]["message"], &tools).len(),
            1,
            "{v}"
        );
    }
    // Auto: calls, or an answer as plain content.
    for seed in [4, 5] {
        let v = s.ok(
            chat,
            &json!({"messages": question, "tools": tools, "parallel_tool_calls": false,
                    "temperature": 0.8, "seed": seed, "max_tokens": 80}),
        );
        let choice = &v["choices"][0];
        if choice["message"]["tool_calls"].is_array() {
            assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
            checked_calls(&choice["message"], &tools);
        } else {
            let content = choice["message"]["content"].as_str().expect("content");
            assert!(!content.trim_start().starts_with("{\"content\""), "{v}");
        }
    }
    // The next turn: the call and its result go back, rendered as the
    // model wrote the call, so the slot's cache serves the whole first
    // turn.
    let required = |messages: &Value| {
        json!({"messages": messages, "tools": tools, "tool_choice": "required",
               "parallel_tool_calls": false, "temperature": 0, "max_tokens": 60})
    };
    let a = s.ok(chat, &required(&question));
    let call = &a["choices"][0]["message"]["tool_calls"][0];
    let id = call["id"].as_str().expect("id");
    let history = json!([
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": id, "content": "18 degrees, sunny"},
    ]);
    let b = s.ok(chat, &required(&history));
    checked_calls(&b["choices"][0]["message"], &tools);
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(
        cached >= a["usage"]["prompt_tokens"].as_u64(),
        "the first turn's prompt came from the cache: {a} then {b}"
    );
    // tool_choice none: plain text, with the call and result in the prompt.
    let none = |messages: &Value| {
        json!({"messages": messages, "tools": tools, "tool_choice": "none", "temperature": 0,
               "max_tokens": 20})
    };
    let v = s.ok(chat, &none(&history));
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    chat_text(&v);
    let plain = s.ok(chat, &none(&question));
    let prompt_tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(
        prompt_tokens(&v) > prompt_tokens(&plain) + 10,
        "{v} {plain}"
    );
    // The deprecated functions API: one call, in `message.function_call`.
    let legacy = json!({"messages": question, "functions": [tools[0]["function"]],
                        "function_call": {"name": "get_weather"}, "temperature": 0, "max_tokens": 60});
    let v = s.ok(chat, &legacy);
    let message = &v["choices"][0]["message"];
    assert_eq!(v["choices"][0]["finish_reason"], "function_call", "{v}");
    assert!(
        message.get("tool_calls").is_none() && message["content"].is_null(),
        "{v}"
    );
    assert_eq!(message["function_call"]["name"], "get_weather", "{v}");
    let arguments_text = message["function_call"]["arguments"]
        .as_str()
        .unwrap_or_default();
    let arguments: Value =
        serde_json::from_str(arguments_text).unwrap_or_else(|e| panic!("{e}: {v}"));
    let validator = jsonschema::validator_for(&tools[0]["function"]["parameters"]).expect("schema");
    assert!(validator.is_valid(&arguments), "{v}");
    let mut streamed = legacy.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&s, chat, &streamed).all();
    let pieces: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["delta"]["function_call"])
        .filter(|f| f.is_object())
        .collect();
    assert_eq!(pieces[0]["name"], "get_weather", "{chunks:?}");
    let streamed_arguments: String = pieces
        .iter()
        .filter_map(|f| f["arguments"].as_str())
        .collect();
    assert_eq!(streamed_arguments, arguments_text);
    let finish = &chunks.last().expect("chunks")["choices"][0]["finish_reason"];
    assert_eq!(finish, "function_call");
    let legacy_history = json!([
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
        {"role": "assistant", "content": null, "function_call": message["function_call"]},
        {"role": "function", "name": "get_weather", "content": "18 degrees, sunny"},
    ]);
    let v = s.ok(
        chat,
        &json!({"messages": legacy_history, "functions": [tools[0]["function"]],
                "function_call": "none", "temperature": 0, "max_tokens": 10}),
    );
    assert!(
        v["usage"]["prompt_tokens"].as_u64() > plain["usage"]["prompt_tokens"].as_u64(),
        "{v}"
    );
    let mut nameless = legacy_history.clone();
    nameless[2].as_object_mut().map(|m| m.remove("name"));
    let (st, b) = s.call(chat, &json!({"messages": nameless}));
    assert_error(st, &b, 400, Some("messages[2].name"), &["needs `name`"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": question, "functions": [tools[0]["function"]],
                                       "tools": tools}),
    );
    assert_error(st, &b, 400, Some("functions"), &["use tools"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": question, "functions": [tools[0]["function"]],
                                       "function_call": {"name": "nope"}}),
    );
    assert_error(st, &b, 400, Some("function_call.name"), &["nope"]);
    // Refusals name their field.
    let mut bad = history.clone();
    bad[2]["tool_call_id"] = json!("call_nope");
    let (st, b) = s.call(chat, &json!({"messages": bad, "tools": tools}));
    assert_error(
        st,
        &b,
        400,
        Some("messages[2].tool_call_id"),
        &["call_nope"],
    );
    let (st, b) = s.call(
        chat,
        &json!({"messages": question, "tools": tools,
                "response_format": {"type": "json_object"}}),
    );
    assert_error(st, &b, 400, Some("response_format"), &["tools"]);
    let (st, b) = s.call(chat, &json!({"messages": question, "tool_choice": "auto"}));
    assert_error(st, &b, 400, Some("tool_choice"), &["needs tools"]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": question, "tools": tools, "tool_choice": 3}),
    );
    assert_error(st, &b, 400, Some("tool_choice"), &["\"required\""]);
    let (st, b) = s.call(
        chat,
        &json!({"messages": question, "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": "get_news"}}}),
    );
    assert_error(
        st,
        &b,
        400,
        Some("tool_choice.function.name"),
        &["get_news"],
    );
    let mut unusable = tools.clone();
    unusable[1]["function"]["parameters"] = json!({"type": "strnig"});
    let (st, b) = s.call(chat, &json!({"messages": question, "tools": unusable}));
    assert_error(st, &b, 400, Some("tools"), &["strnig"]);
}

/// The `data:` payloads of a Responses API stream, checked: each is named
/// by its `event:` line, and sequence numbers count up from 0.
fn response_events(server: &Server, body: &Value) -> Vec<Value> {
    let r = server.post("/v1/responses", body);
    assert_eq!(r.status().as_u16(), 200);
    let mut events = Vec::new();
    let mut name = None;
    for line in BufReader::new(r).lines() {
        let line = line.expect("stream read");
        if let Some(event) = line.strip_prefix("event: ") {
            name = Some(event.to_string());
        } else if let Some(data) = line.strip_prefix("data: ") {
            let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
            assert_eq!(name.take().as_deref(), v["type"].as_str(), "{v}");
            assert_eq!(v["sequence_number"], events.len(), "{v}");
            events.push(v);
        }
    }
    events
}

fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|part| part["text"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn the_responses_api_serves_text_calls_and_their_streams() {
    let s = Server::start(&["-c", "1024"]);
    let question = "What is the capital of France?";
    // The same reply as the chat completion it amounts to.
    let chat = s.ok(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": question}],
                "temperature": 0, "max_tokens": 30}),
    );
    let body = json!({"input": question, "instructions": "Answer briefly.", "temperature": 0,
                      "max_output_tokens": 30});
    let r = s.ok("/v1/responses", &body);
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(output_text(&r), chat_text(&chat), "{r}");
    assert_eq!(
        r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"],
        "{r}"
    );
    assert_eq!(
        r["usage"]["output_tokens"], chat["usage"]["completion_tokens"],
        "{r}"
    );
    assert_eq!(r["instructions"], "Answer briefly.");
    // Streamed: the message's deltas make the same text, and the last
    // event carries the whole response.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = response_events(&s, &streamed);
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ],
        "{kinds:?}"
    );
    assert_eq!(
        kinds[kinds.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ],
        "{kinds:?}"
    );
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(deltas, output_text(&r));
    let last = &events[events.len() - 1]["response"];
    assert_eq!(output_text(last), output_text(&r), "{last}");
    assert_eq!(last["usage"], r["usage"]);
    // Log-probabilities, as the chat completion reports them.
    let with_logprobs = json!({"input": question, "instructions": "Answer briefly.", "temperature": 0,
                               "max_output_tokens": 30, "include": ["message.output_text.logprobs"],
                               "top_logprobs": 2});
    let r = s.ok("/v1/responses", &with_logprobs);
    let chat_lp = s.ok(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": question}],
                "temperature": 0, "max_tokens": 30, "logprobs": true, "top_logprobs": 2}),
    );
    let logprobs = &r["output"][0]["content"][0]["logprobs"];
    assert!(logprobs.as_array().is_some_and(|l| !l.is_empty()), "{r}");
    assert_eq!(
        logprobs, &chat_lp["choices"][0]["logprobs"]["content"],
        "{r}"
    );
    let mut streamed = with_logprobs.clone();
    streamed["stream"] = json!(true);
    let events = response_events(&s, &streamed);
    let streamed_logprobs: Vec<Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(&Value::Array(streamed_logprobs), logprobs);
    // Cut by max_output_tokens: incomplete, and said why.
    let cut = s.ok(
        "/v1/responses",
        &json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": question}]}],
                "temperature": 0, "max_output_tokens": 3}),
    );
    assert_eq!(cut["status"], "incomplete", "{cut}");
    assert_eq!(cut["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(cut["usage"]["output_tokens"], 3);
    // Function calls: items of their own, arguments streamed in pieces.
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": false}}]);
    let call_body = json!({"input": "Weather in Paris?", "tools": tools, "tool_choice": "required",
                           "parallel_tool_calls": false, "temperature": 0, "max_output_tokens": 40});
    let r = s.ok("/v1/responses", &call_body);
    let call = &r["output"][0];
    assert_eq!(call["type"], "function_call", "{r}");
    assert_eq!(call["name"], "get_weather");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap_or_default())
        .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {r}"));
    assert!(arguments["city"].is_string(), "{r}");
    let mut streamed = call_body.clone();
    streamed["stream"] = json!(true);
    let events = response_events(&s, &streamed);
    let pieces: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert!(pieces.len() > 1, "{events:?}");
    assert_eq!(
        pieces.concat(),
        call["arguments"].as_str().unwrap_or_default()
    );
    let done = events
        .iter()
        .find(|e| e["type"] == "response.function_call_arguments.done");
    assert_eq!(
        done.map(|d| &d["arguments"]),
        Some(&call["arguments"]),
        "{events:?}"
    );
    // The call and its output go back as input items, into the prompt.
    let turn = |items: Value| {
        s.ok(
            "/v1/responses",
            &json!({"input": items, "tools": tools, "tool_choice": "none", "temperature": 0,
                    "max_output_tokens": 10}),
        )
    };
    let asked = json!({"role": "user", "content": "Weather in Paris?"});
    let alone = turn(json!([asked]));
    let answered = turn(json!([asked,
        {"type": "function_call", "call_id": call["call_id"], "name": "get_weather",
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]));
    let input_tokens = |v: &Value| v["usage"]["input_tokens"].as_u64().unwrap_or(0);
    assert!(
        input_tokens(&answered) > input_tokens(&alone) + 10,
        "{alone} {answered}"
    );
    // Refusals name the Responses API's fields.
    for (body, param, words) in [
        (
            json!({"input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
            "stores no responses",
        ),
        (
            json!({"input": [{"type": "input_image", "image_url": "x"}]}),
            "input[0].type",
            "input_image",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "xml"}}}),
            "text.format.type",
            "xml",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                "schema": {"type": "strnig"}}}}),
            "text.format.schema",
            "strnig",
        ),
        (
            json!({"input": "hi", "max_output_tokens": 0}),
            "max_output_tokens",
            "at least 1",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function"}]}),
            "tools[0].name",
            "needs `name`",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
            "web_search",
        ),
        (
            json!({"input": "hi", "tools": tools, "tool_choice": {"type": "function", "name": "nope"}}),
            "tool_choice.name",
            "nope",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}),
            "input[0].call_id",
            "c1",
        ),
    ] {
        let (st, b) = s.call("/v1/responses", &body);
        assert_error(st, &b, 400, Some(param), &[words]);
    }
}

#[test]
fn api_key_guards_every_endpoint_but_health() {
    let s = Server::start_with_env(&["-c", "256"], &[("PULSAR_API_KEY", "sekrit")]);
    let body = json!({"prompt": "Hi", "max_tokens": 2});
    let no_key = client()
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .expect("sent");
    assert_eq!(no_key.status().as_u16(), 401);
    let b: Value = no_key.json().expect("JSON");
    assert_eq!(b["error"]["type"], "authentication_error", "{b}");
    for (path, key) in [
        ("/v1/completions", "Bearer wrong"),
        ("/v1/completions", "sekrit"),
    ] {
        let r = client()
            .post(s.url(path))
            .header("authorization", key)
            .json(&body)
            .send()
            .expect("sent");
        assert_eq!(r.status().as_u16(), 401, "{key}");
    }
    let r = client().get(s.url("/v1/models")).send().expect("sent");
    assert_eq!(r.status().as_u16(), 401);
    let r = client().get(s.url("/metrics")).send().expect("sent");
    assert_eq!(r.status().as_u16(), 401);
    let r = client().get(s.url("/health")).send().expect("sent");
    assert_eq!(r.status().as_u16(), 200);
    let r = client()
        .post(s.url("/v1/completions"))
        .bearer_auth("sekrit")
        .json(&body)
        .send()
        .expect("sent");
    assert_eq!(r.status().as_u16(), 200);
}

/// A streaming completion that runs to `max_tokens` (end tokens banned).
fn endless(max_tokens: u32) -> Value {
    json!({"prompt": "Write a very long story.", "max_tokens": max_tokens, "stream": true,
           "temperature": 0.8, "seed": 3, "logit_bias": {EOS: -100, END_OF_TURN: -100}})
}

#[test]
fn a_client_that_disconnects_frees_its_slot() {
    let s = Server::start(&["-c", "4096", "--parallel", "1"]);
    let c = client();
    let r = c
        .post(s.url("/v1/completions"))
        .json(&endless(3000))
        .send()
        .expect("sent");
    let mut sse = Sse::new(r);
    for _ in 0..3 {
        assert!(sse.next_data().is_some());
    }
    assert_eq!(s.metric("pulsar_slots_busy"), 1.0);
    drop(sse);
    drop(c);
    let freed = Instant::now();
    s.wait_metric("pulsar_slots_busy", Duration::from_secs(30), |v| v == 0.0);
    eprintln!("slot freed {:?} after the disconnect", freed.elapsed());
    assert_eq!(s.metric("pulsar_disconnects_total"), 1.0);
    let generated = s.metric("pulsar_generated_tokens_total");
    assert!(generated < 3000.0, "{generated}");
    // A client of a non-streaming request that gives up waiting.
    let mut body = endless(3000);
    body["stream"] = json!(false);
    let impatient = Client::builder()
        .timeout(Duration::from_millis(1500))
        .build()
        .expect("HTTP client");
    let gave_up = impatient.post(s.url("/v1/completions")).json(&body).send();
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    drop(impatient);
    s.wait_metric("pulsar_slots_busy", Duration::from_secs(30), |v| v == 0.0);
    assert_eq!(s.metric("pulsar_disconnects_total"), 2.0);
    // The slot serves the next request.
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 3}),
    );
    assert_eq!(v["object"], "text_completion");
}

#[test]
fn a_full_queue_gets_503_and_health_answers_during_a_long_prefill() {
    let s = Server::start(&["-c", "4096", "--parallel", "1", "--queue", "1"]);
    // A request's choices wait together: more than the queue holds can
    // never be taken.
    let (st, b) = s.call(
        "/v1/completions",
        &json!({"prompt": "Hi", "n": 2, "max_tokens": 2}),
    );
    assert_error(st, &b, 400, Some("n"), &["n = 2", "--queue 1"]);
    // A long prompt: its prefill takes many steps.
    let long = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(250);
    let c = client();
    let r = c
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": long, "max_tokens": 4000, "stream": true,
                      "logit_bias": {EOS: -100, END_OF_TURN: -100}}))
        .send()
        .expect("sent");
    let mut running = Sse::new(r);
    // /health while the prefill runs: it never waits on the engine.
    s.wait_metric("pulsar_slots_busy", Duration::from_secs(30), |v| v == 1.0);
    let mut worst = Duration::ZERO;
    for _ in 0..10 {
        let t = Instant::now();
        let r = client().get(s.url("/health")).send().expect("health");
        assert_eq!(r.status().as_u16(), 200);
        worst = worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    let still_prefilling = s.metric("pulsar_generated_tokens_total") == 0.0;
    eprintln!(
        "/health during a prefill: slowest of 10 took {worst:?} (prefill still running: {still_prefilling})"
    );
    assert!(worst < Duration::from_secs(1), "{worst:?}");
    assert!(running.next_data().is_some());

    // The slot is busy: one request waits, the next is refused.
    let waiting = std::thread::spawn({
        let url = s.url("/v1/completions");
        move || {
            let r = client()
                .post(url)
                .json(&json!({"prompt": "Hi", "max_tokens": 2}))
                .send()
                .expect("sent");
            r.status().as_u16()
        }
    });
    s.wait_metric("pulsar_queue_length", Duration::from_secs(30), |v| v == 1.0);
    let r = client()
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "Hi", "max_tokens": 2}))
        .send()
        .expect("sent");
    assert_eq!(r.status().as_u16(), 503);
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert!(retry.is_some_and(|s| s >= 1), "{retry:?}");
    let b: Value = r.json().expect("JSON error");
    assert_eq!(b["error"]["type"], "server_error");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("busy"),
        "{b}"
    );
    assert_eq!(s.metric("pulsar_rejected_busy_total"), 1.0);
    // Freeing the slot lets the waiting request through.
    drop(running);
    drop(c);
    assert_eq!(waiting.join().unwrap(), 200);
}

#[test]
fn shutdown_lets_running_streams_finish_and_exits_zero() {
    let s = Server::start(&["-c", "512", "--parallel", "2"]);
    let mut sse = stream(&s, "/v1/completions", &endless(60));
    assert!(sse.next_data().is_some());
    let base = s.url("");
    let pid = s.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(killed.is_ok_and(|st| st.success()));
    // The running stream goes on to its end.
    let mut last = Value::Null;
    let mut done = false;
    while let Some(data) = sse.next_data() {
        if data == "[DONE]" {
            done = true;
            break;
        }
        last = serde_json::from_str(&data).expect("chunk");
    }
    assert!(done, "the stream was cut");
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    // New requests are refused (the listener is closed or says 503).
    let refused = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "Hi", "max_tokens": 2}))
        .send();
    if let Ok(r) = refused {
        assert_eq!(r.status().as_u16(), 503);
    }
    let status = s.terminate();
    assert_eq!(status.code(), Some(0), "{status:?}");
}

/// The repository's root and the venv's Python with the official `openai`
/// package (pinned in tests/openai_requirements.txt), created the first
/// time a test needs it, so `cargo test` alone is the test command.
fn pyenv_python() -> (&'static Path, PathBuf) {
    static READY: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = READY.get_or_init(|| {
        let venv = root.join("target/pyenv");
        let python = venv.join("bin/python");
        let run = |cmd: &mut Command| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            match out.status.success() {
                true => Ok(()),
                false => Err(format!(
                    "{cmd:?} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )),
            }
        };
        if !python.exists() {
            run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        }
        // Quick when the pinned package is already there.
        run(Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(root.join("tests/openai_requirements.txt")))?;
        Ok(python)
    });
    match python {
        Ok(python) => (root, python.clone()),
        Err(why) => panic!("cannot set up the openai client's venv in target/pyenv: {why}"),
    }
}

/// The official `openai` Python package against the server: chat and
/// completions, streaming and not, models, seeds, stop strings, an error
/// as the client's exception, and structured output parsed into a
/// Pydantic model. `.ci/run` installs the venv.
#[test]
fn the_official_openai_python_client_works() {
    let (root, python) = pyenv_python();
    let s = Server::start(&["-c", "1024", "--api-key", "test-key"]);
    let out = Command::new(&python)
        .arg(root.join("tests/openai_client_check.py"))
        .arg(format!("{}/v1", s.base))
        .arg("test-key")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai_client_check.py failed\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver:\n{}",
        s.stderr.lock().unwrap()
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
    eprintln!("{stdout}");
}

/// `tools/serve_load.py`'s benchmark, with its own light client and with
/// the official one, against a running server: every stream is timed, and
/// every stream's tokens are counted from the usage the server sends (the
/// script warns when a stream sent none or ended short). A speed figure is
/// not checked here; the benchmark is run by hand (see the README).
#[test]
fn the_load_benchmark_counts_every_token_with_either_client() {
    let (root, python) = pyenv_python();
    let s = Server::start(&["-c", "512", "--parallel", "2"]);
    for client in ["raw", "openai"] {
        let out = Command::new(&python)
            .arg(root.join("tools/serve_load.py"))
            .args(["--url", &format!("{}/v1", s.base)])
            .args(["--levels", "1,2", "--requests", "2", "--max-tokens", "6"])
            .args(["--client", client])
            .output()
            .expect("python runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "serve_load.py --client {client} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        for level in ["| 1 |", "| 2 |"] {
            assert!(stdout.contains(level), "--client {client}: {stdout}");
        }
        for warning in ["sent no usage", "ended before"] {
            assert!(
                !stderr.contains(warning),
                "--client {client}: {warning}\n{stderr}"
            );
        }
        // 2 levels x 2 clients at most x 2 requests x 6 tokens, each level's
        // streams counted from their usage: the aggregate rate is positive.
        assert!(
            stderr.contains("streams: ") && !stderr.contains(" 0.0 tok/s"),
            "--client {client}: {stderr}"
        );
    }
}

/// A model template with its own call syntax (Gemma 4's, given as a file)
/// renders a request with tools: the tools declared, the history's call and
/// result written as jinja2 writes them (tests/data/chat_templates), and a
/// reply without a call comes back as content, whole or streamed.
#[test]
fn a_template_with_its_own_call_syntax_renders_requests_with_tools() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates");
    let template = dir.join("google-gemma-4-31B-it.jinja");
    let s = Server::start(&["-c", "1024", "--chat-template", template.to_str().unwrap()]);
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let conversation = &cases["conversations"]["tool_exchange"];
    // OpenAI clients send a call's arguments as JSON text.
    let mut messages = conversation["messages"].clone();
    for m in messages.as_array_mut().unwrap() {
        for call in m["tool_calls"].as_array_mut().into_iter().flatten() {
            let text = call["function"]["arguments"].to_string();
            call["function"]["arguments"] = json!(text);
        }
    }
    let body = json!({"messages": messages, "tools": conversation["tools"],
                      "temperature": 0, "max_tokens": 8});
    let v = s.ok("/v1/chat/completions", &body);
    let expected = std::fs::read_to_string(dir.join("expected/gemma4_tool_exchange.txt")).unwrap();
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let src = pulsar::model::source::ModelSource::open(&model).expect("model opens");
    let tok = pulsar::commands::run::load_tokenizer(&src).expect("tokenizer");
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64(),
        Some(tok.encode(&expected, false).len() as u64),
        "{v}"
    );
    let content = chat_text(&v);
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&s, "/v1/chat/completions", &streamed).all();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content);
    let last = chunks.last().expect("chunks");
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");

    // A message's text cannot pass for the template's markers.
    let (st, b) = s.call(
        "/v1/chat/completions",
        &json!({"messages": user("a \u{FDD0} b"), "tools": conversation["tools"]}),
    );
    assert_error(st, &b, 400, Some("messages[0].content"), &["noncharacter"]);
}

// Hostile clients (issue 47): bodies that would cost far more than their
// size, connections that are slow or never read, requests left behind.

/// A raw connection to the server, for clients no HTTP library imitates.
fn raw_connection(s: &Server) -> std::net::TcpStream {
    let addr = s.base.trim_start_matches("http://");
    std::net::TcpStream::connect(addr).expect("connect")
}

/// A connection whose receive buffer is a few KiB (set before it
/// connects, so the window it offers stays small): a client that does not
/// read fills the server's send buffer after little data.
fn small_window_connection(s: &Server) -> std::net::TcpStream {
    use std::os::fd::FromRawFd;
    let addr: std::net::SocketAddrV4 = s
        .base
        .trim_start_matches("http://")
        .parse()
        .expect("an IPv4 address");
    let size: libc::c_int = 4096;
    let peer = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: a new socket of this function's own; the option and address
    // pointers are to locals of the sizes given; once connected, the
    // descriptor is handed to the TcpStream, which closes it.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let set = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(set, 0, "SO_RCVBUF: {}", std::io::Error::last_os_error());
        let connected = libc::connect(
            fd,
            (&peer as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(connected, 0, "connect: {}", std::io::Error::last_os_error());
        std::net::TcpStream::from_raw_fd(fd)
    }
}

/// The peak resident memory of a process (`VmHWM`), in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    kib / 1024.0
}

/// Waits (at most `limit`) until the server closes `conn`: true when it
/// did (end of file or a reset), false when it is still open.
fn closed_within(conn: &mut std::net::TcpStream, limit: Duration) -> bool {
    use std::io::ErrorKind::{TimedOut, WouldBlock};
    let start = Instant::now();
    conn.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("read timeout");
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn a_prompt_list_beyond_the_queue_is_refused_before_any_work() {
    let s = Server::start(&["-c", "256", "--queue", "4"]);
    // The report's body: 40,000 one-token prompts, 5,000 logit_bias
    // entries, about 250 KiB; each prompt once got its own parsed copy.
    let bias: serde_json::Map<String, Value> = (1000..6000)
        .map(|id| (id.to_string(), json!(1.0)))
        .collect();
    let prompts = vec![json!([2]); 40_000];
    let body = json!({"prompt": prompts, "max_tokens": 1, "logit_bias": bias});
    let before = peak_rss_mib(s.pid());
    let (status, b) = s.call("/v1/completions", &body);
    assert_error(
        status,
        &b,
        400,
        Some("prompt"),
        &["40000 prompts", "--queue 4"],
    );
    let grown = peak_rss_mib(s.pid()) - before;
    eprintln!("peak RSS grew by {grown:.0} MiB");
    assert!(grown < 200.0, "peak RSS grew by {grown:.0} MiB");
    // Within the queue, the shared settings serve every prompt.
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": [[2], [2, 9]], "n": 2, "max_tokens": 2, "temperature": 0,
                "logit_bias": bias, "stop": ["\n\n"]}),
    );
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(4), "{v}");
    // A bias is checked once, and named when wrong.
    let (status, b) = s.call(
        "/v1/completions",
        &json!({"prompt": ["a", "b"], "logit_bias": {"5": 300}}),
    );
    assert_error(status, &b, 400, Some("logit_bias.5"), &["[-100, 100]"]);
    // Embeddings inputs are counted before they are tokenized.
    let (status, b) = s.call("/v1/embeddings", &json!({"input": vec!["word"; 5]}));
    assert_error(status, &b, 400, Some("input"), &["5 inputs", "--queue 4"]);
}

#[test]
fn a_slowloris_connection_is_closed_after_the_header_timeout() {
    let s = Server::start(&["-c", "256", "--header-timeout", "2"]);
    let mut conn = raw_connection(&s);
    let mut writer = conn.try_clone().expect("clone");
    // One byte of a request line every half second, never finishing it.
    let drip = std::thread::spawn(move || {
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ".repeat(4) {
            if writer.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    });
    let start = Instant::now();
    assert!(
        closed_within(&mut conn, Duration::from_secs(20)),
        "still open after 20 s"
    );
    eprintln!("slowloris closed after {:?}", start.elapsed());
    drop(conn);
    let _ = drip.join();
    // An idle kept-alive connection closes after the same time.
    let mut idle = raw_connection(&s);
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("sent");
    assert!(closed_within(&mut idle, Duration::from_secs(20)));
    assert_eq!(
        client()
            .get(s.url("/health"))
            .send()
            .map(|r| r.status().as_u16())
            .ok(),
        Some(200)
    );
}

#[test]
fn a_body_shorter_than_its_length_times_out_with_408() {
    let s = Server::start(&["-c", "256", "--read-timeout", "2"]);
    let mut conn = raw_connection(&s);
    conn.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"prompt\": \"Hi\"",
    )
    .expect("sent");
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read timeout");
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while !reply.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) => panic!("no reply within 20 s: {e}"),
        }
    }
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
}

#[test]
fn a_client_that_stops_reading_is_dropped_after_the_write_timeout() {
    let s = Server::start(&["-c", "256", "--write-timeout", "2", "--max-body", "8000000"]);
    // A reply of tens of megabytes, more than the socket buffers hold.
    let content = "hello ".repeat(1_000_000);
    let body = json!({"content": content, "with_pieces": true}).to_string();
    let mut conn = raw_connection(&s);
    let head = format!(
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).expect("head sent");
    conn.write_all(body.as_bytes()).expect("body sent");
    // Once the reply has begun, reads nothing for a while, then
    // everything that is left.
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    let mut reply = vec![0u8; 1024];
    conn.read_exact(&mut reply).expect("the reply begins");
    std::thread::sleep(Duration::from_secs(8));
    let _ = conn.read_to_end(&mut reply);
    let text = String::from_utf8_lossy(&reply[..reply.len().min(4096)]).to_string();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let length: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no content-length in {text}"));
    let body_start = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(0, |p| p + 4);
    let received = reply.len() - body_start;
    eprintln!("received {received} of {length} bytes");
    assert!(
        received < length,
        "the whole reply ({length} bytes) waited for a client that read nothing"
    );
}

#[test]
fn connections_beyond_the_cap_wait_to_be_accepted() {
    let s = Server::start(&["-c", "256", "--max-connections", "2"]);
    let first = raw_connection(&s);
    let _second = raw_connection(&s);
    let quick = Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("HTTP client");
    let r = quick.get(s.url("/health")).send();
    assert!(
        r.is_err_and(|e| e.is_timeout()),
        "a third connection was served"
    );
    drop(first);
    let r = client().get(s.url("/health")).send().expect("health");
    assert_eq!(r.status().as_u16(), 200);
}

#[test]
fn a_stalled_request_frees_all_its_choices_at_once() {
    let s = Server::start(&["-c", "1024", "--parallel", "2", "--stall-timeout", "5"]);
    // n = 6 on 2 slots, from a client that never reads; big events
    // (20 alternatives per token) and a small receive window fill the
    // socket buffers soon, then each choice's channel.
    let mut body = endless(900);
    body["n"] = json!(6);
    body["logprobs"] = json!(20);
    let body = body.to_string();
    let mut conn = small_window_connection(&s);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).expect("head sent");
    conn.write_all(body.as_bytes()).expect("body sent");
    let sent = Instant::now();
    s.wait_metric("pulsar_stalled_total", Duration::from_secs(300), |v| {
        v >= 1.0
    });
    eprintln!("the request stalled {:?} after it was sent", sent.elapsed());
    // Every choice, running or waiting, ends with the first stall: none
    // takes a slot to stall again for another 5 s.
    let start = Instant::now();
    loop {
        let m = s.metrics();
        let (busy, queued) = (
            metric(&m, "pulsar_slots_busy"),
            metric(&m, "pulsar_queue_length"),
        );
        if busy == 0.0 && queued == 0.0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{busy} slots busy and {queued} choices waiting after the stall"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.metric("pulsar_stalled_total"), 1.0);
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 8}),
    );
    assert_eq!(v["object"], "text_completion");
    drop(conn);
}

#[test]
fn queued_requests_of_clients_that_left_free_their_places() {
    let s = Server::start(&["-c", "4096", "--parallel", "1", "--queue", "2"]);
    let c = client();
    let r = c
        .post(s.url("/v1/completions"))
        .json(&endless(3000))
        .send()
        .expect("sent");
    let mut running = Sse::new(r);
    assert!(running.next_data().is_some());
    // Two clients wait in the queue, then give up.
    let mut body = endless(8);
    body["stream"] = json!(false);
    let leavers: Vec<_> = (0..2)
        .map(|_| {
            let url = s.url("/v1/completions");
            let body = body.clone();
            std::thread::spawn(move || {
                let impatient = Client::builder()
                    .timeout(Duration::from_secs(3))
                    .build()
                    .expect("HTTP client");
                impatient.post(url).json(&body).send().is_err()
            })
        })
        .collect();
    s.wait_metric("pulsar_queue_length", Duration::from_secs(30), |v| v == 2.0);
    for leaver in leavers {
        assert!(leaver.join().unwrap(), "a queued request was answered");
    }
    // Their places are free while the slot is still busy.
    s.wait_metric("pulsar_queue_length", Duration::from_secs(10), |v| v == 0.0);
    let waiting = std::thread::spawn({
        let url = s.url("/v1/completions");
        move || {
            client()
                .post(url)
                .json(&json!({"prompt": "Hi", "max_tokens": 2}))
                .send()
                .expect("sent")
                .status()
                .as_u16()
        }
    });
    s.wait_metric("pulsar_queue_length", Duration::from_secs(30), |v| v == 1.0);
    assert_eq!(s.metric("pulsar_slots_busy"), 1.0);
    drop(running);
    drop(c);
    assert_eq!(waiting.join().unwrap(), 200);
}

#[test]
fn a_schema_that_admits_no_value_is_refused() {
    let s = Server::start(&["-c", "256"]);
    // `false` was refused before; a schema that refers only to itself
    // compiled, and its reply was empty with finish_reason "stop".
    for (schema, words) in [
        (json!({"$ref": "#"}), "admits no value"),
        (json!(false), "schema is false"),
    ] {
        let (status, b) = s.call(
            "/v1/chat/completions",
            &json!({"messages": user("Hi"), "max_tokens": 8,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": schema}}}),
        );
        assert_error(
            status,
            &b,
            400,
            Some("response_format.json_schema.schema"),
            &[words],
        );
    }
}

#[test]
fn unknown_models_get_404_and_each_request_logs_a_line() {
    let s = Server::start(&["-c", "256"]);
    let (status, b) = s.call(
        "/v1/chat/completions",
        &json!({"model": "gpt-4o", "messages": user("Hi"), "max_tokens": 2}),
    );
    assert_error(
        status,
        &b,
        404,
        Some("model"),
        &["gpt-4o", "gemma-3-270m-q4_k_m"],
    );
    assert_eq!(b["error"]["code"], "model_not_found");
    let (status, b) = s.call(
        "/v1/completions",
        &json!({"model": "other", "prompt": "Hi", "max_tokens": 2}),
    );
    assert_error(status, &b, 404, Some("model"), &["other"]);
    let v = s.ok(
        "/v1/completions",
        &json!({"model": "gemma-3-270m-q4_k_m", "prompt": "Hi", "max_tokens": 2}),
    );
    let total = v["usage"]["total_tokens"].as_u64().expect("usage");
    let mut sse = stream(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    while sse.next_data().is_some() {}
    drop(sse);
    // Each line is written when its reply has gone out: the stream's, with
    // its tokens, at its end.
    let wanted = [
        "POST /v1/chat/completions 404 ".to_string(),
        format!("POST /v1/completions 200 {total} tokens "),
        "GET /health 200 ".to_string(),
    ];
    let logged = |s: &Server| {
        let stderr = s.stderr();
        let completions = stderr
            .lines()
            .filter(|l| l.starts_with("pulsar serve: POST /v1/completions 200 "))
            .count();
        completions == 2 && wanted.iter().all(|w| stderr.contains(w.as_str()))
    };
    let start = Instant::now();
    while !logged(&s) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no log lines {wanted:?} and two for /v1/completions in:\n{}",
            s.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !s.stderr().contains("/v1/completions 200 - tokens"),
        "{}",
        s.stderr()
    );

    let quiet = Server::start(&["-c", "256", "--quiet"]);
    quiet.ok("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !quiet.stderr().contains("POST /v1/completions"),
        "{}",
        quiet.stderr()
    );
}

/// A reply cut by `max_tokens` inside a tool call returns finish reason
/// "length" and never a call whose arguments are not JSON (the report's
/// `{"city` in `tool_calls`): every returned call parses, whatever the
/// limit cuts.
#[test]
fn tool_calls_cut_by_max_tokens_are_never_malformed() {
    let s = Server::start(&["-c", "1024"]);
    let tools = weather_tools();
    let question = user("What is the weather in Paris, in celsius?");
    let mut cut_inside_a_call = 0;
    for max_tokens in [6, 9, 12, 15, 18] {
        let v = s.ok(
            "/v1/chat/completions",
            &json!({"messages": question, "tools": tools, "temperature": 0,
                    "max_tokens": max_tokens, "tool_choice": "required"}),
        );
        let choice = &v["choices"][0];
        if choice["finish_reason"] != "length" {
            continue;
        }
        if choice["message"]["tool_calls"].is_null() {
            cut_inside_a_call += 1;
        }
        for call in choice["message"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let text = call["function"]["arguments"].as_str().expect("arguments");
            assert!(
                serde_json::from_str::<Value>(text).is_ok(),
                "max_tokens {max_tokens}: arguments {text:?} are not JSON: {v}"
            );
        }
    }
    assert!(cut_inside_a_call > 0, "no limit cut a call");
}

/// The report's reply: asked for the weather, the model calls
/// `get_weather`, then `get_time` again and again until `max_tokens`.
/// An identical repeated call ends the reply, which returns the distinct
/// calls with finish reason "tool_calls", long before the limit; streamed,
/// the same calls and no others.
#[test]
fn an_identical_repeated_tool_call_ends_the_reply() {
    let s = Server::start(&["-c", "1024"]);
    let tools = weather_tools();
    let body = json!({"messages": user("What is the weather in Paris, in celsius?"),
                      "tools": tools, "tool_choice": "required", "temperature": 0,
                      "max_tokens": 200});
    let v = s.ok("/v1/chat/completions", &body);
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let calls = checked_calls(&choice["message"], &tools);
    assert!(
        calls.len() >= 2,
        "the case needs a reply of several calls: {v}"
    );
    for (k, call) in calls.iter().enumerate() {
        assert!(
            !calls[..k].contains(call),
            "call {k} repeats an earlier one: {v}"
        );
    }
    let generated = v["usage"]["completion_tokens"].as_u64().unwrap_or(200);
    assert!(generated < 100, "generation went on after the repeat: {v}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&s, "/v1/chat/completions", &streamed).all();
    let mut sent: Vec<(String, String)> = Vec::new();
    for delta in chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
    {
        let k = delta["index"].as_u64().expect("index") as usize;
        if k == sent.len() {
            sent.push((
                delta["function"]["name"].as_str().expect("name").into(),
                String::new(),
            ));
        }
        let arguments = delta["function"]["arguments"].as_str().unwrap_or_default();
        sent[k].1.push_str(arguments);
    }
    let whole: Vec<(String, String)> = choice["message"]["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let f = &c["function"];
            (
                f["name"].as_str().unwrap_or_default().into(),
                f["arguments"].as_str().unwrap_or_default().into(),
            )
        })
        .collect();
    assert_eq!(sent, whole, "{chunks:?}");
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{last}");
}
