"""clover_gguf.tool_calls: tool calls parsed out of generated chat text.

Reference: the Qwen3.5 chat template (/work/shared/data/templates/Qwen3.5-4B.jinja, or its copy
under tests/data/templates). The recorded answers below are the text of an assistant turn with
``tool_calls`` as that template renders it (after ``</think>\\n\\n``, up to ``<|im_end|>``), i.e.
what the model is trained to generate; test_recorded_answers_match_template renders them again.
"""
import json
import pathlib
import random
import re

import pytest

from clover_gguf.tool_calls import ToolCallParser

HERE = pathlib.Path(__file__).resolve()
TEMPLATE_PATHS = (HERE.parents[1] / "data" / "templates" / "Qwen3.5-4B.jinja",
                  HERE.parents[3] / "shared" / "data" / "templates" / "Qwen3.5-4B.jinja")


def fn(name, properties, required=()):
    return {"type": "function", "function": {
        "name": name, "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": properties, "required": list(required)}}}


TOOLS = [
    fn("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"]),
    fn("get_time", {"zone": {"type": "string"}}, ["zone"]),
    fn("write_file", {"path": {"type": "string"}, "text": {"type": "string"}}, ["path", "text"]),
    fn("configure", {
        "count": {"type": "integer"}, "ratio": {"type": "number"}, "verbose": {"type": "boolean"},
        "dry_run": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "level": {"enum": [1, 2, 3]},
        "note": {"type": ["string", "null"]}}),
]

WRITE_TEXT = 'line 1\n"quoted" and \\backslash\\\n\u00e9t\u00e9 \u2603 \U0001F600\n'
CONFIGURE = {"count": 7, "ratio": -2.5, "verbose": True, "dry_run": False,
             "opts": {"a": [1, {"b": None}]}, "tags": ["x", "y"], "unit": "celsius", "level": 2,
             "note": None}
# (content, [(name, arguments)]) -> the template's rendering of that assistant turn
RECORDED = {
    "one": ("", [("get_weather", {"city": "Paris"})],
            '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
            '</function>\n</tool_call>'),
    "two": ("Let me check both.",
            [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "Europe/Rome"})],
            'Let me check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n'
            '</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n'
            '<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Rome\n</parameter>\n'
            '</function>\n</tool_call>'),
    "text": ("", [("write_file", {"path": "a b.txt", "text": WRITE_TEXT})],
             '<tool_call>\n<function=write_file>\n<parameter=path>\na b.txt\n</parameter>\n'
             '<parameter=text>\nline 1\n"quoted" and \\backslash\\\n\u00e9t\u00e9 \u2603 '
             '\U0001F600\n\n</parameter>\n</function>\n</tool_call>'),
    "types": ("", [("configure", CONFIGURE)],
              '<tool_call>\n<function=configure>\n<parameter=count>\n7\n</parameter>\n'
              '<parameter=ratio>\n-2.5\n</parameter>\n<parameter=verbose>\nTrue\n</parameter>\n'
              '<parameter=dry_run>\nFalse\n</parameter>\n<parameter=opts>\n{"a": [1, {"b": null}]}\n'
              '</parameter>\n<parameter=tags>\n["x", "y"]\n</parameter>\n<parameter=unit>\ncelsius\n'
              '</parameter>\n<parameter=level>\n2\n</parameter>\n<parameter=note>\nNone\n'
              '</parameter>\n</function>\n</tool_call>'),
}
ID = re.compile(r"call_[0-9a-f]{24}")


def parse(text, tools=TOOLS, pieces=None):
    """Events of ``text`` pushed whole (or as ``pieces``) then flushed."""
    p = ToolCallParser(tools)
    out = []
    for piece in pieces if pieces is not None else [text]:
        out += p.push(piece)
    return out + p.flush()


def normal(events):
    """Events with adjacent content joined and call ids replaced by ``ID``."""
    out = []
    for kind, value in events:
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + value)
        elif kind == "content":
            out.append((kind, value))
        else:
            assert ID.fullmatch(value["id"]), value["id"]
            out.append((kind, dict(value, id="ID")))
    return out


def calls(events):
    return [(v["function"]["name"], json.loads(v["function"]["arguments"]))
            for k, v in events if k == "tool_call"]


def content(events):
    return "".join(v for k, v in events if k == "content")


def test_recorded_answers_match_template():
    path = next((p for p in TEMPLATE_PATHS if p.exists()), None)
    if path is None:
        pytest.skip("Qwen3.5 template not found")
    from clover_gguf.chat import ChatTemplate
    template = ChatTemplate(path.read_text(encoding="utf-8"))
    for text, tool_calls, answer in RECORDED.values():
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": text, "tool_calls": [
                    {"type": "function", "function": {"name": n, "arguments": a}}
                    for n, a in tool_calls]}]
        rendered = template.render(msgs, tools=TOOLS)
        turn = rendered[rendered.rindex("<|im_start|>assistant\n"):]
        assert turn[turn.index("</think>\n\n") + 10:turn.rindex("<|im_end|>")] == answer


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_recorded_answer_parses_back(key):
    text, tool_calls, answer = RECORDED[key]
    events = parse(answer)
    assert content(events) == text
    assert calls(events) == tool_calls
    for _, call in (e for e in events if e[0] == "tool_call"):
        assert call["type"] == "function" and ID.fullmatch(call["id"])
        assert isinstance(call["function"]["arguments"], str)


def test_several_calls_are_ordered_events_with_text_before():
    events = normal(parse(RECORDED["two"][2]))
    assert [k for k, _ in events] == ["content", "tool_call", "tool_call"]
    assert events[0] == ("content", "Let me check both.")  # whitespace before a call is dropped
    assert json.loads(events[1][1]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_text_between_and_after_calls():
    one = RECORDED["one"][2]
    events = normal(parse(f"A\n{one}\n\nB is next.\n{one}\n\n  \n"))
    assert [(k, v if k == "content" else "call") for k, v in events] == [
        ("content", "A"), ("tool_call", "call"), ("content", "B is next."), ("tool_call", "call")]


def test_string_value_keeps_inner_newlines_quotes_backslashes_unicode():
    (name, args), = calls(parse(RECORDED["text"][2]))
    assert args["text"] == WRITE_TEXT
    call = next(v for k, v in parse(RECORDED["text"][2]) if k == "tool_call")
    assert "\u2603" in call["function"]["arguments"]  # JSON text, not \\u escapes


def test_values_converted_by_schema_type():
    (_, args), = calls(parse(RECORDED["types"][2]))
    assert args == CONFIGURE
    assert type(args["count"]) is int and type(args["ratio"]) is float
    assert type(args["level"]) is int  # enum of integers without a type


@pytest.mark.parametrize("schema, value, expected", [
    ({"type": "integer"}, " 42 ", 42),
    ({"type": "number"}, "3", 3),
    ({"type": "number"}, "1e3", 1000.0),
    ({"type": "boolean"}, "true", True),
    ({"type": "array"}, '[1, "two"]', [1, "two"]),
    ({"type": ["integer", "string"]}, "abc", "abc"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "null", None),
    ({}, "7", "7"),
    (None, "7", "7"),
    ({"type": "string"}, "\n\nkeep\n\n", "\n\nkeep\n\n"),  # only the template's newlines go
])
def test_single_value_conversion(schema, value, expected):
    tools = [fn("f", {"x": schema} if schema is not None else {})]
    text = f"<tool_call>\n<function=f>\n<parameter=x>\n{value}\n</parameter>\n</function>\n</tool_call>"
    (_, args), = calls(parse(text, tools))
    assert args == {"x": expected} and type(args["x"]) is type(expected)


@pytest.mark.parametrize("schema, value", [
    ({"type": "integer"}, "4.5"), ({"type": "boolean"}, "yes"), ({"type": "object"}, "[1]"),
    ({"type": "array"}, "{not json"), ({"type": "number"}, "true"),
])
def test_value_that_does_not_convert_makes_the_call_text(schema, value):
    tools = [fn("f", {"x": schema})]
    text = f"<tool_call>\n<function=f>\n<parameter=x>\n{value}\n</parameter>\n</function>\n</tool_call>"
    assert parse(text, tools) == [("content", text)]


@pytest.mark.parametrize("bad", [
    RECORDED["one"][2].replace("get_weather", "get_wether"),            # undeclared tool
    RECORDED["one"][2].replace("city", "town"),                         # missing required
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nA\n</parameter>\n<parameter=zone>\nB\n"
    "</parameter>\n</function>\n</tool_call>",                          # duplicate parameter
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # missing required
    "<tool_call>\nI will call get_weather now.\n</tool_call>",
])
def test_invalid_call_stays_text_in_order(bad):
    text = f"Before. {bad} After."
    events = parse(text)
    assert calls(events) == []
    assert content(events) == text


def test_unclosed_call_at_the_end_is_text():
    text = "Checking. " + RECORDED["one"][2][:-len("</tool_call>")]
    events = parse(text)
    assert calls(events) == [] and content(events) == text


def test_json_form_of_qwen3_templates():
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n'
            '</tool_call>')
    events = normal(parse(text))
    assert events[0] == ("content", "Sure.")
    assert calls(events) == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_no_parsing(tools):
    p = ToolCallParser(tools)
    answer = RECORDED["two"][2]
    assert p.push(answer[:20]) == [("content", answer[:20])]
    assert p.push(answer[20:]) == [("content", answer[20:])]
    assert p.push("") == [] and p.flush() == []


def test_markup_is_held_back_until_the_call_closes():
    answer = RECORDED["two"][2]
    end = answer.index("</tool_call>") + len("</tool_call>")
    p = ToolCallParser(TOOLS)
    seen = []
    for i, ch in enumerate(answer):
        seen += p.push(ch)
        if i < end - 1:
            assert calls(seen) == [] and "Let me check both.".startswith(content(seen))
    assert calls(seen)[0] == ("get_weather", {"city": "Paris", "days": 3})
    p = ToolCallParser(TOOLS)
    assert p.push("a <tool") == [("content", "a")]
    assert p.push("s> b") == [("content", " <tools> b")]
    assert p.push(" <tool_call>\n<function=nope") == [("content", " <tool_call>"), ("content", "\n<function=nope")]


STREAM_TEXTS = [r[2] for r in RECORDED.values()] + [
    "Hi <tool_call>oops</tool_call> <tool_call>\n<function=nope>\n</function>\n</tool_call> ok <tool_ca",
    "x <tool_call> <tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call> y",
    "A " + RECORDED["one"][2] + "\n\n" + RECORDED["one"][2].replace("Paris", "") + " \n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nP</tool_call",
    "trailing spaces   \n", "</tool_call> <tool_call></tool_call><<tool_call>\n<funct",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_random_splits_give_the_same_events(text):
    whole = normal(parse(text))
    rng = random.Random(1234)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert normal(parse(text, pieces=pieces)) == whole, pieces
    assert normal(parse(text, pieces=list(text))) == whole


def test_ids_unique_and_openai_shaped():
    events = parse(RECORDED["two"][2] * 20)
    ids = [v["id"] for k, v in events if k == "tool_call"]
    assert len(ids) == 40 and len(set(ids)) == 40
    assert all(ID.fullmatch(i) for i in ids)


def test_flush_resets_the_parser():
    p = ToolCallParser(TOOLS)
    assert p.push("x <tool_call>\n<function=get_weather>") == [("content", "x")]
    assert content(p.flush()) == " <tool_call>\n<function=get_weather>"
    assert calls(p.push(RECORDED["one"][2])) == [("get_weather", {"city": "Paris"})]
