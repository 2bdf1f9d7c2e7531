"""GGUF files read through the validating native reader (native/core/gguf.c, spec 4).

``GGUFFile(path)`` opens and validates a GGUF v2/v3 file with ``clover_gguf_open``: every
count, string length, value type, shape, tensor type, byte size, offset and the alignment
are checked before anything is used, and a bad file raises :class:`CloverError` with the C
message naming the field and value. Nothing here imports torch or the ``gguf`` package.

    with GGUFFile("model.gguf") as f:
        f.metadata["general.architecture"]      # 'clover'
        f.tensors[0]                            # {'name': ..., 'type': 'Q8_0', 'shape': [2048, 512], ...}
        w = f.tensor("blk.0.attn_q.weight")     # numpy float32, shape reversed from ne
"""
from __future__ import annotations

import os
from typing import Any

from ._ffi import CloverError, err_buf, ffi, lib, raise_error

__all__ = ["GGUFFile", "CloverError", "type_name"]


def type_name(t: int) -> str:
    """ggml's name of tensor type id ``t`` ("Q4_K"), from the engine's type table
    (``clover_type_name``); the number itself for an id ggml does not define."""
    name = lib.clover_type_name(t)
    return ffi.string(name).decode() if name != ffi.NULL else str(t)


_FLOAT_TYPES = (lib.CLOVER_GGUF_FLOAT32, lib.CLOVER_GGUF_FLOAT64)
_UNSIGNED_TYPES = (lib.CLOVER_GGUF_UINT8, lib.CLOVER_GGUF_UINT16, lib.CLOVER_GGUF_UINT32,
                   lib.CLOVER_GGUF_UINT64)


def read_metadata(g, arrays: bool = True) -> dict[str, Any]:
    """The key-value metadata of the native GGUF handle ``g`` (a ``clover_gguf *``), in file
    order: numbers, bools and strings as Python values, arrays as lists (left out with
    ``arrays=False``)."""
    lenp = ffi.new("size_t *")
    out: dict[str, Any] = {}
    for i in range(lib.clover_gguf_n_kv(g)):
        key = ffi.string(lib.clover_gguf_key(g, i)).decode("utf-8", "replace")
        t = lib.clover_gguf_kv_type(g, i)
        if t != lib.CLOVER_GGUF_ARRAY:
            out[key] = _read_values(g, i, t, 1, lenp)[0]
        elif arrays:
            out[key] = _read_values(g, i, lib.clover_gguf_arr_type(g, i), lib.clover_gguf_arr_n(g, i), lenp)
    return out


def _read_values(g, i: int, t: int, n: int, lenp) -> list:
    # Bind the per-element callables once: a 250k-entry vocabulary is one call each.
    if t == lib.CLOVER_GGUF_STRING:
        get, unpack = lib.clover_gguf_get_str, ffi.unpack
        if n > 1:
            # native/core/gguf.c stores the strings of one KV back to back, each NUL-terminated:
            # read them in one copy and split, unless a string holds a NUL itself.
            first = get(g, i, 0, ffi.NULL)
            last = get(g, i, n - 1, lenp)
            parts = unpack(ffi.cast("char *", first), (last - first) + lenp[0]).split(b"\0")
            if len(parts) == n:
                return [s.decode("utf-8", "replace") for s in parts]
        return [unpack(get(g, i, j, lenp), lenp[0]).decode("utf-8", "replace") for j in range(n)]
    if t in _FLOAT_TYPES:
        get = lib.clover_gguf_get_f64
        return [get(g, i, j) for j in range(n)]
    if t == lib.CLOVER_GGUF_BOOL:
        get = lib.clover_gguf_get_i64
        return [get(g, i, j) != 0 for j in range(n)]
    get = lib.clover_gguf_get_u64 if t in _UNSIGNED_TYPES else lib.clover_gguf_get_i64
    return [get(g, i, j) for j in range(n)]


class GGUFFile:
    """A validated, memory-mapped GGUF file.

    Attributes (read at open):
      ``path``: the path given.
      ``version``: GGUF version (2 or 3).
      ``metadata``: dict key -> value in file order; scalars become int/float/bool/str,
        arrays become lists of those. Strings are decoded as UTF-8 with errors='replace';
        float32 values are exact as Python floats.
      ``tensors``: list of dicts in file order with ``name`` (str), ``type`` ('F32', 'F16',
        'BF16' or 'Q8_0'), ``shape`` (list of ints, ggml ``ne`` order: shape[0] is the
        contiguous row length), ``offset`` (absolute file offset of the data) and
        ``nbytes``.

    Raises CloverError (a RuntimeError) if the file cannot be opened or fails validation;
    the message names the file and the problem. Use as a context manager or call
    :meth:`close`; the mapping is also released when the object is garbage collected.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        err = err_buf()
        g = lib.clover_gguf_open(os.fsencode(self.path), err, len(err))
        if g == ffi.NULL:
            raise_error(err)
        self._g = ffi.gc(g, lib.clover_gguf_close)
        self.version = int(lib.clover_gguf_version(g))
        self.metadata = read_metadata(g)
        self.tensors = self._read_tensors()
        self._by_name = {t["name"]: i for i, t in enumerate(self.tensors)}

    # ------------------------------------------------------------------ reading
    def _handle(self):
        if self._g is None:
            raise CloverError(f"{self.path}: GGUF file is closed")
        return self._g

    def _read_tensors(self) -> list[dict[str, Any]]:
        g = self._g
        out = []
        for t in range(lib.clover_gguf_n_tensors(g)):
            n_dims = lib.clover_gguf_tensor_n_dims(g, t)
            ty = lib.clover_gguf_tensor_type(g, t)
            out.append({
                "name": ffi.string(lib.clover_gguf_tensor_name(g, t)).decode("utf-8", "replace"),
                "type": type_name(ty),
                "shape": [int(lib.clover_gguf_tensor_ne(g, t, d)) for d in range(n_dims)],
                "offset": int(lib.clover_gguf_tensor_offset(g, t)),
                "nbytes": int(lib.clover_gguf_tensor_nbytes(g, t)),
            })
        return out

    # ------------------------------------------------------------------ public
    def tensor(self, name: str):
        """Tensor ``name`` converted to float32 (F16/BF16 widened exactly, Q8_0 dequantised
        as d*q) as a new numpy array of shape ``reversed(ne)`` (numpy row-major, so the last
        axis is the GGUF row). Raises KeyError for an unknown name, CloverError if closed."""
        import numpy as np

        g = self._handle()
        if name not in self._by_name:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        t = self._by_name[name]
        shape = tuple(reversed(self.tensors[t]["shape"]))
        n = 1
        for d in shape:
            n *= d
        out = np.empty(n, dtype=np.float32)
        err = err_buf()
        rc = lib.clover_gguf_tensor_to_f32(g, t, ffi.from_buffer("float[]", out), n, err, len(err))
        if rc != 0:
            raise_error(err, self.path)
        return out.reshape(shape)

    def close(self) -> None:
        """Unmap the file and free the reader; further tensor() calls raise CloverError.
        Idempotent."""
        if self._g is not None:
            ffi.release(self._g)
            self._g = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._g is None else f"{len(self.metadata)} keys, {len(self.tensors)} tensors"
        return f"GGUFFile({self.path!r}, v{self.version}, {state})"
