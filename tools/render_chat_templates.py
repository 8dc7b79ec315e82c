#!/usr/bin/env python3
"""Writes the expected renderings of tests/data/chat_templates/cases.json.

Each case names a template file of that folder, a conversation and the
settings; its rendering by Python's jinja2, set up the way transformers sets
it up for `apply_chat_template` (trim_blocks, lstrip_blocks, the loop
controls extension, its `tojson`, `raise_exception` and `strftime_now`), goes
to expected/<case>.txt. tests/chat_template_render.rs renders the same cases
with Pulsar (minijinja) and compares byte for byte.

Rerun after changing a case or a template (needs only jinja2 3.x):

    python3 tools/render_chat_templates.py
"""

import json
import pathlib
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

FOLDER = pathlib.Path(__file__).resolve().parent.parent / "tests/data/chat_templates"
BOS, EOS = "<bos>", "<eos>"


def environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def main():
    spec = json.loads((FOLDER / "cases.json").read_text(encoding="utf-8"))
    env = environment()
    out_dir = FOLDER / "expected"
    out_dir.mkdir(exist_ok=True)
    for case in spec["cases"]:
        conversation = spec["conversations"][case["conversation"]]
        messages = conversation["messages"][: case.get("messages")]
        source = (FOLDER / case["template"]).read_text(encoding="utf-8")
        variables = dict(case.get("extra", {}))
        variables.update(
            messages=messages,
            add_generation_prompt=case["add_generation_prompt"],
            bos_token=BOS,
            eos_token=EOS,
        )
        # transformers passes `tools` only when there are some.
        if conversation.get("tools"):
            variables["tools"] = conversation["tools"]
        text = env.from_string(source).render(**variables)
        (out_dir / f"{case['name']}.txt").write_text(text, encoding="utf-8", newline="")
        print(f"{case['name']}: {len(text)} characters", file=sys.stderr)


if __name__ == "__main__":
    main()
