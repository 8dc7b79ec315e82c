#!/usr/bin/env python3
"""Bounded load tests for `pulsar serve`, on loopback only.

Benchmark (the default). Starts `pulsar serve --port 0` itself (or uses
--url), then for each concurrency level runs that many streaming clients at
once, each sending --requests requests one after another, and reports per
level: aggregate generated tokens per second (all clients' completion tokens
over the level's wall time), p50/p95 time to first token and p50/p95 time
between tokens (between streamed chunks that carry text). With --rounds N
every level runs N times and the table shows the median of each figure.

    target/pyenv/bin/python tools/serve_load.py --pulsar target/release/pulsar \
        --levels 1,2,4,8 --requests 2 --max-tokens 64 --rounds 3

Side by side with llama.cpp: --llama-server BINARY starts llama.cpp's own
server on the same GGUF file with the same slots and threads and runs the same
request mix against it; given with --pulsar, pulsar runs first, then a pause
(--pause), then llama-server, each on a fresh server, and one table has both.

    target/pyenv/bin/python tools/serve_load.py --pulsar target/release/pulsar \
        --llama-server ~/.cache/pulsar-peers/llama.cpp/bin/llama-server \
        --parallel 4 --levels 1,2,4 --requests 2 --max-tokens 64 --rounds 3

Soak: --soak SECONDS runs a mixed load against a pulsar server for that long
(streaming and whole chat and completion requests, prompt batches,
embeddings, function calls and Responses API requests, from several threads, some closed mid-stream, oversized and malformed bodies, a hostile client
(slowloris headers, a stream it never reads, bodies cut short), a /health probe every
second, the server's RSS every few seconds), prints a report and exits 1 if
a check failed.

    target/pyenv/bin/python tools/serve_load.py --pulsar target/release/pulsar --soak 600

The benchmark's streams are sent by a small client of its own (JSON and SSE
over http.client), which leaves the shared CPU to the server it measures;
--client openai sends the same requests through the official `openai`
package instead (about 0.4 ms of CPU per streamed token here).

Everything stops by itself: the work is fixed by the arguments and every
request has a timeout. Needs the `openai` package (.ci/run installs it into
target/pyenv).
"""

import argparse
import collections
import http.client
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import openai

PROMPTS = [
    "Write a story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "Tell me about the history of bread.",
    "Write a letter to a friend about a trip to the sea.",
    "Describe the life of a honeybee.",
    "Explain why the seasons change.",
    "Tell a story about a robot who learns to paint.",
]

DEFAULT_MODEL = os.path.expanduser("~/.cache/pulsar/gemma-3-270m-q4_k_m.gguf")

# <eos> (1) and <end_of_turn> (106) in Gemma 3's GGUF vocabulary. Both servers
# read the same file, so the same ids mean the same tokens to both; both take
# OpenAI's map of token-id strings to biases, and -100 bans a token.
END_TOKENS_BANNED = {"1": -100, "106": -100}

# The sampler chain sent explicitly with every benchmark request, so neither
# server's defaults decide it (they are also both servers' defaults).
SAMPLING_EXTRA = {"top_k": 40, "min_p": 0.05, "repeat_penalty": 1.0}
TOP_P = 0.95

LOOPBACK_PREFIXES = ("127.", "localhost", "[::1]")


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def host_of(url):
    return url.split("//", 1)[-1].split("/")[0]


def require_loopback(url):
    if not host_of(url).startswith(LOOPBACK_PREFIXES):
        raise SystemExit(f"refusing a non-loopback address: {url}")


# --- servers ---------------------------------------------------------------


class Server:
    """A server this script started (or was pointed at): where it answers and
    how to stop it."""

    def __init__(self, name, root, proc=None, log_path=None, pid=None):
        self.name = name
        self.root = root  # http://127.0.0.1:PORT
        self.proc = proc
        self.log_path = log_path
        self.pid = pid if pid is not None else (proc.pid if proc else None)

    @property
    def api(self):
        return self.root + "/v1"

    def log_tail(self, lines=20):
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self):
        """SIGTERM, then wait; returns the exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


def get_status(url, timeout):
    """GET url; (status, seconds). Raises OSError when nothing answers."""
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return status, time.perf_counter() - start


def wait_healthy(server, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc is not None and server.proc.poll() is not None:
            raise SystemExit(
                f"{server.name} exited with {server.proc.returncode} before /health answered:\n"
                + server.log_tail()
            )
        try:
            status, _ = get_status(server.root + "/health", timeout=2)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    server.stop()
    raise SystemExit(f"{server.name}: /health did not answer 200 within {timeout} s:\n" + server.log_tail())


def new_log(name):
    f = tempfile.NamedTemporaryFile(prefix=f"serve_load-{name}-", suffix=".log", delete=False)
    return f


def start_pulsar(binary, model, parallel, threads, ctx, extra):
    cmd = [binary, "serve", "--port", "0", "--parallel", str(parallel), "-c", str(ctx)]
    if model:
        cmd += ["-m", model]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += extra
    log = new_log("pulsar")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"pulsar serve did not start: {line!r}")
    addr = line.split("http://", 1)[1].split()[0]
    if not addr.startswith(LOOPBACK_PREFIXES):
        proc.kill()
        raise SystemExit(f"refusing a non-loopback address: {addr}")
    server = Server("pulsar", f"http://{addr}", proc, log.name)
    wait_healthy(server, 120)
    print(f"pulsar: {' '.join(cmd)} (log {log.name})", file=sys.stderr)
    return server


def free_loopback_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_env(binary):
    # The build's shared libraries (libllama, libggml*) sit beside the binaries.
    env = dict(os.environ)
    folder = os.path.dirname(os.path.abspath(binary))
    env["LD_LIBRARY_PATH"] = folder + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def llama_version(binary):
    try:
        out = subprocess.run(
            [binary, "--version"], env=llama_env(binary), capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = (out.stdout + out.stderr).strip().splitlines()
    return "; ".join(line for line in text if "version" in line or "built with" in line) or "unknown"


def start_llama_server(binary, model, parallel, threads, ctx, extra):
    port = free_loopback_port()
    cmd = [
        binary,
        "-m", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(parallel),
        # pulsar's -c is tokens per slot; llama-server's -c is the whole KV
        # cache, which it shares out among the slots: ctx x parallel gives
        # each slot ctx tokens, as pulsar's. Without a unified cache (its
        # default only when the slot count is automatic; said explicitly
        # here) each slot has its own ctx cells, as in pulsar.
        "-c", str(ctx * parallel),
        "--no-kv-unified",
        "--threads", str(threads),
        "--threads-batch", str(threads),
    ]
    cmd += extra
    log = new_log("llama-server")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=llama_env(binary))
    log.close()
    server = Server("llama-server", f"http://127.0.0.1:{port}", proc, log.name)
    wait_healthy(server, 300)
    print(f"llama-server: {' '.join(cmd)} (log {log.name})", file=sys.stderr)
    return server


def check_end_token_ids(server):
    """llama-server can say which text the banned ids stand for; a wrong id
    would let requests end early and flatter the tok/s."""
    body = json.dumps({"tokens": [int(t) for t in END_TOKENS_BANNED]}).encode()
    req = urllib.request.Request(
        server.root + "/detokenize", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            content = json.load(r).get("content")
    except (OSError, ValueError) as e:
        content = f"(no answer: {e})"
    print(f"{server.name}: banned ids {list(END_TOKENS_BANNED)} are {content!r}", file=sys.stderr)


# --- benchmark ---------------------------------------------------------------


def completion_body(model, prompt, max_tokens, seed):
    """The benchmark's request: the same fields whichever client sends it."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "top_p": TOP_P,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        # End tokens banned: every request generates exactly max_tokens.
        "logit_bias": END_TOKENS_BANNED,
        **SAMPLING_EXTRA,
    }


class StreamTimer:
    """Times one streamed completion's chunks as they arrive."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first = None
        self.last = None
        self.gaps = []
        self.usage_tokens = None
        self.text_chunks = 0
        self.finish = None

    def chunk(self, text, finish, usage_tokens):
        now = time.perf_counter()
        if usage_tokens is not None:
            self.usage_tokens = usage_tokens
        if finish:
            self.finish = finish
        if text:
            self.text_chunks += 1
            if self.first is None:
                self.first = now - self.start
            else:
                self.gaps.append(now - self.last)
            self.last = now

    def result(self, max_tokens):
        tokens = self.usage_tokens if self.usage_tokens is not None else self.text_chunks
        return {
            "first": self.first,
            "gaps": self.gaps,
            # Usage when the server sent it, else the streamed text chunks
            # (a lower bound: a chunk may carry more than one token).
            "tokens": tokens,
            "usage_missing": self.usage_tokens is None,
            "short": tokens < max_tokens,
            "finish": self.finish,
        }


class RawClient:
    """One benchmark thread's connection: the request's JSON over a kept-alive
    http.client connection and its SSE lines read as they come. On these 2-core
    machines the load client shares the CPU with the server it measures: the
    official client (httpx, a pydantic model per chunk) spent about 0.4 ms of
    CPU per streamed token, 13% of a core at 4 streams against pulsar, taken
    from the server's two threads; this one spends a small fraction of that.
    `--client openai` times the same requests through the official client."""

    def __init__(self, root):
        self.host = host_of(root)
        self.conn = None

    def connect(self):
        self.conn = http.client.HTTPConnection(self.host, timeout=600)
        self.conn.connect()
        # http.client sends the headers and the body in two writes; with
        # Nagle's algorithm the second waits for the first's ACK.
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, body):
        """Sends the request and returns the response. A kept-alive connection
        the server has closed meanwhile (servers may close idle ones at any
        time) fails before any response; such a request is sent once more on
        a new connection, as HTTP client libraries do."""
        reused = self.conn is not None
        if not reused:
            self.connect()
        try:
            self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            return self.conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.conn.close()
            if not reused:
                raise
            self.connect()
            self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            return self.conn.getresponse()

    def complete(self, model, prompt, max_tokens, seed, out):
        body = json.dumps(completion_body(model, prompt, max_tokens, seed)).encode()
        timer = StreamTimer()
        try:
            resp = self.send(body)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            # read1 hands over what has arrived (readline on a chunked body
            # reads it a byte at a time, which cost as much CPU as the
            # official client); events end with a blank line.
            pending = b""
            done = False
            while not done:
                piece = resp.read1(65536)
                if not piece:
                    break
                pending += piece
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    data = event.strip()
                    if not data.startswith(b"data: "):
                        continue
                    data = data[6:]
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    usage = chunk.get("usage")
                    choices = chunk.get("choices") or []
                    first = choices[0] if choices else {}
                    timer.chunk(
                        first.get("text"),
                        first.get("finish_reason"),
                        usage.get("completion_tokens") if usage else None,
                    )
            # Drain what is left so the connection can carry the next request.
            resp.read()
        except Exception:
            self.conn.close()
            self.conn = None
            raise
        out.append(timer.result(max_tokens))


class OpenAIClient:
    """The same request through the official `openai` package."""

    def __init__(self, client):
        self.client = client

    def complete(self, model, prompt, max_tokens, seed, out):
        one_request(self.client, model, prompt, max_tokens, seed, out)


def one_request(client, model, prompt, max_tokens, seed, out):
    """One streamed completion through the official client."""
    body = completion_body(model, prompt, max_tokens, seed)
    # The sampler fields the client has no parameters for go in its extra body.
    extra = {k: body.pop(k) for k in SAMPLING_EXTRA}
    timer = StreamTimer()
    for chunk in client.completions.create(**body, extra_body=extra):
        choice = chunk.choices[0] if chunk.choices else None
        timer.chunk(
            choice.text if choice else None,
            choice.finish_reason if choice else None,
            chunk.usage.completion_tokens if chunk.usage is not None else None,
        )
    out.append(timer.result(max_tokens))


def run_level(new_client, model, level, requests, max_tokens, round_index):
    results = []
    lock = threading.Lock()
    errors = []

    def worker(w):
        mine = []
        client = new_client()
        try:
            for r in range(requests):
                prompt = PROMPTS[(w + r) % len(PROMPTS)]
                client.complete(model, prompt, max_tokens, 1000 * round_index + 10 * w + r, mine)
        except Exception as e:  # reported below; the level's figures would be wrong
            with lock:
                errors.append(repr(e))
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(level)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"level {level}: {len(errors)} client(s) failed: {errors[0]}")
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["first"] for r in results if r["first"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "tok_s": tokens / wall,
        "ttft50": percentile(ttft, 0.5),
        "ttft95": percentile(ttft, 0.95),
        "tbt50": percentile(gaps, 0.5),
        "tbt95": percentile(gaps, 0.95),
        "tokens": tokens,
        "wall": wall,
        "usage_missing": sum(r["usage_missing"] for r in results),
        "short": sum(r["short"] for r in results),
    }


def bench(server, args, levels):
    client = openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    if args.client == "openai":
        def new_client():
            return OpenAIClient(client)
    else:
        def new_client():
            return RawClient(server.root)
    # A warm-up request, so the first level does not pay first-touch costs.
    new_client().complete(model, PROMPTS[0], 8, 0, [])
    rows = []
    for level in levels:
        runs = [run_level(new_client, model, level, args.requests, args.max_tokens, r) for r in range(args.rounds)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("tok_s", "ttft50", "ttft95", "tbt50", "tbt95")}
        med["all_tok_s"] = [r["tok_s"] for r in runs]
        med["usage_missing"] = sum(r["usage_missing"] for r in runs)
        med["short"] = sum(r["short"] for r in runs)
        rows.append((level, med))
        print(
            f"{server.name}, {level} streams: {med['tok_s']:.1f} tok/s aggregate "
            f"(runs: {', '.join(f'{x:.1f}' for x in med['all_tok_s'])}), "
            f"TTFT p50 {med['ttft50'] * 1e3:.0f} ms p95 {med['ttft95'] * 1e3:.0f} ms, "
            f"TBT p50 {med['tbt50'] * 1e3:.0f} ms p95 {med['tbt95'] * 1e3:.0f} ms",
            file=sys.stderr,
        )
        if med["usage_missing"]:
            print(
                f"  {med['usage_missing']} streams sent no usage: their tokens are the text chunks counted",
                file=sys.stderr,
            )
        if med["short"]:
            print(
                f"  warning: {med['short']} streams ended before {args.max_tokens} tokens (end tokens not banned?)",
                file=sys.stderr,
            )
    return rows


def print_table(results, levels):
    several = len(results) > 1
    head = "| server " if several else ""
    print(f"{head}| streams | aggregate tok/s | vs {levels[0]} stream{'s' if levels[0] != 1 else ''} "
          "| TTFT p50 / p95 | TBT p50 / p95 |")
    print(("|---" if several else "") + "|---|---|---|---|---|")
    for name, rows in results:
        base = rows[0][1]["tok_s"]
        for level, m in rows:
            note = " (chunks counted)" if m["usage_missing"] else ""
            print(
                (f"| {name} " if several else "")
                + f"| {level} | {m['tok_s']:.1f}{note} "
                f"(rounds {', '.join(f'{x:.1f}' for x in m['all_tok_s'])}) | {m['tok_s'] / base:.2f}x | "
                f"{m['ttft50'] * 1e3:.0f} / {m['ttft95'] * 1e3:.0f} ms | "
                f"{m['tbt50'] * 1e3:.0f} / {m['tbt95'] * 1e3:.0f} ms |"
            )


# --- soak --------------------------------------------------------------------


def health_probe(root, conn, stop):
    """In its own process, so the load's Python threads (and their GIL) do
    not delay it: GET /health once a second on a fresh connection until
    `stop` is set, then send back [(t, status or None, seconds, error)]."""
    host, port = host_of(root).rsplit(":", 1)
    samples = []
    start = time.monotonic()
    tick = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        status, error = None, None
        try:
            c = http.client.HTTPConnection(host, int(port), timeout=5)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            status = r.status
            c.close()
        except OSError as e:
            error = repr(e)
        samples.append((time.monotonic() - start, status, time.perf_counter() - t0, error))
        tick += 1
        stop.wait(max(0.0, start + tick - time.monotonic()))
    conn.send(samples)
    conn.close()


def read_rss_kib(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def read_metrics(root):
    """The server's Prometheus text as {name{labels}: value}; {} if it fails."""
    try:
        with urllib.request.urlopen(root + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


LONG_PROMPT = " ".join(PROMPTS * 6)  # hundreds of tokens: several bulk prefill runs


class Tally:
    """Thread-safe counters for the soak."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent = collections.Counter()
        self.ok = collections.Counter()
        self.failed = collections.Counter()
        self.closed = collections.Counter()  # closed by us mid-stream, on purpose
        self.ended_first = collections.Counter()  # meant to be closed, but ended first
        self.failures = []
        self.bad_statuses = collections.defaultdict(collections.Counter)
        self.bad_expected = {}
        self.bad_shape = collections.Counter()  # error body not OpenAI's {"error": {...}}
        self.hostile = collections.defaultdict(collections.Counter)  # kind -> how it ended

    def add(self, counter, kind, n=1):
        with self.lock:
            counter[kind] += n

    def fail(self, kind, what):
        with self.lock:
            self.failed[kind] += 1
            if len(self.failures) < 20:
                self.failures.append(f"{kind}: {what}")


def soak_messages(rng, prompt):
    if rng.random() < 0.3:
        # A second turn: the first turn's prompt can be reused from a slot.
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": "Here is one."},
            {"role": "user", "content": "Now make it shorter."},
        ]
    return [{"role": "user", "content": prompt}]


def soak_request(client, model, kind, rng, tally, first):
    prompt = LONG_PROMPT if first or rng.random() < 0.1 else rng.choice(PROMPTS)
    max_tokens = 128 if first else rng.randint(8, 160)
    common = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=rng.choice([0.0, 0.8]),
        seed=rng.randint(0, 2**31),
    )
    tally.add(tally.sent, kind)
    try:
        if kind == "embeddings":
            inputs = [rng.choice(PROMPTS) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.2:
                inputs.append(LONG_PROMPT)
            r = client.embeddings.create(model=model, input=inputs)
            lengths = [sum(x * x for x in d.embedding) for d in r.data]
            if [d.index for d in r.data] != list(range(len(inputs))) or any(abs(n - 1) > 1e-3 for n in lengths):
                return tally.fail(kind, f"ill-formed embeddings: {len(r.data)} of {len(inputs)}, squared lengths {lengths}")
            return tally.add(tally.ok, kind)
        if kind == "completion_batch":
            prompts = [rng.choice(PROMPTS) for _ in range(rng.randint(2, 3))]
            r = client.completions.create(prompt=prompts, **common)
            if [c.index for c in r.choices] != list(range(len(prompts))) or any(
                c.finish_reason not in ("stop", "length") for c in r.choices
            ):
                return tally.fail(kind, f"ill-formed batch reply: {r.choices!r}"[:300])
            if r.usage.completion_tokens > max_tokens * len(prompts):
                return tally.fail(kind, f"{r.usage.completion_tokens} tokens > {len(prompts)} x max_tokens")
            return tally.add(tally.ok, kind)
        if kind == "responses":
            # The Responses API, streamed or not; with its typed stream the
            # last event carries the whole response.
            budget = common["max_tokens"]
            args = dict(model=model, input=prompt, max_output_tokens=budget, temperature=common["temperature"])
            if rng.random() < 0.5:
                r = client.responses.create(**args)
            else:
                r = None
                for event in client.responses.create(stream=True, **args):
                    if event.type in ("response.completed", "response.incomplete"):
                        r = event.response
                if r is None:
                    return tally.fail(kind, "a response stream ended without response.completed")
            if r.status not in ("completed", "incomplete") or r.usage.output_tokens > budget:
                return tally.fail(kind, f"ill-formed response: {r.status!r}, {r.usage!r}"[:300])
            return tally.add(tally.ok, kind)
        if kind == "tool_call":
            r = client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}],
                tools=SOAK_TOOLS,
                tool_choice=rng.choice(["auto", "required"]),
                parallel_tool_calls=rng.random() < 0.5,
                **common,
            )
            choice = r.choices[0]
            calls = choice.message.tool_calls or []
            names = {t["function"]["name"] for t in SOAK_TOOLS}
            if any(call.function.name not in names for call in calls):
                return tally.fail(kind, f"a call of an unknown function: {calls!r}"[:300])
            if choice.finish_reason == "tool_calls":
                # A whole reply: each call's arguments are a JSON object.
                for call in calls:
                    if not isinstance(json.loads(call.function.arguments), dict):
                        return tally.fail(kind, f"ill-formed call: {call!r}"[:300])
                if not calls:
                    return tally.fail(kind, "finish_reason tool_calls without calls")
            elif choice.finish_reason == "length":
                # Cut by max_tokens: the calls so far, their arguments as
                # far as they were written (as OpenAI sends them).
                pass
            elif choice.finish_reason != "stop" or calls:
                return tally.fail(kind, f"ill-formed reply: finish {choice.finish_reason!r}, calls {calls!r}"[:300])
            return tally.add(tally.ok, kind)
        if kind in ("chat", "completion"):
            if kind == "chat":
                r = client.chat.completions.create(messages=soak_messages(rng, prompt), **common)
                finish = r.choices[0].finish_reason
                ok = r.choices[0].message.content is not None
            else:
                r = client.completions.create(prompt=prompt, **common)
                finish = r.choices[0].finish_reason
                ok = r.choices[0].text is not None
            if not ok or finish not in ("stop", "length") or r.usage is None:
                return tally.fail(kind, f"ill-formed reply: finish {finish!r}, usage {r.usage!r}")
            if r.usage.completion_tokens > max_tokens:
                return tally.fail(kind, f"{r.usage.completion_tokens} tokens > max_tokens {max_tokens}")
            return tally.add(tally.ok, kind)

        chat = kind in ("chat_stream", "disconnect_chat")
        close_after = None
        if kind.startswith("disconnect"):
            # Long (end tokens banned), so closing after 1..12 chunks is
            # mid-stream.
            common["max_tokens"] = 256
            common["logit_bias"] = END_TOKENS_BANNED
            close_after = rng.randint(1, 12)
        if chat:
            stream = client.chat.completions.create(
                messages=soak_messages(rng, prompt), stream=True, stream_options={"include_usage": True}, **common
            )
        else:
            stream = client.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **common
            )
        chunks = 0
        finish = None
        usage = None
        for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if close_after is not None and chunks >= close_after:
                stream.close()
                return tally.add(tally.closed, kind)
        if close_after is not None:
            # A chat reply can still end before the close: the dialogue
            # format's stop text "\nUser:" is not a banned token. Then it is
            # an ordinary completed stream, checked as one below.
            tally.add(tally.ended_first, kind)
        if finish not in ("stop", "length") or usage is None:
            return tally.fail(kind, f"stream ended without finish_reason/usage: {finish!r}, {usage!r}")
        if usage.completion_tokens > common["max_tokens"]:
            return tally.fail(kind, f"{usage.completion_tokens} tokens > max_tokens")
        tally.add(tally.ok, kind)
    except Exception as e:  # any exception is a failed well-formed request
        tally.fail(kind, repr(e)[:300])


WELL_FORMED_KINDS = {
    "chat_stream": 3,
    "chat": 2,
    "completion_stream": 3,
    "completion": 2,
    "disconnect_chat": 1,
    "disconnect_completion": 1,
    "embeddings": 1,
    "completion_batch": 1,
    "tool_call": 1,
    "responses": 1,
}

# Function calling in the soak: any call must name one of these and carry
# an arguments object.
SOAK_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "look_up",
            "description": "Look a word up in a dictionary",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "maxLength": 40}},
                "required": ["word"],
            },
        },
    },
    {"type": "function", "function": {"name": "roll_die", "description": "Roll a six-sided die"}},
]


def soak_worker(server, model, deadline, seed, tally):
    rng = random.Random(seed)
    client = openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=120)
    kinds = list(WELL_FORMED_KINDS)
    weights = [WELL_FORMED_KINDS[k] for k in kinds]
    first = True
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        if first:
            kind = rng.choice(["chat_stream", "completion_stream"])
        soak_request(client, model, kind, rng, tally, first)
        first = False


# Bodies the server must refuse: (kind, path, expected status, body maker).
OVERSIZE = 4 * 1024 * 1024 + 64 * 1024  # over the default --max-body of 4 MiB


def big_chat_body():
    return json.dumps({"messages": [{"role": "user", "content": "a" * OVERSIZE}]}).encode()


BAD_BODIES = [
    ("oversized", "/v1/chat/completions", 413, big_chat_body),
    ("oversized_chunked", "/v1/completions", 413, lambda: json.dumps({"prompt": "b" * OVERSIZE}).encode()),
    ("malformed_json", "/v1/chat/completions", 400, lambda: b'{"messages": [{"role": "user", "content": "hi"'),
    ("malformed_json", "/v1/completions", 400, lambda: b'{"prompt": "hi",}'),
    ("wrong_type", "/v1/chat/completions", 400, lambda: b'{"messages": "hello"}'),
    ("wrong_type", "/v1/chat/completions", 400, lambda: b'{"messages": [{"role": "user", "content": 5}]}'),
    ("wrong_type", "/v1/completions", 400, lambda: b'{"prompt": "hi", "max_tokens": "ten"}'),
    ("wrong_type", "/v1/completions", 400, lambda: b'{"prompt": {"text": "hi"}}'),
]


def send_bad(root, path, body, chunked):
    """POST body with http.client; (status, parsed error body or None)."""
    host, port = host_of(root).rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if chunked:
            pieces = (body[i:i + 65536] for i in range(0, len(body), 65536))
            try:
                c.request("POST", path, body=pieces, headers=headers, encode_chunked=True)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server may answer and close before the whole body is sent
        else:
            try:
                c.request("POST", path, body=body, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                pass
        r = c.getresponse()
        data = r.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = None
        return r.status, parsed
    finally:
        c.close()


def bad_body_worker(server, deadline, seed, tally):
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        kind, path, expected, make = rng.choice(BAD_BODIES)
        tally.add(tally.sent, kind)
        with tally.lock:
            tally.bad_expected[kind] = expected
        try:
            status, parsed = send_bad(server.root, path, make(), kind.endswith("chunked"))
        except OSError as e:
            status, parsed = f"no answer ({type(e).__name__})", None
        with tally.lock:
            tally.bad_statuses[kind][status] += 1
        if not (isinstance(parsed, dict) and isinstance(parsed.get("error"), dict) and parsed["error"].get("message")):
            tally.add(tally.bad_shape, kind)
        time.sleep(rng.uniform(1.0, 3.0))


# What a hostile client does, mixed into the soak (`hostile_worker`), and
# what the server must do about it.
HOSTILE_KINDS = ("slowloris", "stalled_reader", "cut_body")


def hostile_once(root, kind, rng):
    """One hostile connection; returns how it ended, as a short word."""
    host, port = host_of(root).rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=90)
    try:
        if kind == "slowloris":
            # Headers one byte every 2 s: the server's header timeout (5 s
            # by default) must close the connection long before they end.
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            started = time.monotonic()
            for b in head:
                try:
                    sock.sendall(bytes([b]))
                except OSError:
                    return "closed by server"
                sock.settimeout(2.0)
                try:
                    if sock.recv(4096) == b"":
                        return "closed by server"
                    return "answered"
                except socket.timeout:
                    pass
                except OSError:
                    return "closed by server"
                if time.monotonic() - started > 60:
                    return "still open after 60 s"
            return "still open after 60 s"
        if kind == "stalled_reader":
            # A streaming request whose reply is never read for 20 s, then
            # the connection dropped.
            body = json.dumps({"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
                               "max_tokens": 256, "stream": True}).encode()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(20)
            return "dropped by us"
        # cut_body: a body shorter than its Content-Length, then gone.
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hi")
        time.sleep(rng.uniform(0.1, 2.0))
        return "dropped by us"
    except OSError as e:
        return f"error {type(e).__name__}"
    finally:
        sock.close()


def hostile_worker(server, deadline, seed, tally):
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        kind = rng.choice(HOSTILE_KINDS)
        outcome = hostile_once(server.root, kind, rng)
        with tally.lock:
            tally.hostile[kind][outcome] += 1
        time.sleep(rng.uniform(1.0, 3.0))


def soak(server, args):
    if server.pid is None:
        raise SystemExit("--soak needs the server's pid (start it with --pulsar, or give --server-pid)")
    seconds = args.soak
    warmup = args.soak_warmup if args.soak_warmup is not None else min(60.0, seconds / 5)
    clients = args.soak_clients or args.parallel + 1
    client = openai.OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    pid = server.pid
    rss_before = read_rss_kib(pid)

    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    prober = ctx.Process(target=health_probe, args=(server.root, child_end, stop), daemon=True)
    prober.start()

    tally = Tally()
    start = time.monotonic()
    deadline = start + seconds
    workers = [
        threading.Thread(target=soak_worker, args=(server, model, deadline, args.seed * 100 + i, tally), daemon=True)
        for i in range(clients)
    ]
    workers.append(
        threading.Thread(target=bad_body_worker, args=(server, deadline, args.seed * 100 + 99, tally), daemon=True)
    )
    workers.append(
        threading.Thread(target=hostile_worker, args=(server, deadline, args.seed * 100 + 98, tally), daemon=True)
    )
    for w in workers:
        w.start()
    print(
        f"soak: {seconds:.0f} s, {clients} client threads + 1 bad-body thread + 1 hostile thread, pid {pid}, "
        f"RSS before load {rss_before / 1024:.1f} MiB",
        file=sys.stderr,
    )

    rss = []  # (seconds since start, KiB)
    next_report = start + 60
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        rss.append((now - start, read_rss_kib(pid)))
        if now >= next_report:
            with tally.lock:
                done = sum(tally.ok.values()) + sum(tally.closed.values())
                failed = sum(tally.failed.values())
            print(
                f"  {now - start:4.0f} s: RSS {rss[-1][1] / 1024:.1f} MiB, {done} requests done, {failed} failed",
                file=sys.stderr,
            )
            next_report += 60
        time.sleep(min(args.rss_every, max(0.0, deadline - time.monotonic())))
    rss.append((time.monotonic() - start, read_rss_kib(pid)))
    rss_end_load = rss[-1][1]

    # Requests in flight at the deadline finish (each has a timeout).
    for w in workers:
        w.join(timeout=180)
    stuck = sum(w.is_alive() for w in workers)
    time.sleep(5)  # idle: every slot should be free again
    rss_idle = read_rss_kib(pid)
    hwm = read_rss_kib(pid, "VmHWM")
    metrics = read_metrics(server.root)
    stop.set()
    health = parent_end.recv() if parent_end.poll(30) else []
    prober.join(timeout=10)

    return report_soak(
        args, seconds, warmup, clients, tally, health, rss, rss_before, rss_end_load, rss_idle, hwm, metrics, stuck
    )


def report_soak(args, seconds, warmup, clients, tally, health, rss, rss_before, rss_end, rss_idle, hwm, metrics, stuck):
    checks = []  # (passed, text)

    def check(passed, text):
        checks.append((passed, text))

    print(f"## Soak: {seconds:.0f} s, {clients} client threads, --parallel {args.parallel}")
    print()
    print("| well-formed kind | sent | completed | closed mid-stream on purpose | failed |")
    print("|---|---|---|---|---|")
    for kind in WELL_FORMED_KINDS:
        print(f"| {kind} | {tally.sent[kind]} | {tally.ok[kind]} | {tally.closed[kind]} | {tally.failed[kind]} |")
    sent = sum(tally.sent[k] for k in WELL_FORMED_KINDS)
    ok = sum(tally.ok.values())
    closed = sum(tally.closed.values())
    failed = sum(tally.failed.values())
    print(f"| all | {sent} | {ok} | {closed} | {failed} |")
    early = sum(tally.ended_first.values())
    if early:
        print(f"({early} of the streams meant to be closed ended first, on a stop text, and count as completed)")
    check(failed == 0 and ok + closed == sent, f"well-formed requests: {ok + closed} of {sent} completed, {failed} failed")
    for f in tally.failures:
        print(f"  failure: {f}")
    print()

    print("| refused kind | sent | expected | statuses seen | error body not OpenAI's shape |")
    print("|---|---|---|---|---|")
    bad_unexpected = 0
    for kind in sorted(tally.bad_statuses):
        seen = tally.bad_statuses[kind]
        expected = tally.bad_expected[kind]
        bad_unexpected += sum(n for s, n in seen.items() if s != expected)
        seen_text = ", ".join(f"{s}: {n}" for s, n in sorted(seen.items(), key=str))
        print(f"| {kind} | {tally.sent[kind]} | {expected} | {seen_text} | {tally.bad_shape[kind]} |")
    bad_sent = sum(tally.sent[k] for k in tally.bad_statuses)
    check(bad_sent > 0 and bad_unexpected == 0, f"refused bodies: {bad_sent} sent, {bad_unexpected} with an unexpected status")
    check(sum(tally.bad_shape.values()) == 0, f"error bodies in OpenAI's shape: {sum(tally.bad_shape.values())} not")
    print()

    print("| hostile kind | connections | how they ended |")
    print("|---|---|---|")
    for kind in HOSTILE_KINDS:
        seen = tally.hostile[kind]
        text = ", ".join(f"{o}: {n}" for o, n in sorted(seen.items()))
        print(f"| {kind} | {sum(seen.values())} | {text} |")
    slow = tally.hostile["slowloris"]
    check(sum(slow.values()) > 0 and slow.get("closed by server", 0) == sum(slow.values()),
          f"slowloris connections closed by the server: {slow.get('closed by server', 0)} of {sum(slow.values())}")
    print()

    lat = [s[2] for s in health if s[1] is not None]
    health_fail = [s for s in health if s[1] != 200 or s[2] > args.health_limit]
    print(
        f"/health: {len(health)} probes, {len(health_fail)} failures (not 200 within "
        f"{args.health_limit * 1e3:.0f} ms); latency p50 {percentile(lat, 0.5) * 1e3:.2f} ms, "
        f"p99 {percentile(lat, 0.99) * 1e3:.2f} ms, max {max(lat, default=float('nan')) * 1e3:.2f} ms"
    )
    for s in health_fail[:10]:
        print(f"  at {s[0]:.1f} s: status {s[1]}, {s[2] * 1e3:.1f} ms {s[3] or ''}")
    check(len(health) >= seconds * 0.9 and not health_fail, f"/health: {len(health_fail)} failures in {len(health)} probes")
    print()

    # Baseline: the first sample after the warm-up, when every slot has held
    # a long prompt (each client's first request) and the allocator has
    # reached its working size; end: the last sample under load.
    after = [(t, k) for t, k in rss if t >= warmup]
    base_t, base = after[0] if after else rss[-1]
    peak = max(k for _, k in rss)
    change = (rss_end - base) / base * 100
    slope = float("nan")
    if len(after) >= 3:
        ts = [t for t, _ in after]
        ks = [k / 1024 for _, k in after]
        mt, mk = statistics.fmean(ts), statistics.fmean(ks)
        slope = sum((t - mt) * (k - mk) for t, k in zip(ts, ks)) / sum((t - mt) ** 2 for t in ts) * 60
    print(
        f"RSS (VmRSS, every {args.rss_every:g} s, {len(rss)} samples): before load {rss_before / 1024:.1f} MiB; "
        f"baseline {base / 1024:.1f} MiB (first sample after a {warmup:.0f} s warm-up, at {base_t:.0f} s); "
        f"end of load {rss_end / 1024:.1f} MiB; max {peak / 1024:.1f} MiB (VmHWM {hwm / 1024:.1f} MiB); "
        f"idle 5 s after {rss_idle / 1024:.1f} MiB"
    )
    print(f"RSS end vs baseline: {change:+.2f}% (target within ±{args.rss_limit:g}%); "
          f"least-squares drift after warm-up {slope:+.3f} MiB/min")
    marks = [(t, k) for t, k in rss if int(t) % 60 < args.rss_every]
    print("RSS by minute: " + ", ".join(f"{t:.0f} s {k / 1024:.1f}" for t, k in marks))
    check(abs(change) <= args.rss_limit, f"RSS end vs baseline {change:+.2f}%")
    print()

    if metrics:
        busy = metrics.get("pulsar_slots_busy")
        queue = metrics.get("pulsar_queue_length")
        disc = metrics.get("pulsar_disconnects_total")
        stalls = metrics.get("pulsar_stalled_total")
        statuses = {k: v for k, v in metrics.items() if k.startswith("pulsar_requests_total")}
        print(f"server /metrics after 5 s idle: slots busy {busy}, queue {queue}, disconnects {disc} "
              f"(we closed {closed}), stalls {stalls}")
        for k, v in sorted(statuses.items()):
            print(f"  {k} {v:.0f}")
        check(busy == 0 and queue == 0, f"idle after the load: slots busy {busy}, queue {queue}")
    check(stuck == 0, f"client threads still running after the load: {stuck}")
    print()

    return checks


def finish_checks(checks, server_alive, exit_code):
    checks.append((server_alive, "server still running at the end of the load"))
    checks.append((exit_code == 0, f"server exited {exit_code} after SIGTERM"))
    print("| check | result |")
    print("|---|---|")
    for passed, text in checks:
        print(f"| {text} | {'pass' if passed else 'FAIL'} |")
    failed = [t for p, t in checks if not p]
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


# --- main ---------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pulsar", help="the pulsar binary to start (default: use --url)")
    ap.add_argument("--llama-server", help="also benchmark llama.cpp's llama-server binary, after pulsar")
    ap.add_argument("--url", help="a running server's base URL (ending in /v1), loopback only")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file both servers load (default: %(default)s)")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--parallel", type=int, help="slots of a started server (default: the largest level; soak: 4)")
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens per slot (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--client",
        choices=("raw", "openai"),
        default="raw",
        help="benchmark client: raw (JSON and SSE over http.client, light on the shared CPU) or the official openai package",
    )
    ap.add_argument("--threads", type=int, default=2, help="engine threads of a started server")
    ap.add_argument("--pause", type=float, default=5.0, help="seconds between one server's stop and the next start")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for pulsar serve")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra argument for llama-server")
    ap.add_argument("--soak", type=float, help="run the soak for this many seconds instead of the benchmark")
    ap.add_argument("--soak-clients", type=int, help="well-formed client threads (default: --parallel + 1)")
    ap.add_argument("--soak-warmup", type=float, help="seconds before the RSS baseline (default: min(60, soak/5))")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--rss-limit", type=float, default=5.0, help="allowed RSS change, %% (default: %(default)s)")
    ap.add_argument("--health-limit", type=float, default=0.1, help="seconds /health may take (default: %(default)s)")
    ap.add_argument("--server-pid", type=int, help="with --url and --soak: the server's pid, for its RSS")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.parallel is None:
        args.parallel = 4 if args.soak else max(levels)

    if args.soak:
        if args.llama_server:
            raise SystemExit("--soak runs against pulsar only")
        if args.pulsar:
            server = start_pulsar(args.pulsar, args.model, args.parallel, args.threads, args.ctx, args.server_arg)
        elif args.url:
            require_loopback(args.url)
            server = Server("server", args.url.rsplit("/v1", 1)[0], pid=args.server_pid)
        else:
            raise SystemExit("give --pulsar BINARY or --url URL")
        exit_code = None
        try:
            checks = soak(server, args)
            alive = server.proc is None or server.proc.poll() is None
        finally:
            exit_code = server.stop()
        if server.proc is None:
            exit_code = 0  # not ours to stop
        if server.log_path:
            print(f"server log: {server.log_path}; last lines:\n{server.log_tail(5)}", file=sys.stderr)
        sys.exit(finish_checks(checks, alive, exit_code))

    results = []
    if args.url:
        require_loopback(args.url)
        server = Server("server", args.url.rsplit("/v1", 1)[0])
        results.append((server.name, bench(server, args, levels)))
    starters = []
    if args.pulsar:
        starters.append(lambda: start_pulsar(
            args.pulsar, args.model, args.parallel, args.threads, args.ctx, args.server_arg))
    if args.llama_server:
        print(f"llama-server version: {llama_version(args.llama_server)}", file=sys.stderr)
        starters.append(lambda: start_llama_server(
            args.llama_server, args.model, args.parallel, args.threads, args.ctx, args.llama_arg))
    if not starters and not args.url:
        raise SystemExit("give --pulsar BINARY, --llama-server BINARY or --url URL")
    for i, start in enumerate(starters):
        if i or results:
            time.sleep(args.pause)
        server = start()
        try:
            if server.name == "llama-server":
                check_end_token_ids(server)
            results.append((server.name, bench(server, args, levels)))
        finally:
            server.stop()
    print_table(results, levels)


if __name__ == "__main__":
    main()
