"""llama.cpp side of the oracle tests: runs inside a Python that has llama-cpp-python.

Reads one JSON object from argv[1]: ``{"model": PATH, "prompts": [[ids]...], "n_greedy": N,
"out": NPZ_PATH, "threads": T}`` and writes ``NPZ_PATH`` with, for prompt k, ``logits{k}``
(float32 [len, n_vocab], every position, ``logits_all=True``), ``greedy{k}`` (int32 [N]:
N greedy tokens, each the argmax of the last row, fed back one token at a time; no end-token
stop) and ``glogits{k}`` (float32 [N, n_vocab], the row each greedy token was chosen from).
llama.cpp runs with an F32 KV cache, like our engine. Also ``quantize`` mode: ``{"quantize": [SRC, DST, "Q4_K_M"]}`` runs llama.cpp's own
``llama_model_quantize``. Needs only numpy and llama_cpp, so it runs in llama.cpp's own venv.
"""
import ctypes
import json
import sys

import numpy as np
import llama_cpp


def quantize(src: str, dst: str, ftype: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed: {rc}")


def run(cfg: dict) -> None:
    n_ctx = max(len(p) for p in cfg["prompts"]) + cfg["n_greedy"] + 8
    llm = llama_cpp.Llama(model_path=cfg["model"], n_ctx=max(n_ctx, 64), n_threads=cfg.get("threads", 2),
                          n_threads_batch=cfg.get("threads", 2), n_batch=512, logits_all=True, verbose=False,
                          type_k=0, type_v=0)  # F32 KV cache, like ours (GGML_TYPE_F32 = 0)
    out = {}
    for k, ids in enumerate(cfg["prompts"]):
        llm.reset()
        llm.eval(ids)
        out[f"logits{k}"] = np.array(llm.scores[:len(ids)], dtype=np.float32)
        greedy, rows = [], []
        last = out[f"logits{k}"][-1]
        for _ in range(cfg["n_greedy"]):
            t = int(np.argmax(last))
            greedy.append(t)
            rows.append(last)
            llm.eval([t])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        out[f"greedy{k}"] = np.array(greedy, dtype=np.int32)
        out[f"glogits{k}"] = np.array(rows, dtype=np.float32).reshape(len(rows), -1)
    np.savez(cfg["out"], **out)


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    if "quantize" in cfg:
        quantize(*cfg["quantize"])
    else:
        run(cfg)
