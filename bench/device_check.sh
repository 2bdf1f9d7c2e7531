#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU and no network (issue 7 item 4): build with the
# CUDA backend, run the GPU tests, time the kernels alone (bench/gpu_kernels.py: products per type,
# attention over 4096 keys), then on the real-dims 4-layer Q4_K_M model (generated here): greedy
# tokens of every mode on the GPU vs the CPU, and a short benchmark (pp512, tg128, block
# forward, tokens/s per mode; the GPU also after a 4096-token prefix) on the GPU and on the CPU.
# Target: under 8 minutes on an H200.
#
#   bash bench/device_check.sh [OUT_DIR]        # logs and JSON go to /tmp/clover-device-logs, packed at each
#                                                # step into OUT_DIR/logs.tgz (default $OUT or /tmp/clover-device):
#                                                # the device tool brings back at most 8 files
#   CLOVER_DEVICE_FULL=1 bash bench/device_check.sh   # also the 40-layer model: all on the GPU, experts on
#                                                      # the CPU, a 12 GB budget (issue 8; several minutes more)
#
# Python packages the machine lacks travel as wheels in .whl/ (cffi, pycparser, gguf), and the real
# model's config in shared/data: bench/device_prep.sh puts both there before the call (carry
# [".whl", "shared"]); the wheels are installed into /tmp/site when present. Each step has a time
# limit, so one hang costs that step only; the steps run in order of what they prove.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-${OUT:-/tmp/clover-device}}"
out=/tmp/clover-device-logs
rm -rf "$out" && mkdir -p "$out" "$dest"
pack() { tar czf "$dest/logs.tgz" -C "$out" . 2>/dev/null || true; }  # at every step: a run the tool
trap pack EXIT                                                          # stops still brings back its logs
export PYTHONUNBUFFERED=1
py=python3
if ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
t0=$(date +%s)
step() { pack; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
step "build (CLOVER_CUDA=ON)"
cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DCLOVER_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
    > "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
timeout -k 10 300 cmake --build build-cuda -j"$(nproc)" >> "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
export CLOVER_LIB="$PWD/build-cuda/libclover.so"
$py -c "from clover_gguf._ffi import lib, ffi; b = ffi.new('char[]', 256); n = lib.clover_gpu_devices(b, 256); \
print(n, ffi.string(b).decode()); raise SystemExit(0 if n > 0 else 1)"

step "GPU tests (tests/test_cuda.py)"
set +e
ptimeout=$($py -c "import pytest_timeout" 2>/dev/null && echo "--timeout=120" || true)  # a hung test fails alone
timeout -k 10 300 $py -m pytest -q -rs -p no:cacheprovider $ptimeout tests/test_cuda.py 2>&1 | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}
set -e

step "kernels alone (bench/gpu_kernels.py): products with and without tensor cores, attention; us, GB/s, % of copy bw"
timeout -k 10 90 $py bench/gpu_kernels.py --json | tee "$out/kernels.txt" || true

step "real-dims 4-layer Q4_K_M model"
model=/tmp/clover-real4-q4km.gguf
[ -f "$model" ] || timeout -k 10 240 $py bench/make_bench_model.py "$model" --dims real --layers 4 --outtype q4_k_m \
    --arch clover --unique-experts 16 --no-progress -t "$(nproc)" > "$out/make_model.log" 2>&1 \
    || { tail -30 "$out/make_model.log"; exit 1; }

step "modes on the GPU (-ngl all) and the CPU: tokens/s and greedy tokens"
timeout -k 10 120 $py bench/modes.py "$model" -n 64 -t "$(nproc)" -ngl -1 --json | tee "$out/modes_gpu.txt" | tail -1 \
    > "$out/modes_gpu.json" || true
timeout -k 10 120 $py bench/modes.py "$model" -n 64 -t "$(nproc)" --json | tee "$out/modes_cpu.txt" | tail -1 \
    > "$out/modes_cpu.json" || true
grep -v '^{' "$out/modes_gpu.txt" "$out/modes_cpu.txt" || true
$py - "$out/modes_gpu.json" "$out/modes_cpu.json" <<'PY' || echo "(no comparison: a modes run failed, see its log above)"
import json, sys
g, c = (json.load(open(p)) for p in sys.argv[1:3])
ok = True
for mode in c:
    same = g[mode]["ids"] == c[mode]["ids"]
    ok &= same
    print(f"{mode:9s} GPU {g[mode]['tokens_per_second']:8.1f} t/s  CPU {c[mode]['tokens_per_second']:8.1f} t/s  "
          f"tokens/forward {g[mode]['tokens_per_forward']:.2f}  greedy tokens identical: {same}")
print("greedy tokens identical in all modes:", ok)
if "spec" in g:
    print("on the GPU, spec's tokens equal ar's, per prompt:", g["spec"]["spec_equals_ar"])
PY

step "modes on the GPU without CUDA graphs (CLOVER_CUDA_GRAPHS=0): tokens/s, and the graphs' speed-up"
CLOVER_CUDA_GRAPHS=0 timeout -k 10 90 $py bench/modes.py "$model" -n 64 -t "$(nproc)" -ngl -1 --json | tail -1 \
    > "$out/modes_gpu_nographs.json" || true
$py - "$out/modes_gpu.json" "$out/modes_gpu_nographs.json" <<'PY' || echo "(no comparison)"
import json, sys
g, n = (json.load(open(p)) for p in sys.argv[1:3])
for mode in g:
    a, b = g[mode]["tokens_per_second"], n[mode]["tokens_per_second"]
    print(f"{mode:9s} graphs {a:8.1f} t/s  no graphs {b:8.1f} t/s  x{a / b:.2f}  same tokens: {g[mode]['ids'] == n[mode]['ids']}")
PY

step "bench (pp512, tg128, block forward): GPU (resident forward, then the per-product path), then CPU"
timeout -k 10 60 $py -m clover_gguf.cli bench -m "$model" -ngl all -p 512 -n 128 -r 2 | tee "$out/bench_gpu.txt" || true
CLOVER_GPU_RESIDENT=0 timeout -k 10 60 $py -m clover_gguf.cli bench -m "$model" -ngl all -p 512 -n 128 -r 2 \
    | tee "$out/bench_gpu_per_product.txt" || true
step "bench on the GPU without tensor cores (CLOVER_CUDA_MMA=0: dp4a for every product)"
CLOVER_CUDA_MMA=0 timeout -k 10 60 $py -m clover_gguf.cli bench -m "$model" -ngl all -p 512 -n 128 -r 2 \
    | tee "$out/bench_gpu_dp4a.txt" || true
step "bench on the GPU after a 4096-token prefix (-d 4096): attention over a long cache, with and without tensor cores"
timeout -k 10 60 $py -m clover_gguf.cli bench -m "$model" -ngl all -p 512 -n 32 -d 4096 -r 1 \
    | tee "$out/bench_gpu_d4096.txt" || true
CLOVER_CUDA_MMA=0 timeout -k 10 60 $py -m clover_gguf.cli bench -m "$model" -ngl all -p 512 -n 32 -d 4096 -r 1 \
    | tee "$out/bench_gpu_d4096_no_mma.txt" || true
timeout -k 10 90 $py -m clover_gguf.cli bench -m "$model" -p 512 -n 128 -r 2 | tee "$out/bench_cpu.txt" || true
if [ "${CLOVER_DEVICE_FULL:-0}" = 1 ]; then  # issue 8: the full 40-layer model and placements
    step "40-layer real-dims Q4_K_M model (about 20 GiB, generated here)"
    full=/tmp/clover-real40-q4km.gguf
    [ -f "$full" ] || timeout -k 10 540 $py bench/make_bench_model.py "$full" --dims real --layers 40 \
        --outtype q4_k_m --arch clover --unique-experts 16 --no-progress -t "$(nproc)" > "$out/make_full.log" 2>&1 \
        || { tail -30 "$out/make_full.log"; exit 1; }
    bw=$($py -c "import torch; x = torch.empty(2**31, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x); \
torch.cuda.synchronize(); import time; t = time.perf_counter(); [y.copy_(x) for _ in range(20)]; torch.cuda.synchronize(); \
print(2 * 20 * x.numel() / (time.perf_counter() - t))" 2>/dev/null || echo 0)
    echo "device copy bandwidth (read + write): $bw bytes/s"
    for placement in "-ngl all" "-ngl all --cpu-moe" "--fit --gpu-budget 12G"; do
        step "placement: $placement"
        $py -m clover_gguf.cli fit -m "$full" $placement | tee -a "$out/placements.txt" || true
        $py -m clover_gguf.cli bench -m "$full" $placement -p 512 -n 64 -r 1 --json > "$out/bench_full.json" || true
        $py - "$out/bench_full.json" "$bw" <<'PY' || echo "(no bench figures for this placement)"
import json, sys
r = json.load(open(sys.argv[1])); bw = float(sys.argv[2])
bpt = r["model"]["bytes_per_token"]
for t in r["results"]:
    tps = t["tokens_per_second_mean"]
    extra = f", {100 * tps * bpt / bw:.0f}% of the bandwidth limit" if t["test"].startswith("tg") and bw else ""
    print(f"{t['test']}: {tps:.2f} t/s{extra}")
print("block forward / tg step:", r.get("block_vs_tg"))
PY
        if [ "$placement" = "-ngl all" ]; then  # decoding as generate runs it: selection on the GPU, CUDA graphs
            $py bench/modes.py "$full" -n 64 -t "$(nproc)" -ngl -1 --json | tail -1 > "$out/modes_full.json" || true
            $py - "$out/modes_full.json" "$out/bench_full.json" "$bw" <<'PY' || true
import json, sys
m, r, bw = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3])
bpt = r["model"]["bytes_per_token"]
ms = {}
for mode, v in m.items():
    tps = v["tokens_per_second"]
    ms[mode] = 1000 * v["tokens_per_forward"] / tps if tps else float("nan")  # per decoding forward
    bwp = f", ar at {100 * tps * bpt / bw:.0f}% of the bandwidth limit" if mode == "ar" and bw else ""
    print(f"generate {mode}: {tps:.2f} t/s, {v['tokens_per_forward']:.2f} tokens/forward, {ms[mode]:.2f} ms/forward{bwp}")
if "ar" in ms and "diffusion" in ms:  # issue 8's target: a coreset block forward at most 2x an ar step
    print(f"diffusion forward (32-row denoising passes and commits, as generate runs them) / ar step: "
          f"{ms['diffusion'] / ms['ar']:.2f}")
PY
        fi
    done
fi
step "done (GPU tests exit status $tests_rc)"
exit "$tests_rc"
