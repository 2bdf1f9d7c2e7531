"""``clover-gguf fit``: the GPU placement for a memory budget or given flags; needs no GPU."""
from __future__ import annotations

import json

from ..options import positive_int
from .common import MODEL_HELP, add_device_args, check_model_path


def cmd(a) -> int:
    """Print the GPU placement for a budget (or the given -ngl / --n-cpu-moe) without a GPU."""
    from ..model import Model
    from ..placement import describe, fit, gpu_free_bytes, placement

    check_model_path(a.model)
    with Model(a.model, n_ctx=16, n_threads=1, type_k=a.cache_type_k, type_v=a.cache_type_v,
               diffusion_path=a.diffusion) as m:
        n_layer = int(m.hparams["n_layer"])
        budget = a.gpu_budget if a.gpu_budget is not None else gpu_free_bytes()
        if a.n_gpu_layers is not None or budget is None:
            n_cpu_moe = 1 << 30 if a.cpu_moe else a.n_cpu_moe
            plan = placement(m, -1 if a.n_gpu_layers is None else a.n_gpu_layers, n_cpu_moe, a.ctx_size,
                             a.parallel)
        else:
            plan = fit(m, budget, a.ctx_size, a.parallel)
        plan["plan"] = describe(plan, n_layer)
        plan["n_gpu_layers_flag"] = "all" if plan["n_gpu_layers"] > n_layer else plan["n_gpu_layers"]
    if a.json:
        print(json.dumps(plan))
    else:
        print(f"{a.model}: {n_layer} layers; -ngl {plan['n_gpu_layers_flag']} --n-cpu-moe "
              f"{min(plan['n_cpu_moe'], n_layer)}")
        print(plan["plan"])
    return 0


def add_parser(sub) -> None:
    ft = sub.add_parser("fit", help="print the GPU placement (bytes on the GPU and on the CPU) for a memory "
                        "budget, or for -ngl / --n-cpu-moe; needs no GPU")
    ft.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    add_device_args(ft)
    ft.add_argument("-c", "--ctx-size", type=positive_int, default=4096,
                    help="context length whose caches are counted on the GPU (4096)")
    ft.add_argument("-np", "--parallel", type=positive_int, default=1,
                    help="contexts whose caches are counted on the GPU: serve's slots (serve's -np, default 4 "
                         "there); 1 for run and chat (1)")
    ft.add_argument("--json", action="store_true", help="print one JSON object")
    ft.set_defaults(func=cmd)
