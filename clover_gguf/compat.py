"""llama-cpp-python arguments that :class:`~clover_gguf.llama.Clover` accepts without an effect.

Each entry names llama-cpp-python 0.3.36's default (``Llama.__init__``, ``create_completion``,
``create_chat_completion``) and why the argument changes nothing here. A value other than the
default raises one ``UserWarning`` per argument and process; the default passes silently, since
it asks for nothing. The table in docs/python.md lists the same names (a test keeps them equal).
"""
from __future__ import annotations

import threading
import warnings

_UNSPECIFIED = -1  # llama.cpp's LLAMA_*_TYPE_UNSPECIFIED
_ROPE = "RoPE uses the GGUF's rope.freq_base; there is no context extension"
_LORA = "LoRA adapters are not loaded: merge the adapter into the checkpoint, then convert it"
_GPU = "the CUDA backend uses one device, the first visible one (choose it with CUDA_VISIBLE_DEVICES)"
_CHAT = "chat prompts are always rendered with the GGUF's tokenizer.chat_template (Jinja)"

# name -> (llama-cpp-python's default, why it changes nothing)
INIT = {
    "split_mode": (1, _GPU),
    "main_gpu": (0, _GPU),
    "tensor_split": (None, _GPU),
    "vocab_only": (False, "the weights are always loaded (memory-mapped, so untouched pages cost nothing)"),
    "kv_overrides": (None, "metadata is read as the file says; rewrite the file to change it"),
    "rope_scaling_type": (_UNSPECIFIED, _ROPE),
    "rope_freq_base": (0.0, _ROPE),
    "rope_freq_scale": (0.0, _ROPE),
    "yarn_ext_factor": (-1.0, _ROPE),
    "yarn_attn_factor": (1.0, _ROPE),
    "yarn_beta_fast": (32.0, _ROPE),
    "yarn_beta_slow": (1.0, _ROPE),
    "yarn_orig_ctx": (0, _ROPE),
    "attention_type": (_UNSPECIFIED, "prompts are causal; block attention is chosen by mode='diffusion'"),
    "logits_all": (False, "each token's logprobs come from the row that chose it (logprobs=); "
                          "every prompt position's logits: Model.prefix_logits"),
    "offload_kqv": (True, "the KV cache lives where its attention layers run (n_gpu_layers)"),
    "op_offload": (None, "GPU placement is chosen by n_gpu_layers, n_cpu_moe and gpu_budget"),
    "swa_full": (None, "the model has no sliding-window attention layers"),
    "no_perf": (False, "timings are always measured (their cost is a few clock reads per call)"),
    "last_n_tokens_size": (64, "repetition penalties count the whole response, or the prompt too "
                                      "(penalty_scope, the GGUF's diffusion.penalty_scope)"),
    "lora_base": (None, _LORA),
    "lora_path": (None, _LORA),
    "lora_scale": (1.0, _LORA),
    "numa": (False, "threads are not pinned to NUMA nodes"),
    "chat_format": (None, _CHAT),
    "chat_handler": (None, _CHAT),
    "draft_model": (None, "speculative decoding is self-speculative: mode='spec' drafts with the model itself"),
    "tokenizer": (None, "the GGUF's own tokenizer is always used"),
    "spm_infill": (False, "there is no fill-in-the-middle"),
}

# Model's (and so Clover's) options of llama-cpp-python's that change nothing
MODEL = {
    "use_mmap": (True, "the weights are always read through a read-only mapping of the file (pages load on "
                       "first use and are shared with the page cache); use_mlock=True keeps them in RAM"),
    "flash_attn": (False, "attention is always fused (native/cpu/attend.c: the scores, softmax and V sum of a "
                          "tile of query rows run in one kernel over tiles of keys, without a [heads, rows, "
                          "keys] score matrix; the same on the GPU)"),
}

_SAMPLER = "the sampler implements temperature, top_k, top_p, min_p, penalties and logit_bias (docs/python.md)"
CALL = {
    "typical_p": (1.0, _SAMPLER),
    "tfs_z": (1.0, _SAMPLER),
    "mirostat_mode": (0, _SAMPLER),
    "mirostat_tau": (5.0, _SAMPLER),
    "mirostat_eta": (0.1, _SAMPLER),
    "stopping_criteria": (None, "generation stops at end tokens, stop strings, max_tokens or cancel()"),
    "logits_processor": (None, "rows are processed in the engine; constrain output with grammar= or "
                               "response_format="),
}

def _is_default(value, default) -> bool:
    if value is default:
        return True
    scalar = (bool, int, float, str)
    return isinstance(value, scalar) and isinstance(default, scalar) and value == default


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_ignored(table: dict, values: dict, stacklevel: int = 3) -> None:
    """Warn once per process for each argument of ``values`` whose value differs from its
    default in ``table`` (:data:`INIT`, :data:`MODEL` or :data:`CALL`)."""
    for name, value in values.items():
        default, why = table[name]
        if _is_default(value, default):
            continue
        with _warned_lock:
            if name in _warned:
                continue
            _warned.add(name)
        warnings.warn(f"{name}={value!r} is accepted for llama-cpp-python compatibility and has no effect: {why}",
                      UserWarning, stacklevel=stacklevel)


def reset_warnings() -> None:
    """Forget which arguments were warned about (tests)."""
    with _warned_lock:
        _warned.clear()
