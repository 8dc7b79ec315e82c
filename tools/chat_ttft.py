#!/usr/bin/env python3
"""Time to first token of `pulsar chat`: the time from writing a line to the
chat's stdin until the first byte of the reply on its stdout, per turn.

    python3 tools/chat_ttft.py [--engine reference] [-- extra pulsar flags]
"""
import argparse
import os
import select
import subprocess
import time

MESSAGES = ["Once upon a time there was a dragon.", "What is the capital of France?"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="reference")
    ap.add_argument("--binary", default="target/release/pulsar")
    ap.add_argument("extra", nargs="*", help="more flags for pulsar chat")
    args = ap.parse_args()
    cmd = [args.binary, "chat", "--engine", args.engine, "-t", "0", "-n", "4", *args.extra]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    start = time.monotonic()
    err = b""
    # The load line says the model is ready.
    while b"loaded" not in err:
        chunk = os.read(p.stderr.fileno(), 4096)
        if not chunk:
            raise SystemExit("pulsar ended before loading: " + err.decode(errors="replace"))
        err += chunk
    print(f"load: {time.monotonic() - start:.2f} s")
    for turn, message in enumerate(MESSAGES, 1):
        sent = time.monotonic()
        p.stdin.write((message + "\n").encode())
        p.stdin.flush()
        os.read(p.stdout.fileno(), 1)
        print(f"turn {turn}: first reply byte {1000 * (time.monotonic() - sent):.0f} ms after the line")
        # Drain the reply until this turn's stats line, so the next turn's
        # first byte is really its own.
        while err.count(b"[prompt") < turn:
            ready, _, _ = select.select([p.stdout, p.stderr], [], [])
            for f in ready:
                chunk = os.read(f.fileno(), 4096)
                if f is p.stderr:
                    err += chunk
        while select.select([p.stdout], [], [], 0)[0]:
            if not os.read(p.stdout.fileno(), 4096):
                break
    p.stdin.close()
    p.wait()
    print(err.decode(errors="replace").strip())


if __name__ == "__main__":
    main()
