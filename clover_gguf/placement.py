"""Where the weights go on a machine with a GPU: -ngl, --cpu-moe / --n-cpu-moe, --fit.

llama.cpp users run 35B-A3B MoE models on small GPUs by keeping the routed experts in system
memory (``--cpu-moe``, ``--n-cpu-moe N``) and everything else on the GPU; the same flags exist
here, with the engine's byte counts (``clover_model_placement_bytes``). :func:`fit` picks the
placement for a GPU memory budget: everything on the GPU if it fits, else the routed experts of
the first layers on the CPU (as few layers as needed), else fewer layers on the GPU. What
stays on the CPU exchanges only activations with the GPU.
"""
from __future__ import annotations

import re

from ._ffi import ffi, lib

PARTS = ("gpu", "dense", "experts", "output", "experts_cpu", "vectors")
# bytes of the budget kept for the CUDA context and activation buffers (at 35B-A3B dimensions the
# resident forward's buffers for a 512-row prefill pass are about 210 MiB plus 50 MiB of product
# scratch, 45 MiB for a 32-row block pass: native/gpu/resident_ops.c res_layout; BF16 weights add 48 MiB,
# the experts' inputs split for tensor cores: native/cuda/memory.cuh split_act)
RESERVE = 512 << 20


def placement(model, n_gpu_layers: int, n_cpu_moe: int = 0, n_ctx: int | None = None, n_parallel: int = 1) -> dict:
    """Bytes per part of a placement on ``model`` (a :class:`~clover_gguf.model.Model`):
    ``gpu`` (the weights on the GPU), ``dense`` (attention/GDN projections, routers, shared
    experts of the offloaded layers), ``experts`` (their routed experts on the GPU), ``output``
    (the LM head), ``experts_cpu`` (routed experts of offloaded layers kept on the CPU),
    ``vectors`` (the float32 norms, conv weights and gates a whole offload copies for the
    resident forward; ``gpu`` counts them),
    ``cache`` (the state on the GPU of ``n_parallel`` contexts, llama-server's slots, each
    ``cache_context`` bytes: :func:`cache_bytes` for ``n_ctx`` tokens, default the model's), plus
    the arguments (``n_gpu_layers`` -1 = all and the output, ``n_parallel``)."""
    n_parallel = _check_parallel(n_parallel)
    n = _layers(model, n_gpu_layers)
    out = {name: int(lib.clover_model_placement_bytes(model._model, n, n_cpu_moe, i)) for i, name in enumerate(PARTS)}
    one = cache_bytes(model, model.n_ctx if n_ctx is None else n_ctx, n)
    out.update(cache=one * n_parallel, cache_context=one, n_parallel=n_parallel, n_gpu_layers=n, n_cpu_moe=n_cpu_moe)
    return out


def _check_parallel(n_parallel) -> int:
    if isinstance(n_parallel, bool) or not isinstance(n_parallel, int) or n_parallel < 1:
        raise ValueError(f"n_parallel: expected an integer >= 1, got {n_parallel!r}")
    return n_parallel


def cache_bytes(model, n_ctx: int, n_gpu_layers: int) -> int:
    """Bytes a context of ``n_ctx`` tokens keeps on the GPU when the first ``n_gpu_layers`` layers
    are offloaded, as the engine reserves them when the context is created
    (``clover_model_gpu_cache_bytes``): the KV cache of each offloaded attention layer in the
    model's cache types, and, once any GDN layer is offloaded, the state of every GDN layer
    (float32 [Hv][dk][dv]), with its conv history when the whole model is resident."""
    n = int(lib.clover_model_gpu_cache_bytes(model._model, n_ctx, n_gpu_layers, model.type_k, model.type_v))
    if n < 0:
        raise ValueError(f"n_ctx / n_gpu_layers: no cache size for n_ctx={n_ctx}, n_gpu_layers={n_gpu_layers}")
    return n


def _layers(model, n_gpu_layers: int) -> int:
    return int(model.hparams["n_layer"]) + 1 if n_gpu_layers < 0 else n_gpu_layers


def fit(model, budget_bytes: int, n_ctx: int | None = None, n_parallel: int = 1) -> dict:
    """The placement for ``budget_bytes`` of GPU memory (less :data:`RESERVE` and the ``cache``
    of ``n_parallel`` contexts of ``n_ctx`` tokens): all layers and the output with every routed
    expert on the GPU if it fits; else the routed experts of the first N layers on the CPU, N as
    small as fits; else all routed experts on the CPU and as many layers as fit. Returns
    :func:`placement`'s dict plus ``budget``."""
    budget = budget_bytes - RESERVE
    L = int(model.hparams["n_layer"])

    def fits(p: dict) -> bool:
        return p["gpu"] + p["cache"] <= budget

    best = placement(model, L + 1, 0, n_ctx, n_parallel)
    if not fits(best):
        for n_cpu_moe in range(1, L + 1):
            best = placement(model, L + 1, n_cpu_moe, n_ctx, n_parallel)
            if fits(best):
                break
        else:
            for n in range(L + 1, -1, -1):
                best = placement(model, n, L, n_ctx, n_parallel)
                if fits(best):
                    break
    best["budget"] = int(budget_bytes)
    return best


def gpu_free_bytes() -> int | None:
    """Free bytes of GPU 0, or None without a usable GPU."""
    free, total = ffi.new("int64_t *"), ffi.new("int64_t *")
    return int(free[0]) if lib.clover_gpu_memory(free, total) == 0 else None


def parse_size(s: str) -> int:
    """``12G``, ``12GiB``, ``800M``, ``1.5T`` or a byte count -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", s, re.IGNORECASE)
    if not m:
        raise ValueError(f"gpu budget: {s!r} is not a size such as 12G or 800M")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _layer_range(a: int, b: int) -> str:
    """Layers a to b (inclusive) in a plan line: ``layer 3`` or ``layers 0-2``."""
    return f"layer {a}" if a == b else f"layers {a}-{b}"


def describe(plan: dict, n_layer: int) -> str:
    """A one-line plan: bytes per part on the GPU and on the CPU."""
    gib = 1 << 30
    n, k = plan["n_gpu_layers"], min(plan["n_cpu_moe"], min(plan["n_gpu_layers"], n_layer))
    layers = min(n, n_layer)
    parts = [f"{_layer_range(0, layers - 1)} dense {plan['dense'] / gib:.2f} GiB" if layers else "no layer"]
    if plan["experts"]:
        parts.append(f"routed experts of {_layer_range(k, layers - 1)} {plan['experts'] / gib:.2f} GiB")
    if plan["output"]:
        parts.append(f"output {plan['output'] / gib:.2f} GiB")
    if plan.get("vectors"):
        parts.append(f"norms and gates {plan['vectors'] / gib:.2f} GiB")
    if plan.get("cache"):
        slots = plan.get("n_parallel", 1)
        each = f"{slots} x {plan['cache_context'] / gib:.2f} GiB = " if slots > 1 else ""
        parts.append(f"caches {each}{plan['cache'] / gib:.2f} GiB")
    line = f"GPU: {' + '.join(parts)} = {(plan['gpu'] + plan.get('cache', 0)) / gib:.2f} GiB"
    if "budget" in plan:
        line += f" (budget {plan['budget'] / gib:.2f} GiB)"
    cpu = []
    if plan["experts_cpu"]:
        cpu.append(f"routed experts of {_layer_range(0, k - 1)} {plan['experts_cpu'] / gib:.2f} GiB")
    if layers < n_layer:
        cpu.append(_layer_range(layers, n_layer - 1))
    if not plan["output"]:
        cpu.append("output")
    return line + "; CPU: " + (", ".join(cpu) if cpu else "nothing")
