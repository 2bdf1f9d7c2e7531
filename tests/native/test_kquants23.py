"""Q2_K and Q3_K quantisers of native/quant/kquants23.c against a Python transcription of ggml's
reference quantisers (spec 6).

The transcription follows ggml-quants.c of llama.cpp (quantize_row_q2_K_ref with
make_qkx2_quants, quantize_row_q3_K_ref with make_q3_quants: what llama-quantize runs without
an importance matrix) line by line in float32 scalars, one rounding per C operation (C without
FMA contraction), fp16 by numpy's round-to-nearest-even. Our bytes must equal it on random rows
(normal, heavy-tailed, per-block scaled, and the edge blocks of test_kquants.py). This check
needs no llama.cpp source; test_kquants.py's oracle compares with ggml's own C where that source
is present.
"""
import numpy as np
import pytest
from test_kquants import KINDS, dequant, quant, sample

F = np.float32


def nearest_int(v):
    """ggml nearest_int: round to nearest, ties to even."""
    return int(np.rint(F(v)))


def clamp(v, lo, hi):
    return max(lo, min(hi, v))


def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """ggml make_qkx2_quants: (levels, scale, the_min)."""
    n = len(x)
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = F(sum_w * x[0])
    for i in range(1, n):
        mn = x[i] if x[i] < mn else mn
        mx = x[i] if x[i] > mx else mx
        sum_w = F(sum_w + w[i])
        sum_x = F(sum_x + F(w[i] * x[i]))
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return [0] * n, F(0), F(-mn)

    def err(scale, m, L):
        e = F(0)
        for i in range(n):
            diff = F(F(F(scale * F(L[i])) + m) - x[i])
            e = F(e + F(w[i] * (F(abs(diff)) if use_mad else F(diff * diff))))
        return e

    iscale = F(F(nmax) / F(mx - mn))
    scale = F(F(1) / iscale)
    L = [clamp(nearest_int(F(iscale * F(x[i] - mn))), 0, nmax) for i in range(n)]
    best = err(scale, mn, L)
    for step in range(nstep + 1):
        iscale = F(F(F(rmin + F(rdelta * F(step))) + F(nmax)) / F(mx - mn))
        Laux = [clamp(nearest_int(F(iscale * F(x[i] - mn))), 0, nmax) for i in range(n)]
        sum_l = sum_l2 = sum_xl = F(0)
        for i in range(n):
            wl = F(w[i] * F(Laux[i]))
            sum_l = F(sum_l + wl)
            sum_l2 = F(sum_l2 + F(wl * F(Laux[i])))
            sum_xl = F(sum_xl + F(wl * x[i]))
        D = F(F(sum_w * sum_l2) - F(sum_l * sum_l))
        if D > 0:
            this_scale = F(F(F(sum_w * sum_xl) - F(sum_x * sum_l)) / D)
            this_min = F(F(F(sum_l2 * sum_x) - F(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = F(0)
                this_scale = F(sum_xl / sum_l2)
            cur = err(this_scale, this_min, Laux)
            if cur < best:
                L, best, scale, mn = Laux, cur, this_scale, this_min
    return L, scale, F(-mn)


def pack_2bit(L):
    qs = [0] * 64
    for j in (0, 128):
        for l in range(32):
            qs[j // 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)
    return qs


def f16_bytes(v):
    return list(np.array([v], np.float16).view(np.uint8))


def q2_k_ref(xb):
    """ggml quantize_row_q2_K_ref of one block of 256 float32 values: 84 bytes."""
    xb = [F(v) for v in xb]
    L = [0] * 256
    scales, mins = [], []
    max_scale = max_min = F(0)
    for j in range(16):
        xs = xb[16 * j:16 * j + 16]
        Lj, s, m = make_qkx2_quants(xs, [F(abs(v)) for v in xs], 3, F(-0.5), F(0.1), 15, True)
        L[16 * j:16 * j + 16] = Lj
        scales.append(s)
        mins.append(m)
        max_scale = s if s > max_scale else max_scale
        max_min = m if m > max_min else max_min
    sc = [0] * 16
    d = dmin = np.float16(0)
    if max_scale > 0:
        iscale = F(F(15) / max_scale)
        sc = [nearest_int(F(iscale * s)) & 0xFF for s in scales]
        d = np.float16(F(max_scale / F(15)))
    if max_min > 0:
        iscale = F(F(15) / max_min)
        sc = [(sc[j] | (nearest_int(F(iscale * mins[j])) << 4)) & 0xFF for j in range(16)]
        dmin = np.float16(F(max_min / F(15)))
    for j in range(16):
        dl = F(F(d) * F(sc[j] & 0xF))
        if dl == 0:
            continue
        ml = F(F(dmin) * F(sc[j] >> 4))
        for i in range(16):
            L[16 * j + i] = clamp(nearest_int(F(F(xb[16 * j + i] + ml) / dl)), 0, 3)
    return sc + pack_2bit(L) + f16_bytes(d) + f16_bytes(dmin)


def make_q3_quants(x, nmax):
    """ggml make_q3_quants with do_rmse: (levels + nmax, scale)."""
    n = len(x)
    mx = amax = F(0)
    for v in x:
        if F(abs(v)) > amax:
            amax, mx = F(abs(v)), v
    if amax < F(1e-15):
        return [0] * n, F(0)
    iscale = F(F(-nmax) / mx)
    L = []
    sumlx = suml2 = F(0)
    for v in x:
        l = clamp(nearest_int(F(iscale * v)), -nmax, nmax - 1)
        L.append(l)
        w = F(v * v)
        sumlx = F(sumlx + F(F(w * v) * F(l)))
        suml2 = F(suml2 + F(F(w * F(l)) * F(l)))
    for _ in range(5):
        n_changed = 0
        for i, v in enumerate(x):
            w = F(v * v)
            slx = F(sumlx - F(F(w * v) * F(L[i])))
            if slx > 0:
                sl2 = F(suml2 - F(F(w * F(L[i])) * F(L[i])))
                new_l = clamp(nearest_int(F(F(v * sl2) / slx)), -nmax, nmax - 1)
                if new_l != L[i]:
                    slx = F(slx + F(F(w * v) * F(new_l)))
                    sl2 = F(sl2 + F(F(w * F(new_l)) * F(new_l)))
                    if sl2 > 0 and F(F(slx * slx) * suml2) > F(F(sumlx * sumlx) * sl2):
                        L[i], sumlx, suml2 = new_l, slx, sl2
                        n_changed += 1
        if not n_changed:
            break
    return [l + nmax for l in L], (F(sumlx / suml2) if suml2 > 0 else F(0))


def q3_k_ref(xb):
    """ggml quantize_row_q3_K_ref of one block of 256 float32 values: 110 bytes."""
    xb = [F(v) for v in xb]
    L = [0] * 256
    scales = []
    max_scale = amax = F(0)
    for j in range(16):
        Lj, s = make_q3_quants(xb[16 * j:16 * j + 16], 4)
        L[16 * j:16 * j + 16] = Lj
        scales.append(s)
        if F(abs(s)) > amax:
            amax, max_scale = F(abs(s)), s
    sc = [0] * 12
    d = np.float16(0)
    if max_scale != 0:
        iscale = F(F(-32) / max_scale)
        for j in range(16):
            l = (nearest_int(F(iscale * scales[j])) + 128) % 256 - 128  # int8_t l = nearest_int(...)
            l = clamp(l, -32, 31) + 32
            if j < 8:
                sc[j] = l & 0xF
            else:
                sc[j - 8] |= (l & 0xF) << 4
            sc[j % 4 + 8] |= (l >> 4) << (2 * (j // 4))
        d = np.float16(F(F(1) / iscale))
    for j in range(16):
        s = sc[j] & 0xF if j < 8 else sc[j - 8] >> 4
        s = (s | (((sc[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        dl = F(F(d) * F(s))
        if dl == 0:
            continue
        for i in range(16):
            L[16 * j + i] = clamp(nearest_int(F(xb[16 * j + i] / dl)), -4, 3) + 4
    hmask = [0] * 32
    for j in range(256):
        if L[j] > 3:
            hmask[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    return hmask + pack_2bit(L) + sc + f16_bytes(d)


REF = {"Q2_K": (q2_k_ref, 84), "Q3_K": (q3_k_ref, 110)}


@pytest.mark.parametrize("name", list(REF))
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_equal_python_transcription_of_ggml(name, kind):
    ref_fn, nbytes = REF[name]
    rng = np.random.default_rng([3000, nbytes, KINDS.index(kind)])
    x = sample(kind, 8 * 256, 256, rng)
    ours = quant(name, x).reshape(-1, nbytes)
    for b in range(8):
        want = np.array(ref_fn(x[256 * b:256 * (b + 1)]), np.uint8)
        np.testing.assert_array_equal(ours[b], want, err_msg=f"{name} {kind} block {b}")
    if kind == "edge":  # the all-zero block stays zero
        np.testing.assert_array_equal(dequant(name, ours[0], 256), 0.0)
