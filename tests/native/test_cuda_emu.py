"""The CUDA backend's code run on a machine without a GPU.

native/cuda is built by the host C++ compiler against the CUDA emulator (native/cuda/emu,
``-DCLOVER_CUDA=EMU``, about 40 s), and every test of tests/native/test_cuda.py then runs against that
library in a child pytest: each kernel against the CPU engine, whole-model logits and greedy
tokens in all three modes, and the GPU placements; then the kernel tests and the F32
whole-model test once more with each block's threads run in the opposite order
(CLOVER_EMU_ORDER=reverse). The emulator runs
the threads of a block as fibers that switch at barriers and warp shuffles; what it checks and
what it cannot is in native/cuda/emu/cuda_runtime.h. A pass here is not a GPU run (bench/device_check.sh).
"""
from __future__ import annotations

import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# tests/native/test_cuda.py's kernel-level tests (seconds under the emulator) and the F32 whole-model
# test (the resident forward's kernels; 30 s), for the run in reverse thread order
KERNEL_TESTS = "matmul or experts or attention or gdn or routing or combine or greedy_and or kv_store or (whole_model and f32)"


@pytest.mark.slow
def test_cuda_tests_pass_under_the_emulator(tmp_path):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the CUDA emulator's context switch is x86-64 only")
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.fail("cmake and a C++ compiler are needed to build the emulated CUDA backend")
    build = tmp_path / "emubuild"
    for cmd in (["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DCLOVER_CUDA=EMU"],
                ["cmake", "--build", str(build), "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    env = dict(os.environ, CLOVER_LIB=str(build / "libclover.so"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "native" / "test_cuda.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    summary = r.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    skipped = int(m.group(1)) if (m := re.search(r"(\d+) skipped", summary)) else 0
    # only the two tests of a machine without a GPU are skipped: every GPU test ran
    assert skipped == 2 and out.count("a GPU is present: CUDA device 0: CUDA emulator") == 2, out[-3000:]
    assert passed >= 50 and "failed" not in summary, summary
    print(summary)
    # the kernel tests (and the resident forward) again with the threads of each block run in the
    # opposite order: a result
    # that depends on the order threads run between barriers would be a race on a GPU
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", KERNEL_TESTS,
                        str(ROOT / "tests" / "native" / "test_cuda.py")], cwd=ROOT, env=dict(env, CLOVER_EMU_ORDER="reverse"),
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    assert int(re.search(r"(\d+) passed", r.stdout.strip().splitlines()[-1]).group(1)) >= 50
