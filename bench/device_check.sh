#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU and no network, sized for the
# device tool's 15 minutes a session (one call of at most 10 minutes, the machine's start
# included in the 15): the steps run in order of what they prove, each within what is left of
# a time budget, and the optional ones only when enough is left.
#   1. build with the CUDA backend;
#   2. the GPU tests (tests/native/test_cuda.py);
#   3. the embedded default model: every mode on the GPU and the CPU,
#      greedy tokens compared, and diffusion and spec against ar;
#   4. real-dims 4-layer models (generated here, in the background from the start):
#      Q4_K_M: tokens/s of every mode on the GPU; the logits of a prefix and a block forward on
#      the GPU against the CPU's, with the CPU's scalar path against its SIMD one as the yardstick
#      (bench/logits_check.py); a short bench (pp512, tg128, block forward). BF16: greedy tokens of
#      every mode on the GPU against the CPU, and the same logits check. On a random model with
#      int8-rounded activations (Q4_K_M) float order alone parts the tokens (seen under the
#      emulator, and between the CPU's own scalar and SIMD paths: up to 0.75 x the logits' std);
#      float products (BF16) keep them within 2e-5 x std, so there the tokens must match;
#   5. with CLOVER_DEVICE_FULL=1, the 40-layer real-dims Q4_K_M model (about 20 GiB, generated
#      in the background after the 4-layer ones): placements all on the GPU, experts on the CPU
#      and a 12 GB budget, tokens/s and % of the bandwidth limit;
#   6. optional, while time is left: the kernels alone (bench/gpu_kernels.py), CUDA graphs off,
#      the per-product path, no tensor cores, a 4096-token prefix, the Q4_K_M model's greedy
#      tokens on the CPU (16 a prompt) against the GPU's, the CPU bench.
#
#   bash bench/device_check.sh [OUT_DIR]   # logs and JSON in /tmp/clover-device-logs, packed at each step
#                                           # into OUT_DIR/logs.tgz (default $OUT or /tmp/clover-device):
#                                           # the device tool brings back at most 8 files
#   CLOVER_DEVICE_FULL=1 ...                # also step 5
#   CLOVER_DEVICE_BUDGET=S ...              # seconds for the whole script (default 480; give the call
#                                           # timeout_s about 40 more)
#   CLOVER_DEVICE_DRY=1 ...                 # a rehearsal on a machine without a GPU: the CUDA emulator's
#                                           # build, tiny-dims models, a few tokens, one GPU test
#
# Python packages the machine lacks travel as wheels in .whl/ (cffi, pycparser, gguf), and the real
# model's config in shared/data: bench/device_prep.sh puts both there before the call (carry
# [".whl", "shared"]); the wheels are installed into /tmp/site when present. A failed build stops
# the script at once (the time left is for a rerun); any other failed step is reported and the
# script goes on. It exits with the GPU tests' status.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-${OUT:-/tmp/clover-device}}"
out=/tmp/clover-device-logs
rm -rf "$out" && mkdir -p "$out" "$dest"
pack() { tar czf "$dest/logs.tgz" -C "$out" . 2>/dev/null || true; }  # at every step: a run the tool
kill_tree() { local c; for c in $(pgrep -P "$1"); do kill_tree "$c"; done; kill "$1" 2>/dev/null || true; }
bg=""
trap 'pack; [ -z "$bg" ] || kill_tree "$bg"' EXIT  # stops still brings back its logs; no generator outlives it
export PYTHONUNBUFFERED=1
py=python3
if ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
full=${CLOVER_DEVICE_FULL:-0}
budget=${CLOVER_DEVICE_BUDGET:-480}
nt=$(nproc)
if [ "${CLOVER_DEVICE_DRY:-0}" = 1 ]; then  # sizes for the emulator, about 1000 times slower than a CPU
    build=build-emu-dry cuda=EMU dims=tiny n_gpu=6 n_cpu=3 n_bf16=3 pp=16 tg=4 deep=32 kern="--ne0 256 --ne1 64 --types Q4_K --rows 1,32 --keys 64 --gdn-rows 32 --iters 1 --reps 1"
    pytest_sel=(-k "test_gpu_kernels_bench_runs or absent_gpu")
else
    build=build-cuda cuda=ON dims=real n_gpu=64 n_cpu=16 n_bf16=8 pp=512 tg=128 deep=4096 kern=""
    pytest_sel=()
fi
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
lim() {  # a step's time limit: $1 seconds, or what is left of the budget
    local l=$(( $(left) - 5 ))
    (( l < $1 )) && echo $(( l > 1 ? l : 1 )) || echo "$1"
}
room() {  # an optional step runs only when about $1 seconds are left
    (( $(left) >= $1 )) || { echo "(skipped: $(left) s of the budget left, the step takes up to $1 s)"; return 1; }
}
step() { pack; echo "=== [$(( $(date +%s) - t0 )) s] $*"; }
run_to() { local s=$1; shift; timeout -k 10 "$(lim "$s")" "$@"; }  # run_to SECONDS CMD...

# The models, generated in the background (niced, so the build and tests come first); NAME.rc
# holds the generator's exit status when it is done.
model=/tmp/clover-$dims-4-q4km.gguf bf16=/tmp/clover-$dims-4-bf16.gguf fullm=/tmp/clover-$dims-40-q4km.gguf
gen() {  # gen OUT LAYERS OUTTYPE LOG LIMIT
    [ -f "$1" ] && [ "$(cat "$1.rc" 2>/dev/null)" = 0 ] && return 0  # kept from an earlier call
    rm -f "$1.rc"
    local rc=0
    nice -n 10 timeout -k 10 "$5" $py bench/make_bench_model.py "$1" --dims $dims --layers "$2" --outtype "$3" \
        --arch clover_moe --unique-experts 16 --no-progress -t "$nt" > "$4" 2>&1 || rc=$?
    echo $rc > "$1.rc"
}
wait_model() {  # wait_model OUT LOG: 0 once the generator wrote OUT; 1 if it failed or the budget ran out
    while [ ! -f "$1.rc" ] && (( $(left) > 10 )); do sleep 2; done
    [ "$(cat "$1.rc" 2>/dev/null)" = 0 ] && return 0
    echo "no model $1: generator status $(cat "$1.rc" 2>/dev/null || echo 'still running')"; tail -20 "$2"; return 1
}
( gen "$model" 4 q4_k_m "$out/make_model.log" 300; gen "$bf16" 4 bf16 "$out/make_bf16.log" 200
  [ "$full" != 1 ] || gen "$fullm" 40 q4_k_m "$out/make_full.log" 480 ) &
bg=$!

# modes MODEL N JSON [ARGS...]: bench/modes.py's greedy runs of every mode; its table to the log,
# its JSON line to JSON
modes() {
    local m=$1 n=$2 j=$3; shift 3
    local rc=0
    run_to 150 $py bench/modes.py "$m" -n "$n" -t "$nt" --json "$@" > "$j.txt" 2>&1 || rc=$?
    (( rc == 0 )) || { echo "bench/modes.py $m -n $n $*: exit status $rc (124: out of time)"; tail -5 "$j.txt"; return 1; }
    grep -v '^{' "$j.txt"; tail -1 "$j.txt" > "$j"
}
# compare GPU_JSON CPU_JSON: per mode the speeds, and whether the CPU's tokens (N a prompt) are the
# first N of the GPU's
compare() {
    $py - "$1" "$2" <<'PY' || echo "(no comparison: a modes run failed, see above)"
import json, sys
g, c = (json.load(open(p)) for p in sys.argv[1:3])
ok = True
for mode in c:
    same = all(gi[:len(ci)] == ci for gi, ci in zip(g[mode]["ids"], c[mode]["ids"]))
    ok &= same
    n = sum(len(ci) for ci in c[mode]["ids"])
    print(f"{mode:9s} GPU {g[mode]['tokens_per_second']:8.1f} t/s  CPU {c[mode]['tokens_per_second']:8.1f} t/s  "
          f"tokens/forward {g[mode]['tokens_per_forward']:.2f}  greedy tokens identical ({n} compared): {same}")
print("greedy tokens identical in all modes:", ok)
ar = g["ar"]["tokens_per_second"] if "ar" in g else 0
for mode in ("diffusion", "spec"):
    if mode in g:
        print(f"on the GPU, {mode} / ar tokens/s: {g[mode]['tokens_per_second'] / ar:.2f}" if ar else "")
if "spec" in g:
    print("on the GPU, spec's tokens equal ar's, per prompt:", g["spec"]["spec_equals_ar"])
PY
}
# logits MODEL TAG [--prompts K]: bench/logits_check.py's logits on the CPU, its scalar path and the
# GPU, compared (the GPU and the scalar path against the CPU's SIMD path)
logits() {
    local m=$1 d=/tmp/clover-logits/$2; shift 2
    mkdir -p "$d"
    run_to 60 $py bench/logits_check.py "$m" "$d/cpu.npz" -t "$nt" "$@" \
        && CLOVER_ISA=scalar run_to 90 $py bench/logits_check.py "$m" "$d/cpu_scalar.npz" -t "$nt" "$@" \
        && run_to 60 $py bench/logits_check.py "$m" "$d/gpu.npz" -t "$nt" -ngl -1 "$@" \
        && $py bench/logits_check.py --compare "$d/cpu.npz" "$d/gpu.npz" "$d/cpu_scalar.npz"
}

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
step "build (CLOVER_CUDA=$cuda)"
archs=(); [ "$cuda" = ON ] && archs=(-DCMAKE_CUDA_ARCHITECTURES=90-real)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCLOVER_CUDA=$cuda "${archs[@]}" > "$out/cmake.log" 2>&1 \
    || { tail -30 "$out/cmake.log"; exit 1; }
run_to 300 cmake --build "$build" -j"$nt" >> "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
export CLOVER_LIB="$PWD/$build/libclover.so"
$py -c "from clover_gguf._ffi import lib, ffi; b = ffi.new('char[]', 256); n = lib.clover_gpu_devices(b, 256); \
print(n, ffi.string(b).decode()); raise SystemExit(0 if n > 0 else 1)"

step "GPU tests (tests/native/test_cuda.py)"
set +e
ptimeout=$($py -c "import pytest_timeout" 2>/dev/null && echo "--timeout=120" || true)  # a hung test fails alone
run_to 240 $py -m pytest -q -rs -p no:cacheprovider $ptimeout "${pytest_sel[@]}" tests/native/test_cuda.py 2>&1 \
    | tee "$out/pytest.log" | tail -25
tests_rc=${PIPESTATUS[0]}
set -e

step "embedded default model: every mode on the GPU (-ngl all) and the CPU"
emb=clover_gguf/models/clover-tiny-q8_0.gguf
modes $emb $n_gpu "$out/modes_emb_gpu.json" -ngl -1 && modes $emb $n_gpu "$out/modes_emb_cpu.json" \
    && compare "$out/modes_emb_gpu.json" "$out/modes_emb_cpu.json" || true

step "real-dims 4-layer Q4_K_M model: every mode on the GPU ($n_gpu tokens a prompt, tokens/s)"
if wait_model "$model" "$out/make_model.log"; then
    modes "$model" $n_gpu "$out/modes_gpu.json" -ngl -1 || true
    step "Q4_K_M logits of a prefix and a block forward: the GPU and the CPU's scalar path against the CPU"
    logits "$model" q4km | tee "$out/logits_q4km.txt" || true
    step "bench on the GPU (pp$pp, tg$tg, block forward)"
    run_to 60 $py -m clover_gguf.cli bench -m "$model" -ngl all -p $pp -n $tg -r 2 | tee "$out/bench_gpu.txt" || true
fi
step "real-dims 4-layer BF16 model (float products: no int8 rounding to amplify float order): greedy tokens of every mode, GPU against CPU ($n_bf16 tokens, 2 prompts), and logits"
if wait_model "$bf16" "$out/make_bf16.log"; then
    modes "$bf16" $n_bf16 "$out/modes_bf16_gpu.json" -ngl -1 --prompts 2 \
        && modes "$bf16" $n_bf16 "$out/modes_bf16_cpu.json" --prompts 2 \
        && compare "$out/modes_bf16_gpu.json" "$out/modes_bf16_cpu.json" || true
    logits "$bf16" bf16 --prompts 2 | tee "$out/logits_bf16.txt" || true
fi

if [ "$full" = 1 ]; then  # the full 40-layer model and placements
    step "40-layer real-dims Q4_K_M model"
    if wait_model "$fullm" "$out/make_full.log"; then
        bw=$($py -c "import torch; x = torch.empty(2**31, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x); \
torch.cuda.synchronize(); import time; t = time.perf_counter(); [y.copy_(x) for _ in range(20)]; torch.cuda.synchronize(); \
print(2 * 20 * x.numel() / (time.perf_counter() - t))" 2>/dev/null || echo 0)
        echo "device copy bandwidth (read + write): $bw bytes/s"
        i=0
        for placement in "-ngl all" "-ngl all --cpu-moe" "--fit --gpu-budget 12G"; do
            i=$((i + 1)) && bj="$out/bench_full_$i.json"
            step "placement: $placement"
            $py -m clover_gguf.cli fit -m "$fullm" $placement | tee -a "$out/placements.txt" || true
            run_to 90 $py -m clover_gguf.cli bench -m "$fullm" $placement -p $pp -n 64 -r 1 --json \
                > "$bj" || true
            $py - "$bj" "$bw" <<'PY' || echo "(no bench figures for this placement)"
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
                modes "$fullm" $n_gpu "$out/modes_full.json" -ngl -1 \
                    && $py - "$out/modes_full.json" "$bj" "$bw" <<'PY' || true
import json, sys
m, r, bw = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3])
bpt = r["model"]["bytes_per_token"]
ms = {}
for mode, v in m.items():
    tps = v["tokens_per_second"]
    ms[mode] = 1000 * v["tokens_per_forward"] / tps if tps else float("nan")  # per decoding forward
    bwp = f", ar at {100 * tps * bpt / bw:.0f}% of the bandwidth limit" if mode == "ar" and bw else ""
    print(f"generate {mode}: {tps:.2f} t/s, {v['tokens_per_forward']:.2f} tokens/forward, {ms[mode]:.2f} ms/forward{bwp}")
if "ar" in ms and "diffusion" in ms:  # the target: a coreset block forward at most 2x an ar step
    print(f"diffusion forward (32-row denoising passes and commits, as generate runs them) / ar step: "
          f"{ms['diffusion'] / ms['ar']:.2f}")
PY
            fi
        done
    fi
fi

step "optional: the kernels alone (bench/gpu_kernels.py): products with and without tensor cores, attention, GDN block"
room 60 && { run_to 60 $py bench/gpu_kernels.py $kern --json > "$out/kernels.txt" 2>&1; grep -v '^{' "$out/kernels.txt"; } || true
if [ -f "$model.rc" ] && [ "$(cat "$model.rc")" = 0 ]; then
    step "optional: modes on the GPU without CUDA graphs (CLOVER_CUDA_GRAPHS=0)"
    room 60 && CLOVER_CUDA_GRAPHS=0 modes "$model" $n_gpu "$out/modes_gpu_nographs.json" -ngl -1 > /dev/null \
        && $py - "$out/modes_gpu.json" "$out/modes_gpu_nographs.json" <<'PY' || true
import json, sys
g, n = (json.load(open(p)) for p in sys.argv[1:3])
for mode in g:
    a, b = g[mode]["tokens_per_second"], n[mode]["tokens_per_second"]
    print(f"{mode:9s} graphs {a:8.1f} t/s  no graphs {b:8.1f} t/s  x{a / b:.2f}  same tokens: {g[mode]['ids'] == n[mode]['ids']}")
PY
    step "optional: bench on the GPU's per-product path (CLOVER_GPU_RESIDENT=0)"
    room 45 && CLOVER_GPU_RESIDENT=0 run_to 45 $py -m clover_gguf.cli bench -m "$model" -ngl all -p $pp -n $tg -r 1 \
        | tee "$out/bench_gpu_per_product.txt" || true
    step "optional: bench on the GPU without tensor cores (CLOVER_CUDA_MMA=0: dp4a for every product)"
    room 45 && CLOVER_CUDA_MMA=0 run_to 45 $py -m clover_gguf.cli bench -m "$model" -ngl all -p $pp -n $tg -r 1 \
        | tee "$out/bench_gpu_dp4a.txt" || true
    step "optional: bench on the GPU after a $deep-token prefix (-d $deep), with and without tensor cores"
    room 45 && run_to 45 $py -m clover_gguf.cli bench -m "$model" -ngl all -p $pp -n 32 -d $deep -r 1 \
        | tee "$out/bench_gpu_d4096.txt" || true
    room 45 && CLOVER_CUDA_MMA=0 run_to 45 $py -m clover_gguf.cli bench -m "$model" -ngl all -p $pp -n 32 -d $deep -r 1 \
        | tee "$out/bench_gpu_d4096_no_mma.txt" || true
    step "optional: Q4_K_M greedy tokens on the CPU ($n_cpu a prompt) against the GPU's first $n_cpu"
    room 90 && modes "$model" $n_cpu "$out/modes_cpu.json" && compare "$out/modes_gpu.json" "$out/modes_cpu.json" || true
    step "optional: bench on the CPU"
    room 60 && run_to 60 $py -m clover_gguf.cli bench -m "$model" -p $pp -n $tg -r 1 | tee "$out/bench_cpu.txt" || true
fi
step "done (GPU tests exit status $tests_rc)"
exit "$tests_rc"
