#!/usr/bin/env python3
"""Structured-output benchmark (issue 16): decode tok/s under a JSON-schema
constraint against the same prompts unconstrained, with speculation off and
with `--spec ngram`; the time to compile each schema; and how many outputs
parse and validate with and without the constraint.

The cases are the (prompt, schema) pairs of tests/data/structured_cases.json,
the list tests/structured_output.rs runs. In each round every case runs the
release binary greedily (`pulsar run -t 0 -n N`) in four timed modes, in an
order that alternates constrained and unconstrained and is reversed every
other round, because the host is shared and noisy; the tables give medians:

    constrained   off    --json-schema SCHEMA --spec off
    unconstrained off    --spec off
    constrained   ngram  --json-schema SCHEMA --spec ngram
    unconstrained ngram  --spec ngram

An unconstrained timed run gets `-n G`, G being the number of tokens of the
constrained reply (greedy, so the same in every run), so that both sides
decode about as many tokens after the same prompt: at most as many, since
the unconstrained reply may end sooner (EOS, or the dialogue format's
"\\nUser:"); the tables give both counts. At -n N the unconstrained side
would decode up to N tokens over a longer context, and with ngram the base
model's habit of repeating a sentence would be drafted well, which says
nothing about the constraint. `--same-n` gives it -n N instead.

Validity is measured once per case, outside the timing: the constrained
reply (the same in every run; the tables say if it was not), and an
unconstrained run at -n N with the schema written into the prompt, as the
test `unconstrained_outputs_are_not_all_valid` does. Outputs are validated
with the `jsonschema` module when it imports; otherwise they only have to
parse, and the report says "parse only".

Binaries that turn speculation off under a constraint print a line saying
so; the table then says "off (binary)" for the constrained ngram runs.

Run time is bounded: cases x (4 x runs + 1) runs, each killed after
--timeout seconds (default 120), which stops the tool with an error naming
the case. A run took 1-2 s on 2 cores (model load and vocabulary index,
then a short decode): the 20 cases took 2.4 minutes with --runs 1 and 6
with --runs 3. The tool takes no lock itself, so that it can run
under one held for its whole run:

    flock /tmp/pulsar-cpu.lock python3 tools/bench_structured.py --runs 3

Standard library only (plus `jsonschema` if present).
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = os.path.join(REPO, "tests", "data", "structured_cases.json")

# The stderr lines of `pulsar run` (src/generate.rs, src/constrain/lookahead.rs,
# src/commands/mod.rs). Searched for, not matched in full, so that words added
# around them do not break the tool.
STATS = re.compile(
    r"\[prompt (\d+) tok, [0-9.]+ tok/s \| generated (\d+) tok, ([0-9.]+) tok/s"
    r"(?: \| spec: drafted (\d+), accepted (\d+) \(\d+%\), ([0-9.]+) tok/step)?\]"
)
COMPILED = re.compile(r"--json-schema constraint:.*\bcompiled in ([0-9.]+) ms")
INDEXED = re.compile(r"--json-schema constraint:.*\bindexed in ([0-9.]+) ms")
MASKS = re.compile(
    r"\[--json-schema: (\d+) masks, ([0-9.]+) ms each to compute, ([0-9.]+) ms each on the decode path\]"
)
SPEC_OFF = re.compile(r"--spec \w+ is off under --json-schema")
LOADED = re.compile(r"loaded (.+?) in [0-9.]+ s \(")

# (constrained, spec) in the order of an even round; odd rounds reverse it.
# Constrained off comes first so that the first round knows G before any
# unconstrained run.
MODES = [(True, "off"), (False, "off"), (True, "ngram"), (False, "ngram")]


def die(msg):
    sys.exit(f"bench_structured: {msg}")


def load_cases(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        die(f"{path}: {e.strerror}")
    except json.JSONDecodeError as e:
        die(f"{path}: not JSON: {e}")
    if not isinstance(data, list) or not data:
        die(f'{path}: expected a non-empty array of {{"prompt": ..., "schema": ...}} objects')
    for i, case in enumerate(data, 1):
        if not isinstance(case, dict):
            die(f"{path}: case {i}: expected an object")
        unknown = sorted(set(case) - {"prompt", "schema"})
        if unknown:
            die(f"{path}: case {i}: unknown field {unknown[0]!r}")
        if not isinstance(case.get("prompt"), str):
            die(f'{path}: case {i}: field "prompt": expected a string')
        if not isinstance(case.get("schema"), dict):
            die(f'{path}: case {i}: field "schema": expected an object')
    return data


def schema_text(schema):
    """The schema as tests/structured_output.rs passes it (serde_json's
    `to_string`: compact, keys in file order, non-ASCII unescaped)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def reject_constant(name):
    # Python's json accepts NaN and Infinity; JSON (and serde_json) does not.
    raise ValueError(f"{name} is not JSON")


def make_validator():
    """(why_invalid(schema, text) -> reason or None, description)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None

    def why_invalid(schema, text):
        try:
            value = json.loads(text.strip(), parse_constant=reject_constant)
        except ValueError:  # JSONDecodeError is a ValueError
            return "not JSON"
        if jsonschema is None:
            return None
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
        return None if error is None else error.message

    if jsonschema is None:
        return why_invalid, "parse only (the jsonschema module is not installed)"
    from importlib.metadata import PackageNotFoundError, version

    try:
        about = f"jsonschema {version('jsonschema')}"
    except PackageNotFoundError:
        about = "jsonschema"
    return why_invalid, f"parse and validate ({about})"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


class Runner:
    def __init__(self, args):
        self.args = args
        # The speculation policy must time its own steps, as in normal use.
        self.env = {k: v for k, v in os.environ.items() if k != "PULSAR_SPEC_STEP_COST"}
        self.model = None

    def run(self, where, n, extra):
        """Runs `pulsar run`; returns (stdout, stderr)."""
        a = self.args
        cmd = [a.pulsar, "run", "-t", "0", "-n", str(n), "--threads", str(a.threads)]
        if a.model:
            cmd += ["-m", a.model]
        cmd += extra
        try:
            done = subprocess.run(
                cmd, capture_output=True, encoding="utf-8", errors="replace",
                env=self.env, timeout=a.timeout,
            )
        except subprocess.TimeoutExpired:
            die(f"{where}: no result after {a.timeout:g} s (--timeout); command: {shlex.join(cmd)}")
        if done.returncode != 0:
            tail = "\n".join(done.stderr.splitlines()[-5:])
            die(f"{where}: exit status {done.returncode}; command: {shlex.join(cmd)}\n{tail}")
        if self.model is None:
            found = LOADED.search(done.stderr)
            self.model = found.group(1) if found else "(no 'loaded' line on stderr)"
        return done.stdout, done.stderr


def parse_run(where, stderr, constrained):
    found = STATS.findall(stderr)
    if not found:
        die(f"{where}: no '[prompt P tok, ... | generated G tok, R tok/s]' line on stderr:\n{stderr}")
    prompt, generated, tok_s, drafted, accepted, per_step = found[-1]
    generated, tok_s = int(generated), float(tok_s)
    run = {
        "prompt_tokens": int(prompt),
        "generated": generated,
        "tok_s": tok_s,
        # The line's rate is generated / decode seconds; invert it to sum time.
        "decode_secs": generated / tok_s if tok_s > 0 else 0.0,
        "spec": None,
    }
    if drafted:
        run["spec"] = {"drafted": int(drafted), "accepted": int(accepted), "per_step": float(per_step)}
    elif SPEC_OFF.search(stderr):
        run["spec"] = "off"
    if constrained:
        compiled, masks = COMPILED.search(stderr), MASKS.search(stderr)
        if not compiled:
            die(f"{where}: no '--json-schema constraint: ... compiled in X ms' line on stderr:\n{stderr}")
        if not masks:
            die(f"{where}: no '[--json-schema: M masks, ...]' line on stderr:\n{stderr}")
        indexed = INDEXED.search(stderr)
        run["compile_ms"] = float(compiled.group(1))
        run["index_ms"] = float(indexed.group(1)) if indexed else None
        run["masks"] = int(masks.group(1))
        run["mask_ms"] = float(masks.group(2))
        run["wait_ms"] = float(masks.group(3))
    return run


def median(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def spec_cell(runs):
    """What speculation did over a mode's runs."""
    if any(r["spec"] == "off" for r in runs):
        return "off (binary)"
    stats = [r["spec"] for r in runs if isinstance(r["spec"], dict)]
    if not stats:
        return "no stats"
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    per_step = statistics.median(s["per_step"] for s in stats)
    return f"{accepted}/{drafted} accepted, {per_step:.2f} tok/step"


def cell_text(text, limit):
    """A reply for a table cell: JSON-quoted (newlines visible), shortened,
    pipes escaped."""
    quoted = json.dumps(text.strip(), ensure_ascii=False)
    if len(quoted) > limit:
        quoted = quoted[: limit - 1] + "…"
    return quoted.replace("|", "\\|")


def short_reason(why, limit=50):
    return why if len(why) <= limit else why[: limit - 1] + "…"


def aggregate(cases_runs):
    """Σ generated / Σ decode seconds over the per-case medians."""
    tokens = sum(median(runs, "generated") for runs in cases_runs)
    secs = sum(median(runs, "decode_secs") for runs in cases_runs)
    return tokens / secs if secs > 0 else None, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pulsar", help="pulsar binary (default: $CARGO_TARGET_DIR or target/, release)")
    ap.add_argument("-m", "--model", help="model (default: pulsar's default model)")
    ap.add_argument("--runs", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("-n", type=int, default=96, help="-n of the constrained and validity runs (default 96)")
    ap.add_argument("--threads", type=int, default=2, help="pulsar --threads (default 2)")
    ap.add_argument("--cases", default=CASES, help="the cases file (default: tests/data/structured_cases.json)")
    ap.add_argument("--same-n", action="store_true",
                    help="unconstrained timed runs get -n N, not the constrained reply's length")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is killed (default 120)")
    ap.add_argument("--json", help="also write every run's figures to this file")
    args = ap.parse_args()
    if args.runs < 1:
        die("--runs: must be at least 1")
    if args.n < 1:
        die("-n: must be at least 1")

    args.pulsar = args.pulsar or os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")), "release", "pulsar"
    )
    if not os.access(args.pulsar, os.X_OK):
        die(f"{args.pulsar}: no such binary; build with cargo build --release or pass --pulsar")
    cases = load_cases(args.cases)
    why_invalid, validation = make_validator()
    runner = Runner(args)
    started = time.monotonic()

    # Validity of the unconstrained model, with the schema in the prompt.
    loose = []
    for i, case in enumerate(cases, 1):
        prompt = f"{case['prompt']} Use this JSON schema: {schema_text(case['schema'])}"
        out, _ = runner.run(f"case {i} (unconstrained, schema in the prompt)", args.n, ["-p", prompt])
        loose.append(out)
        print(f"validity case {i:2}: {len(out)} bytes", file=sys.stderr, flush=True)

    # runs[i][(constrained, spec)] -> list of parsed runs; texts likewise.
    runs = [{mode: [] for mode in MODES} for _ in cases]
    texts = [{mode: [] for mode in MODES} for _ in cases]
    for r in range(args.runs):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for i, case in enumerate(cases, 1):
            for constrained, spec in order:
                label = f"{'constrained' if constrained else 'unconstrained'} {spec}"
                where = f"case {i} ({label}, round {r + 1})"
                extra = ["-p", case["prompt"], "--spec", spec]
                n = args.n
                if constrained:
                    extra += ["--json-schema", schema_text(case["schema"])]
                elif not args.same_n:
                    # Round 0 ran constrained off first; greedy keeps G fixed.
                    n = max(1, runs[i - 1][(True, "off")][0]["generated"])
                out, err = runner.run(where, n, extra)
                run = parse_run(where, err, constrained)
                runs[i - 1][(constrained, spec)].append(run)
                texts[i - 1][(constrained, spec)].append(out)
                print(f"round {r + 1}/{args.runs} case {i:2} {label:19} {run['generated']:3} tok "
                      f"{run['tok_s']:6.1f} tok/s", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started

    rounds = f"{args.runs} round" + ("s" if args.runs != 1 else "")
    built = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(args.pulsar)))
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("PULSAR_"))
    print("# Structured output: JSON schema constraint vs unconstrained")
    print()
    print(f"- command: `{shlex.join([sys.executable] + sys.argv)}`")
    print(f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs")
    print(f"- binary: {args.pulsar} (built {built}); model: {runner.model}")
    print(f"- cases: {args.cases} ({len(cases)}); `-t 0`, `--threads {args.threads}`, {rounds}, "
          f"constrained `-n {args.n}`, unconstrained timed runs "
          + (f"`-n {args.n}`" if args.same_n else "`-n` = the constrained reply's token count"))
    print(f"- validation: {validation}; PULSAR_* environment: {env or 'none'}; took {elapsed / 60:.1f} min")
    print()
    print("tok/s: decode only, median over the rounds; c/u: constrained over unconstrained; "
          "mask ms: per mask, to compute it / waited for on the decode path (medians).")

    for spec in ("off", "ngram"):
        print()
        print(f"## `--spec {spec}`")
        print()
        if spec == "off":
            print("| # | prompt | compile ms | tokens c / u | constrained tok/s | unconstrained tok/s | c/u "
                  "| mask ms compute / decode path |")
            print("|---|---|---|---|---|---|---|---|")
        else:
            print("Spec: accepted/drafted over the rounds and tokens per step (median); "
                  "off (binary): the binary turned speculation off under the constraint.")
            print()
            print("| # | tokens c / u | constrained tok/s | unconstrained tok/s | c/u "
                  "| mask ms compute / decode path | constrained spec | unconstrained spec |")
            print("|---|---|---|---|---|---|---|---|")
        for i, case in enumerate(cases, 1):
            c, u = runs[i - 1][(True, spec)], runs[i - 1][(False, spec)]
            c_rate, u_rate = median(c, "tok_s"), median(u, "tok_s")
            ratio = c_rate / u_rate if u_rate else None
            common = (f"| {median(c, 'generated'):g} / {median(u, 'generated'):g} "
                      f"| {fmt(c_rate)} | {fmt(u_rate)} | {fmt(ratio, 2)} "
                      f"| {fmt(median(c, 'mask_ms'), 2)} / {fmt(median(c, 'wait_ms'), 2)} |")
            if spec == "off":
                prompt = case["prompt"] if len(case["prompt"]) <= 40 else case["prompt"][:39] + "…"
                # Compiling does not depend on --spec: the median of every constrained run.
                compile_ms = median(c + runs[i - 1][(True, "ngram")], "compile_ms")
                print(f"| {i} | {prompt} | {fmt(compile_ms)} {common}")
            else:
                print(f"| {i} {common} {spec_cell(c)} | {spec_cell(u)} |")

    print()
    print("## Validity")
    print()
    print("Constrained: the reply to the prompt under `--json-schema`. Unconstrained: the prompt + "
          '" Use this JSON schema: " + the schema, no constraint, `-n` '
          f"{args.n}. Same text: every constrained run gave one text, and each round's unconstrained "
          "off and ngram runs gave the same text.")
    print()
    print("| # | constrained reply | valid | unconstrained reply | valid | same text |")
    print("|---|---|---|---|---|---|")
    c_valid = u_valid = same = 0
    for i, case in enumerate(cases, 1):
        schema = case["schema"]
        c_texts = [t for mode in MODES if mode[0] for t in texts[i - 1][mode]]
        u_off, u_ngram = texts[i - 1][(False, "off")], texts[i - 1][(False, "ngram")]
        c_why = why_invalid(schema, c_texts[0])
        u_why = why_invalid(schema, loose[i - 1])
        c_valid += c_why is None
        u_valid += u_why is None
        differ = []
        if len(set(c_texts)) > 1:
            differ.append(f"constrained: {len(set(c_texts))} texts")
        if u_off != u_ngram:
            differ.append("unconstrained off != ngram")
        same += not differ
        print(f"| {i} | {cell_text(c_texts[0], 60)} | {'yes' if c_why is None else 'no: ' + short_reason(c_why)} "
              f"| {cell_text(loose[i - 1], 40)} | {'yes' if u_why is None else 'no: ' + short_reason(u_why)} "
              f"| {'; '.join(differ) or 'yes'} |")

    print()
    print("## Summary")
    print()
    print(f"Decode tok/s over the {len(cases)} cases: Σ generated tokens / Σ decode seconds, each case's "
          f"figures the medians of {rounds}. Target (issue 16): constrained ≥ 0.90 × unconstrained.")
    print()
    print("| spec | constrained tok/s | unconstrained tok/s | c/u | per-case c/u median (min-max) "
          "| tokens c / u | target |")
    print("|---|---|---|---|---|---|---|")
    for spec in ("off", "ngram"):
        c_rate, c_tokens = aggregate([cr[(True, spec)] for cr in runs])
        u_rate, u_tokens = aggregate([cr[(False, spec)] for cr in runs])
        ratio = c_rate / u_rate if c_rate and u_rate else None
        per_case = [median(cr[(True, spec)], "tok_s") / median(cr[(False, spec)], "tok_s")
                    for cr in runs if median(cr[(False, spec)], "tok_s")]
        spread = (f"{statistics.median(per_case):.2f} ({min(per_case):.2f}-{max(per_case):.2f})"
                  if per_case else "-")
        verdict = "-" if ratio is None else ("met" if ratio >= 0.90 else "not met")
        print(f"| {spec} | {fmt(c_rate)} | {fmt(u_rate)} | {fmt(ratio, 2)} | {spread} "
              f"| {c_tokens:g} / {u_tokens:g} | {verdict} |")
    print()
    compile_ms = [median(cr[(True, "off")] + cr[(True, "ngram")], "compile_ms") for cr in runs]
    all_compiles = [r["compile_ms"] for cr in runs for mode in MODES if mode[0] for r in cr[mode]]
    index_ms = [r["index_ms"] for cr in runs for mode in MODES if mode[0] for r in cr[mode]
                if r.get("index_ms") is not None]
    print(f"- Schema compile ms (each case's median): median {statistics.median(compile_ms):.1f}, "
          f"max {max(compile_ms):.1f}; largest single run {max(all_compiles):.1f}.")
    if index_ms:
        print(f"- Vocabulary index (once per process, beside the model load): median {statistics.median(index_ms):.0f} ms, "
              f"{min(index_ms):.0f}-{max(index_ms):.0f} ms.")
    for spec in ("off", "ngram"):
        c_runs = [r for cr in runs for r in cr[(True, spec)]]
        print(f"- Masks under `--spec {spec}` (all runs): median {median(c_runs, 'mask_ms'):.2f} ms to compute, "
              f"{median(c_runs, 'wait_ms'):.2f} ms on the decode path, per mask.")
    print(f"- Valid ({validation}): constrained {c_valid}/{len(cases)}, "
          f"unconstrained with the schema in the prompt {u_valid}/{len(cases)}.")
    print(f"- Same text in every run and mode: {same}/{len(cases)} cases.")

    if args.json:
        rows = [{"case": i, "constrained": m[0], "spec": m[1], "runs": cr[m]}
                for i, cr in enumerate(runs, 1) for m in MODES]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
