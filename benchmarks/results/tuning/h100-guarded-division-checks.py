"""The guarded division's bit checks (h100-guarded-division-5537788.log), as run from a
scratch folder beside this tree's benchmarks/: compiled on a GPU (MUFU.RCP seed), else in
the interpreter (numpy's correctly rounded 1/d as the seed).

    python3 h100-guarded-division-checks.py guard    # div_fast_or_nan: where not NaN, numpy's m / d
    python3 h100-guarded-division-checks.py packed   # with h100-guarded-division-packed-ptx.patch
                                                     # applied: _div_rn_packed against tl.div_rn

The pairs are built as in the check script at the end of h100-exact-branch-free-897c0e7.log
(the same seed and draws, 587,214 pairs), copied so that this file runs on its own; the
AdamW-like and arbitrary-pattern draws after them are new.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from checkout import forge_kernels  # noqa: E402  (maps kernels/ to forge_kernels)

forge_kernels()
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from forge_kernels._backend import INTERPRETED  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODE = sys.argv[1]


@triton.jit
def _seed(d):
    if INTERPRETED:
        return 1.0 / d
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def div_fast_or_nan(m, d):
    y0 = _seed(d)
    y = tl.fma(tl.fma(-d, y0, 1.0), y0, y0)
    q = m * y
    q = tl.fma(tl.fma(-d, q, m), y, q)
    q = tl.fma(tl.fma(-d, q, m), y, q)
    a = tl.abs(q)
    ok = ((d >= 2.3509887016445750e-38) & (d <= 4.2535295865117308e+37)
          & (((a >= 9.4039548065783001e-38) & (a <= 4.2535295865117308e+37) & (tl.abs(m) >= 7.888609052210118e-31))
             | (m == 0.0)))
    return tl.where(ok, tl.where(m == 0.0, m, q), float("nan"))


if MODE == "packed":
    from forge_kernels.rules.adamw import _div_rn_packed as _divide
else:
    _divide = div_fast_or_nan


@triton.jit
def _kernel(m_ptr, d_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    m = tl.load(m_ptr + offs, mask=mask, other=1.0)
    d = tl.load(d_ptr + offs, mask=mask, other=1.0)
    tl.store(o_ptr + offs, _divide(m, d), mask=mask)
    tl.store(o_ptr + n + offs, tl.div_rn(m, d), mask=mask)


def run(m, d):
    """(the checked division, tl.div_rn) on the pairs (m, d); in "guard" mode the second is numpy's m / d."""
    with np.errstate(all="ignore"):
        mt = torch.from_numpy(m).to(DEVICE)
        dt = torch.from_numpy(d).to(DEVICE)
        o = torch.empty(2 * m.size, dtype=torch.float32, device=DEVICE)
        _kernel[(triton.cdiv(m.size, 4096),)](mt, dt, o, m.size, BLOCK=4096)
        o = o.cpu().numpy()
        return o[:m.size], (m / d if MODE == "guard" else o[m.size:])


rng = np.random.default_rng(0)
N = 400_000


def bits(lo, hi, n):
    return rng.integers(lo, hi, n, dtype=np.uint32).view(np.float32)


# divisors over [2^-126, 2^126], dividends over every float32 incl. subnormals, both signs
d = bits(0x00800000, 0x7E800001, N)
m = bits(0, 0x7F800000, N) * np.where(rng.random(N) < 0.5, -1, 1).astype(np.float32)
# quotients near the subnormal range and its ties: m = (j + 1/2) 2^-149 * d, rounded, and neighbours
j = rng.integers(0, 2**23, N // 4).astype(np.float64)
dd = bits(0x00800000, 0x7E800001, N // 4).astype(np.float64)
mm = ((j + 0.5) * 2.0**-149 * dd)
ok = (mm > 2.0**-149) & (mm < 3e38)
mm = mm[ok].astype(np.float32); dd = dd[ok].astype(np.float32)
mm = np.concatenate([mm, np.nextafter(mm, np.float32(0)), np.nextafter(mm, np.float32(np.inf))]); dd = np.tile(dd, 3)
# exact ties: d a power of two, m an odd multiple of 2^-150 scaled
p = 2.0 ** rng.integers(-126, 127, 20000)
mt = ((2 * rng.integers(0, 2**22, 20000) + 1) * 2.0**-150 * p)
okt = (mt >= 2.0**-149) & (mt < 3e38)
special_m = np.array([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 3e38, 1e-45, -1e-45], dtype=np.float32)
special_d = np.array([1.0, 2.0**-126, 2.0**126, np.inf], dtype=np.float32)
sm, sd = np.meshgrid(special_m, special_d)
M = np.concatenate([m, mm, mt[okt].astype(np.float32), sm.ravel()]).astype(np.float32)
D = np.concatenate([d, dd, p[okt].astype(np.float32), sd.ravel()]).astype(np.float32)
if MODE == "guard":
    got, want = run(M, D)
    flagged = np.isnan(got)
    bad = ~flagged & (got.view(np.uint32) != want.view(np.uint32))
    print(DEVICE, M.size, "cases,", int(flagged.sum()), "flagged,", int(bad.sum()), "unflagged and differ")
    for i in np.nonzero(bad)[0][:10]:
        print(repr(M[i]), repr(D[i]), repr(got[i]), repr(want[i]))
    # the unflagged set covers the proven range: every pair inside it is taken
    inside = (D >= 2.0**-125) & (D <= 2.0**125) & (((np.abs(want) >= 2.0**-122) & (np.abs(want) <= 2.0**124) & (np.abs(M) >= 2.0**-100)) | (M == 0))
    print("inside the range:", int(inside.sum()), "flagged there:", int((inside & flagged).sum()))
    # AdamW-like operands: m ~ N(0, 1e-3), d = |N| * 1e-3 + 1e-8
    m2 = (rng.standard_normal(N) * 1e-3).astype(np.float32); d2 = (np.abs(rng.standard_normal(N)) * 1e-3 + 1e-8).astype(np.float32)
    g2, _ = run(m2, d2)
    print("AdamW-like:", N, "flagged", int(np.isnan(g2).sum()), "differ", int((g2.view(np.uint32) != (m2 / d2).view(np.uint32)).sum()))
else:
    got, want = run(M, D)
    bad = got.view(np.uint32) != want.view(np.uint32)
    bad &= ~(np.isnan(got) & np.isnan(want))
    print(DEVICE, M.size, "cases against tl.div_rn,", int(bad.sum()), "differ")
    for i in np.nonzero(bad)[0][:10]:
        print(repr(M[i]), repr(D[i]), repr(got[i]), repr(want[i]))
    m2 = (rng.standard_normal(N) * 1e-3).astype(np.float32); d2 = (np.abs(rng.standard_normal(N)) * 1e-3 + 1e-8).astype(np.float32)
    g2, w2 = run(m2, d2)
    m3 = bits(0, 0xFFFFFFFF, N); d3 = bits(0, 0xFFFFFFFF, N)
    g3, w3 = run(m3, d3)
    b3 = (g3.view(np.uint32) != w3.view(np.uint32)) & ~(np.isnan(g3) & np.isnan(w3))
    print("any bit patterns:", N, "differ", int(b3.sum()))
    print("AdamW-like:", N, "differ", int((g2.view(np.uint32) != w2.view(np.uint32)).sum()))
