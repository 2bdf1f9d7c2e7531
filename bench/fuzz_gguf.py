#!/usr/bin/env python3
"""A fuzz campaign of the GGUF reader and model loader under ASan + UBSan (docs/reliability.md).

Builds libclover and tests/fuzz/fuzz_gguf.c with ``-DCLOVER_SANITIZE=ON -DCLOVER_FUZZ=ON`` into
--build, writes the seed files into --seeds (once: a small file with every KV type, the embedded
model, the tiny test model converted to each engine weight type, both architectures, and its
diffusion sidecar), runs
the mutator for --iters inputs from --seed, then every prefix of the small files (--truncate) and
the regression corpus, and prints the harness's JSON lines. Inputs that crash are written to
--crashes; copy them into tests/fuzz/corpus/ once fixed. The test suite runs the same harness
with 100,000 inputs (tests/native/test_fuzz.py).

    python bench/fuzz_gguf.py --iters 1000000 --seed 2      # about 50 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout; tests/reference as `reference`

CONVERTED = [("q8_0", None, True), ("f32", "qwen35moe", False), ("q8_0", "qwen35moe", True),
             ("bf16", "qwen35moe", False), ("q4_k_m", None, True), ("q6_k", None, True), ("iq4_xs", None, True),
             ("q4_0", None, True), ("f16", None, True)]
SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:allocator_may_return_null=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:abort_on_error=1"}


def small_kv_file(path: pathlib.Path) -> pathlib.Path:
    """A small valid GGUF with every KV value type, string and numeric arrays, general.alignment
    64 and F32/F16/BF16/Q8_0 tensors of 1-4 dims."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(7)
    w = GGUFWriter(str(path), "clover_moe")
    w.add_uint32("general.alignment", 64)
    w.add_uint8("k.u8", 200), w.add_int8("k.i8", -5), w.add_uint16("k.u16", 60000), w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 7), w.add_int32("k.i32", -7), w.add_float32("k.f32", 0.5), w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo"), w.add_uint64("k.u64", 2**40), w.add_int64("k.i64", -2**40)
    w.add_float64("k.f64", 1e-300)
    w.add_array("k.arr_i32", [1, -2, 3]), w.add_array("k.arr_str", ["a", "", "ccc"])
    w.add_array("k.arr_f32", [0.25, 0.5])
    for name, qt, shape in [("t.f32", QT.F32, (7,)), ("t.f16", QT.F16, (3, 5)), ("t.bf16", QT.BF16, (2, 3, 4)),
                            ("t.q8", QT.Q8_0, (2, 1, 2, 64))]:
        x = rng.standard_normal(shape).astype(np.float32)
        if qt == QT.F32:
            w.add_tensor(name, x)
        elif qt == QT.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def make_seeds(out: pathlib.Path) -> list[pathlib.Path]:
    """The seed files (written once into out)."""
    import clover_gguf
    from clover_gguf.convert.convert import convert
    from reference.checkpoint import make_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    files = [out / "kv.gguf", out / "embedded.gguf"]
    if not files[0].exists():
        small_kv_file(files[0])
    if not files[1].exists():
        shutil.copy(clover_gguf.DEFAULT_MODEL, files[1])
    ckpts: dict[bool, pathlib.Path] = {}
    for outtype, arch, clover in CONVERTED:
        p = out / f"{outtype}-{arch or 'auto'}-{'clover' if clover else 'parent'}.gguf"
        if not p.exists():
            if clover not in ckpts:
                ckpts[clover] = make_checkpoint(pathlib.Path(tempfile.mkdtemp()), clover=clover)
            convert(ckpts[clover], p, outtype=outtype, arch=arch, progress=False)
        files.append(p)
    sidecar = out / "clover-sidecar.diffusion.gguf"
    if not sidecar.exists():
        if True not in ckpts:
            ckpts[True] = make_checkpoint(pathlib.Path(tempfile.mkdtemp()), clover=True)
        convert(ckpts[True], sidecar, diffusion_only=True, progress=False)
    return files + [sidecar]


def build(build_dir: pathlib.Path) -> pathlib.Path:
    """libclover (ASan + UBSan, no CUDA) and the harness in build_dir; returns the harness path.
    Raises CalledProcessError (with the output) when CMake fails."""
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DCLOVER_SANITIZE=ON", "-DCLOVER_FUZZ=ON", "-DCLOVER_CUDA=OFF"], check=True, capture_output=True,
                   text=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j2"], check=True, capture_output=True, text=True)
    return build_dir / "fuzz_gguf"


def run(harness: pathlib.Path, args: list[str]) -> tuple[int, dict | None, str]:
    r = subprocess.run([str(harness), *args], capture_output=True, text=True, env=dict(os.environ, **SAN_ENV))
    lines = r.stdout.strip().splitlines()
    return r.returncode, json.loads(lines[-1]) if lines else None, r.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--build", default=str(ROOT / "build-san"))
    ap.add_argument("--seeds", default=str(ROOT / "build-san" / "seeds"))
    ap.add_argument("--crashes", default=str(ROOT / "build-san" / "crashes"))
    ap.add_argument("--forward-every", type=int, default=16)
    a = ap.parse_args(argv)
    harness = build(pathlib.Path(a.build))
    seeds = make_seeds(pathlib.Path(a.seeds))
    crashes = pathlib.Path(a.crashes)
    crashes.mkdir(parents=True, exist_ok=True)
    corpus = sorted((ROOT / "tests" / "fuzz" / "corpus").glob("*.gguf"))
    status = 0
    for args in (["--iters", str(a.iters), "--seed", str(a.seed), "--forward-every", str(a.forward_every)],
                 ["--truncate-all"], ["--replay"]):
        files = seeds[:2] if args == ["--truncate-all"] else corpus if args == ["--replay"] else seeds
        t0 = time.time()
        rc, rep, err = run(harness, [*args, "--out", str(crashes), *map(str, files)])
        print(json.dumps({"exit": rc, "wall_s": round(time.time() - t0, 1), **(rep or {})}), flush=True)
        if rc != 0:
            sys.stderr.write(err[-8000:])
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
