#!/usr/bin/env python3
"""Speculative decoding benchmark: decode tok/s with `--spec ngram` and
`--spec off` on input-grounded tasks (summarize a document given with -f,
rewrite a code file with one change, answer by quoting a passage) and on
free-form text, greedy and at temperature 0.7.

Each configuration runs the release binary once per repetition with the
two settings alternating (which goes first swaps every repetition, so a
slow spell of the shared machine does not fall on one side), each run
holding /tmp/pulsar-cpu.lock so no build or other benchmark runs beside it.
Both settings of a repetition get the same seed: speculation changes
neither greedy text nor seeded sampled text, so both decode the same
tokens and their speeds compare like for like. Prints the medians of
decode tok/s, the speedup (median of the per-repetition ratios) and the
acceptance (accepted / drafted over all repetitions, and tokens per step).

Standard library only:

    python3 tools/bench_spec.py --runs 5
    python3 tools/bench_spec.py --tasks summarize,free --temps 0 --runs 3 -n 128
"""

import argparse
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A made-up document (so no model has seen it) with names, dates and
# figures a summary or a quote repeats.
DOCUMENT = """\
The Kessler Valley Water Cooperative was founded in 1958 by eleven farming
families who had grown tired of waiting for the county to extend its pipes
beyond the river bend. Each family paid forty dollars and two weeks of
labour, and by the autumn of 1959 a single steel main carried water from
the Harlan spring to a storage tank on Miller's Hill.

Today the cooperative serves 1,240 households and three small businesses.
It is run by a board of seven members, elected for three-year terms at the
annual meeting held on the second Saturday of March. The board employs a
general manager, two field technicians and a part-time bookkeeper. Every
household that draws water is a member and has exactly one vote, whatever
the size of its bill.

The system now draws from two sources. The Harlan spring still supplies
about sixty percent of the water in a normal year; the rest comes from a
well drilled in 1994 near the old creamery, which is pumped mainly in late
summer when the spring runs low. Water from both sources is filtered and
disinfected at the treatment building on Miller's Hill before it enters
the storage tank, which holds 450,000 gallons.

In 2019 the cooperative replaced twelve miles of its oldest pipe, much of
it the original steel main, with polyethylene. The project cost 2.3 million
dollars, paid for by a state loan at one percent interest over thirty years
and by a rate increase of six dollars a month. Leaks, which had wasted an
estimated fifteen percent of the water pumped, fell to under four percent
in the first year after the work was finished.

The board's current concern is the well. Tests in 2023 found nitrate
levels that were still within the legal limit but had risen each year
since 2016. The general manager has proposed a second well on the east
side of the valley, away from the fields, at an estimated cost of 480,000
dollars. The members will vote on the proposal at the next annual meeting.
"""

# name -> (-f file: "doc", a repository path or None; prompt). Runs are
# plain completions (--raw) so that every run decodes -n tokens rather than
# stopping where a base model's reply would; each prompt ends with a lead-in
# to the answer.
TASKS = {
    "summarize": ("doc", "Summary of the document above, in a few sentences:\n"),
    "code-edit": (
        "src/stop_strings.rs",
        "The same file with the struct StopStrings renamed to StopScanner:\n\n",
    ),
    "quote": (
        "doc",
        "The paragraph of the document about the 2019 pipe replacement, quoted word for word:\n\n",
    ),
    "free": (None, "Write a short story about a fox who learns to sail.\n\n"),
    "prose": (
        None,
        "Chapter One\n\nThe old lighthouse keeper had not spoken to anyone in three weeks. "
        "On the morning the storm arrived,",
    ),
}

STATS = re.compile(
    r"generated (\d+) tok, ([0-9.]+) tok/s"
    r"(?: \| spec: drafted (\d+), accepted (\d+) \([0-9]+%\), ([0-9.]+) tok/step)?"
)


def locked_run(cmd, lock_path, env):
    """Runs cmd while holding the CPU lock; returns (stdout, stderr)."""
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if done.returncode != 0:
        sys.exit(f"bench_spec: {' '.join(cmd)} failed:\n{done.stderr}")
    return done.stdout, done.stderr


def parse(stderr):
    found = STATS.findall(stderr)
    if not found:
        sys.exit(f"bench_spec: no stats line in the output:\n{stderr}")
    generated, tok_s, drafted, accepted, per_step = found[-1]
    return {
        "generated": int(generated),
        "tok_s": float(tok_s),
        "drafted": int(drafted or 0),
        "accepted": int(accepted or 0),
        "tok_per_step": float(per_step or 1.0),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", help="pulsar binary (default: the release build)")
    ap.add_argument("-m", "--model", help="model (default: pulsar's default model)")
    ap.add_argument("--runs", type=int, default=3, help="repetitions per configuration")
    ap.add_argument("-n", type=int, default=256, help="tokens to generate")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: " + ", ".join(TASKS))
    ap.add_argument("--temps", default="0,0.7", help="comma-separated temperatures")
    ap.add_argument("--lock", default="/tmp/pulsar-cpu.lock", help="lock file held during each run")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between runs")
    ap.add_argument("--json", help="also write every run's figures to this file")
    args = ap.parse_args()

    binary = args.binary or os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")), "release", "pulsar"
    )
    if not os.access(binary, os.X_OK):
        sys.exit(f"bench_spec: {binary}: no such binary; build with cargo build --release or pass --binary")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in tasks:
        if t not in TASKS:
            sys.exit(f"bench_spec: --tasks: unknown task {t!r}; known: {', '.join(TASKS)}")
    try:
        temps = [float(t) for t in args.temps.split(",")]
    except ValueError:
        sys.exit(f"bench_spec: --temps: expected numbers like 0,0.7, got {args.temps!r}")

    # Removed when the runs end, also on an error or Ctrl-C, so that no
    # pulsar-bench-spec-* folder is left in /tmp.
    with tempfile.TemporaryDirectory(prefix="pulsar-bench-spec-") as workdir:
        doc_path = os.path.join(workdir, "document.txt")
        with open(doc_path, "w") as f:
            f.write(DOCUMENT)
        # The speculation policy measures its own step costs; nothing is fixed.
        env = {k: v for k, v in os.environ.items() if k != "PULSAR_SPEC_STEP_COST"}

        results = {}  # (task, temp, spec) -> list of runs
        for rep in range(args.runs):
            for task in tasks:
                file_arg, prompt = TASKS[task]
                for temp in temps:
                    order = ["off", "ngram"] if rep % 2 == 0 else ["ngram", "off"]
                    for spec in order:
                        cmd = [binary, "run", "--raw", "-p", prompt, "-n", str(args.n),
                               "-t", str(temp), "-s", str(1000 + rep),
                               "--threads", str(args.threads), "--spec", spec]
                        if file_arg == "doc":
                            cmd += ["-f", doc_path]
                        elif file_arg:
                            cmd += ["-f", os.path.join(REPO, file_arg)]
                        if args.model:
                            cmd += ["-m", args.model]
                        out, err = locked_run(cmd, args.lock, env)
                        run = parse(err)
                        run["text_bytes"] = len(out)
                        results.setdefault((task, temp, spec), []).append(run)
                        print(f"run {rep + 1}/{args.runs} {task:10} t={temp:<4} {spec:5} "
                              f"{run['generated']:4} tok {run['tok_s']:7.1f} tok/s "
                              f"drafted {run['drafted']:4} accepted {run['accepted']:4}",
                              file=sys.stderr, flush=True)
                        time.sleep(args.pause)

    print()
    print(f"decode tok/s, median of {args.runs} runs, {args.threads} threads, -n {args.n} "
          "(speedup: median of the per-run ratios)")
    print()
    print("| task | temp | off tok/s | ngram tok/s | speedup | acceptance | tok/step | generated |")
    print("|---|---|---|---|---|---|---|---|")
    for task in tasks:
        for temp in temps:
            off = results[(task, temp, "off")]
            on = results[(task, temp, "ngram")]
            ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(off, on) if a["tok_s"] > 0]
            drafted = sum(r["drafted"] for r in on)
            accepted = sum(r["accepted"] for r in on)
            acc = f"{100.0 * accepted / drafted:.0f}% ({accepted}/{drafted})" if drafted else "no drafts"
            gen = statistics.median(r["generated"] for r in on)
            print(f"| {task} | {temp:g} | {statistics.median(r['tok_s'] for r in off):.1f} "
                  f"| {statistics.median(r['tok_s'] for r in on):.1f} "
                  f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
                  f"| {acc} | {statistics.median(r['tok_per_step'] for r in on):.2f} | {gen:.0f} |")
    if args.json:
        rows = [{"task": k[0], "temp": k[1], "spec": k[2], "runs": v} for k, v in results.items()]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
