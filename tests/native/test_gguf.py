"""The validating GGUF reader (native/core/gguf.c, clover_gguf.gguf.GGUFFile; spec 4).

Valid files are written with gguf-py's GGUFWriter and read back; every KV and tensor must
equal gguf-py's GGUFReader view (values, types, shapes, offsets, sizes, dequantised data).
Malformed files are made by patching bytes of valid ones at positions computed by a small
independent walker of the format (`layout` below); each must raise CloverError whose message
names the problem, and the process must stay alive.
"""
import os
import re
import struct
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter
from gguf.quants import dequantize, quantize

from clover_gguf._ffi import CloverError, err_buf, ffi, lib
from clover_gguf.gguf import GGUFFile

SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
U64 = 2 ** 64


# ---------------------------------------------------------------------------- writing
def _tensor_set(rng):
    """name -> (ggml type, float32 values with numpy shape = reversed ne)."""
    return {
        "t.f32_1d": (QT.F32, rng.standard_normal(7)),
        "t.f16_2d": (QT.F16, rng.standard_normal((3, 5))),
        "t.bf16_3d": (QT.BF16, rng.standard_normal((2, 3, 4)) * 100),
        "t.q8_4d": (QT.Q8_0, rng.standard_normal((2, 1, 2, 64))),
        "blk.0.attn_q.weight": (QT.Q8_0, rng.standard_normal((4, 32))),
        "blk.0.attn_k.weight": (QT.F32, rng.standard_normal((2, 3))),
    }


def write_gguf(path, *, tensors=None, alignment=None, full_kv=True, seed=0):
    rng = np.random.default_rng(seed)
    tensors = _tensor_set(rng) if tensors is None else tensors
    w = GGUFWriter(str(path), "clover_moe")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "Clover tést ✓")
    if full_kv:
        w.add_uint8("t.u8", 200)
        w.add_int8("t.i8", -100)
        w.add_uint16("t.u16", 60000)
        w.add_int16("t.i16", -30000)
        w.add_uint32("t.u32", 4_000_000_000)
        w.add_int32("t.i32", -2_000_000_000)
        w.add_float32("t.f32", 0.1)
        w.add_uint64("t.u64", U64 - 1)
        w.add_int64("t.i64", -2 ** 63)
        w.add_float64("t.f64", -1.25e300)
        w.add_bool("t.true", True)
        w.add_bool("t.false", False)
        w.add_array("t.arr_i32", [1, -2, 3, 2 ** 31 - 1])
        w.add_array("t.arr_f32", [0.5, -1e-3, 3e38])
        w.add_array("t.arr_str", ["a", "", "Ġhello", "日本語", "x" * 300])
        w.add_array("t.arr_bool", [True, False, True])
        w.add_array("t.arr_str_nul", ["x\0y", "z", "\0"])  # NUL inside strings
        w.add_string("t.str_nul", "a\0b")
        w.add_key_value("t.arr_u8", [0, 255, 7], VT.ARRAY, sub_type=VT.UINT8)
        w.add_key_value("t.arr_u64", [0, U64 - 1], VT.ARRAY, sub_type=VT.UINT64)
        w.add_key_value("t.arr_i64", [-2 ** 63, 2 ** 63 - 1], VT.ARRAY, sub_type=VT.INT64)
        w.add_key_value("t.arr_f64", [1e-300, -2.5], VT.ARRAY, sub_type=VT.FLOAT64)
        w.add_key_value("t.arr_i16", [-32768, 32767], VT.ARRAY, sub_type=VT.INT16)
        w.add_array("clover_moe.rope.dimension_sections", [11, 11, 10, 0])
    for name, (qt, values) in tensors.items():
        values = values.astype(np.float32)
        if qt == QT.F32:
            w.add_tensor(name, values)
        elif qt == QT.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, quantize(values, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def small_gguf(path):
    """A few hundred bytes: two KVs, two tensors."""
    rng = np.random.default_rng(5)
    write_gguf(path, full_kv=False, tensors={"a": (QT.F32, rng.standard_normal(8)),
                                             "b.weight": (QT.Q8_0, rng.standard_normal((1, 32)))})
    return path.read_bytes()


# ---------------------------------------------------------------------------- format walker
def layout(buf: bytes) -> dict:
    """Byte positions (and values) of every field of a (valid) GGUF, from the format alone."""
    u32 = lambda p: struct.unpack_from("<I", buf, p)[0]  # noqa: E731
    u64 = lambda p: struct.unpack_from("<Q", buf, p)[0]  # noqa: E731
    n_tensors, n_kv = u64(8), u64(16)
    p = 24
    kvs, alignment = [], 32
    for _ in range(n_kv):
        e = {"start": p}
        klen = u64(p)
        e["key"] = buf[p + 8:p + 8 + klen].decode()
        p += 8 + klen
        e["type_pos"], e["type"] = p, u32(p)
        p += 4
        et, n = e["type"], 1
        if et == 9:
            e["elem_type_pos"], et = p, u32(p)
            e["count_pos"], n = p + 4, u64(p + 4)
            p += 12
        e["value_pos"] = p
        vals = []
        for _ in range(n):
            if et == 8:
                ln = u64(p)
                vals.append(buf[p + 8:p + 8 + ln].decode("utf-8", "replace"))
                p += 8 + ln
            else:
                v = struct.unpack_from("<" + SCALAR_FMT[et], buf, p)[0]
                vals.append(float(v) if et in (6, 12) else v)
                p += SCALAR_SIZE[et]
        e["value"] = vals if e["type"] == 9 else vals[0]
        if e["key"] == "general.alignment":
            alignment = u32(e["value_pos"])
        kvs.append(e)
    tensors = []
    for _ in range(n_tensors):
        e = {"start": p}
        nlen = u64(p)
        e["name"] = buf[p + 8:p + 8 + nlen].decode()
        p += 8 + nlen
        e["n_dims_pos"], nd = p, u32(p)
        p += 4
        e["ne_pos"], e["ne"] = p, [u64(p + 8 * d) for d in range(nd)]
        p += 8 * nd
        e["type_pos"], e["type"] = p, u32(p)
        p += 4
        e["offset_pos"], e["offset"] = p, u64(p)
        p += 8
        tensors.append(e)
    data_start = (p + alignment - 1) // alignment * alignment
    return {"kv": {e["key"]: e for e in kvs}, "kv_list": kvs, "tensors": tensors,
            "info_end": p, "data_start": data_start, "alignment": alignment}


def patch(buf: bytes, pos: int, fmt: str, *values) -> bytes:
    b = bytearray(buf)
    struct.pack_into("<" + fmt, b, pos, *values)
    return bytes(b)


def tensor_entry(lay, name):
    return next(t for t in lay["tensors"] if t["name"] == name)


# ---------------------------------------------------------------------------- valid files
@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    tensors = write_gguf(path)
    return path, tensors


def _reader_value(field):
    v = field.contents()
    t = field.types[-1]
    if t == VT.FLOAT32:
        return [float(np.float32(x)) for x in v] if isinstance(v, list) else float(np.float32(v))
    return v


def test_metadata_equals_gguf_reader(valid):
    path, _ = valid
    r = GGUFReader(path)
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    with GGUFFile(path) as f:
        assert f.version == 3
        assert list(f.metadata) == list(fields)  # file order
        for key, field in fields.items():
            got, want = f.metadata[key], _reader_value(field)
            assert got == want, key
            assert type(got) is type(want), key
            if isinstance(got, list):
                assert all(type(a) is type(b) for a, b in zip(got, want)), key
    # spot checks against the values written (the reader could share a bug with gguf-py)
    m = GGUFFile(path).metadata
    assert m["general.architecture"] == "clover_moe" and m["general.name"] == "Clover tést ✓"
    assert m["t.u64"] == U64 - 1 and m["t.i64"] == -2 ** 63 and m["t.u8"] == 200 and m["t.i8"] == -100
    assert m["t.f32"] == float(np.float32(0.1)) and m["t.f64"] == -1.25e300
    assert m["t.true"] is True and m["t.false"] is False
    assert m["t.arr_str"] == ["a", "", "Ġhello", "日本語", "x" * 300]
    assert m["t.arr_u64"] == [0, U64 - 1]
    assert m["t.arr_str_nul"] == ["x\0y", "z", "\0"] and m["t.str_nul"] == "a\0b"


def test_empty_array_and_no_tensors(tmp_path):
    # GGUFWriter skips empty arrays and strings: write them by hand (header, two KVs, no tensors)
    k1, k2 = b"t.empty_arr", b"t.empty_str"
    raw = (b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
           + struct.pack("<Q", len(k1)) + k1 + struct.pack("<IIQ", 9, 5, 0)
           + struct.pack("<Q", len(k2)) + k2 + struct.pack("<IQ", 8, 0))
    p = tmp_path / "empty.gguf"
    p.write_bytes(raw)
    with GGUFFile(p) as f:
        assert f.metadata == {"t.empty_arr": [], "t.empty_str": ""} and f.tensors == []
    r = GGUFReader(p)
    assert r.fields["t.empty_arr"].contents() == [] and r.fields["t.empty_str"].contents() == ""


def test_kv_types_and_accessors_equal_gguf_reader(valid):
    path, _ = valid
    r = GGUFReader(path)
    err = err_buf()
    g = lib.clover_gguf_open(os.fsencode(path), err, len(err))
    assert g != ffi.NULL, ffi.string(err)
    try:
        fields = [f for k, f in r.fields.items() if not k.startswith("GGUF.")]
        assert lib.clover_gguf_n_kv(g) == len(fields)
        for i, field in enumerate(fields):
            assert ffi.string(lib.clover_gguf_key(g, i)).decode() == field.name
            assert lib.clover_gguf_find_key(g, field.name.encode()) == i
            assert lib.clover_gguf_kv_type(g, i) == int(field.types[0])
            if field.types[0] == VT.ARRAY:
                assert lib.clover_gguf_arr_type(g, i) == int(field.types[-1])
                assert lib.clover_gguf_arr_n(g, i) == len(field.data)
            else:
                assert lib.clover_gguf_arr_type(g, i) == -1 and lib.clover_gguf_arr_n(g, i) == -1
        # numeric getters convert between kinds; strings and bad indices give 0 / NULL
        k = lambda name: lib.clover_gguf_find_key(g, name.encode())  # noqa: E731
        assert lib.clover_gguf_get_f64(g, k("t.i32"), 0) == -2e9
        assert lib.clover_gguf_get_i64(g, k("t.f64"), 0) == -2 ** 63          # saturates
        assert lib.clover_gguf_get_u64(g, k("t.i8"), 0) == 0                  # negative -> 0
        assert lib.clover_gguf_get_i64(g, k("t.u64"), 0) == 2 ** 63 - 1       # saturates
        assert lib.clover_gguf_get_u64(g, k("t.arr_i32"), 3) == 2 ** 31 - 1
        assert lib.clover_gguf_get_i64(g, k("t.arr_i32"), 4) == 0             # j out of range
        assert lib.clover_gguf_get_i64(g, k("general.name"), 0) == 0          # string
        assert lib.clover_gguf_get_str(g, k("t.u8"), 0, ffi.NULL) == ffi.NULL
        assert lib.clover_gguf_get_str(g, k("t.arr_str"), 5, ffi.NULL) == ffi.NULL
        assert lib.clover_gguf_get_str(g, k("general.name"), 1, ffi.NULL) == ffi.NULL
        lenp = ffi.new("size_t *")
        p = lib.clover_gguf_get_str(g, k("t.arr_str"), 3, lenp)
        assert ffi.string(p).decode() == "日本語" and lenp[0] == len("日本語".encode())
        assert lib.clover_gguf_find_key(g, b"no.such.key") == -1
        assert lib.clover_gguf_key(g, -1) == ffi.NULL and lib.clover_gguf_key(g, len(fields)) == ffi.NULL
        assert lib.clover_gguf_kv_type(g, len(fields)) == -1
    finally:
        lib.clover_gguf_close(g)


def test_tensors_equal_gguf_reader(valid):
    path, written = valid
    r = GGUFReader(path)
    names = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0}
    with GGUFFile(path) as f:
        assert [t["name"] for t in f.tensors] == [t.name for t in r.tensors]
        for info, rt in zip(f.tensors, r.tensors):
            assert names[info["type"]] == rt.tensor_type
            assert info["shape"] == [int(d) for d in rt.shape]
            assert info["offset"] == rt.data_offset and info["offset"] % 32 == 0
            assert info["nbytes"] == rt.n_bytes
            got = f.tensor(info["name"])
            want = dequantize(rt.data, rt.tensor_type).reshape(tuple(reversed(info["shape"])))
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.array_equal(got, want)
            qt, values = written[info["name"]]
            assert got.shape == values.shape
            assert np.array_equal(got, dequantize(quantize(values.astype(np.float32), qt), qt))
        with pytest.raises(KeyError):
            f.tensor("missing")


def test_tensor_accessors(valid):
    path, _ = valid
    err = err_buf()
    g = lib.clover_gguf_open(os.fsencode(path), err, len(err))
    assert g != ffi.NULL
    try:
        t = lib.clover_gguf_find_tensor(g, b"t.q8_4d")
        assert ffi.string(lib.clover_gguf_tensor_name(g, t)) == b"t.q8_4d"
        assert lib.clover_gguf_tensor_type(g, t) == lib.CLOVER_TYPE_Q8_0
        assert lib.clover_gguf_tensor_n_dims(g, t) == 4
        assert [lib.clover_gguf_tensor_ne(g, t, d) for d in range(4)] == [64, 2, 1, 2]
        assert lib.clover_gguf_tensor_ne(g, t, 4) == -1
        t1 = lib.clover_gguf_find_tensor(g, b"t.f32_1d")
        assert [lib.clover_gguf_tensor_ne(g, t1, d) for d in range(4)] == [7, 1, 1, 1]
        # data pointer is the mapped file at the tensor offset
        raw = path.read_bytes()
        off, nb = lib.clover_gguf_tensor_offset(g, t), lib.clover_gguf_tensor_nbytes(g, t)
        assert bytes(ffi.buffer(lib.clover_gguf_tensor_data(g, t), nb)) == raw[off:off + nb]
        assert lib.clover_gguf_find_tensor(g, b"nope") == -1
        assert lib.clover_gguf_tensor_name(g, 99) == ffi.NULL and lib.clover_gguf_tensor_data(g, -1) == ffi.NULL
        out = ffi.new("float[]", 256)
        assert lib.clover_gguf_tensor_to_f32(g, t, out, 255, err, len(err)) == lib.CLOVER_E_ARG
        assert "capacity 255" in ffi.string(err).decode() and "t.q8_4d" in ffi.string(err).decode()
        assert lib.clover_gguf_tensor_to_f32(g, 99, out, 256, err, len(err)) == lib.CLOVER_E_ARG
        assert lib.clover_gguf_tensor_to_f32(g, t, out, 256, err, len(err)) == lib.CLOVER_OK
    finally:
        lib.clover_gguf_close(g)


def test_version_2_and_custom_alignment(tmp_path):
    p = tmp_path / "a.gguf"
    write_gguf(p)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(patch(p.read_bytes(), 4, "I", 2))
    with GGUFFile(p) as f3, GGUFFile(v2) as f2:
        assert f2.version == 2 and f2.metadata == f3.metadata and f2.tensors == f3.tensors
    p64 = tmp_path / "a64.gguf"
    write_gguf(p64, alignment=64)
    with GGUFFile(p64) as f, GGUFFile(p) as ref:
        assert f.metadata["general.alignment"] == 64
        assert all(t["offset"] % 64 == 0 for t in f.tensors)
        for t in ref.tensors:
            assert np.array_equal(f.tensor(t["name"]), ref.tensor(t["name"]))


def test_close_and_context_manager(valid):
    path, _ = valid
    f = GGUFFile(path)
    f.close()
    f.close()  # idempotent
    with pytest.raises(CloverError, match="closed"):
        f.tensor("t.f32_1d")
    assert isinstance(CloverError("x"), RuntimeError)


def test_large_vocabulary_reads_fast(tmp_path):
    n = 250_000
    tokens = [f"tok{i}Ġ" for i in range(n)]
    path = tmp_path / "vocab.gguf"
    w = GGUFWriter(str(path), "clover_moe")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t0 = time.perf_counter()
    with GGUFFile(path) as f:
        got = f.metadata["tokenizer.ggml.tokens"]
        types = f.metadata["tokenizer.ggml.token_type"]
    dt = time.perf_counter() - t0
    assert got == tokens and types == [1] * n
    assert dt < 5.0, f"reading {n} tokens + types took {dt:.2f} s"  # measured ~0.2 s


def test_real_vocabulary_file():
    """llama.cpp's qwen35 vocabulary GGUF (152k tokens and merges): every value equals the
    pure-Python walk of the same bytes."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "qwen35-vocab", "ggml-vocab-qwen35.gguf")
    if not os.path.exists(path):
        pytest.skip("tests/data/qwen35-vocab/ggml-vocab-qwen35.gguf not present")
    with open(path, "rb") as fh:
        lay = layout(fh.read())
    t0 = time.perf_counter()
    with GGUFFile(path) as f:
        meta = f.metadata
    dt = time.perf_counter() - t0
    assert list(meta) == [e["key"] for e in lay["kv_list"]]
    for e in lay["kv_list"]:
        assert meta[e["key"]] == e["value"], e["key"]
    assert len(meta["tokenizer.ggml.tokens"]) > 150_000
    assert dt < 5.0, f"{dt:.2f} s"  # measured 0.25-0.5 s on a loaded 2-core machine


# ---------------------------------------------------------------------------- malformed files
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "base.gguf"
    write_gguf(path)
    buf = path.read_bytes()
    return buf, layout(buf)


def open_error(tmp_path, data: bytes, *patterns: str, name="bad.gguf") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(CloverError) as ei:
        GGUFFile(p)
    msg = str(ei.value)
    assert str(p) in msg
    for pat in patterns:
        assert re.search(pat, msg), f"{pat!r} not in {msg!r}"
    return msg


def test_walker_agrees_with_reader(base, tmp_path):
    buf, lay = base
    (tmp_path / "w.gguf").write_bytes(buf)
    r = GGUFReader(tmp_path / "w.gguf")
    assert lay["data_start"] == r.data_offset
    for e, rt in zip(lay["tensors"], r.tensors):
        assert e["name"] == rt.name and lay["data_start"] + e["offset"] == rt.data_offset


def test_truncated_at_every_position(tmp_path):
    buf = small_gguf(tmp_path / "small.gguf")
    lay = layout(buf)
    last = max(lay["tensors"], key=lambda t: t["offset"])
    with GGUFFile(tmp_path / "small.gguf") as f:
        data_end = max(t["offset"] + t["nbytes"] for t in f.tensors)
    assert data_end == lay["data_start"] + last["offset"] + 34
    assert len(buf) < 1024
    p = tmp_path / "cut.gguf"
    truncation = re.compile(r"end of file|exceeds remaining|past end|too large|file is empty")
    for cut in range(data_end):
        p.write_bytes(buf[:cut])
        with pytest.raises(CloverError) as ei:
            GGUFFile(p)
        assert truncation.search(str(ei.value)), f"cut at {cut}: {ei.value}"
    for cut in range(data_end, len(buf) + 1):  # only the final padding is missing: still valid
        p.write_bytes(buf[:cut])
        with GGUFFile(p) as f:
            assert np.array_equal(f.tensor("b.weight"), GGUFFile(tmp_path / "small.gguf").tensor("b.weight"))


def test_bad_magic_and_version(tmp_path, base):
    buf, _ = base
    open_error(tmp_path, b"GGML" + buf[4:], r"bad magic 'GGML'", "expected 'GGUF'")
    open_error(tmp_path, b"\0\0\0\0" + buf[4:], r"bad magic")
    open_error(tmp_path, patch(buf, 4, "I", 1), r"unsupported GGUF version 1")
    open_error(tmp_path, patch(buf, 4, "I", 4), r"unsupported GGUF version 4")
    open_error(tmp_path, patch(buf, 4, "I", 0), r"version")
    open_error(tmp_path, patch(buf, 4, "I", 0x03000000), r"byte-swapped|big-endian")
    open_error(tmp_path, b"", r"empty")
    with pytest.raises(CloverError, match="cannot open"):
        GGUFFile(tmp_path / "does-not-exist.gguf")
    with pytest.raises(CloverError, match="not a regular file"):
        GGUFFile(tmp_path)


def test_counts_larger_than_the_file(tmp_path, base):
    buf, _ = base
    open_error(tmp_path, patch(buf, 8, "Q", 2 ** 40), r"tensor count 1099511627776 too large")
    open_error(tmp_path, patch(buf, 8, "Q", U64 - 1), r"tensor count 18446744073709551615 too large")
    open_error(tmp_path, patch(buf, 16, "Q", 2 ** 60), r"kv count 1152921504606846976 too large")
    open_error(tmp_path, patch(buf, 16, "Q", U64 - 1), r"kv count \d+ too large")
    # plausible but wrong counts: the next section is misparsed, which must still be an error
    n_t, n_kv = struct.unpack_from("<QQ", buf, 8)
    open_error(tmp_path, patch(buf, 8, "Q", n_t + 1), r"tensor")
    open_error(tmp_path, patch(buf, 16, "Q", n_kv + 1), r"tensor|kv")


def test_huge_string_lengths(tmp_path, base):
    buf, lay = base
    big = 2 ** 63
    kv = lay["kv"]["general.name"]
    open_error(tmp_path, patch(buf, kv["start"], "Q", big),
               rf"kv \d+: key: string length {big} exceeds remaining \d+ bytes")
    open_error(tmp_path, patch(buf, kv["value_pos"], "Q", big),
               rf"kv \d+ \(key 'general.name'\): string value: string length {big} exceeds remaining \d+ bytes")
    arr = lay["kv"]["t.arr_str"]
    second = arr["value_pos"] + 8 + 1  # after string 0 ("a")
    open_error(tmp_path, patch(buf, second, "Q", big), rf"key 't.arr_str'\): string 1: string length {big} exceeds")
    open_error(tmp_path, patch(buf, arr["count_pos"], "Q", 2 ** 61), r"array of 2305843009213693952 strings exceeds")
    ints = lay["kv"]["t.arr_i32"]
    open_error(tmp_path, patch(buf, ints["count_pos"], "Q", 2 ** 62),
               r"key 't.arr_i32'\): array of 4611686018427387904 int32 values \(4 bytes each\) exceeds remaining")
    t0 = lay["tensors"][0]
    open_error(tmp_path, patch(buf, t0["start"], "Q", big), rf"tensor 0: name: string length {big} exceeds")


def test_bad_value_types(tmp_path, base):
    buf, lay = base
    open_error(tmp_path, patch(buf, lay["kv"]["t.u8"]["type_pos"], "I", 13),
               r"key 't.u8'\): value type 13 is not a GGUF type")
    arr = lay["kv"]["t.arr_i32"]
    open_error(tmp_path, patch(buf, arr["elem_type_pos"], "I", 13), r"array element type 13 is not a GGUF type")
    open_error(tmp_path, patch(buf, arr["elem_type_pos"], "I", 9), r"nested arrays")
    open_error(tmp_path, patch(buf, lay["kv"]["t.u8"]["start"], "Q", 0), r"empty key")


def test_duplicates(tmp_path, base):
    buf, lay = base
    i8 = lay["kv"]["t.i8"]
    msg = open_error(tmp_path, patch(buf, i8["start"] + 8, "4s", b"t.u8"), r"key 't.u8'\): duplicate key")
    assert re.search(r"first defined by kv \d+", msg)
    # blk.0.attn_k.weight -> blk.0.attn_q.weight (same length)
    k = tensor_entry(lay, "blk.0.attn_k.weight")
    open_error(tmp_path, patch(buf, k["start"] + 8, "19s", b"blk.0.attn_q.weight"),
               r"tensor blk.0.attn_q.weight: duplicate tensor name")


def test_bad_shapes(tmp_path, base):
    buf, lay = base
    t = tensor_entry(lay, "t.f16_2d")
    open_error(tmp_path, patch(buf, t["n_dims_pos"], "I", 5), r"tensor t.f16_2d: n_dims 5 not in 1..4")
    open_error(tmp_path, patch(buf, t["n_dims_pos"], "I", 0), r"n_dims 0 not in 1..4")
    open_error(tmp_path, patch(buf, t["ne_pos"], "q", -1), r"tensor t.f16_2d: ne\[0\] = -1 is negative")
    open_error(tmp_path, patch(buf, t["ne_pos"], "QQ", 2 ** 32, 2 ** 32),
               r"tensor t.f16_2d: shape \{4294967296, 4294967296, 1, 1\}: element count overflows")
    # element count fits int64 but the byte size (x4 for F32) does not fit 64 bits
    f = tensor_entry(lay, "blk.0.attn_k.weight")
    open_error(tmp_path, patch(buf, f["ne_pos"], "QQ", 2 ** 61, 2), r"blk.0.attn_k.weight: byte size .* overflows")
    q = tensor_entry(lay, "blk.0.attn_q.weight")
    open_error(tmp_path, patch(buf, q["ne_pos"], "Q", 33),
               r"blk.0.attn_q.weight: row length ne\[0\] = 33 is not a multiple of the Q8_0 block size 32")


def test_unknown_tensor_types(tmp_path, base):
    buf, lay = base
    t = tensor_entry(lay, "blk.0.attn_q.weight")
    open_error(tmp_path, patch(buf, t["type_pos"], "I", 3),
               r"tensor blk.0.attn_q.weight: ggml type 3 \(Q4_1\) is not supported by this engine "
               r"\(supported: F32, F16, BF16, Q8_0, Q4_0, Q2_K, Q3_K, Q4_K,")
    open_error(tmp_path, patch(buf, t["type_pos"], "I", 1000), r"ggml type 1000 \(unknown\) is not supported")


def test_bad_offsets_and_alignment(tmp_path, base):
    buf, lay = base
    last = max(lay["tensors"], key=lambda t: t["offset"])
    name = re.escape(last["name"])
    past = last["offset"] + 1024 * lay["alignment"]
    open_error(tmp_path, patch(buf, last["offset_pos"], "Q", past),
               rf"tensor {name}: offset {past} \+ size \d+ past end of file \({len(buf)} bytes")
    open_error(tmp_path, patch(buf, last["offset_pos"], "Q", U64 - 32), rf"tensor {name}: offset \d+ .*past end")
    open_error(tmp_path, patch(buf, last["offset_pos"], "Q", last["offset"] + 1),
               rf"tensor {name}: data offset {last['offset'] + 1} is not a multiple of the alignment 32")


def test_bad_alignment_key(tmp_path):
    p = tmp_path / "a64.gguf"
    write_gguf(p, alignment=64)
    buf = p.read_bytes()
    kv = layout(buf)["kv"]["general.alignment"]
    open_error(tmp_path, patch(buf, kv["value_pos"], "I", 48), r"general.alignment'\): alignment 48 is not a power")
    open_error(tmp_path, patch(buf, kv["value_pos"], "I", 0), r"alignment 0 is not a power of two")
    open_error(tmp_path, patch(buf, kv["type_pos"], "I", 5), r"general.alignment'\): type int32, expected uint32")


def test_type_names_are_ggml_s():
    """clover_type_name: ggml's names for ids 0..39 as gguf-py numbers them, None for the ids ggml
    removed and for ids outside 0..39 (the table's range)."""
    from gguf import GGMLQuantizationType

    from clover_gguf._ffi import ffi, lib

    defined = {int(t): t.name for t in GGMLQuantizationType if int(t) < 40}
    for i in range(-2, 45):
        p = lib.clover_type_name(i)
        got = ffi.string(p).decode() if p != ffi.NULL else None
        assert got == defined.get(i), i
    assert [ffi.string(lib.clover_type_name(i)).decode() for i in (0, 1, 2, 8, 12, 14, 30)] == \
        ["F32", "F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "BF16"]
