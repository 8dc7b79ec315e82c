"""Drives a running `pulsar serve` with the official `openai` package.

Usage: openai_client_check.py BASE_URL API_KEY   (BASE_URL ends in /v1)

Run by tests/serve.rs against a server it started; exits non-zero with the
failed check's message, prints "all checks passed" otherwise.
"""

import json
import sys
from typing import Literal

import openai
from pydantic import BaseModel, Field

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


models = client.models.list()
model = models.data[0].id
check(model == "gemma-3-270m-q4_k_m", f"models.list names the model ({model})")
check(client.models.retrieve(model).id == model, "models.retrieve finds it by its id")
try:
    client.models.retrieve("no-such-model")
    check(False, "an unknown model id is refused")
except openai.NotFoundError as e:
    check(e.status_code == 404, f"an unknown model id raises NotFoundError: {e}")

question = [{"role": "user", "content": "What is the capital of France?"}]
reply = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=40)
text = reply.choices[0].message.content
check("Paris" in text, f"chat completion: {text!r}")
check(reply.choices[0].finish_reason == "stop", "chat finish_reason stop")
check(reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens, "chat usage adds up")
fingerprint = reply.system_fingerprint
check(
    isinstance(fingerprint, str) and fingerprint.startswith("fp_") and len(fingerprint) == 15,
    f"chat completion has a system_fingerprint ({fingerprint!r})",
)

pieces, usage, roles, chunk_fingerprints = [], None, [], set()
for chunk in client.chat.completions.create(
    model=model, messages=question, temperature=0, max_tokens=40, stream=True,
    stream_options={"include_usage": True},
):
    chunk_fingerprints.add(chunk.system_fingerprint)
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.role:
            roles.append(choice.delta.role)
        if choice.delta.content:
            pieces.append(choice.delta.content)
check("".join(pieces) == text, "streamed chat equals the non-streamed reply")
check(roles == ["assistant"], f"the role comes once, first ({roles})")
check(chunk_fingerprints == {fingerprint}, f"every chunk has the reply's system_fingerprint ({chunk_fingerprints})")
check(usage is not None and usage.completion_tokens == reply.usage.completion_tokens, "streamed usage")

comp = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=12)
check(comp.choices[0].finish_reason in ("length", "stop"), f"completion: {comp.choices[0].text!r}")
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=12, stream=True
    )
    if c.choices
)
check(streamed == comp.choices[0].text, "streamed completion equals the non-streamed one")
batch = client.completions.create(
    model=model, prompt=["The capital of France is", "Once upon a time"], temperature=0, max_tokens=12
)
check(
    [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == comp.choices[0].text,
    "a list of prompts gets one choice each, in order, as when sent alone",
)

def sampled(seed):
    r = client.completions.create(model=model, prompt="Once upon a time", temperature=1.0, seed=seed, max_tokens=24)
    return r.choices[0].text

check(
    client.completions.create(model=model, prompt="Hi", max_tokens=1).system_fingerprint == fingerprint,
    "completions carry the chat's system_fingerprint",
)
a, b, c = sampled(7), sampled(7), sampled(8)
check(a == b, "the same seed gives the same text")
check(a != c, "another seed gives another text")

full = comp.choices[0].text
stop = full.strip().split()[2]
cut = client.completions.create(
    model=model, prompt="The capital of France is", temperature=0, max_tokens=12, stop=[stop]
)
check(cut.choices[0].text == full[: full.index(stop)], f"stop string {stop!r} ends the text, unshown")
check(cut.choices[0].finish_reason == "stop", "stop string finish_reason")

several = client.completions.create(
    model=model, prompt="Once upon a time", temperature=1.0, seed=7, max_tokens=24, n=2
)
check([c.index for c in several.choices] == [0, 1], "n=2 gives choices 0 and 1")
check(several.choices[0].text == a and several.choices[1].text == c, "choice i is seed + i's text")

try:
    client.chat.completions.create(model=model, messages=question, n=17)
    check(False, "n=17 is refused")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "n = 17" in str(e), f"n=17 raises BadRequestError: {e}")

try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    check(False, "a wrong key is refused")
except openai.AuthenticationError as e:
    check(e.status_code == 401, "a wrong key raises AuthenticationError")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favourite_colour: Literal["red", "green", "blue"]


parsed = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Describe a person: name, age and favourite colour."}],
    response_format=Person,
    temperature=0,
    max_tokens=100,
)
person = parsed.choices[0].message.parsed
check(isinstance(person, Person), f"structured output parsed into a Pydantic model: {person!r}")
check(0 <= person.age <= 120 and len(person.name) <= 20, "the parsed values follow the schema")

try:
    client.chat.completions.create(
        model=model,
        messages=question,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
    )
    check(False, "a schema that cannot compile is refused")
except openai.BadRequestError as e:
    check("strnig" in str(e), f"a bad schema raises BadRequestError naming it: {e}")

# Function calling: every call names a given function, and its arguments
# parse and follow that function's schema.
class GetWeather(BaseModel):
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


weather_question = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
weather_tool = openai.pydantic_function_tool(GetWeather, name="get_weather", description="Current weather of a city")
time_tool = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
parsed = client.chat.completions.parse(
    model=model,
    messages=weather_question,
    tools=[weather_tool, time_tool],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    temperature=0,
    max_tokens=60,
)
choice = parsed.choices[0]
calls = choice.message.tool_calls or []
check(choice.finish_reason == "tool_calls", f"a named tool_choice ends with tool_calls ({choice.finish_reason})")
check(
    len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_"),
    f"one call of the named function: {calls}",
)
check(
    isinstance(calls[0].function.parsed_arguments, GetWeather),
    f"its arguments parse into the tool's Pydantic model: {calls[0].function.parsed_arguments!r}",
)
# Streamed: the client's delta shapes, put together as a client does.
stream = client.chat.completions.create(
    model=model,
    messages=weather_question,
    tools=[weather_tool, time_tool],
    tool_choice="required",
    parallel_tool_calls=False,
    temperature=0,
    max_tokens=60,
    stream=True,
)
streamed = {}
finish = None
for chunk in stream:
    for c in chunk.choices:
        for d in c.delta.tool_calls or []:
            entry = streamed.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = c.finish_reason or finish
check(finish == "tool_calls" and len(streamed) == 1, f"a streamed required call: {streamed} ({finish})")
streamed_call = streamed[0]
check(streamed_call["name"] in ("get_weather", "get_time"), f"it names a given function ({streamed_call['name']})")
check(isinstance(json.loads(streamed_call["arguments"]), dict), "its arguments are a JSON object")
# The next turn: the call and its result go back, and the server answers.
followup = client.chat.completions.create(
    model=model,
    messages=weather_question
    + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": streamed_call["id"],
                    "type": "function",
                    "function": {"name": streamed_call["name"], "arguments": streamed_call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": streamed_call["id"], "content": "18 degrees, sunny"},
    ],
    tools=[weather_tool, time_tool],
    parallel_tool_calls=False,
    temperature=0,
    max_tokens=60,
)
answer = followup.choices[0]
check(
    answer.finish_reason in ("stop", "tool_calls")
    and (answer.message.content is not None or len(answer.message.tool_calls or []) == 1),
    f"a turn after a tool result is answered: {answer.message}",
)
try:
    client.chat.completions.create(model=model, messages=weather_question, tools=[time_tool], tool_choice="always")
    check(False, "a wrong tool_choice is refused")
except openai.BadRequestError as e:
    check("tool_choice" in str(e), f"a wrong tool_choice raises BadRequestError naming it: {e}")

# The Responses API: the same reply as the chat completion it amounts to,
# whole and streamed through the client's own stream helper.
response = client.responses.create(model=model, input=question, temperature=0, max_output_tokens=40)
check(response.status == "completed", f"responses.create completes ({response.status})")
check(response.output_text == text, f"responses.create gives the chat's greedy reply: {response.output_text!r}")
with client.responses.stream(model=model, input=question, temperature=0, max_output_tokens=40) as events:
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events.get_final_response()
check(streamed_text == text and final.output_text == text, f"responses.stream: {streamed_text!r}")
check(final.usage.output_tokens == response.usage.output_tokens, "the streamed response's usage")
call_response = client.responses.create(
    model=model,
    input="What is the weather in Paris, in celsius?",
    tools=[{"type": "function", "name": "get_weather", "description": "Current weather of a city",
            "parameters": GetWeather.model_json_schema(), "strict": False}],
    tool_choice="required",
    parallel_tool_calls=False,
    temperature=0,
    max_output_tokens=60,
)
function_calls = [o for o in call_response.output if o.type == "function_call"]
check(
    len(function_calls) == 1 and GetWeather.model_validate_json(function_calls[0].arguments),
    f"a Responses function_call item with valid arguments: {function_calls}",
)
try:
    client.responses.create(model=model, input="hi", previous_response_id="resp_1")
    check(False, "previous_response_id is refused")
except openai.BadRequestError as e:
    check("previous_response_id" in str(e), f"previous_response_id raises BadRequestError: {e}")

# Embeddings: the client asks for base64 unless told otherwise, and decodes it.
texts = ["The cat sat on the mat.", "A kitten rested on the rug.", "Stock prices fell sharply today."]
emb = client.embeddings.create(model=model, input=texts)
vectors = [d.embedding for d in emb.data]
check(
    [d.index for d in emb.data] == [0, 1, 2] and all(len(v) == 640 for v in vectors),
    "embeddings.create gives one 640-value vector per input, in order",
)
check(all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors), "each embedding has length 1")
check(emb.usage.prompt_tokens == emb.usage.total_tokens > 3, f"embedding usage ({emb.usage})")
as_floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
check([d.embedding for d in as_floats.data] == vectors, "float and base64 encodings give the same values")


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b))


check(cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]), "the related sentence is nearer")
try:
    client.embeddings.create(model=model, input="x", dimensions=64)
    check(False, "other dimensions are refused")
except openai.BadRequestError as e:
    check("640" in str(e), f"dimensions other than the model's raise BadRequestError: {e}")

print("all checks passed")
