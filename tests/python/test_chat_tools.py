"""Tool calls through :meth:`Clover.create_chat_completion` and the server: the answer's
tool-call markup (parsed by clover_gguf.tool_calls) becomes OpenAI ``tool_calls``, whole and
streamed alike; ``tool_choice``; assistant ``tool_calls`` with OpenAI's JSON-string arguments and
``tool`` messages rendered through the template.

The answers here are recorded template text fed in place of the model's pieces (a random model
does not write tool calls); the generation itself runs for real (its stats and finish reason)."""
from __future__ import annotations

import json

import pytest

from clover_gguf import Clover

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def llm(make_gguf):
    with Clover(str(make_gguf("f32")), n_ctx=1024, n_threads=1, mode="ar") as c:
        yield c


def _chat(llm, messages=MSGS, **kw):
    """A chat call that ends at once on an end token (finish "stop"), thinking off."""
    bias = {str(t): 100.0 for t in llm.engine.end_ids}
    return llm.create_chat_completion(messages, max_tokens=4, logit_bias=bias, enable_thinking=False, **kw)


def _answer(monkeypatch, llm, text, pieces=7):
    """Make the next call's generation yield ``text`` (in ``pieces`` parts) after generating."""
    real = llm._pieces

    def fake(holder, started):
        for _ in real(holder, started):
            pass
        step = max(1, len(text) // pieces)
        yield from ((text[k:k + step], []) for k in range(0, len(text), step))

    monkeypatch.setattr(llm, "_pieces", fake)


def _stream(llm, **kw):
    """(content, calls assembled from their deltas as an OpenAI client does, finish_reason); each
    call's first delta carries index, id, type and name, the later ones argument text only."""
    content, calls, finish = "", [], None
    for c in _chat(llm, stream=True, **kw):
        d = c["choices"][0]["delta"]
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            assert "<tool_call>" not in content
            if tc["index"] == len(calls):
                assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                calls.append({"index": tc["index"], "id": tc["id"], "type": tc["type"],
                              "function": {"name": tc["function"]["name"], "arguments": ""}})
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
        finish = c["choices"][0]["finish_reason"] or finish
    return content, calls, finish


def test_a_call_becomes_tool_calls_whole_and_streamed(monkeypatch, llm):
    _answer(monkeypatch, llm, "Let me check.\n" + CALL)
    r = _chat(llm, tools=TOOLS)
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert ch["message"]["content"].strip() == "Let me check."
    _answer(monkeypatch, llm, "Let me check.\n" + CALL)
    content, calls, finish = _stream(llm, tools=TOOLS)
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert [c["index"] for c in calls] == [0]
    assert calls[0]["function"] == call["function"]


def test_only_calls_give_null_content_and_several_calls_keep_their_order(monkeypatch, llm):
    second = CALL.replace("Paris", "Oslo").replace("\n3\n", "\n1\n")
    _answer(monkeypatch, llm, CALL + "\n" + second)
    r = _chat(llm, tools=TOOLS)
    m = r["choices"][0]["message"]
    assert m["content"] is None
    assert [json.loads(c["function"]["arguments"])["city"] for c in m["tool_calls"]] == ["Paris", "Oslo"]
    assert len({c["id"] for c in m["tool_calls"]}) == 2


def test_tool_choice_none_and_undeclared_tools_leave_text(monkeypatch, llm):
    _answer(monkeypatch, llm, CALL)
    r = _chat(llm, tools=TOOLS, tool_choice="none")
    assert "tool_calls" not in r["choices"][0]["message"] and "<tool_call>" in r["choices"][0]["message"]["content"]
    assert r["choices"][0]["finish_reason"] != "tool_calls"
    _answer(monkeypatch, llm, CALL.replace("get_weather", "launch_rocket"))
    r = _chat(llm, tools=TOOLS)
    assert "tool_calls" not in r["choices"][0]["message"] and "launch_rocket" in r["choices"][0]["message"]["content"]
    _answer(monkeypatch, llm, CALL)
    r = _chat(llm)  # no tools declared: no parsing
    assert "tool_calls" not in r["choices"][0]["message"]


@pytest.mark.parametrize("tools,choice", [(TOOLS, "any"), (TOOLS, {"type": "function", "function": {"name": "nope"}}),
                                          (TOOLS, {"type": "function"}), (None, "required")])
def test_bad_tool_choices_are_refused_by_name(llm, tools, choice):
    with pytest.raises(ValueError, match="^tool_choice: "):
        _chat(llm, tools=tools, tool_choice=choice)


def test_a_round_trip_renders_openai_shaped_history(llm):
    """call -> tool result -> answer: the assistant's tool_calls carry arguments as a JSON string
    (as OpenAI clients send them back) and the tool message its result; the template renders both."""
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"}]
    prompt = llm.prepare_chat(history, tools=TOOLS)
    text = llm.engine.detokenize(prompt.ids)
    assert "sunny, 21 C" in text and "Paris" in text
    r = llm.create_chat_completion(prompt, max_tokens=4)
    assert r["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("field,value", [("response_format", {"type": "xml"}),
                                         ("response_format", {"type": "json_schema", "json_schema": {}}),
                                         ("response_format", {"type": "json_schema",
                                                              "json_schema": {"schema": {"type": "frob"}}}),
                                         ("grammar", "root ::= (\"a\""), ("grammar", 7)])
def test_bad_constraints_are_refused_by_name(field, value, llm):
    """A response_format or grammar that does not parse or compile: a ValueError naming the field,
    never an unconstrained answer."""
    with pytest.raises(ValueError, match=f"^{field}[.:]"):
        llm.create_chat_completion(MSGS, max_tokens=2, **{field: value})
    with pytest.raises(ValueError, match=f"^{field}[.:]"):
        llm.create_completion("x", max_tokens=2, **{field: value})
    assert _chat(llm, response_format={"type": "text"})["choices"][0]["finish_reason"] == "stop"
