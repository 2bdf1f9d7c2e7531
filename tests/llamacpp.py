"""Where the tests find llama.cpp (read-only oracle, never copied into the project).

- ``LLAMA_CPP_SRC``: the llama.cpp source tree of the llama-cpp-python 0.3.36 sdist
  (``CLOVER_LLAMA_CPP_SRC``; bench/llama_oracle.sh unpacks it and sets the variable).
- :func:`llama_python`: a Python that can import llama_cpp (this one, or ``CLOVER_LLAMA_PYTHON``).
- :func:`run_llama_converter`: llama.cpp's ``convert_hf_to_gguf.py`` with its pre-tokenizer
  hash check answered ``qwen35`` (our test tokenizers are not in its table; oracles.md).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

LLAMA_CPP_SRC = pathlib.Path(os.environ.get("CLOVER_LLAMA_CPP_SRC",
                                            "/tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def llama_python() -> str | None:
    """This interpreter when it imports llama_cpp, else $CLOVER_LLAMA_PYTHON when it exists."""
    try:
        import llama_cpp  # noqa: F401
        return sys.executable
    except ImportError:
        pass
    p = os.environ.get("CLOVER_LLAMA_PYTHON")
    return p if p and pathlib.Path(p).is_file() else None


def run_llama_converter(hf_dir, out, outtype: str, no_mtp: bool = True, timeout: int = 600) -> pathlib.Path:
    """Convert ``hf_dir`` to ``out`` with llama.cpp's converter; asserts it succeeded."""
    runner = (
        "import sys, runpy; LL = sys.argv[1]; sys.path.insert(0, LL); sys.path.insert(1, LL + '/gguf-py'); "
        "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen35'; "
        "sys.argv = [LL + '/convert_hf_to_gguf.py'] + sys.argv[2:]; "
        "runpy.run_path(LL + '/convert_hf_to_gguf.py', run_name='__main__')"
    )
    p = subprocess.run([sys.executable, "-c", runner, str(LLAMA_CPP_SRC), str(hf_dir), "--outfile", str(out),
                        "--outtype", outtype] + (["--no-mtp"] if no_mtp else []),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return pathlib.Path(out)
