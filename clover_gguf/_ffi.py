"""cffi (ABI mode) binding to the native engine: the declarations and the library load.

The declarations are read from ``clover.h`` itself (installed next to the library), with the
preprocessor lines and the export macro removed, so the C header stays the one source of
truth. The header next to the library found is preferred (else the checkout's
``native/include``), and the library's struct sizes are checked against the declarations, so a
header and a library of different builds are refused with an ImportError instead of
corrupting memory. Nothing here imports torch.

Library search order: ``$CLOVER_LIB`` (a path to the shared library, for development), then
the package directory (where ``pip install .`` puts it), then ``build/`` trees of a source
checkout, then ``clover_gguf/`` under every ``sys.path`` entry (the installed copy, when a
source checkout's package shadows it).
"""
from __future__ import annotations

import os
import pathlib
import re
import sys

import cffi

_PKG = pathlib.Path(__file__).resolve().parent
_ROOT = _PKG.parent

if sys.platform == "darwin":
    _LIBNAMES = ("libclover.dylib",)
elif sys.platform == "win32":
    _LIBNAMES = ("clover.dll", "libclover.dll")
else:
    _LIBNAMES = ("libclover.so",)


def _header_text(lib_path: str) -> str:
    """clover.h next to the library, else the checkout's native/include, else the package's."""
    for cand in (pathlib.Path(lib_path).resolve().parent / "clover.h", _ROOT / "native" / "include" / "clover.h",
                 _PKG / "clover.h"):
        if cand.is_file():
            return cand.read_text()
    raise ImportError("clover.h not found next to the library, in native/include or in the package")


def _cdef_from_header(text: str) -> str:
    """Strip what cffi's cdef cannot parse: preprocessor lines other than integer constants
    (``#define NAME 65``, which cffi understands), the export macro and the ``extern "C"``
    wrapper."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        # a lone "}" only closes the extern "C" wrapper (structs close with "} name;")
        if (s.startswith("#") and not re.fullmatch(r"#define\s+[A-Z_][A-Z0-9_]*\s+\d+", s)) \
                or s.startswith('extern "C"') or s == "}":
            continue
        out.append(line.replace("CLOVER_API ", ""))
    return "\n".join(out)


def _find_library() -> str:
    env = os.environ.get("CLOVER_LIB")
    if env:
        return env
    dirs = [_PKG, _ROOT / "build", _ROOT / "build" / "native"]
    # A source checkout's clover_gguf/ can shadow the installed package (pytest run at the
    # repository root puts the root on sys.path first); `pip install .` put the library
    # only into site-packages, so look there too.
    for entry in sys.path:
        try:
            d = pathlib.Path(entry or os.getcwd()).resolve() / "clover_gguf"
        except OSError:
            continue
        if d != _PKG:
            dirs.append(d)
    for d in dirs:
        for name in _LIBNAMES:
            if (d / name).is_file():
                return str(d / name)
    raise ImportError(
        "native library libclover not found: install the package with `pip install .`, "
        "build it with `cmake -S . -B build && cmake --build build`, "
        "or set CLOVER_LIB to the built library"
    )


# OpenMP workers sleep instead of spinning between parallel regions unless the user says
# otherwise: on a shared or oversubscribed machine a spinning worker starves the thread it waits
# for (measured on a busy 2-core machine: 358 ms per decoded token spinning, 24 ms passive).
# libgomp reads this once, when the library below pulls it in.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_LIB_PATH = _find_library()
ffi = cffi.FFI()
ffi.cdef(_cdef_from_header(_header_text(_LIB_PATH)))
# RTLD_NODELETE: the library is never unloaded, so the OpenMP runtime it pulls in is not torn
# down under its own idle worker threads at interpreter exit (that crashed with SIGSEGV).
lib = ffi.dlopen(_LIB_PATH, ffi.RTLD_NOW | getattr(ffi, "RTLD_NODELETE", 0))


def _check_abi() -> None:
    try:
        size = lib.clover_struct_size
    except AttributeError:
        raise ImportError(f"{_LIB_PATH} has no clover_struct_size (built from older sources): "
                          "rebuild or reinstall it") from None
    for name in ("clover_hparams", "clover_gen_params", "clover_stats"):
        have, want = int(size(name.encode())), ffi.sizeof(name)
        if have != want:
            raise ImportError(f"{_LIB_PATH} was built with another clover.h ({name}: {have} bytes in the "
                              f"library, {want} in the header): rebuild or reinstall it")


_check_abi()

ERR_SIZE = 512


class CloverError(RuntimeError):
    """An error reported by the native engine; the message names the field and value."""


def err_buf():
    """A fresh error buffer for a native call (char[ERR_SIZE])."""
    return ffi.new("char[]", ERR_SIZE)


def raise_error(buf, what: str = "") -> None:
    """Raise CloverError with the message the native call wrote into buf."""
    msg = ffi.string(buf).decode("utf-8", "replace") or "unknown native error"
    raise CloverError(f"{what}: {msg}" if what else msg)
