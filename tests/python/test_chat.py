"""clover_gguf.chat: chat templates rendered as transformers' apply_chat_template does.

Reference: transformers 5.23.0 ``PreTrainedTokenizerFast.apply_chat_template(...,
tokenize=False)`` with the same template and special tokens; our text must be identical, byte
for byte. Templates: Qwen3.5's real one (tests/data/templates/Qwen3.5-4B.jinja, a copy of
/work/shared/data/templates/Qwen3.5-4B.jinja, the file tests/reference/checkpoint.py puts into
the test checkpoints) and small templates that exercise one feature each (tojson options,
loop controls, the generation tag, whitespace control, special-token variables).
"""
import datetime
import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from clover_gguf.chat import ChatTemplate, chat_template_from_metadata

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
QWEN35 = (DATA / "templates" / "Qwen3.5-4B.jinja").read_text(encoding="utf-8")
SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def hf_render(template, messages, special=SPECIAL, **kw):
    """transformers' rendering of ``messages`` with ``template`` and special tokens ``special``."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        chat_template=template, **special)
    assert tok.special_tokens_map == special
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def ours(template, messages, special=SPECIAL, **kw):
    return ChatTemplate(template, special).render(messages, **kw)


# ---------------------------------------------------------------------------------------------
# The Qwen3.5 template against transformers
# ---------------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — temperature in °C, <b>no HTML</b> & \"quotes\"",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. München"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "top_k": {"type": "integer"}}},
    },
}
TOOL_TURNS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in München and Paris? Then search news."},
    {"role": "assistant", "content": None, "reasoning_content": "Two cities: call twice.",
     "tool_calls": [
         {"type": "function", "function": {"name": "get_weather",
                                           "arguments": {"city": "München", "unit": "celsius"}}},
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
     ]},
    {"role": "tool", "content": '{"temp": 3, "sky": "Schnee ❄"}'},
    {"role": "tool", "content": '{"temp": 9}'},
    {"role": "assistant", "content": "Let me search too.",
     "tool_calls": [{"name": "search",
                     "arguments": {"query": "news", "top_k": 3,
                                   "filters": {"lang": ["de", "fr"], "safe": True},
                                   "tags": ["a", "ü"]}}]},
    {"role": "tool", "content": "1. Nothing happened."},
]

CASES = {
    "user": ([{"role": "user", "content": "hi"}], {}),
    "user_gen": ([{"role": "user", "content": "hi"}], {"add_generation_prompt": True}),
    "user_gen_no_think": ([{"role": "user", "content": "hi"}],
                          {"add_generation_prompt": True, "enable_thinking": False}),
    "user_gen_think": ([{"role": "user", "content": "hi"}],
                       {"add_generation_prompt": True, "enable_thinking": True}),
    "system_user": ([{"role": "system", "content": "  Be terse.\n"},
                     {"role": "user", "content": "What is 2+2?"}], {"add_generation_prompt": True}),
    "multi_turn": ([
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "\n3+3 is six.\n"},
        {"role": "user", "content": "Thanks!\n\n"},
    ], {"add_generation_prompt": True, "enable_thinking": False}),
    "last_assistant_reasoning": ([
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Rayleigh scattering.",
         "reasoning_content": "Short wavelengths scatter more."},
    ], {}),
    "inline_think": ([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhidden thoughts\n</think>\n\nvisible answer"},
    ], {}),
    "reasoning_alias": ([
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "thinking": "via thinking"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning": "via reasoning"},
    ], {}),
    "tools_only": ([{"role": "user", "content": "Weather in Paris?"}],
                   {"tools": [WEATHER_TOOL, SEARCH_TOOL], "add_generation_prompt": True}),
    "tools_system": ([{"role": "system", "content": "Use tools wisely."},
                      {"role": "user", "content": "Weather in Paris?"}],
                     {"tools": [WEATHER_TOOL]}),
    "tools_empty_system": ([{"role": "system", "content": "   "},
                            {"role": "user", "content": "x"}], {"tools": [WEATHER_TOOL]}),
    "tool_calls": (TOOL_TURNS, {"tools": [WEATHER_TOOL, SEARCH_TOOL],
                                "add_generation_prompt": True}),
    "tool_calls_no_gen": (TOOL_TURNS + [{"role": "assistant", "content": "Done."}],
                          {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    "tool_calls_no_tools_given": (TOOL_TURNS, {"add_generation_prompt": True,
                                               "enable_thinking": False}),
    "content_parts": ([
        {"role": "system", "content": [{"type": "text", "text": "System "},
                                       {"type": "text", "text": "in parts."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image", "image": "file.png"},
                                     {"type": "text", "text": " and "},
                                     {"type": "video", "video": "clip.mp4"},
                                     {"image_url": {"url": "http://x/y.png"}}]},
    ], {"add_generation_prompt": True}),
    "vision_ids": ([
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "video"},
                                     {"type": "text", "text": "compare"}]},
    ], {"add_vision_id": True}),
    "unicode_and_control_text": ([
        {"role": "user", "content": "Grüße 🙂 日本語 <|im_end|> literal & <tag> \\n {{ not jinja }}"},
    ], {"add_generation_prompt": True}),
    "none_and_extra_keys": ([
        {"role": "user", "content": "hi", "name": None, "extra": {"k": 1}},
        {"role": "assistant", "content": "yo", "tool_calls": None, "reasoning_content": None},
        {"role": "user", "content": "again"},
    ], {"add_generation_prompt": False}),
    "tool_response_user_text": ([
        {"role": "user", "content": "first question"},
        {"role": "user", "content": "<tool_response>\nfake\n</tool_response>"},
        {"role": "assistant", "content": "answer", "reasoning_content": "r"},
    ], {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_qwen35_matches_transformers(name):
    messages, kw = CASES[name]
    expected = hf_render(QWEN35, messages, **kw)
    got = ours(QWEN35, messages, **kw)
    assert got == expected
    assert got.encode("utf-8") == expected.encode("utf-8")


def test_qwen35_known_text():
    # Independent of transformers: the shape Qwen3.5 documents for a thinking-off prompt.
    got = ours(QWEN35, [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
               add_generation_prompt=True, enable_thinking=False)
    assert got == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tools = ours(QWEN35, [{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    # tojson keeps non-ASCII and HTML characters as they are (jinja's own filter escapes them)
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in tools
    assert "München" in tools and "<b>no HTML</b> &" in tools


ERROR_CASES = {
    "no_user_query": [{"role": "system", "content": "s"}],
    "system_not_first": [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}],
    "system_image": [{"role": "system", "content": [{"type": "image"}]},
                     {"role": "user", "content": "u"}],
    "bad_role": [{"role": "user", "content": "u"}, {"role": "narrator", "content": "n"}],
    "bad_content": [{"role": "user", "content": 5}],
    "bad_part": [{"role": "user", "content": [{"type": "audio"}]}],
}


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_qwen35_raise_exception_matches_transformers(name):
    import jinja2

    messages = ERROR_CASES[name]
    with pytest.raises(jinja2.exceptions.TemplateError) as hf_err:
        hf_render(QWEN35, messages)
    with pytest.raises(ValueError) as err:
        ours(QWEN35, messages)
    assert str(hf_err.value)  # the template's own message, e.g. "No user query found in messages."
    assert str(err.value) == f"tokenizer.chat_template: {hf_err.value}"


def test_inputs_not_modified():
    messages = [{"role": "user", "content": "q", "name": None},
                {"role": "assistant", "content": "a", "reasoning": "r"}]
    before = json.dumps(messages)
    ours(QWEN35, messages, add_generation_prompt=True)
    assert json.dumps(messages) == before


# ---------------------------------------------------------------------------------------------
# One feature per template, against transformers
# ---------------------------------------------------------------------------------------------

DATA_VAR = {"b": [1, 2.5, None, True], "a": "é<&>'\"", "c": {"z": {}, "y": []}}

SMALL = {
    "tojson_default": ("{{ data | tojson }}", {"data": DATA_VAR}),
    "tojson_indent": ("{{ data | tojson(indent=2) }}", {"data": DATA_VAR}),
    "tojson_options": ("{{ data | tojson(separators=(',', ':'), sort_keys=true) }}",
                       {"data": DATA_VAR}),
    "tojson_ascii": ("{{ data | tojson(ensure_ascii=true) }}", {"data": DATA_VAR}),
    "message_keys": ("{% for m in messages %}{% for k, v in m | items %}{{ k }}={{ v }};"
                     "{% endfor %}{{ '\\n' }}{% endfor %}", {}),
    "loopcontrols": ("{% for m in messages %}{% if m.role == 'assistant' %}{% continue %}{% endif %}"
                     "{% if loop.index > 3 %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}", {}),
    "generation_tag": ("{% for m in messages %}{% if m.role == 'assistant' %}"
                       "{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
                       "{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}", {}),
    "whitespace": ("{% for m in messages %}\n    {% if m.role == 'user' %}\n"
                   "        U: {{ m.content }}\n    {% else %}\n        A: {{ m.content }}\n"
                   "    {% endif %}\n{% endfor %}\n{%- if add_generation_prompt %}\nA:{% endif %}",
                   {"add_generation_prompt": True}),
    "special_tokens": ("{{ bos_token }}{% for m in messages %}{{ m.content + eos_token }}"
                       "{% endfor %}|{{ pad_token }}|{{ unk_token is defined }}", {}),
    "kwarg_overrides_special": ("{{ eos_token }}", {"eos_token": "<END>"}),
    "dict_namespace": ("{% set d = dict(a=1, b=[2]) %}{% set ns = namespace(n=0) %}"
                       "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                       "{{ d | tojson }} {{ ns.n }} {{ dict.fromkeys(['x'], 0) | tojson }}", {}),
    "tools_none_vs_list": ("{{ tools is none }} {{ documents is none }} {{ tools | tojson }}", {}),
    "tools_list": ("{{ tools is none }} {{ tools | tojson }}", {"tools": [SEARCH_TOOL]}),
    "documents": ("{% for d in documents %}{{ d.title }}: {{ d.text }}\n{% endfor %}",
                  {"documents": [{"title": "T1", "text": "one"}, {"title": "T2", "text": "two"}]}),
    "plain_data": ("{{ n }} {{ f }} {{ flag }} {{ arr }} {{ tup }} {{ [n, f, flag] | tojson }}",
                   {"n": np.int64(7), "f": np.float32(0.5), "flag": np.bool_(False),
                    "arr": np.zeros(2), "tup": (1, "x")}),
    "undefined_var": ("[{{ nothing }}][{{ messages[0].missing }}]", {}),
    # what the limits check: loops (and their loop variables), operators, literals, filters
    "loop_variables": ("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}/"
                       "{{ loop.revindex }}/{{ loop.last }}/{{ loop.previtem.role if loop.previtem }};"
                       "{% else %}none{% endfor %}{% for k, v in {'b': 1, 'a': 2} | dictsort %}{{ k }}{{ v }}"
                       "{% endfor %}{% for x in [1, [2, 3]] recursive %}{% if x is iterable %}{{ loop(x) }}"
                       "{% else %}{{ x }}{% endif %}{% endfor %}", {}),
    "operators_literals": ("{{ [1, 'a'] ~ (2, 3) ~ {'k': none} }} {{ '%s-%05d' % ('x', 42) }} "
                           "{{ '%(a)s%(a)s' % {'a': 'y'} }} {{ '{:>5}|{}'.format('a', 1.5) }} {{ 'ab' * 3 }} "
                           "{{ [1] + [2] }} {{ 7 // 2 }} {{ 7 - 9 }} {{ 7 / 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} "
                           "{{ 3 * [0] }} {{ dict(a=[1]) }} {{ dict.fromkeys('ab', 0) }}", {}),
    "filters": ("{{ 'x' | center(7) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'p q r' | wordwrap(3) }}|"
                "{{ ' '.join(['a', 'b']) }}|{{ messages | map(attribute='role') | join(',') }}|"
                "{{ [3, 1, 2] | sort | list }}|{{ [[1], [2]] | sum(start=[]) }}|{{ [1, 2] | sum }}|"
                "{{ 'a-b' | replace('-', '+') }}|{{ '%s!' | format('hi') }}|"
                "{{ [1, 2, 3] | batch(2, 0) | list }}|"
                "{{ [1, 2, 3] | slice(2) | list }}|{{ 'ab'.ljust(4, '.') }}|{{ 'a\tb'.expandtabs(4) }}|"
                "{{ 'Ab Cd' | title }}|{{ ('ff' | int(base=16)) }}|"
                "{{ {'b': [1, {'c': 2}]} | tojson(indent=2) }}", {}),
}
SMALL_MESSAGES = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "q1", "reasoning": "r-user"},
    {"role": "assistant", "content": "a1", "thinking": "t1"},
    {"role": "user", "content": "q2", "name": None},
    {"role": "assistant", "content": "a2", "reasoning_content": "rc2", "thinking": "t2"},
    {"role": "user", "content": "q3"},
]


@pytest.mark.parametrize("name", list(SMALL))
def test_feature_matches_transformers(name):
    template, kw = SMALL[name]
    special = {"bos_token": "<s>", **SPECIAL} if name == "special_tokens" else SPECIAL
    expected = hf_render(template, SMALL_MESSAGES, special=special, **kw)
    assert ours(template, SMALL_MESSAGES, special=special, **kw) == expected


def test_feature_known_text():
    # Independent of transformers, the results the comparisons above rely on.
    t = SMALL["generation_tag"][0]
    assert ours(t, SMALL_MESSAGES[:3]) == "<u>sys</u><u>q1</u><a>a1</a>"
    t = SMALL["whitespace"][0]
    assert ours(t, SMALL_MESSAGES[1:3], add_generation_prompt=True) == "        U: q1\n        A: a1\nA:"
    assert ours(SMALL["tojson_default"][0], [{"role": "user"}], data={"a": "é<"}) == '{"a": "é<"}'
    # reasoning aliases: thinking first (the caller's value if given), then the caller's keys,
    # reasoning_content last unless the caller gave it
    keys = ours(SMALL["message_keys"][0], SMALL_MESSAGES[1:5]).splitlines()
    assert keys == ["thinking=r-user;role=user;content=q1;reasoning=r-user;reasoning_content=r-user;",
                    "thinking=t1;role=assistant;content=a1;reasoning_content=t1;",
                    "role=user;content=q2;",
                    "thinking=t2;role=assistant;content=a2;reasoning_content=rc2;"]


# ---------------------------------------------------------------------------------------------
# Errors and the sandbox
# ---------------------------------------------------------------------------------------------

def test_raise_exception_is_value_error():
    t = ChatTemplate("{% if messages | length > 1 %}{{ raise_exception('Only one message, got '"
                     " ~ messages | length) }}{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: Only one message, got 2$"):
        t.render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])


def test_syntax_error_names_the_key():
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template: syntax error at line 2"):
        ChatTemplate("ok\n{% for m in messages %}{{ m }}")
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template: syntax error"):
        ChatTemplate("{% generation %}unclosed")
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template: expected a str"):
        ChatTemplate(b"{{ x }}")


@pytest.mark.parametrize("messages,field", [
    ("hello", "messages: expected a list"),
    ({"role": "user", "content": "x"}, "messages: expected a list"),
    ([], "messages: empty"),
    ([{"role": "user", "content": "x"}, "text"], r"messages\[1\]: expected a dict, got str"),
    ([{"role": "user"}, {"role": "user"}, {"content": "x"}], r"messages\[2\]\.role: missing"),
    ([{"role": None, "content": "x"}], r"messages\[0\]\.role: missing"),
    ([{"role": "user"}, {"role": 3}], r"messages\[1\]\.role: expected a str, got 3"),
])
def test_bad_messages(messages, field):
    with pytest.raises(ValueError, match=field):
        ChatTemplate(QWEN35).render(messages)


def test_bad_tools_and_documents():
    t = ChatTemplate(QWEN35)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match=r"^tools: expected a list"):
        t.render(msgs, tools=WEATHER_TOOL)
    with pytest.raises(ValueError, match=r"^tools\[1\]: expected a dict"):
        t.render(msgs, tools=[WEATHER_TOOL, len])
    with pytest.raises(ValueError, match=r"^documents\[0\]: expected a dict"):
        t.render(msgs, documents=["text"])


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_secret=1) %}",                # underscore attribute on a namespace
    "{% set ns = namespace(a=1) %}{% set ns._b = 2 %}",
    "{{ messages.append(1) }}",                          # immutable sandbox: no mutation
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ ''.__class__.__mro__ }}",                        # no route to Python internals
])
def test_sandbox_refusals_are_value_errors(template):
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: "):
        ChatTemplate(template).render([{"role": "user", "content": "x"}])


TEMPLATE_ERRORS = {  # name -> (a template raising it while rendering, the message it gives)
    "ZeroDivisionError": ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    "TypeError": ("{{ [1, 'a'] | sort }}",
                  "TypeError: '<' not supported between instances of 'str' and 'int'"),
    "OverflowError": ("{% for i in range(100001) %}{% endfor %}",
                      "OverflowError: Range too big. The sandbox blocks ranges larger than "
                      "MAX_RANGE (100000)."),
    "KeyError": ("{{ '%(a)s' % {} }}", "KeyError: 'a'"),
    "AttributeError": ("{{ [1] | dictsort }}",
                       "AttributeError: 'list' object has no attribute 'items'"),
    "IndexError": ("{{ '{0}'.format() }}", "IndexError: tuple index out of range"),
    "ValueError": ("{{ 'abc'.index('z') }}", "ValueError: substring not found"),
    "LookupError": ("{{ 'x'.encode('nope') }}", "LookupError: unknown encoding: nope"),
}


@pytest.mark.parametrize("name", list(TEMPLATE_ERRORS))
def test_exceptions_while_rendering_are_value_errors(name):
    template, message = TEMPLATE_ERRORS[name]
    t = ChatTemplate(template)
    with pytest.raises(ValueError) as info:
        t.render([{"role": "user", "content": "x"}])
    assert str(info.value) == f"tokenizer.chat_template: {message}"
    assert type(info.value.__cause__).__name__ == name
    # the caller's own errors are checked first and keep naming the argument
    with pytest.raises(ValueError, match=r"^messages\[1\]\.role: missing$"):
        t.render([{"role": "user"}, {"content": "x"}])


def test_strftime_now():
    t = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.date.today().isoformat()
    got = t.render([{"role": "user"}])
    assert got in (before, datetime.date.today().isoformat())


def test_chat_template_from_metadata():
    md = {"tokenizer.chat_template": "{{ 1 }}", "tokenizer.chat_template.tool_use": "{{ 2 }}",
          "tokenizer.chat_template.bad": 5}
    assert chat_template_from_metadata(md) == "{{ 1 }}"
    assert chat_template_from_metadata(md, "tool_use") == "{{ 2 }}"
    assert ChatTemplate.from_metadata(md, "tool_use").render([{"role": "user"}]) == "2"
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: missing"):
        chat_template_from_metadata({})
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template\.bad: expected a str"):
        chat_template_from_metadata(md, "bad")


def test_import_does_not_load_torch_or_transformers():
    code = ("import sys, clover_gguf, clover_gguf.chat; "
            "print(sorted(m for m in ('torch', 'transformers', 'clover_gguf._ffi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# From a GGUF: the tokenizer's template and special tokens, and Model.apply_chat_template
# ---------------------------------------------------------------------------------------------

def test_for_tokenizer_from_vocab_gguf():
    # llama.cpp's Qwen vocab GGUF carries Qwen2's ChatML template and bos = eos = pad =
    # <|endoftext|>; rendered with those special tokens, as transformers would.
    pytest.importorskip("clover_gguf._ffi", exc_type=ImportError)
    from clover_gguf.tokenizer import CloverTokenizer

    tok = CloverTokenizer.from_gguf(DATA / "qwen35-vocab" / "ggml-vocab-qwen35.gguf")
    t = ChatTemplate.for_tokenizer(tok)
    assert t.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                "pad_token": "<|endoftext|>"}
    msgs = CASES["multi_turn"][0]
    got = t.render(msgs, add_generation_prompt=True)
    assert got == hf_render(tok.chat_template, msgs, special=t.special_tokens,
                            add_generation_prompt=True)
    assert got.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: missing"):
        ChatTemplate.for_tokenizer(tok)


def test_model_apply_chat_template(make_gguf, make_ckpt):
    # The converter copies the checkpoint's template (Qwen3.5's) into the GGUF; the Model's
    # rendering must equal transformers' AutoTokenizer on the checkpoint itself.
    pytest.importorskip("clover_gguf._ffi", exc_type=ImportError)
    transformers = pytest.importorskip("transformers")
    from clover_gguf import Model

    hf = transformers.AutoTokenizer.from_pretrained(str(make_ckpt()))
    with Model(make_gguf("f32"), n_ctx=64, n_threads=1) as m:
        assert m.tokenizer.chat_template == hf.chat_template
        for name in ("user_gen_no_think", "tool_calls", "multi_turn"):
            msgs, kw = CASES[name]
            kw = {k: v for k, v in kw.items() if k != "add_generation_prompt"}
            expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
            assert m.apply_chat_template(msgs, **kw) == expected
        assert m.apply_chat_template([{"role": "user", "content": "x"}],
                                     add_generation_prompt=False).endswith("<|im_end|>\n")
        with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
            m.apply_chat_template([{"content": "x"}])
        m.tokenizer.chat_template, m._chat = None, None
        with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: missing"):
            m.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------
# Limits: a template written by a stranger cannot hang a render or build a huge value. Small
# limits keep these fast; every size below is one the template would build unchecked.
# ---------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "x"}]

LOOPS = {
    "nested_range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "over_string": "{% set s = 'ab' * 50000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "over_list": "{% set l = range(100000) | list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
    "macro_calls": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                   "{{ f(60) }}",
    "recursive_loop": "{% for x in [1, 1] recursive %}{% if loop.depth < 60 %}{{ loop([1, 1]) }}{% endif %}"
                      "{% endfor %}",
    # one filter call looping in Python over a 4 MB text (about 2 s when not interrupted)
    "inside_filter": "{{ ('a b ' * 1000000) | wordwrap(1) | length }}",
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_loops_stop_at_max_seconds(name):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: rendering took longer than "
                                         r"max_seconds=0\.2$"):
        ChatTemplate(LOOPS[name], max_seconds=0.2).render(USER)
    assert time.monotonic() - t0 < 10  # generous bound: a 0.2 s limit on a loaded machine


def test_recursion_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: recursion too deep"):
        ChatTemplate("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").render(USER)


def doubling(step, n=27):
    """A template doubling a value ``n`` times (2**27 = 128M elements if unchecked)."""
    return ("{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x', l=[1]) %}"
            f"{{% for i in range({n}) %}}{step}{{% endfor %}}{{{{ ns.s | length }}}}")


AMPLIFIERS = {
    "str_times": "{{ 'x' * 10**8 }}",
    "list_times": "{{ ([0] * 2 * 10**7) | length }}",
    "plus": doubling("{% set ns.s = ns.s + ns.s %}"),
    "tilde": doubling("{% set ns.s = ns.s ~ ns.s %}"),
    "list_plus": doubling("{% set ns.l = ns.l + ns.l %}", 24),
    "macro_output": doubling("{% set ns.s = twice(ns.s) %}"),
    "set_block": doubling("{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}"),
    "percent_star": "{{ '%*s' % (10**8, 'x') }}",
    "percent_width": "{{ '%100000000s' % 'x' }}",
    "str_format": "{{ '{:>100000000}'.format('x') }}",
    "str_format_repeat": "{{ ('{0}' * 10000).format('x' * 10000) }}",
    "filter_format": "{{ '%100000000s' | format('x') }}",
    "filter_center": "{{ 'x' | center(10**8) }}",
    "filter_center_constant": "{{ 'x' | center(100000000) }}",  # jinja folds constants at compile
    "filter_indent": "{{ 'a\nb' | indent(10**8) }}",
    "filter_wordwrap": "{{ ('a ' * 1000) | wordwrap(1, wrapstring='x' * 100000) }}",
    "filter_replace": "{{ ('a' * 10000) | replace('a', 'b' * 10000) }}",
    "filter_join": "{{ range(10000) | join('x' * 10000) }}",
    "filter_tojson_indent": "{{ [[1]] | tojson(indent=10**8) }}",
    "filter_batch": "{{ [1] | batch(10**8, 'x') | list | length }}",
    "filter_slice": "{{ [1] | slice(10**6) | list | length }}",
    "str_ljust": "{{ 'x'.ljust(10**8) }}",
    "str_zfill": "{{ 'x'.zfill(10**8) }}",
    "str_expandtabs": "{{ ('\t' * 100).expandtabs(10**6) }}",
    "str_replace": "{{ ('a' * 10000).replace('a', 'b' * 10000) }}",
    "str_join": "{{ ('x' * 10000).join(range(10000) | map('string')) }}",
    "str_translate": "{{ ('a' * 10000).translate({97: 'b' * 10000}) }}",
    "int_to_bytes": "{{ (1).to_bytes(10**8, 'big') | length }}",
    "lipsum": "{{ lipsum(1000, false, 1000, 1000) | length }}",
    "output": "{% for i in range(10000) %}{{ 'x' * 10000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(AMPLIFIERS))
def test_amplifiers_refused_before_allocating(name):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: .* is longer than "
                                             r"max_chars=10000 \(about \d+ chars\)$"):
            ChatTemplate(AMPLIFIERS[name], max_chars=10000).render(USER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20  # each would allocate 100 MB or more if it ran


INTEGERS = {  # each takes seconds to minutes unchecked, or makes later arithmetic quadratic
    "power": "{{ 7 ** 100000000 }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                "{% endfor %}",
    "doubling": "{% set ns = namespace(x=3) %}{% for i in range(20000) %}{% set ns.x = ns.x + ns.x %}"
                "{% endfor %}",
    "int_filter_base16": "{% set x = ('f' * 1000000) | int(base=16) %}{{ x // (x // 3) }}",
    "from_bytes": "{% set x = (1).from_bytes('x'.encode() * 1000000, 'big') %}{{ x % (x // 7) }}",
}


@pytest.mark.parametrize("name", list(INTEGERS))
def test_integers_stay_small(name):
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: the result of .* is an integer "
                                         r"of about \d+ bits, over the 16384-bit limit$"):
        ChatTemplate(INTEGERS[name], max_seconds=5).render(USER)
    assert ChatTemplate("{{ 2 ** 64 * 3 }}").render(USER) == str(2 ** 64 * 3)


def test_templates_nested_too_deeply_to_compile():
    for template in ("{{ " + "[" * 3000 + "]" * 3000 + " }}",
                     "{% for a in b %}" * 25 + "{% endfor %}" * 25):
        with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: nested too deeply to compile"):
            ChatTemplate(template)


SHARED = {  # values holding one value twice, nested: 2**100 references in a few KB
    "list_literal": "{% set ns = namespace(v=['x']) %}{% for i in range(100) %}{% set ns.v = [ns.v, ns.v] %}"
                    "{% endfor %}{{ ns.v }}",
    "compare": "{% set ns = namespace(a=['x'], b=['x']) %}{% for i in range(100) %}"
               "{% set ns.a, ns.b = [ns.a, ns.b], [ns.b, ns.a] %}{% endfor %}{{ ns.a == ns.b }}",
    "dict_global": "{% set ns = namespace(v={}) %}{% for i in range(100) %}"
                   "{% set ns.v = dict(a=ns.v, b=ns.v) %}{% endfor %}{{ ns.v | length }}",
    "fromkeys": "{% set ns = namespace(v={}) %}{% for i in range(100) %}"
                "{% set ns.v = dict.fromkeys('ab', ns.v) %}{% endfor %}{{ ns.v | tojson }}",
    "namespaces_linked_later": "{% set a = namespace(v=0) %}{% set ns = namespace(n=a) %}"
                               "{% for i in range(100) %}{% set b = namespace(v=0) %}{% set cur = ns.n %}"
                               "{% set cur.v = [b, b] %}{% set ns.n = b %}{% endfor %}{{ a }}",
}


@pytest.mark.parametrize("name", list(SHARED))
def test_shared_values_measured_with_every_reference(name):
    with pytest.raises(ValueError, match=r"^tokenizer\.chat_template: .* is longer than max_chars=10000 "):
        ChatTemplate(SHARED[name], max_chars=10000, max_seconds=5).render(USER)


def nested(levels):
    v = "x"
    for _ in range(levels // 2):
        v = {"k": [v]}
    return v


def test_deep_inputs_refused_naming_the_argument():
    t = ChatTemplate("{{ messages | length }}")
    msgs = USER * 3 + [{"role": "user", "content": nested(1000)}]
    with pytest.raises(ValueError, match=r"^messages\[3\]\.content: nested deeper than 100 levels$"):
        t.render(msgs)
    with pytest.raises(ValueError, match=r"^tools: nested deeper than 100 levels$"):
        t.render(USER, tools=[nested(1000)])
    with pytest.raises(ValueError, match=r"^documents: nested deeper than 100 levels$"):
        t.render(USER, documents=[nested(1000)])
    with pytest.raises(ValueError, match=r"^schema: nested deeper than 100 levels$"):
        t.render(USER, schema=nested(1000))
    assert t.render(USER, schema=nested(100)) == "1"  # 100 levels: the limit itself


def test_reserved_variables_refused():
    from clover_gguf.chat import RESERVED_VARIABLES, check_template_kwargs

    t = ChatTemplate("{{ messages | length }}")
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.messages: set from the request, not a "
                                         r"template variable a caller may override$"):
        t.render(USER, **{"messages": USER * 2})
    assert t.render(USER, **{"tools": None}) == "1"  # a keyword of render itself
    for name in RESERVED_VARIABLES:
        with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{name}: set from the request"):
            check_template_kwargs({"enable_thinking": False, name: 1})
    check_template_kwargs({"enable_thinking": False})


def test_limits_are_configurable():
    from clover_gguf.chat import DEFAULT_MAX_CHARS, DEFAULT_MAX_DEPTH, DEFAULT_MAX_SECONDS

    t = ChatTemplate("x")
    assert (t.max_seconds, t.max_chars, t.max_depth) == (DEFAULT_MAX_SECONDS, DEFAULT_MAX_CHARS,
                                                         DEFAULT_MAX_DEPTH)
    t = ChatTemplate("{{ 'x' * n }}{{ v | length }}", max_chars=100, max_seconds=3, max_depth=3)
    assert (t.max_seconds, t.max_chars, t.max_depth) == (3, 100, 3)
    assert t.render(USER, n=99, v=[[[1]]]) == "x" * 99 + "1"
    with pytest.raises(ValueError, match=r"the result of '\*' is longer than max_chars=100 \(about 101 "):
        t.render(USER, n=101, v=[])
    with pytest.raises(ValueError, match=r"^v: nested deeper than 3 levels$"):
        t.render(USER, n=1, v=[[[[1]]]])
    assert ChatTemplate("{{ 'x' * 101 }}", max_chars=101).render(USER) == "x" * 101
    loop = LOOPS["nested_range"]
    with pytest.raises(ValueError, match=r"max_seconds=0\.05$"):
        ChatTemplate(loop, max_seconds=0.05).render(USER)
    md = {"tokenizer.chat_template": "{{ 'x' * 20 }}"}
    with pytest.raises(ValueError, match=r"max_chars=10 "):
        ChatTemplate.from_metadata(md, max_chars=10).render(USER)
    for bad in ({"max_seconds": 0}, {"max_chars": -1}, {"max_depth": 1.5}, {"max_chars": True},
                {"max_seconds": "5"}):
        with pytest.raises(ValueError, match=rf"^{next(iter(bad))}: expected a positive number"):
            ChatTemplate("x", **bad)


def test_trace_function_restored():
    # filters that loop in Python run under a trace function of their own; the caller's
    # (a debugger's, a coverage tool's) is back afterwards
    def tracer(frame, event, arg):
        return None

    outer = sys.gettrace()
    sys.settrace(tracer)
    try:
        assert ChatTemplate("{{ 'a b c' | wordwrap(2) }}").render(USER) == "a\nb\nc"
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(outer)
