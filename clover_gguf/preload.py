"""Model loading with a progress bar: read the GGUF file once into the page cache.

The engine maps the file (mmap), so ``Model(...)`` returns at once and the weights are read from
disk by page faults during the first forwards, with no sign of progress; on a 20 GB file that is
the minute-long pause before the first token. :func:`preload` reads the file sequentially first,
with a tqdm bar on stderr, so the first forward finds the pages in memory (llama.cpp's loader
prints its progress the same way). It is skipped where it cannot help: small files, files larger
than the memory available (the read would evict its own pages), or stderr not a terminal.
"""
from __future__ import annotations

import os
import sys

CHUNK = 16 << 20  # bytes per read
MIN_BYTES = 256 << 20  # smaller files load in a moment: no bar


def available_bytes() -> int | None:
    """Bytes the kernel reports as available (MemAvailable), else free physical pages; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def preload(path, *, force: bool = False, file=None) -> int:
    """Read ``path`` once (16 MiB reads) with a progress bar on ``file`` (default stderr); return
    the bytes read, 0 when skipped. Without ``force`` it runs only when ``file`` is a terminal,
    the file has at least 256 MiB and fits in the memory the kernel reports as available.
    Errors reading the file are left to the loader (0 is returned)."""
    out = sys.stderr if file is None else file
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    if not force:
        avail = available_bytes()
        if size < MIN_BYTES or not getattr(out, "isatty", lambda: False)() or (avail is not None and size > avail):
            return 0
    from tqdm import tqdm

    done = 0
    buf = bytearray(CHUNK)
    try:
        with open(path, "rb", buffering=0) as f, \
                tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc="loading model",
                     file=out, leave=False, dynamic_ncols=True) as bar:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                done += n
                bar.update(n)
    except OSError:
        return 0
    return done
