"""What an agent asks of ``clover-gguf serve``, through the official ``openai`` client, in all three
decoding modes, on the embedded model and on a random model with the real vocabulary (248,320
ids): a tool call round trip (call -> tool result -> answer), whole and streamed; ``tool_choice``
required and named giving a valid call for every seed; ``json_schema`` answers that parse and
validate for many prompts and three schemas; logprobs shapes and values.

The counts (20 seeds for the forced calls, 20 prompts x 3 schemas per mode) run on the embedded
model; on the real-vocabulary model, whose passes are slower, 4 of each in the default suite and
all 20 with ``CLOVER_FULL_AGENT_TESTS=1``.

Random and tiny models write no tool calls or JSON on their own: every valid call and object
here comes from constrained decoding. The schemas bound their strings, numbers and arrays so that
a random model ends within max_tokens (the check is that each finished answer validates and that
every answer finishes).
"""
from __future__ import annotations

import json
import math
import os
import sys

import jsonschema
import pytest

openai = pytest.importorskip("openai")

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from serverproc import HANG, serving  # noqa: E402

import clover_gguf  # noqa: E402

KEY = "agent-key"
MODES = ("ar", "spec", "diffusion")
FAST = {"block_size": 8}  # spec and diffusion blocks: small, quick passes at the real vocabulary
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99},
        "exact": {"type": "boolean"}},
        "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False},
        "active": {"type": "boolean"}},
        "required": ["user", "active"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "mood": {"enum": ["happy", "sad", "calm"]},
        "level": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["mood", "level"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "tag": {"type": "string", "maxLength": 4}},
            "required": ["id", "tag"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
}
PROMPTS = [f"Describe item {k} as JSON." for k in range(20)]
FULL = os.environ.get("CLOVER_FULL_AGENT_TESTS") == "1"


@pytest.fixture(scope="module", params=["embedded", "real-vocab"])
def served(request, make_gguf, tmp_path_factory):
    """(openai client of a server on the model, how many seeds / prompts the counted tests use)."""
    embedded = request.param == "embedded"
    path = clover_gguf.DEFAULT_MODEL if embedded else str(make_gguf("q8_0", vocab_size=248320))
    log = tmp_path_factory.mktemp("server") / "server.log"
    with serving(path, ["--api-key", KEY, "-c", 2048, "-t", 2], log) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=HANG, max_retries=0), \
            20 if embedded or FULL else 4


@pytest.fixture(scope="module")
def client(served):
    return served[0]


def _model(client) -> str:
    return client.models.list().data[0].id


def _chat(client, messages, mode, **kw):
    return client.chat.completions.create(model=_model(client), messages=messages, max_tokens=kw.pop("max_tokens", 160),
                                          extra_body={"mode": mode, **FAST, **kw.pop("extra_body", {})}, **kw)


def _check_call(call, names=("get_weather", "add")):
    assert call.type == "function" and call.id.startswith("call_")
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])


def _stream_chat(client, messages, mode, **kw):
    """(content, tool calls as {index: {id, name, arguments}}, finish_reason) of a streamed answer."""
    content, calls, finish = "", {}, None
    for ch in _chat(client, messages, mode, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        assert "<tool_call>" not in content and "<function=" not in content
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] = (tc.function.name if tc.function else None) or c["name"]
            c["arguments"] += (tc.function.arguments if tc.function else None) or ""
        finish = ch.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("mode", MODES)
def test_tool_round_trip(client, mode):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = _chat(client, msgs, mode, tools=TOOLS, tool_choice="required", seed=1, temperature=0.7)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    _check_call(call)
    content, calls, finish = _stream_chat(client, msgs, mode, tools=TOOLS, tool_choice="required", seed=1,
                                          temperature=0.7)
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (call.function.name,
                                                                     json.loads(call.function.arguments))
    history = msgs + [ch.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = _chat(client, history, mode, tools=TOOLS, max_tokens=24, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result were rendered
    text, _, finish = _stream_chat(client, history, mode, tools=TOOLS, tool_choice="none", max_tokens=24,
                                   temperature=0)
    assert finish in ("stop", "length")


@pytest.mark.parametrize("mode", MODES)
def test_required_and_named_tool_choice_give_a_valid_call_every_time(served, mode):
    client, n = served
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(n):
        msgs = [{"role": "user", "content": f"Request number {seed}."}]
        for choice, names in (("required", ("get_weather", "add")), (named, ("add",))):
            r = _chat(client, msgs, mode, tools=TOOLS, tool_choice=choice, seed=seed, temperature=1.0)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            (call,) = r.choices[0].message.tool_calls
            _check_call(call, names)


@pytest.mark.parametrize("mode", MODES)
def test_json_schema_answers_validate(served, mode):
    client, n = served
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        for k, prompt in enumerate(PROMPTS[:n]):
            r = _chat(client, [{"role": "user", "content": prompt}], mode, response_format=fmt, seed=k,
                      temperature=0.0 if k == 0 else 1.0)
            assert r.choices[0].finish_reason == "stop", r.choices[0]
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_streamed(client):
    for mode in MODES:
        parts = [ch.choices[0].delta.content or "" for ch in
                 _chat(client, [{"role": "user", "content": "JSON please"}], mode, stream=True,
                       response_format={"type": "json_object"}, max_tokens=200) if ch.choices]
        assert isinstance(json.loads("".join(parts)), dict)


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_shapes_and_values(client, mode):
    r = _chat(client, [{"role": "user", "content": "hi"}], mode, logprobs=True, top_logprobs=3, max_tokens=12,
              temperature=0, extra_body={"presence_penalty": 0.0, "repeat_penalty": 1.0})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3 and bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        # greedy without penalties: the chosen token is the row's most likely
        assert e.top_logprobs[0].token == e.token and math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-6)
    c = client.completions.create(model=_model(client), prompt="Hello", max_tokens=6, logprobs=2,
                                  extra_body={"mode": mode, **FAST})
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    streamed = [t for ch in client.completions.create(model=_model(client), prompt="Hello", max_tokens=6,
                                                      logprobs=2, stream=True, extra_body={"mode": mode, **FAST})
                for t in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs
