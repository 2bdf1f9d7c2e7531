#!/usr/bin/env python3
"""Memory read bandwidth of this machine, in GB/s (1e9 bytes/s).

A small C program, compiled on the fly (cc -O3 -march=native -fopenmp), sums a buffer of
64-bit integers (default 1.5 GiB, far beyond the caches) with 1 and 2 threads (``--threads``);
each thread first-touches its own slice; the best of ``--reps`` passes is reported, as the
decode speed limit is set by the best sustained streaming rate. Without a C compiler it falls
back to numpy (``arr.sum()`` on one thread, numpy threads via ``threading`` for more; numpy
releases the GIL in reductions), which reads a little lower.

Usage: python bench/bandwidth.py [--size-mib 1536] [--reps 5] [--threads 1,2] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

_C_SRC = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
int main(int argc, char **argv) {
    size_t bytes = (size_t)atoll(argv[1]);
    int reps = atoi(argv[2]), nt = atoi(argv[3]);
    size_t n = bytes / sizeof(uint64_t);
    uint64_t *a = aligned_alloc(4096, n * sizeof(uint64_t));
    if (!a) { fprintf(stderr, "alloc failed\n"); return 1; }
    omp_set_num_threads(nt);
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = i * 2654435761u;   /* first touch per thread */
    double best = 1e30; uint64_t sink = 0;
    for (int r = 0; r < reps; r++) {
        uint64_t s = 0;
        double t0 = omp_get_wtime();
        #pragma omp parallel for schedule(static) reduction(+:s)
        for (size_t i = 0; i < n; i++) s += a[i];
        double dt = omp_get_wtime() - t0;
        sink += s;
        if (dt < best) best = dt;
    }
    printf("%.6f %llu\n", best, (unsigned long long)(sink & 1));
    free(a);
    return 0;
}
"""


def _compile(tmp: str) -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    src, exe = os.path.join(tmp, "bw.c"), os.path.join(tmp, "bw")
    with open(src, "w") as fh:
        fh.write(_C_SRC)
    r = subprocess.run([cc, "-O3", "-march=native", "-fopenmp", src, "-o", exe], capture_output=True, text=True)
    return exe if r.returncode == 0 else None


def _numpy_bw(nbytes: int, reps: int, threads: int) -> float:
    import numpy as np

    parts = [np.arange(nbytes // 8 // threads, dtype=np.int64) for _ in range(threads)]
    best = float("inf")
    for _ in range(reps):
        ts = [threading.Thread(target=p.sum) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return sum(p.nbytes for p in parts) / best / 1e9


def measure(threads=(1, 2), size_mib: int = 1536, reps: int = 5) -> dict:
    """Best-of-``reps`` read bandwidth for each thread count.

    Returns ``{"method": "c-openmp" | "numpy", "size_mib": int, "gbps": {threads: GB/s}}``
    (GB = 1e9 bytes). Raises RuntimeError if the C program fails at run time.
    """
    nbytes = int(size_mib) * 2**20
    out = {"size_mib": int(size_mib), "reps": int(reps), "gbps": {}}
    with tempfile.TemporaryDirectory() as tmp:
        exe = _compile(tmp)
        out["method"] = "c-openmp" if exe else "numpy"
        for t in threads:
            if exe:
                r = subprocess.run([exe, str(nbytes), str(reps), str(t)], capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"bandwidth program failed: {r.stderr.strip()}")
                secs = float(r.stdout.split()[0])
                out["gbps"][int(t)] = (nbytes // 8 * 8) / secs / 1e9
            else:
                out["gbps"][int(t)] = _numpy_bw(nbytes, reps, int(t))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1536, help="buffer size in MiB (1536)")
    ap.add_argument("--reps", type=int, default=5, help="passes; the best counts (5)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (1,2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    threads = [int(x) for x in a.threads.split(",") if x]
    res = measure(threads, a.size_mib, a.reps)
    if a.json:
        print(json.dumps(res))
    else:
        for t, g in res["gbps"].items():
            print(f"read bandwidth, {t} thread{'s' if t != 1 else ''}: {g:.1f} GB/s "
                  f"({res['method']}, {res['size_mib']} MiB, best of {res['reps']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
