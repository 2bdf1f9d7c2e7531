"""Tokenizer rebuilt from GGUF metadata (clover-spec section 4.2; contract "Tokenizer").

A GGUF of arch ``clover`` or ``qwen35moe`` carries a byte-level BPE (``tokenizer.ggml.model
= "gpt2"``, ``tokenizer.ggml.pre = "qwen35"``): ``tokenizer.ggml.tokens`` (byte-level
strings), ``tokenizer.ggml.token_type`` (NORMAL=1, CONTROL=3, USER_DEFINED=4, UNUSED=5) and
``tokenizer.ggml.merges`` (``"a b"`` strings). :class:`CloverTokenizer` turns them back into a
Hugging Face ``tokenizers.Tokenizer`` of the form Qwen3.5 ships (no normaliser, Split on
the Qwen3.5 regex, ByteLevel without its own regex, BPE, ByteLevel decoder); CONTROL and
USER_DEFINED tokens become added tokens (special and non-special), while UNUSED tokens and
the ``[PAD{i}]`` padding rows are never produced by encoding.

Decoding goes through bytes (each token's byte string) so that a stream of tokens can be
turned into text without ever splitting a UTF-8 character: see :class:`StreamDetokenizer`.
Nothing here imports torch.
"""
from __future__ import annotations

import codecs
import json
import re
import threading
from typing import Iterable, Iterator, Mapping, Sequence

from tokenizers import Tokenizer, pre_tokenizers

# llama.cpp token types (gguf.TokenType numbering).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Qwen3.5 pre-tokenizer regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35, Qwen's tokenizer.json).
QWEN35_PRE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/Qwen3 regex (numbers in groups of 1..3), accepted for GGUFs tagged qwen2.
QWEN2_PRE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_REGEX = {"qwen35": QWEN35_PRE_REGEX, "qwen2": QWEN2_PRE_REGEX}

_PAD_RE = re.compile(r"\[PAD\d+\]")

# Long inputs are encoded as pieces (see _segments): chunks of about _CHUNK_CHARS characters
# cut where the pre-tokenizer regex always splits, and runs of at least _LONG_WS_RUN
# characters of horizontal whitespace handed to BPE alone: Oniguruma backtracks over such a
# run once per character, and tokenizers panics when that passes its retry-limit-in-match
# (10,000,000 steps: 9,999,983 spaces before a letter panic, one fewer does not).
_CHUNK_CHARS = 1 << 15
_LONG_WS_RUN = 1 << 15
# Unicode White_Space less CR and LF: what the regex's \s matches besides [\r\n].
_HWS = "\t\x0b\x0c \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
_HWS_RUN_RE = re.compile("[" + re.escape(_HWS) + "]*")
_LAST_NON_HWS_RE = re.compile("(?s).*[^" + re.escape(_HWS) + "]")  # .match(text, lo, hi)
# A cut point c (the match's start): ' ', '\t' or an ASCII digit after a non-space. The regex
# always splits there and encodes text[:c] and text[c:] as it does the whole: no alternative
# reads on from a non-space into horizontal whitespace (only "[\r\n]*" after punctuation
# crosses into whitespace) or into a digit ("\p{N}" takes digits one at a time).
_CUT_RE = re.compile(r"[ \t0-9](?<=\S.)")
# An added token that could span a cut point or a whitespace run's ends.
_UNCUTTABLE_TOKEN_RE = re.compile(r"\s|\S[0-9]")

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.chat_template",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


def _byte_level_to_bytes(token: str) -> bytes:
    out = bytearray()
    for ch in token:
        b = _BYTE_DECODER.get(ch)
        if b is None:  # not a byte-level character: keep its UTF-8 form
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


# Maps every byte-level character to one ASCII character: the UTF-8 length of a token
# translated with it is the byte length of the token.
_ONE_BYTE = str.maketrans({c: "x" for c in _BYTE_DECODER})


def _long_ws_runs(text: str, n: int) -> Iterator[tuple[int, int]]:
    """Spans ``(a, e)`` of the maximal runs of ``_HWS`` characters at least ``n`` long, in
    order. Looks at every n-th character only (each such run holds one) and at the run
    around a hit, so that it scans a text without long runs at C speed."""
    p = n - 1
    while p < len(text):
        if text[p] in _HWS:
            e = _HWS_RUN_RE.match(text, p).end()
            # The run starts after p - n: the character there was looked at and is not in it.
            lo = max(0, p - n + 1)
            m = _LAST_NON_HWS_RE.match(text, lo, p)
            a = m.end() if m else lo
            if e - a >= n:
                yield a, e
            p += (e - p) // n * n + n
        else:
            p += n


def _segments(text: str, added: tuple[str, ...] = ()) -> list[tuple[str, bool]]:
    r"""Cut ``text`` into pieces whose encodings, concatenated, are the encoding of ``text``.

    ``(piece, False)`` goes through the whole tokenizer; ``(run, True)`` is one pre-token of
    horizontal whitespace (matched by the regex's ``\s+(?!\S)``), to be given to BPE alone.
    A maximal run ``text[a:e]`` of ``_HWS`` characters, at least ``_LONG_WS_RUN`` long, is such
    a pre-token (less its last character when a non-space follows: that one starts the next
    match) when ``text[a-1]`` is CR, LF or a non-space (the regex splits at ``a``: a match
    ``\s*[\r\n]+`` ends at the last CR/LF of the whitespace) and ``text[e]`` is a non-space.
    ``added`` are the added tokens the tokenizer matches (none holds whitespace): one starting
    at ``e`` ends the text the regex sees, so the run keeps its last character.
    The rest is cut into chunks at :data:`_CUT_RE` points.
    """
    out: list[tuple[str, bool]] = []
    pos = 0
    n = len(text)
    if n >= _LONG_WS_RUN:
        for a, e in _long_ws_runs(text, max(2, _LONG_WS_RUN)):
            if a > 0 and text[a - 1] not in "\r\n" and text[a - 1].isspace():
                continue
            if e < n and text[e].isspace():
                continue
            b = e if e == n or text.startswith(added, e) else e - 1
            out += _chunks(text, pos, a)
            out.append((text[a:b], True))
            pos = b
    out += _chunks(text, pos, n)
    return out


def _chunks(text: str, lo: int, hi: int) -> list[tuple[str, bool]]:
    """``text[lo:hi]`` in pieces of at least ``_CHUNK_CHARS`` characters (the last may be
    shorter), cut at :data:`_CUT_RE` points (one piece where there is none)."""
    out = []
    while hi - lo > _CHUNK_CHARS:
        m = _CUT_RE.search(text, lo + _CHUNK_CHARS, hi)
        if m is None:
            break
        out.append((text[lo : m.start()], False))
        lo = m.start()
    if hi > lo:
        out.append((text[lo:hi], False))
    return out


def _native(fn, *args, **kwargs):
    """Call into ``tokenizers``; map its failures, a Rust panic included (pyo3's
    ``PanicException`` derives from ``BaseException``), to ``ValueError``."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:
        raise ValueError(f"text: the tokenizer failed on this input ({type(e).__name__}: {e})") from e


class CloverTokenizer:
    """Byte-level BPE tokenizer of a Clover/Qwen3.5 GGUF.

    Build it with :meth:`from_gguf` (a path), :meth:`from_handle` (an open native
    ``clover_gguf *``) or :meth:`from_metadata` (a mapping of GGUF keys to values, arrays
    as lists). Token ids are Python ints in ``[0, n_vocab)``.

    Raises ``ValueError`` naming the key when the metadata is missing or inconsistent.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        *,
        pre: str = "qwen35",
        eos_token_id: int | None = None,
        padding_token_id: int | None = None,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        n = len(tokens)
        if n == 0:
            raise ValueError("tokenizer.ggml.tokens: empty")
        if token_types is None:
            token_types = [TOKEN_NORMAL] * n
        if len(token_types) != n:
            raise ValueError(
                f"tokenizer.ggml.token_type: {len(token_types)} entries, expected {n} (one per token)"
            )
        if pre not in _PRE_REGEX:
            raise ValueError(
                f"tokenizer.ggml.pre: {pre!r} not supported (expected one of {sorted(_PRE_REGEX)})"
            )
        self.tokens = list(tokens)
        self.token_types = [int(t) for t in token_types]
        self.pre = pre
        self.eos_token_id = eos_token_id
        self.padding_token_id = padding_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self._piece_cache: dict[int, bytes] = {}

        vocab: dict[str, int] = {}
        added: list[dict] = []
        self.special_ids: set[int] = set()
        for i, (tok, tt) in enumerate(zip(self.tokens, self.token_types)):
            if tt in (TOKEN_UNUSED, TOKEN_UNKNOWN) or _PAD_RE.fullmatch(tok):
                continue  # padding rows and unused slots are never produced
            if tt in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
                special = tt == TOKEN_CONTROL
                if special:
                    self.special_ids.add(i)
                added.append(
                    {"id": i, "content": tok, "single_word": False, "lstrip": False,
                     "rstrip": False, "normalized": False, "special": special}
                )
            else:
                vocab.setdefault(tok, i)

        merge_pairs = []
        for k, m in enumerate(merges):
            # As llama.cpp: split at the first space after position 0 (byte-level tokens
            # never contain a raw space).
            cut = m.find(" ", 1)
            if cut < 0:
                raise ValueError(f"tokenizer.ggml.merges[{k}]: {m!r} is not of the form 'a b'")
            merge_pairs.append([m[:cut], m[cut + 1 :]])

        # The tokenizer.json form Qwen ships (added tokens keep their GGUF ids this way).
        spec = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": _PRE_REGEX[pre]},
                     "behavior": "Isolated", "invert": False},
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                     "use_regex": False},
                ],
            },
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {
                "type": "BPE", "dropout": None, "unk_token": None,
                "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                "byte_fallback": False, "ignore_merges": False,
                "vocab": vocab, "merges": merge_pairs,
            },
        }
        self._tk = Tokenizer.from_str(json.dumps(spec))
        # Cutting text into pieces (_segments) keeps the ids only if no added token can span a cut.
        self._cuttable = not any(_UNCUTTABLE_TOKEN_RE.search(t["content"]) for t in added)
        self._added = tuple(t["content"] for t in added)
        self._added_non_special = tuple(t["content"] for t in added if not t["special"])
        self._variants: dict[str, Tokenizer] = {}  # built on first use, see _variant
        self._variants_lock = threading.Lock()
        self._max_token_bytes = max(self._byte_length(i) for i in range(n))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_metadata(cls, md: Mapping[str, object]) -> "CloverTokenizer":
        """Build from a mapping of GGUF keys (arrays as lists), e.g. ``GGUFFile.metadata``.
        Raises ValueError naming the key for a missing key or a value of the wrong type."""
        model = _meta(md, "tokenizer.ggml.model", "a string", _is_str)
        if model is not None and model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model: {model!r} not supported (expected 'gpt2')")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in md:
                raise ValueError(f"{key}: missing from the GGUF")
        pre = _meta(md, "tokenizer.ggml.pre", "a string", _is_str)
        return cls(
            _meta_array(md, "tokenizer.ggml.tokens", "strings", _is_str),
            _meta_array(md, "tokenizer.ggml.token_type", "integers", _is_int),
            _meta_array(md, "tokenizer.ggml.merges", "strings", _is_str),
            pre="qwen35" if pre is None else pre,
            eos_token_id=_meta(md, "tokenizer.ggml.eos_token_id", "an integer token id", _is_int),
            padding_token_id=_meta(md, "tokenizer.ggml.padding_token_id", "an integer token id", _is_int),
            bos_token_id=_meta(md, "tokenizer.ggml.bos_token_id", "an integer token id", _is_int),
            chat_template=_meta(md, "tokenizer.chat_template", "a string", _is_str),
        )

    @classmethod
    def from_handle(cls, g) -> "CloverTokenizer":
        """Build from an open native GGUF handle (``clover_gguf *``, e.g. from
        ``clover_model_gguf``); reads only the tokenizer keys."""
        return cls.from_metadata(read_tokenizer_metadata(g))

    @classmethod
    def from_gguf(cls, path) -> "CloverTokenizer":
        """Open ``path`` with the validating native reader and build the tokenizer.
        Raises ``CloverError`` for a malformed file, ``ValueError`` for missing keys."""
        import os

        from ._ffi import err_buf, ffi, lib, raise_error

        err = err_buf()
        g = lib.clover_gguf_open(os.fsencode(os.fspath(path)), err, len(err))
        if g == ffi.NULL:
            raise_error(err, str(path))
        try:
            return cls.from_handle(g)
        finally:
            lib.clover_gguf_close(g)

    # ------------------------------------------------------------------ properties
    @property
    def n_vocab(self) -> int:
        """Number of token ids (GGUF ``tokenizer.ggml.tokens`` length, padding included)."""
        return len(self.tokens)

    @property
    def hf_tokenizer(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tk

    @property
    def max_token_bytes(self) -> int:
        """Byte length of the longest token (as :meth:`token_bytes` gives): ``n`` tokens never
        cover more than ``n * max_token_bytes`` bytes of UTF-8 text."""
        return self._max_token_bytes

    def _byte_length(self, i: int) -> int:
        """``len(self.token_bytes(i))`` without building the bytes."""
        tok, tt = self.tokens[i], self.token_types[i]
        if tt in (TOKEN_UNUSED, TOKEN_UNKNOWN) or _PAD_RE.fullmatch(tok):
            return 0
        if tt in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            return len(tok.encode("utf-8"))
        return len(tok.translate(_ONE_BYTE).encode("utf-8"))

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (byte-level form for normal tokens), or None."""
        return self._tk.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        """Token string (as stored in the GGUF) of id ``i``."""
        return self.tokens[i]

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS is added: ``add_bos_token`` is false for Qwen).

        With ``special=True`` control tokens written in the text (``<|im_start|>``...) are
        recognised as single tokens; with ``special=False`` they are encoded as plain text.
        Non-special added tokens (USER_DEFINED, e.g. ``<think>``) are always recognised.

        Safe to call from several threads at once; the native work runs without the GIL.
        Long texts are encoded in pieces (:func:`_segments`) with the same ids as in one.
        Raises TypeError if text is not a str, ValueError (``"text: ..."``) if the native
        tokenizer fails on it.
        """
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        if not text:
            return []
        tk = self._tk if special else self._variant("special_as_text")
        if self._cuttable:
            pieces = _segments(text, self._added if special else self._added_non_special)
        else:
            pieces = [(text, False)]
        # encode_batch_fast releases the GIL (Tokenizer.encode holds it) and gives the same ids.
        plain = [p for p, run in pieces if not run]
        runs = [p for p, run in pieces if run]
        plain = iter(_native(tk.encode_batch_fast, plain, add_special_tokens=False))
        bpe = iter(_native(self._variant("bpe_only").encode_batch_fast, runs, add_special_tokens=False)
                   if runs else ())
        ids: list[int] = []
        for _, run in pieces:
            ids += next(bpe if run else plain).ids
        return ids

    def _variant(self, kind: str) -> Tokenizer:
        """Another ``tokenizers.Tokenizer`` over the same vocabulary, built on first use and
        never changed after: ``"special_as_text"`` (control tokens are plain text) or
        ``"bpe_only"`` (BPE over the byte-level form of the whole input, no regex split)."""
        tk = self._variants.get(kind)
        if tk is None:
            with self._variants_lock:
                tk = self._variants.get(kind)
                if tk is None:
                    tk = Tokenizer.from_str(self._tk.to_str())
                    if kind == "special_as_text":
                        tk.encode_special_tokens = True
                    else:
                        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
                    self._variants[kind] = tk
        return tk

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for: byte-level decoded for normal tokens, the UTF-8
        text for control/user-defined tokens, ``b""`` for unused/padding ids.
        Raises ValueError for an id outside ``[0, n_vocab)``."""
        i = int(i)
        b = self._piece_cache.get(i)
        if b is not None:
            return b
        if not 0 <= i < len(self.tokens):
            raise ValueError(f"token id: {i} out of range [0, {len(self.tokens)})")
        tok, tt = self.tokens[i], self.token_types[i]
        if tt in (TOKEN_UNUSED, TOKEN_UNKNOWN) or _PAD_RE.fullmatch(tok):
            b = b""
        elif tt in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            b = tok.encode("utf-8")
        else:
            b = _byte_level_to_bytes(tok)
        self._piece_cache[i] = b
        return b

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated bytes of ``ids`` (see :meth:`token_bytes`)."""
        if skip_special:
            return b"".join(self.token_bytes(i) for i in ids if int(i) not in self.special_ids)
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a sequence cut mid-character) becomes U+FFFD.
        Control tokens are written out unless ``skip_special``."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> "StreamDetokenizer":
        """A fresh incremental detokenizer over this vocabulary."""
        return StreamDetokenizer(self, skip_special=skip_special)


class StreamDetokenizer:
    """Incremental detokenizer: feed token ids as they become final, get text pieces.

    Bytes of an incomplete UTF-8 character are held back until the next tokens complete
    it, so no piece ever contains a broken character; ``"".join(pieces) + flush()`` equals
    ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: CloverTokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Iterable[int]) -> str:
        """Feed ids; return the text that is now complete (possibly empty)."""
        return self._dec.decode(self._tok.decode_bytes(ids, self._skip_special), final=False)

    def flush(self) -> str:
        """End of stream: return what is held back (an incomplete tail becomes U+FFFD)."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


# ---------------------------------------------------------------------- metadata values
def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _describe(v) -> str:
    """What a metadata value is, for an error message: ``int 5``, ``an array of int``."""
    if isinstance(v, (list, tuple)):
        kinds = sorted({type(x).__name__ for x in v})
        return "an array of " + "/".join(kinds) if kinds else "an empty array"
    return f"{type(v).__name__} {v!r:.40}"


def _meta(md: Mapping[str, object], key: str, expected: str, ok) -> object:
    """Scalar ``md[key]`` (None if absent), checked with ``ok``."""
    v = md.get(key)
    if v is not None and not ok(v):
        raise ValueError(f"{key}: expected {expected}, got {_describe(v)}")
    return v


def _meta_array(md: Mapping[str, object], key: str, expected: str, ok) -> list | None:
    """Array ``md[key]`` as a list (None if absent), each element checked with ``ok``."""
    v = md.get(key)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not all(ok(x) for x in v):
        raise ValueError(f"{key}: expected an array of {expected}, got {_describe(v)}")
    return list(v)


# ---------------------------------------------------------------------- native metadata
def read_tokenizer_metadata(g, keys: Sequence[str] = TOKENIZER_KEYS) -> dict[str, object]:
    """Read ``keys`` (those present) from an open native GGUF handle into a dict; arrays
    become lists. Uses the validated C reader (``clover_gguf_*`` in clover.h)."""
    from ._ffi import ffi, lib

    out: dict[str, object] = {}
    lenp = ffi.new("size_t *")
    for key in keys:
        i = lib.clover_gguf_find_key(g, key.encode())
        if i < 0:
            continue
        out[key] = _read_value(g, i, lib, ffi, lenp)
    return out


def _read_value(g, i, lib, ffi, lenp):
    """Value of KV ``i``: int, float, bool, str or a list of those (the native reader refuses
    arrays of arrays)."""
    t = lib.clover_gguf_kv_type(g, i)

    def scalar(tt, j):
        if tt == lib.CLOVER_GGUF_STRING:
            p = lib.clover_gguf_get_str(g, i, j, lenp)
            return None if p == ffi.NULL else ffi.unpack(p, lenp[0]).decode("utf-8", "replace")
        if tt in (lib.CLOVER_GGUF_FLOAT32, lib.CLOVER_GGUF_FLOAT64):
            return lib.clover_gguf_get_f64(g, i, j)
        if tt == lib.CLOVER_GGUF_BOOL:
            return bool(lib.clover_gguf_get_i64(g, i, j))
        if tt == lib.CLOVER_GGUF_UINT64:
            return int(lib.clover_gguf_get_u64(g, i, j))
        return int(lib.clover_gguf_get_i64(g, i, j))

    if t == lib.CLOVER_GGUF_ARRAY:
        at = lib.clover_gguf_arr_type(g, i)
        n = lib.clover_gguf_arr_n(g, i)
        return [scalar(at, j) for j in range(n)]
    return scalar(t, 0)
