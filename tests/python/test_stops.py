"""Stop strings and streaming (clover-spec 5.2): ``stop=`` of ``generate``,
``generate_stream``, ``generate_tokens`` and ``clover-gguf run --stop``.

References: the same model's output without stop strings (greedy, so a run with a stop string
must be that text cut right before the first occurrence), a brute-force character-by-character
definition of the match for :class:`clover_gguf.stops.StopFilter`, and the API for the CLI.
Stop strings are chosen from the reference output so that they straddle a diffusion block
boundary (block_size 8: generated tokens 8k-1 | 8k) or two streamed pieces.
"""
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

import clover_gguf
from clover_gguf import Model
from clover_gguf.stops import MAX_STOP_STRINGS, StopFilter, check_stop

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"
KW = dict(max_tokens=48, block_size=8, threshold=0.5)
MODES = ["diffusion", "ar"]
NEVER = "\x01never\x02"


@pytest.fixture(scope="module")
def gguf_path(make_gguf):
    return make_gguf("f32")


@pytest.fixture(scope="module")
def model(gguf_path):
    with Model(gguf_path, n_ctx=512, n_threads=2) as m:
        yield m


@pytest.fixture(scope="module")
def base(model):
    """mode -> dict(text, pieces, ids, stats) of the run without stop strings."""
    out = {}
    for mode in MODES:
        ids, st = model.generate_tokens(model.tokenize(PROMPT), mode=mode, **KW)
        pieces = list(model.generate_stream(PROMPT, mode=mode, **KW))
        text = "".join(pieces)
        assert text == model.generate(PROMPT, mode=mode, **KW)
        assert model.last_stats["stop_string"] is None
        assert len(text) > 40 and NEVER[0] not in text
        out[mode] = dict(text=text, pieces=pieces, ids=ids, stats=st)
    return out


def _spanning(text, boundaries, min_start=1):
    """A stop string around one of the character offsets ``boundaries`` (some characters on
    each side) whose first occurrence in ``text`` is there: (stop, start)."""
    for b in boundaries:
        for left, right in ((2, 2), (1, 2), (2, 1), (3, 3), (1, 1)):
            s = text[b - left:b + right]
            if (b - left >= min_start and len(s) == left + right and "\ufffd" not in s
                    and not s.isspace() and text.find(s) == b - left):
                return s, b - left
    pytest.fail(f"no usable stop string around {boundaries} in {text!r}")


def _block_boundaries(model, ids, block=8):
    """Character offsets of the diffusion block boundaries (after generated token 8k)."""
    out = []
    for k in range(block, len(ids), block):
        out.append(len(model.detokenize(ids[:k])))
    return out


def _piece_boundaries(pieces):
    out, n = [], 0
    for p in pieces[:-1]:
        n += len(p)
        out.append(n)
    return out


def _check_stopped(model, mode, ref, stop, start):
    """generate / generate_stream / generate_tokens with ``stop`` against the reference."""
    want = ref["text"][:start]
    text = model.generate(PROMPT, mode=mode, stop=stop, **KW)
    st = dict(model.last_stats)
    assert text == want
    assert st["finish_reason"] == "stop" and st["stop_string"] in (stop if isinstance(stop, list) else [stop])

    pieces = list(model.generate_stream(PROMPT, mode=mode, stop=stop, **KW))
    assert "".join(pieces) == want and all(pieces)
    # no piece holds any character of the stop string's occurrence (nor what follows it)
    assert sum(len(p) for p in pieces) == start
    assert model.last_stats["finish_reason"] == "stop"

    ids, st2 = model.generate_tokens(model.tokenize(PROMPT), mode=mode, stop=stop, **KW)
    matched = st2["stop_string"]
    assert st2["finish_reason"] == "stop" and st2["tokens"] == ids
    assert ids == ref["ids"][:len(ids)]  # greedy: the same tokens, cut
    assert model.detokenize(ids).startswith(want + matched)  # the last token completes it
    assert (want + matched) not in model.detokenize(ids[:-1])
    # the decoder stopped: no token after the completing one in AR; in diffusion no block
    # after the one that holds it (n_generated counts committed tokens: a block's slot 0
    # can be handed out before its block commits), and fewer tokens than without stops
    assert st2["n_generated"] < ref["stats"]["n_generated"]
    assert st2["n_forward"] < ref["stats"]["n_forward"]
    if mode == "ar":
        assert st2["n_generated"] == len(ids)
    else:
        assert st2["n_generated"] <= -(-len(ids) // 8) * 8
    return ids


@pytest.mark.parametrize("mode", MODES)
def test_stop_across_a_block_boundary(model, base, mode):
    ref = base[mode]
    bounds = _block_boundaries(model, ref["ids"])
    stop, start = _spanning(ref["text"], bounds)
    ids = _check_stopped(model, mode, ref, stop, start)
    # the stop string really straddles tokens 8k-1 | 8k: the text before the boundary
    # token does not hold it, the text through it does
    b = next(k for k in range(8, len(ref["ids"]), 8) if len(model.detokenize(ref["ids"][:k])) > start)
    assert stop not in model.detokenize(ref["ids"][:b])
    assert len(ids) > b


@pytest.mark.parametrize("mode", MODES)
def test_stop_across_two_streamed_pieces(model, base, mode):
    ref = base[mode]
    stop, start = _spanning(ref["text"], _piece_boundaries(ref["pieces"]))
    _check_stopped(model, mode, ref, stop, start)
    # it straddles two pieces of the run without stops
    ends = [0] + _piece_boundaries(ref["pieces"])
    assert any(start < e < start + len(stop) for e in ends)


@pytest.mark.parametrize("mode", MODES)
def test_streaming_holds_back_a_possible_stop_prefix(model, base, mode):
    """A stop string whose first characters end a streamed piece but which never completes:
    those characters are held back until the next piece, then released; nothing is lost."""
    ref = base[mode]
    bounds = [b for b, p in zip(_piece_boundaries(ref["pieces"]), ref["pieces"]) if len(p) >= 3]
    b = next(b for b in bounds if "\ufffd" not in ref["text"][b - 2:b])
    stop = ref["text"][b - 2:b] + NEVER
    pieces = list(model.generate_stream(PROMPT, mode=mode, stop=stop, **KW))
    st = model.last_stats
    assert "".join(pieces) == ref["text"]
    assert st["stop_string"] is None and st["finish_reason"] == ref["stats"]["finish_reason"]
    ends = set(_piece_boundaries(pieces))
    assert b not in ends and b - 2 in ends  # the two characters moved to the next piece


@pytest.mark.parametrize("mode", MODES)
def test_stop_at_the_very_beginning_gives_empty_text(model, base, mode):
    ref = base[mode]
    stop = ref["text"][:3]
    assert model.generate(PROMPT, mode=mode, stop=stop, **KW) == ""
    st = model.last_stats
    assert st["finish_reason"] == "stop" and st["stop_string"] == stop
    assert list(model.generate_stream(PROMPT, mode=mode, stop=[NEVER, stop], **KW)) == []
    ids, st = model.generate_tokens(model.tokenize(PROMPT), mode=mode, stop=stop, **KW)
    assert ids and model.detokenize(ids).startswith(stop) and stop not in model.detokenize(ids[:-1])
    assert st["n_generated"] <= 8


@pytest.mark.parametrize("mode", MODES)
def test_stop_that_never_occurs_changes_nothing(model, base, mode):
    ref = base[mode]
    assert model.generate(PROMPT, mode=mode, stop=[NEVER, "\x02"], **KW) == ref["text"]
    st = model.last_stats
    assert st["stop_string"] is None and st["finish_reason"] == ref["stats"]["finish_reason"]
    ids, st = model.generate_tokens(model.tokenize(PROMPT), mode=mode, stop=NEVER, **KW)
    assert ids == ref["ids"] and st["n_generated"] == ref["stats"]["n_generated"]
    assert list(model.generate_stream(PROMPT, mode=mode, stop=NEVER, **KW)) == ref["pieces"]


@pytest.mark.parametrize("mode", MODES)
def test_earliest_stop_wins(model, base, mode):
    ref = base[mode]
    text = ref["text"]
    n = len(text)
    early, s_early = _spanning(text, range(n // 4, n // 2))
    late, s_late = _spanning(text, range(s_early + len(early) + 2, n - 3))
    assert s_early + len(early) <= s_late
    for stops in ([late, early], [early, late]):
        assert model.generate(PROMPT, mode=mode, stop=stops, **KW) == text[:s_early]
        assert model.last_stats["stop_string"] == early
    assert model.generate(PROMPT, mode=mode, stop=late, **KW) == text[:s_late]


def test_utf8_stop_string(model, base):
    """A stop string with a non-ASCII character (several UTF-8 bytes, maybe several tokens)."""
    done = 0
    for mode in MODES:
        text = base[mode]["text"]
        for i, c in enumerate(text):
            if ord(c) > 127 and c != "\ufffd" and i >= 1:
                for stop in (text[i - 1:i + 1], c):
                    start = text.find(stop)
                    _check_stopped(model, mode, base[mode], stop, start)
                done += 1
                break
    assert done >= 1, "no non-ASCII character in the reference outputs"


@pytest.mark.parametrize("bad", [5, "", [""], ["a", ""], ["a", 3], b"ab", [b"ab"], {"a"}, [["a"]],
                                 ["s%d" % k for k in range(MAX_STOP_STRINGS + 1)]])
def test_bad_stop_values_raise(model, bad):
    with pytest.raises(ValueError, match=r"^stop"):
        model.generate(PROMPT, mode="ar", max_tokens=2, stop=bad)
    with pytest.raises(ValueError, match=r"^stop"):
        model.generate_stream(PROMPT, mode="ar", max_tokens=2, stop=bad)  # before iterating
    with pytest.raises(ValueError, match=r"^stop"):
        model.generate_tokens(model.tokenize(PROMPT), mode="ar", max_tokens=2, stop=bad)


def test_check_stop_accepts_str_list_tuple_none():
    assert check_stop(None) == [] and check_stop([]) == []
    assert check_stop("ab") == ["ab"]
    assert check_stop(("a", "b", "a")) == ["a", "b"]
    assert len(check_stop(["s%d" % k for k in range(MAX_STOP_STRINGS)])) == MAX_STOP_STRINGS


# ---------------------------------------------------------------------------- StopFilter
def _reference_cut(text, stops):
    """The definition: first character where a stop string completes; on a tie the longest."""
    for e in range(1, len(text) + 1):
        done = [s for s in stops if text[:e].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[:e - len(s)], s
    return text, None


def _run_filter(chunks, stops):
    f = StopFilter(stops)
    out = []
    for c in chunks:
        hit = f.push(c)
        piece = f.take()
        out.append(piece)
        if hit:
            break
    else:
        out.append(f.flush())
    return out, f.matched


def test_stop_filter_is_independent_of_chunking():
    rng = random.Random(5)
    for _ in range(600):
        text = "".join(rng.choice("abcé") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abcé") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        want = _reference_cut(text, stops)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        for ch in (chunks, list(text), [text]):
            pieces, matched = _run_filter(ch, stops)
            assert ("".join(pieces), matched) == want, (text, stops, ch)
            # streaming never emitted text that a later match removed, nor held too much:
            # after each chunk, what is out is a prefix of the answer
            got = ""
            for p in pieces:
                got += p
                assert want[0].startswith(got)


def test_stop_filter_first_completed_wins_and_holds_back():
    assert _run_filter(["axyzw"], ["xyzw", "yz"]) == (["ax"], "yz")  # yz completes first
    assert _run_filter(["zabc"], ["bc", "abc"]) == (["z"], "abc")  # same end: the longer
    f = StopFilter(["</end>"])
    assert not f.push("hello </e") and f.take() == "hello "  # "</e" may start the stop
    assert not f.push("x") and f.take() == "</ex"  # cannot match any more: released
    assert f.push("yy</end>more") and f.take() == "yy" and f.matched == "</end>"


# ---------------------------------------------------------------------------- CLI
def _cli(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pathlib.Path(clover_gguf.__file__).resolve().parent.parent) + os.pathsep + env.get(
        "PYTHONPATH", "")
    env["PYTHONIOENCODING"] = "utf-8"
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          encoding="utf-8", env=env, timeout=300)


def test_cli_stop_equals_the_api(gguf_path, model, base):
    ref = base["diffusion"]
    stop, start = _spanning(ref["text"], _block_boundaries(model, ref["ids"]))
    common = ["run", "-m", gguf_path, "-p", PROMPT, "-n", 48, "--mode", "diffusion", "--block-size", 8,
              "--threshold", 0.5, "-t", 2, "--stop", NEVER, "--stop", stop]
    r = _cli(*common, "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    want = model.generate(PROMPT, mode="diffusion", stop=[NEVER, stop], **KW)
    assert obj["text"] == want == ref["text"][:start]
    assert obj["finish_reason"] == "stop" and obj["stop_string"] == stop
    assert obj["tokens"] == model.last_stats["tokens"]
    r = _cli(*common)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n" and "finish: stop" in r.stderr
    r = _cli("run", "-m", gguf_path, "-p", PROMPT, "-n", 4, "--stop", "")
    assert r.returncode == 2 and "stop" in r.stderr and "Traceback" not in r.stderr
