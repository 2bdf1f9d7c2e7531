"""GPU placement planning: -ngl, --cpu-moe / --n-cpu-moe, --fit (clover_gguf.placement).

The byte counts come from the engine (clover_model_placement_bytes) and are checked against the
GGUF's own tensor sizes; fit() is checked on budgets around the model's parts (no GPU needed:
it only plans). Greedy tokens across placements on a GPU: tests/native/test_cuda.py.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from gguf import GGUFReader

from clover_gguf import Model
from clover_gguf.placement import RESERVE, cache_bytes, describe, fit, parse_size, placement

EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
DENSE = re.compile(r"blk\.(\d+)\.(attn_(q|k|v|output|qkv|gate)|ssm_(out|alpha|beta)|"
                   r"ffn_gate_inp|ffn_gate_inp_shexp|ffn_(gate|up|down)_shexp)\.weight")


# the float32 tensors a whole offload copies for the resident forward (native/gpu/offload.c layer_vectors)
VECTORS = re.compile(r"blk\.\d+\.(attn_norm\.weight|post_attention_norm\.weight|attn_[qk]_norm\.weight|"
                     r"ssm_conv1d(_right)?\.weight|ssm_a|ssm_dt\.bias|ssm_norm\.weight|bd_(logit_scale|history_bias|history_c))"
                     r"|output_norm\.weight")


def _sizes(path):
    dense, experts, out = {}, {}, 0
    for t in GGUFReader(str(path)).tensors:
        if m := EXPERT.fullmatch(t.name):
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + int(t.n_bytes)
        elif m := DENSE.fullmatch(t.name):
            dense[int(m.group(1))] = dense.get(int(m.group(1)), 0) + int(t.n_bytes)
        elif t.name == "output.weight":
            out = int(t.n_bytes)
    return dense, experts, out


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_placement_bytes_match_the_tensor_sizes(make_gguf, outtype):
    path = make_gguf(outtype)
    dense, experts, out = _sizes(path)
    with Model(path, n_ctx=16, n_threads=1) as m:
        L = m.hparams["n_layer"]
        assert len(dense) == len(experts) == L
        full = placement(m, -1)
        assert full["n_gpu_layers"] == L + 1
        vectors = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if VECTORS.fullmatch(t.name))
        assert vectors > 0
        assert (full["dense"], full["experts"], full["output"], full["experts_cpu"], full["vectors"]) == \
            (sum(dense.values()), sum(experts.values()), out, 0, vectors)
        assert full["gpu"] == full["dense"] + full["experts"] + full["output"] + full["vectors"]
        p = placement(m, 3, 2)  # layers 0-2 on the GPU, experts of 0-1 on the CPU, no output
        assert p["dense"] == sum(dense[i] for i in range(3)) and p["output"] == p["vectors"] == 0
        assert p["experts"] == experts[2] and p["experts_cpu"] == experts[0] + experts[1]
        cpu_moe = placement(m, -1, 1 << 30)
        assert cpu_moe["experts"] == 0 and cpu_moe["experts_cpu"] == sum(experts.values())
        assert placement(m, 0)["gpu"] == 0


def test_cache_bytes_are_the_device_kv_cache_and_gdn_state(make_gguf):
    """One context's state on the GPU: K and V rows for every offloaded attention layer and
    position (4 bytes a value in the default F32 cache, 2 in an F16 one), and the GDN state
    [Hv][dk][dv] (float32) of every GDN layer once one is offloaded, with its conv history
    [d_conv - 1][channels] (float32) when everything is (tiny model: layer 3 of 4 is attention,
    2 KV heads of 64, 4 value heads of 64 x 64, a 4-tap conv over 512 channels)."""
    with Model(make_gguf("q8_0"), n_ctx=16, n_threads=1) as m:
        hp = m.hparams
        assert (hp["n_layer"], hp["full_attention_interval"], hp["n_head_kv"], hp["head_dim"]) == (4, 4, 2, 64)
        assert (hp["ssm_d_conv"], 2 * hp["ssm_n_group"] * hp["ssm_d_state"] + hp["ssm_d_inner"]) == (4, 512)
        assert cache_bytes(m, 100, 5) == 1 * 2 * 100 * 2 * 64 * 4 + 3 * 4 * 64 * 64 * 4 + 3 * 3 * 512 * 4
        assert cache_bytes(m, 100, 3) == 3 * 4 * 64 * 64 * 4  # layer 3, the attention one, stays on the CPU
        assert placement(m, -1)["cache"] == cache_bytes(m, 16, 5) and placement(m, 0)["cache"] == 0
        assert placement(m, 2, 0, 4096)["cache"] == cache_bytes(m, 4096, 2)
    with Model(make_gguf("q8_0"), n_ctx=16, n_threads=1, type_k="f32", type_v="f16") as m:
        assert cache_bytes(m, 100, 4) == 1 * 100 * 2 * 64 * (4 + 2) + 3 * 4 * 64 * 64 * 4


def test_fit_chooses_the_smallest_change_that_fits(make_gguf):
    with Model(make_gguf("q8_0"), n_ctx=16, n_threads=1) as m:
        L = m.hparams["n_layer"]
        full = placement(m, -1)
        cache = full["cache"]
        assert cache > 0
        assert fit(m, full["gpu"] + cache + RESERVE) | {"budget": 0} == full | {"budget": 0}
        # the caches of a longer context do not fit beside every weight
        assert fit(m, full["gpu"] + cache + RESERVE, n_ctx=4096)["n_cpu_moe"] > 0
        # between the dense part and everything: some layers' experts move to the CPU, as few as fit
        budget = full["gpu"] - full["experts"] // 2 + cache + RESERVE
        p = fit(m, budget)
        assert p["n_gpu_layers"] == L + 1 and 0 < p["n_cpu_moe"] < L and p["gpu"] + cache <= budget - RESERVE
        assert placement(m, -1, p["n_cpu_moe"] - 1)["gpu"] + cache > budget - RESERVE
        # less than the dense part: all experts on the CPU and fewer layers
        small = fit(m, full["dense"] // 2 + cache + RESERVE)
        assert small["n_gpu_layers"] < L and small["experts"] == 0
        assert small["gpu"] + small["cache"] <= full["dense"] // 2 + cache
        assert fit(m, RESERVE)["n_gpu_layers"] == 0
        line = describe(p, L)
        assert line.startswith("GPU: layers 0-") and "CPU: routed experts of layer" in line


def test_plan_line_names_each_part():
    """describe's line, exactly: layer ranges (one layer named alone), GiB per part, the budget."""
    g = 1 << 30
    plan = dict(n_gpu_layers=2, n_cpu_moe=1, dense=g, experts=g // 2, experts_cpu=g // 4, output=0, vectors=0,
                cache=g // 4, gpu=3 * g // 2, budget=2 * g)
    assert describe(plan, 4) == ("GPU: layers 0-1 dense 1.00 GiB + routed experts of layer 1 0.50 GiB + caches 0.25 GiB"
                                 " = 1.75 GiB (budget 2.00 GiB); CPU: routed experts of layer 0 0.25 GiB, layers 2-3,"
                                 " output")
    plan.update(n_gpu_layers=5, n_cpu_moe=0, experts_cpu=0, output=g // 8)
    del plan["budget"]
    assert describe(plan, 4) == ("GPU: layers 0-3 dense 1.00 GiB + routed experts of layers 0-3 0.50 GiB + output "
                                 "0.12 GiB + caches 0.25 GiB = 1.75 GiB; CPU: nothing")
    plan.update(n_gpu_layers=0, dense=0, experts=0, output=0, cache=0, gpu=0)
    assert describe(plan, 1) == "GPU: no layer = 0.00 GiB; CPU: layer 0, output"


def test_gpu_budget_sizes_are_checked(make_gguf):
    """Model's gpu_budget: a size string that is not one is refused by name before the load."""
    with pytest.raises(ValueError, match=r"gpu_budget: 'lots' is not \"free\", a byte count or a size such as 12G"):
        Model(str(make_gguf("q8_0")), gpu_budget="lots")
    with pytest.raises(ValueError, match="gpu_budget"):
        Model(str(make_gguf("q8_0")), gpu_budget=0)


def test_parse_size():
    assert parse_size("12G") == 12 << 30 and parse_size("800M") == 800 << 20 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="gpu budget"):
        parse_size("twelve")


def test_fit_command_and_budget_without_a_gpu(make_gguf):
    path = str(make_gguf("q8_0"))
    r = subprocess.run([sys.executable, "-m", "clover_gguf.cli", "fit", "-m", path, "--gpu-budget", "600M", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["budget"] == 600 << 20 and plan["gpu"] <= plan["budget"] - RESERVE
    r = subprocess.run([sys.executable, "-m", "clover_gguf.cli", "fit", "-m", path, "--cpu-moe"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "-ngl all" in r.stdout and "CPU: routed experts of layers 0-" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "clover_gguf.cli", "fit", "-m", path, "--gpu-budget", "lots"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "gpu budget" in r.stderr
    # the KV cache types (-ctk / -ctv) size the plan's cache: F16 keys take 2 bytes a value less
    caches = []
    for flags in (["-ctk", "f16"], [], ["-ctk", "q8_0"]):
        r = subprocess.run([sys.executable, "-m", "clover_gguf.cli", "fit", "-m", path, "-ngl", "all", "-c", "1000",
                            "--json", *flags], capture_output=True, text=True, timeout=120)
        caches.append(json.loads(r.stdout)["cache"] if r.returncode == 0 else r.stderr)
    assert caches[1] - caches[0] == 1000 * 2 * 64 * 2, caches  # one attention layer, 2 KV heads of 64
    assert "--cache-type-k" in caches[2], caches[2]
    # a budget on a machine without a GPU: the plan is made, then a warning and the CPU
    from clover_gguf._ffi import ffi, lib
    info = ffi.new("char[]", 256)
    if lib.clover_gpu_devices(info, 256) > 0:
        pytest.skip("a GPU is present (tests/native/test_cuda.py covers placements there)")
    with pytest.warns(UserWarning, match=r"gpu_budget's plan, n_gpu_layers=5 \(every layer and the output\): .*"
                                         "running on the CPU"):
        with Model(path, n_ctx=64, n_threads=1, gpu_budget="600M") as g, Model(path, n_ctx=64, n_threads=1) as c:
            assert g.n_gpu_layers == 0 and g.placement["plan"].startswith("GPU:")
            assert g.placement["budget"] == 600 << 20  # "600M", as the CLI's --gpu-budget
            assert g.generate_tokens([1, 2, 3], max_tokens=6)[0] == c.generate_tokens([1, 2, 3], max_tokens=6)[0]


def test_layer_is_attn(make_gguf):
    from clover_gguf import Model
    from clover_gguf._ffi import ffi, lib

    with Model(make_gguf("q8_0"), n_ctx=16, n_threads=1) as m:
        L, k = m.hparams["n_layer"], m.hparams["full_attention_interval"]
        assert [lib.clover_model_layer_is_attn(m._model, il) for il in range(L)] == \
            [int((il + 1) % k == 0) for il in range(L)]
        assert lib.clover_model_layer_is_attn(m._model, -1) == -1
        assert lib.clover_model_layer_is_attn(m._model, L) == -1
        assert lib.clover_model_layer_is_attn(ffi.NULL, 0) == -1


def expected_cache_bytes(hp: dict, type_k: int, type_v: int, n_ctx: int, n_gpu_layers: int) -> int:
    """The GPU cache bytes of a placement from the hyperparameters (spec 6): the KV cache of each
    offloaded attention layer, [n_ctx][n_head_kv * head_dim] for K and for V (4 bytes a value for
    F32, 2 for F16), and, once any GDN layer is offloaded, the state of every GDN layer, float32
    [Hv][dk][dv], with, when every layer and the output are (the resident forward), its conv
    history, float32 [d_conv - 1][channels]."""
    n_layer, interval = int(hp["n_layer"]), int(hp.get("full_attention_interval") or 1)
    on = range(min(n_gpu_layers, n_layer))
    n_attn_on = sum((il + 1) % interval == 0 for il in on)
    es = {0: 4, 1: 2}[type_k] + {0: 4, 1: 2}[type_v]
    kv = n_attn_on * n_ctx * int(hp["n_head_kv"]) * int(hp["head_dim"]) * es
    gdn = 0
    if hp.get("ssm_dt_rank") and len(on) > n_attn_on:
        n_gdn = sum((il + 1) % interval != 0 for il in range(n_layer))
        dv = int(hp["ssm_d_inner"]) // int(hp["ssm_dt_rank"])
        gdn = n_gdn * int(hp["ssm_dt_rank"]) * int(hp["ssm_d_state"]) * dv * 4
        if n_gpu_layers > n_layer:
            channels = 2 * int(hp["ssm_n_group"]) * int(hp["ssm_d_state"]) + int(hp["ssm_d_inner"])
            gdn += n_gdn * (int(hp["ssm_d_conv"]) - 1) * channels * 4
    return kv + gdn


@pytest.mark.parametrize("types", [("f32", "f32"), ("f32", "f16"), ("f16", "f16")])
def test_gpu_cache_bytes_follow_the_spec_sizes(make_gguf, types):
    """clover_model_gpu_cache_bytes (the sizing the context's allocations use, which
    clover_gguf.placement.cache_bytes returns) equals the sizes of spec 6 computed here from the
    hyperparameters, on every placement of the tiny model."""
    from clover_gguf import Model
    from clover_gguf._ffi import ffi, lib
    from clover_gguf.placement import cache_bytes

    with Model(make_gguf("q8_0"), n_ctx=16, n_threads=1, type_k=types[0], type_v=types[1]) as m:
        L = m.hparams["n_layer"]
        for n_ctx in (1, 100, 4096):
            for ngl in range(0, L + 3):
                want = expected_cache_bytes(m.hparams, m.type_k, m.type_v, n_ctx, ngl)
                assert lib.clover_model_gpu_cache_bytes(m._model, n_ctx, ngl, m.type_k, m.type_v) == want, (n_ctx, ngl)
                assert cache_bytes(m, n_ctx, ngl) == want
        assert lib.clover_model_gpu_cache_bytes(ffi.NULL, 16, 1, 0, 0) == -1
        assert lib.clover_model_gpu_cache_bytes(m._model, 0, 1, 0, 0) == -1
        assert lib.clover_model_gpu_cache_bytes(m._model, 16, -1, 0, 0) == -1
        assert lib.clover_model_gpu_cache_bytes(m._model, 16, 1, 8, 0) == -1
        assert lib.clover_model_gpu_cache_bytes(m._model, 2**31 - 1, L + 1, 0, 0) > 0


def test_fit_counts_the_caches_of_n_parallel_contexts(make_gguf):
    """n_parallel contexts (serve's slots) keep n_parallel caches on the GPU: placement's ``cache``
    is n_parallel times one context's (``cache_context``), fit plans around all of them, the plan
    line says so, and Model(gpu_budget=..., n_parallel=N) plans for its N contexts."""
    path = make_gguf("q8_0")
    with Model(path, n_ctx=16, n_threads=1) as m:
        L = m.hparams["n_layer"]
        one = cache_bytes(m, 1000, L + 1)
        p = placement(m, -1, 0, 1000, n_parallel=3)
        assert (p["cache"], p["cache_context"], p["n_parallel"]) == (3 * one, one, 3)
        assert placement(m, -1, 0, 1000)["cache"] == one
        budget = p["gpu"] + one + RESERVE  # every weight and one context's cache
        assert fit(m, budget, 1000)["n_cpu_moe"] == 0
        p3 = fit(m, budget, 1000, n_parallel=3)
        assert p3["gpu"] < p["gpu"] and p3["gpu"] + p3["cache"] <= budget - RESERVE and p3["cache"] == 3 * \
            cache_bytes(m, 1000, p3["n_gpu_layers"])
        assert f"caches 3 x {one / (1 << 30):.2f} GiB = {3 * one / (1 << 30):.2f} GiB" in describe(p, L)
        for bad in (0, True, 2.0):
            with pytest.raises(ValueError, match="n_parallel: expected an integer >= 1"):
                placement(m, -1, n_parallel=bad)
    r = [subprocess.run([sys.executable, "-m", "clover_gguf.cli", "fit", "-m", str(path), "-ngl", "all", "-c", "1000",
                         "--json", *flags], capture_output=True, text=True, timeout=120) for flags in ([], ["-np", "4"])]
    assert all(x.returncode == 0 for x in r), [x.stderr for x in r]
    plans = [json.loads(x.stdout) for x in r]
    assert (plans[0]["n_parallel"], plans[1]["n_parallel"], plans[1]["cache"]) == (1, 4, 4 * plans[0]["cache"])
    from clover_gguf._ffi import ffi, lib
    if lib.clover_gpu_devices(ffi.new("char[]", 256), 256) > 0:
        pytest.skip("a GPU is present (tests/native/test_cuda.py covers placements there)")
    with pytest.warns(UserWarning, match="running on the CPU"):
        with Model(path, n_ctx=64, n_threads=1, gpu_budget="600M", n_parallel=2) as g:
            assert g.placement["n_parallel"] == 2 and g.placement["cache"] == 2 * g.placement["cache_context"] > 0
