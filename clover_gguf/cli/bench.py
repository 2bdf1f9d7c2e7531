"""``clover-gguf bench``: the llama-bench-style speed table (:mod:`clover_gguf.bench`)."""
from __future__ import annotations

from ..options import int_at_least, positive_int
from .common import EXIT_OK, MODEL_HELP, UsageError, add_device_args, check_model_path, gpu_layers, \
    placement_kwargs


def cmd(a) -> int:
    from .._ffi import CloverError
    from ..bench import format_table, run_bench, to_json

    check_model_path(a.model)
    if not 0.0 < a.coreset_top_p <= 1.0:
        raise UsageError(f"--coreset-top-p: {a.coreset_top_p} must be in (0, 1]")
    try:
        rep = run_bench(a.model, n_prompt=a.n_prompt, n_gen=a.n_gen, reps=a.repetitions,
                        n_threads=a.threads, block_size=a.block_size, coreset_top_p=a.coreset_top_p,
                        seed=a.seed, warmup=not a.no_warmup, n_gpu_layers=gpu_layers(a),
                        n_cpu_moe=placement_kwargs(a).get("n_cpu_moe", 0), type_k=a.cache_type_k,
                        type_v=a.cache_type_v, n_depth=a.n_depth, diffusion_path=a.diffusion)
    except (CloverError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(to_json(rep) if a.json else format_table(rep))
    return EXIT_OK


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="llama-bench-style speed table: pp, tg, block and commit forwards")
    b.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    b.add_argument("-p", "--n-prompt", type=positive_int, default=512, help="prompt tokens of pp and prefix of block/commit (512)")
    b.add_argument("-n", "--n-gen", type=positive_int, default=128, help="tokens of tg (128)")
    b.add_argument("-d", "--n-depth", type=int_at_least(0), default=0,
                   help="tokens already in the context before each test, untimed (0; llama-bench's -d)")
    b.add_argument("-r", "--repetitions", type=positive_int, default=5, help="repetitions of each test (5)")
    b.add_argument("-t", "--threads", type=int_at_least(0), default=None, help="CPU threads (all cores)")
    b.add_argument("--block-size", type=positive_int, default=32, help="rows of the block and commit forwards (32)")
    b.add_argument("--coreset-top-p", type=float, default=0.9, help="coreset top-p of the block forward (0.9)")
    b.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random tokens (0)")
    b.add_argument("--no-warmup", action="store_true", help="skip the warm-up run")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_device_args(b)
    b.set_defaults(func=cmd)
