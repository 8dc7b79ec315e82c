#!/usr/bin/env python3
"""A bounded load benchmark for `pulsar serve`, on loopback only.

Starts `pulsar serve --port 0` itself (or uses --url), then for each
concurrency level runs that many streaming clients at once, each sending
--requests requests one after another, and reports per level: aggregate
generated tokens per second (all clients' completion tokens over the
level's wall time), p50/p95 time to first token and p50/p95 time between
tokens (between streamed chunks that carry text). With --rounds N every
level runs N times and the table shows the median of each figure. It stops
by itself: the work is fixed by the arguments, and every request has a
timeout.

    target/pyenv/bin/python tools/serve_load.py --pulsar target/release/pulsar \
        --levels 1,2,4,8 --requests 2 --max-tokens 64 --rounds 3

Needs the `openai` package (.ci/run installs it into target/pyenv).
"""

import argparse
import statistics
import subprocess
import sys
import threading
import time

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


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def one_request(client, model, prompt, max_tokens, seed, out):
    start = time.perf_counter()
    first = None
    last = None
    gaps = []
    tokens = 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.8,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        # End tokens banned: every request generates exactly max_tokens.
        logit_bias={"1": -100, "106": -100},
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
    out.append((first, gaps, tokens))


def run_level(client, model, level, requests, max_tokens, round_index):
    results = []
    lock = threading.Lock()

    def worker(w):
        mine = []
        for r in range(requests):
            prompt = PROMPTS[(w + r) % len(PROMPTS)]
            one_request(client, model, prompt, max_tokens, 1000 * round_index + 10 * w + r, mine)
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(level)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(t for _, _, t in results)
    ttft = [f for f, _, _ in results if f is not None]
    gaps = [g for _, gs, _ in results for g in gs]
    return {
        "tok_s": tokens / wall,
        "ttft50": percentile(ttft, 0.5),
        "ttft95": percentile(ttft, 0.95),
        "tbt50": percentile(gaps, 0.5),
        "tbt95": percentile(gaps, 0.95),
        "tokens": tokens,
        "wall": wall,
    }


def start_server(binary, parallel, threads, extra):
    cmd = [binary, "serve", "--port", "0", "--parallel", str(parallel), "-c", "1024"]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += extra
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"pulsar serve did not start: {line!r}")
    addr = line.split("http://", 1)[1].split()[0]
    if not addr.startswith(("127.", "localhost", "[::1]")):
        proc.kill()
        raise SystemExit(f"refusing a non-loopback address: {addr}")
    return proc, f"http://{addr}/v1"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pulsar", help="the pulsar binary to start (default: use --url)")
    ap.add_argument("--url", help="a running server's base URL (ending in /v1), loopback only")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="engine threads of the started server")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for pulsar serve")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    proc = None
    if args.pulsar:
        proc, url = start_server(args.pulsar, max(levels), args.threads, args.server_arg)
    elif args.url:
        url = args.url
        host = url.split("//", 1)[-1].split("/")[0]
        if not host.startswith(("127.", "localhost", "[::1]")):
            raise SystemExit("only loopback servers are benchmarked")
    else:
        raise SystemExit("give --pulsar BINARY or --url URL")
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        # A warm-up request, so the first level does not pay first-touch costs.
        one_request(client, model, PROMPTS[0], 8, 0, [])
        rows = []
        for level in levels:
            runs = [run_level(client, model, level, args.requests, args.max_tokens, r) for r in range(args.rounds)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            med["all_tok_s"] = [r["tok_s"] for r in runs]
            rows.append((level, med))
            print(
                f"{level} streams: {med['tok_s']:.1f} tok/s aggregate "
                f"(runs: {', '.join(f'{x:.1f}' for x in med['all_tok_s'])}), "
                f"TTFT p50 {med['ttft50'] * 1e3:.0f} ms p95 {med['ttft95'] * 1e3:.0f} ms, "
                f"TBT p50 {med['tbt50'] * 1e3:.0f} ms p95 {med['tbt95'] * 1e3:.0f} ms",
                file=sys.stderr,
            )
        base = rows[0][1]["tok_s"]
        print("| streams | aggregate tok/s | vs 1 stream | TTFT p50 / p95 | TBT p50 / p95 |")
        print("|---|---|---|---|---|")
        for level, m in rows:
            print(
                f"| {level} | {m['tok_s']:.1f} | {m['tok_s'] / base:.2f}x | "
                f"{m['ttft50'] * 1e3:.0f} / {m['ttft95'] * 1e3:.0f} ms | "
                f"{m['tbt50'] * 1e3:.0f} / {m['tbt95'] * 1e3:.0f} ms |"
            )
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
