#!/usr/bin/env python3
"""Measures how often chat replies repeat themselves under sampling settings.

Chats with the model (default: the default model) through the real binary:
every question is asked in a fresh conversation (`chat -p`), for
several seeds, once per setting. A reply "repeats" when one of its lines, or
one of its sentences, comes twice; it "runs to -n" when only the token limit
ended it. Used to choose chat's default repeat penalty and min-p.

    python3 tools/chat_defaults.py --seeds 4 -n 128 \
        --setting "--repeat-penalty 1.0" --setting "--repeat-penalty 1.1"
"""

import argparse
import re
import shlex
import subprocess
import sys

QUESTIONS = [
    "Hello! Who are you?",
    "What is the capital of France?",
    "Tell me a joke about cats.",
    "How many legs does a spider have?",
    "Write a short poem about the sea.",
    "What should I cook for dinner tonight?",
    "Explain what a computer is.",
    "What is your favourite book and why?",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
]


def repeats(reply: str) -> bool:
    lines = [l.strip() for l in reply.splitlines() if l.strip()]
    sentences = [s.strip() for s in re.split(r"[.!?]\s+", reply) if len(s.strip()) > 12]
    return len(set(lines)) < len(lines) or len(set(sentences)) < len(sentences)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="target/release/pulsar")
    ap.add_argument("-m", "--model", help="model path (default: pulsar's default model)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--setting", action="append", default=[],
                    help="extra chat flags for one setting (repeatable)")
    args = ap.parse_args()
    print(f"{len(QUESTIONS)} questions x {args.seeds} seeds, -n {args.n}")
    print("| setting | format | replies | repeating | run to -n | mean tokens |")
    print("|---|---|---|---|---|---|")
    for setting in args.setting or [""]:
        total = repeating = to_limit = tokens = 0
        formats = set()
        for seed in range(1, args.seeds + 1):
            for question in QUESTIONS:
                # `chat -p` is one fresh conversation of one turn.
                cmd = [args.binary, "chat", "-p", question, "-n", str(args.n), "-s", str(seed)]
                cmd += shlex.split(setting)
                if args.model:
                    cmd += ["-m", args.model]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                n = int(re.findall(r"generated (\d+) tok", out.stderr)[-1])
                formats.update(re.findall(r'chat format "([^"]+)"', out.stderr))
                total += 1
                tokens += n
                repeating += repeats(out.stdout)
                to_limit += n >= args.n
        print(f"| `{setting or '(defaults)'}` | {', '.join(sorted(formats))} | {total} | "
              f"{repeating} | {to_limit} | "
              f"{tokens / max(total, 1):.1f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
