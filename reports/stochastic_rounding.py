# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stochastic rounding fp32 → bf16
#
# `fk.stochastic_round` is the helper every stochastic bf16 store uses: 16 Philox bits
# added below the bf16 cut, so a value whose discarded low bits are `f` rounds away
# from zero with probability exactly `f / 2¹⁶`
# ([proofs/stochastic_rounding.md](../proofs/stochastic_rounding.md)). This report
# measures that frequency, shows what it buys over round-to-nearest (no stagnation),
# and checks that neighbouring elements and successive streams are uncorrelated. The
# thresholds are those of the proof: Hoeffding and Azuma radii at a false-alarm
# probability of 1e-9 (`forge_verify.numerics.stats`), fixed before measuring; seeds are fixed.

# %% tags=["parameters"]
MODE = "full"  # "fast" is the CI setting (forge-verify report --mode fast)

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import forge_kernels as fk
from forge_verify.commands.notebook import say, show, show_table
from forge_verify.numerics.bits import bf16_bits, fp32_from_bits
from forge_verify.numerics.stats import binomial_acceptance, binomial_consistent, hoeffding_radius, stagnation_radius

SETTINGS = {
    "fast": dict(values=32, samples=2**12, chains=512, additions=1000, pairs=2**14, lags=16),
    "full": dict(values=64, samples=2**16, chains=4096, additions=1000, pairs=2**16, lags=32),
}[MODE]
DEVICE = fk.kernel_device()
FALSE_ALARM = 1e-9
say(f"Mode **{MODE}**: {SETTINGS}; kernels "
    f"{'on the Triton CPU interpreter' if fk.interpreting() else 'compiled on ' + torch.cuda.get_device_name()}.")


# %% [markdown]
# ## Up-rounding frequency against the exact probability
#
# Values of every sign and exponent with chosen discarded fractions `f` (including
# 1, 2¹⁵ and 2¹⁶ − 1); each is rounded `samples` times. A correct rounding makes each
# value's count of up-roundings Binomial(samples, f / 2¹⁶) exactly, so the band is the
# exact binomial test's acceptance interval (what the property test checks), with the
# false-alarm budget split over the values; Hoeffding's radius, which holds for any
# variables in [0, 1], is drawn beside it for scale.

# %%
rng = np.random.default_rng(0)
fractions = np.concatenate([[1, 2**15, 2**16 - 1], rng.integers(0, 2**16, SETTINGS["values"] - 3)]).astype(np.uint32)
heads = rng.integers(0, 2**16, 4 * fractions.size).astype(np.uint32)
heads = heads[((heads & 0x7F80) != 0x7F80) & ((heads & 0x7FFF) != 0x7F7F)][:fractions.size]
n = SETTINGS["samples"]
values = fp32_from_bits(np.repeat((heads << 16) | fractions, n))
out = bf16_bits(fk.stochastic_round(values.to(DEVICE), seed=11)).reshape(fractions.size, n)
counts = (out == (heads + 1)[:, None]).sum(axis=1)
up = counts / n
exact = fractions / 2**16
radius = hoeffding_radius(n, FALSE_ALARM / fractions.size)
worst = np.abs(up - exact).max()
band = np.array([binomial_acceptance(n, float(p), FALSE_ALARM / fractions.size) for p in exact]) / n - exact[:, None]
passed = [binomial_consistent(int(k), n, float(p), FALSE_ALARM / fractions.size) for k, p in zip(counts, exact)]
order = np.argsort(exact)

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
left.plot([0, 1], [0, 1], color="grey", lw=1, label="exact: f / 2¹⁶")
# Bars around the measured share that reach the exact probability exactly when the test passes:
# below by (hi/n - p), above by (p - lo/n).
left.errorbar(exact, up, yerr=[band[:, 1], -band[:, 0]], fmt="o", ms=3, capsize=2,
              label=f"measured ({n:,} samples each)")
left.set_xlabel("exact probability of rounding up, f / 2¹⁶")
left.set_ylabel("measured up-rounding frequency")
left.set_title("Frequency follows the discarded fraction")
left.legend()
right.axhspan(-radius, radius, color="tab:grey", alpha=0.12, label=f"Hoeffding radius ±{radius:.4f}")
right.fill_between(exact[order], band[order, 0], band[order, 1], color="tab:green", alpha=0.35,
                   label="exact binomial test's acceptance")
right.plot(exact, up - exact, "o", ms=3)
right.axhline(0, color="grey", lw=1)
right.set_xlabel("exact probability of rounding up, f / 2¹⁶")
right.set_ylabel("measured − exact frequency")
right.set_title(f"Deviation (largest {worst:.4f})")
right.legend()
show(fig)
say(f"Exact binomial test: {sum(passed)} of {len(passed)} values pass at {FALSE_ALARM:g} / {len(passed)} "
    f"(**{'all within' if all(passed) else 'NOT all within'}** the threshold fixed in advance); the largest "
    f"deviation {worst:.5f}, against Hoeffding's looser radius {radius:.5f}.")

# %% [markdown]
# ## Stagnation: adding 1e-3 to 1.0, a thousand times, in bf16
#
# 1e-3 is less than half a bf16 ulp of 1.0 (2⁻⁸ ≈ 0.0039), so round-to-nearest never
# moves. Stochastic rounding follows the exact sum on average. The band is Azuma's
# radius for the mean over the chains at each step (differences below one bf16 ulp
# under 4, 2⁻⁶, per chain), plus 2e-4 for the fp32 additions' own rounding.

# %%
chains, additions = SETTINGS["chains"], SETTINGS["additions"]
nearest = torch.ones(chains, dtype=torch.bfloat16)
stochastic = torch.ones(chains, dtype=torch.bfloat16, device=DEVICE)
nearest_mean, stochastic_mean = [1.0], [1.0]
for step in range(additions):
    nearest = (nearest.float() + 1e-3).bfloat16()
    stochastic = fk.stochastic_round(stochastic.float() + 1e-3, seed=1234, offset=step * chains)
    nearest_mean.append(nearest.float().mean().item())
    stochastic_mean.append(stochastic.float().mean().item())
k = np.arange(additions + 1)
band = np.array([stagnation_radius(max(s, 1), chains, FALSE_ALARM) for s in k])

fig, (ax, gap) = plt.subplots(1, 2, figsize=(12, 4.2))
ax.plot(k, 1 + k * 1e-3, color="black", lw=1, label="exact: 1 + k · 0.001")
ax.plot(k, stochastic_mean, color="tab:green", label=f"stochastic rounding (mean of {chains:,} chains)")
ax.plot(k, nearest_mean, color="tab:red", label="round to nearest")
ax.set_xlabel("additions of 0.001 (k)")
ax.set_ylabel("stored bf16 value (mean over chains)")
ax.set_title("Round-to-nearest stagnates; stochastic rounding does not")
ax.legend()
gap.fill_between(k, -band, band, color="tab:green", alpha=0.2, label="Azuma radius (1e-9) + fp32 rounding")
gap.plot(k, np.array(stochastic_mean) - (1 + k * 1e-3), color="tab:green", label="stochastic − exact")
gap.axhline(0, color="grey", lw=1)
gap.set_xlabel("additions of 0.001 (k)")
gap.set_ylabel("mean stored value − exact sum")
gap.set_title("Stochastic rounding's error against its threshold")
gap.legend(fontsize=8)
show(fig)
final_gap = abs(stochastic_mean[-1] - (1 + additions * 1e-3))
say(f"After {additions} additions: nearest {nearest_mean[-1]:.4f}, stochastic {stochastic_mean[-1]:.4f} "
    f"(exact {1 + additions * 1e-3:.3f}; gap {final_gap:.4f}, threshold {band[-1]:.4f}: "
    f"**{'within' if final_gap <= band[-1] else 'OUTSIDE'}**).")

# %% [markdown]
# ## Correlation
#
# A value rounded up with probability exactly 1/2. If the up-rounding indicators are
# independent, a disjoint pair is rounded up together with probability 1/4, and the
# number of such pairs among `pairs` disjoint ones is Binomial(pairs, 1/4). Pairs are
# formed at every lag between element indices (counters `i`, `i + lag`; in each block of
# 2·lag elements the first lag pair with the next lag, so no element is in two pairs),
# and between the same element under successive seeds (as successive steps use).

# %%
pairs = SETTINGS["pairs"]
count = 2 * pairs + 2 * SETTINGS["lags"]
half = fp32_from_bits(np.full(count, (0x3F80 << 16) | 0x8000, dtype=np.uint32)).to(DEVICE)
first = bf16_bits(fk.stochastic_round(half, seed=99)) == 0x3F81
second = bf16_bits(fk.stochastic_round(half, seed=100)) == 0x3F81
# The exact binomial test's acceptance for a count of pairs ~ Binomial(pairs, 1/4), as a share.
pair_lo, pair_hi = (end / pairs for end in binomial_acceptance(pairs, 0.25, FALSE_ALARM))
starts = np.arange(pairs) * 2
lags = np.arange(1, SETTINGS["lags"] + 1)


def disjoint_starts(lag):
    """The first `pairs` starts i of pairs (i, i + lag) that use each element at most once."""
    blocks = count // (2 * lag)
    return (np.arange(blocks)[:, None] * 2 * lag + np.arange(lag)[None, :]).ravel()[:pairs]


together = np.array([np.mean(first[disjoint_starts(lag)] & first[disjoint_starts(lag) + lag]) for lag in lags])
successive = np.mean(first[starts] & second[starts])

fig, ax = plt.subplots(figsize=(8, 3.8))
ax.axhspan(pair_lo, pair_hi, color="tab:green", alpha=0.2,
           label=f"independent: [{pair_lo:.4f}, {pair_hi:.4f}] (exact binomial test, 1e-9)")
ax.plot(lags, together, "o-", ms=4, label="same stream, counters i and i + lag")
ax.axhline(successive, color="tab:purple", ls="--", label=f"same counter, seeds 99 and 100: {successive:.4f}")
ax.set_xlabel("lag between element indices")
ax.set_ylabel("share of pairs both rounded up")
ax.set_title(f"Up-rounding of neighbours is uncorrelated ({pairs:,} pairs per point)")
ax.legend(fontsize=8)
show(fig)
worst_lag = np.argmax(np.abs(together - 0.25))
rows = [("adjacent elements (lag 1)", f"{together[0]:.4f}"),
        (f"farthest from 1/4 (lag {lags[worst_lag]})", f"{together[worst_lag]:.4f}"),
        ("successive seeds", f"{successive:.4f}"), ("share rounded up (1/2 expected)", f"{first.mean():.4f}")]
show_table(["pairs", "measured share"], rows)
inside = all(pair_lo <= share <= pair_hi for share in [*together, successive])
say(f"Every pair share within [{pair_lo:.4f}, {pair_hi:.4f}]: **{'yes' if inside else 'NO'}**. Philox's independence "
    "is an assumption about the generator (proofs/stochastic_rounding.md); this probes it, it does not prove it.")
