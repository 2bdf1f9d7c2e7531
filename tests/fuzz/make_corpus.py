#!/usr/bin/env python3
"""Write the hand-made part of the GGUF regression corpus (tests/fuzz/corpus/).

Each file is a small GGUF built byte by byte with one hostile field, after the classes of bug in
llama.cpp's published GGUF advisories (wrapped size computations, unchecked counts, string
lengths and offsets) and in other readers (huge counts that make a reader loop or allocate).
The fuzz harness replays every file of the corpus (``fuzz_gguf --replay``) under the sanitisers,
and tests/native/test_fuzz.py checks that the reader refuses each with a message naming the field.
Inputs the fuzzer finds crashing are added to the corpus as they are (``crash-*.gguf``).

    python tests/fuzz/make_corpus.py            # rewrites the hand-made files
"""
from __future__ import annotations

import pathlib
import struct

CORPUS = pathlib.Path(__file__).resolve().parent / "corpus"
U64 = 2**64 - 1


def s(text: bytes | str) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv_u32(key: str, v: int) -> bytes:
    return s(key) + struct.pack("<II", 4, v)


def kv_str(key: str, v: str) -> bytes:
    return s(key) + struct.pack("<I", 8) + s(v)


def tensor(name: str, dims: list[int], typ: int, off: int) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", typ, off)


def gguf(kvs: list[bytes], tensors: list[bytes], n_kv=None, n_t=None, data=b"", version=3, magic=b"GGUF",
         align=32) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_t is None else n_t,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    pad = (-len(body)) % align if align else 0
    return body + b"\0" * pad + data


ARCH = kv_str("general.architecture", "clover")
F32x8 = struct.pack("<8f", *range(8))

CASES: dict[str, bytes] = {
    "empty": b"",
    "magic_only": b"GGUF",
    "bad_magic": gguf([ARCH], [], magic=b"GGML"),
    "version_1": gguf([ARCH], [], version=1),
    "version_huge": gguf([ARCH], [], version=0xFFFFFFFF),
    "n_kv_huge": gguf([ARCH], [], n_kv=2**63),
    "n_kv_wraps": gguf([ARCH], [], n_kv=U64),
    "n_tensors_huge": gguf([ARCH], [], n_t=2**62),
    "n_tensors_wraps_with_kv": gguf([ARCH], [], n_t=U64 // 33 + 1),
    "key_len_wraps": struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", U64) + b"x" * 16,
    "key_len_past_end": struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1000) + b"general",
    "key_with_nul": gguf([s(b"general.\0rchitecture") + struct.pack("<I", 8) + s("clover")], []),
    "empty_key": gguf([s("") + struct.pack("<II", 4, 1)], []),
    "duplicate_key": gguf([ARCH, ARCH], []),
    "value_type_13": gguf([s("a.b") + struct.pack("<II", 13, 0)], []),
    "value_type_huge": gguf([s("a.b") + struct.pack("<II", 0xFFFFFFFF, 0)], []),
    "string_len_wraps": gguf([s("a.b") + struct.pack("<IQ", 8, U64 - 7) + b"abcdefgh"], []),
    "string_len_past_end": gguf([s("a.b") + struct.pack("<IQ", 8, 2**40) + b"abc"], []),
    "array_nested": gguf([s("a.b") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 1) + b"\0" * 4], []),
    "array_type_bad": gguf([s("a.b") + struct.pack("<IIQ", 9, 77, 1) + b"\0" * 8], []),
    "array_n_times_size_wraps": gguf([s("a.b") + struct.pack("<IIQ", 9, 10, 2**61 + 1) + b"\0" * 16], []),
    "array_strings_huge": gguf([s("a.b") + struct.pack("<IIQ", 9, 8, 2**60) + s("x")], []),
    "array_string_len_wraps": gguf([s("a.b") + struct.pack("<IIQ", 9, 8, 2) + s("x") +
                                    struct.pack("<Q", U64) + b"y" * 8], []),
    "n_dims_5": gguf([ARCH], [s("t") + struct.pack("<I", 5) + struct.pack("<5Q", 1, 1, 1, 1, 8) +
                              struct.pack("<IQ", 0, 0)], data=F32x8),
    "n_dims_huge": gguf([ARCH], [s("t") + struct.pack("<I", 0xFFFFFFFF) + b"\0" * 64], data=F32x8),
    "dim_zero": gguf([ARCH], [tensor("t", [0, 8], 0, 0)], data=F32x8),
    "dim_negative": gguf([ARCH], [tensor("t", [2**63, 1], 0, 0)], data=F32x8),
    "dims_product_wraps": gguf([ARCH], [tensor("t", [2**32, 2**32, 2], 0, 0)], data=F32x8),
    "dims_bytes_wrap": gguf([ARCH], [tensor("t", [2**62, 1], 0, 0)], data=F32x8),
    "dim_not_block_multiple": gguf([ARCH], [tensor("t", [31], 8, 0)], data=b"\0" * 64),
    "tensor_type_unknown": gguf([ARCH], [tensor("t", [8], 99, 0)], data=F32x8),
    "tensor_type_huge": gguf([ARCH], [tensor("t", [8], 0xFFFFFFFF, 0)], data=F32x8),
    "tensor_offset_past_end": gguf([ARCH], [tensor("t", [8], 0, 4096)], data=F32x8),
    "tensor_offset_wraps": gguf([ARCH], [tensor("t", [8], 0, U64 - 15)], data=F32x8),
    "tensor_offset_misaligned": gguf([ARCH], [tensor("t", [4], 0, 4), tensor("u", [1], 0, 0)], data=F32x8),
    "tensor_name_len_wraps": gguf([ARCH], [struct.pack("<Q", U64) + b"t" * 24], data=F32x8),
    "tensor_name_empty": gguf([ARCH], [tensor("", [8], 0, 0)], data=F32x8),
    "duplicate_tensor": gguf([ARCH], [tensor("t", [8], 0, 0), tensor("t", [8], 0, 0)], data=F32x8),
    "alignment_zero": gguf([ARCH, kv_u32("general.alignment", 0)], [tensor("t", [8], 0, 0)], data=F32x8),
    "alignment_not_power_of_two": gguf([ARCH, kv_u32("general.alignment", 48)], [tensor("t", [8], 0, 0)],
                                       data=F32x8, align=48),
    "alignment_huge": gguf([ARCH, kv_u32("general.alignment", 2**31)], [tensor("t", [8], 0, 0)], data=F32x8),
    "alignment_wrong_type": gguf([ARCH, kv_str("general.alignment", "32")], [tensor("t", [8], 0, 0)],
                                 data=F32x8),
    "data_truncated": gguf([ARCH], [tensor("t", [64], 0, 0)], data=F32x8),
}


def main() -> int:
    CORPUS.mkdir(exist_ok=True)
    for name, data in CASES.items():
        (CORPUS / f"{name}.gguf").write_bytes(data)
    print(f"wrote {len(CASES)} files to {CORPUS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
