"""clover-gguf: a local runtime for the Clover block-diffusion LLM from GGUF files.

Public names: :class:`Model` (load a GGUF, tokenize, generate in ``diffusion`` or ``ar``
mode, read logits), :class:`Clover` (the llama-cpp-python-style face over it: OpenAI-shaped
completions and chat, streaming, ``cancel()``, thread-safe), :class:`CloverError` (errors
reported by the native engine),
``DEFAULT_MODEL`` (path of the small trained Clover shipped inside the package, which
``clover-gguf run`` uses when ``-m`` is absent; bench/train/train_tiny.py makes it) and
``__version__``. ``Model``, ``Clover`` and ``CloverError`` are loaded on first use, so reading
``clover_gguf.__version__`` works even before the native library is built. Nothing here
imports torch.
"""
from __future__ import annotations

from .paths import DEFAULT_MODEL

__version__ = "0.1.0"

__all__ = ["Model", "Clover", "CloverError", "DEFAULT_MODEL", "__version__"]


def __getattr__(name: str):
    # PEP 562: load the native binding only when Model/CloverError are first used.
    if name == "Model":
        from .model import Model

        return Model
    if name == "Clover":
        from .llama import Clover

        return Clover
    if name == "CloverError":
        from ._ffi import CloverError

        return CloverError
    raise AttributeError(f"module 'clover_gguf' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + ["Model", "Clover", "CloverError"])
