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
# # Deviation from the exact trajectory, per storage regime
#
# AdamW on a small seeded problem, stepped in every storage regime by three methods
# (`forge_verify/checks/deviation.py`): **forge** (the fused kernel; the gradient never leaves
# fp32 registers), **standard** (the kernel's gradient stored in the weight's dtype,
# then the same epilogue) and **torch.optim** where its storage matches the regime.
# Each is compared with the **exact trajectory**: exact gradient sums, the rule in
# mpmath at 113 bits, nothing rounded. Errors are in ulps of the weight's dtype at
# the exact value.
#
# The **proven bound** is the rigorous enclosure of the fused kernel's steps
# ([proofs/reference_enclosure.md](../proofs/reference_enclosure.md), computed by
# `forge_verify.checks.catalog.reference_step` over `ENCLOSURE` along
# `forge_verify.checks.claims.enclosure_trajectory`): it contains both the kernel's weight and
# the exact one, so each element's error is at most the enclosure's width there. It
# bounds forge only; the standard pipeline's bf16 gradient store is not modelled.

# %% tags=["parameters"]
MODE = "full"  # "fast" is the CI setting (forge-verify report --mode fast)

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import forge_kernels as fk
from forge_verify.checks.claims import enclosure_trajectory
from forge_verify.checks.deviation import REGIMES, deviation_table, ulp_at
from forge_verify.checks.problems import Problem, make_inputs
from forge_verify.commands.notebook import say, show, show_table

SETTINGS = {
    "fast": dict(size=8, tokens=16, steps=20, seed=0),
    "full": dict(size=8, tokens=32, steps=100, seed=0),
}[MODE]
RULE = fk.AdamW(lr=1e-3, weight_decay=0.01)
BACKEND = "interpreter" if fk.interpreting() else "gpu"
DEVICE = fk.kernel_device()
STEPS = tuple(range(1, SETTINGS["steps"] + 1))
PROBLEM = Problem(SETTINGS["tokens"], SETTINGS["size"], SETTINGS["size"], torch.bfloat16, SETTINGS["steps"],
                  SETTINGS["seed"])
say(f"Mode **{MODE}**: `{RULE!r}`, weight {SETTINGS['size']}×{SETTINGS['size']}, {SETTINGS['tokens']} bf16 tokens "
    f"per step, {SETTINGS['steps']} steps, seed {SETTINGS['seed']}; kernels "
    f"{'on the Triton CPU interpreter' if fk.interpreting() else 'compiled on ' + torch.cuda.get_device_name()}.")

# %%
exact_at = {}  # the exact trajectories, one per weight dtype, as the table computed them
rows = deviation_table(RULE, PROBLEM, checkpoints=STEPS, device=DEVICE, exact_at=exact_at)
series = {}
for row in rows:
    series.setdefault((row.regime, row.method), []).append(row)

bound, within = {}, {}
for name, regime in REGIMES.items():
    inputs = make_inputs(PROBLEM, DEVICE, regime)
    exact = exact_at[regime.weight]
    widths = []
    for step, _, _, w_enc, _ in enclosure_trajectory(RULE, regime, BACKEND, inputs):
        widths.append(float(((w_enc.hi - w_enc.lo).numpy() / ulp_at(exact[step], regime.weight)).max()))
    bound[name] = np.array(widths)
    forge = np.array([r.max_ulp for r in series[name, "forge"]])
    within[name] = bool(np.all(forge <= bound[name]))

# %% [markdown]
# ## Error against step count, with the proven bound
#
# Lines that coincide are methods that agree: with fp32 weights the gradient stored in
# fp32 is what the registers hold, so forge and standard are the same bits.

# %%
COLORS = {"forge": "tab:blue", "standard": "tab:orange", "torch.optim": "tab:green", "torchao 8-bit": "tab:purple"}
ROWS = -(-len(REGIMES) // 3)  # every regime gets a panel
fig, axes = plt.subplots(ROWS, 3, figsize=(13, 3.4 * ROWS), sharex=True)
for ax in axes.flat[len(REGIMES):]:
    ax.set_visible(False)
for ax, name in zip(axes.flat, REGIMES):
    for (regime, method), points in series.items():
        if regime == name:
            ax.plot(STEPS, [max(p.max_ulp, 1e-3) for p in points], color=COLORS[method], label=method,
                    ls="-" if method == "forge" else "--")
    ax.plot(STEPS, bound[name], color="black", lw=1, ls=":", label="proven bound (forge)")
    ax.set_yscale("log")
    ax.set_title(name, fontsize=9)
    dtype = "bf16" if REGIMES[name].weight == torch.bfloat16 else "fp32"
    ax.set_ylabel(f"max |error| ({dtype} ulp)", fontsize=8)
for ax in axes.flat:
    ax.set_xlabel("step")
legend = {}
for ax in axes.flat:
    legend.update(zip(*reversed(ax.get_legend_handles_labels())))
fig.suptitle("Largest weight error against the exact trajectory, per storage regime (log scale)", y=0.995)
fig.tight_layout(rect=(0, 0, 1, 0.94))
fig.legend(legend.values(), legend.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.972), ncol=len(legend),
           fontsize=9)
show(fig)
say("Forge's largest error is below the proven bound at every step in "
    f"**{sum(within.values())} of {len(within)}** regimes"
    + ("." if all(within.values()) else f"; not in {[k for k, v in within.items() if not v]}."))

# %% [markdown]
# ## Bias and spread
#
# The bias is the mean error signed along the exact change (negative: the weight lags
# behind, an update lost to rounding); the band is ± two standard errors of that mean
# (spread / √elements). Round-to-nearest bf16 weights lag; stochastic rounding should
# stay around zero. Curves with the same weight rounding nearly coincide: the weight's
# own bf16 rounding dominates the state's, and those regimes draw the same weight stream.

# %%
numel = SETTINGS["size"] ** 2
bf16_regimes = [name for name, regime in REGIMES.items() if regime.weight == torch.bfloat16]
fig, ax = plt.subplots(figsize=(9, 4.5))
for name, color, style in zip(bf16_regimes, ("tab:red", "tab:green", "tab:orange", "tab:blue", "tab:purple"),
                              ("-", "-", ":", ":", "--")):
    points = series[name, "forge"]
    bias = np.array([p.bias_ulp for p in points])
    error = 2 * np.array([p.spread_ulp for p in points]) / np.sqrt(numel)
    ax.plot(STEPS, bias, color=color, ls=style, lw=2, label=name)
    ax.fill_between(STEPS, bias - error, bias + error, color=color, alpha=0.15)
ax.axhline(0, color="grey", lw=1)
ax.set_xlabel("step")
ax.set_ylabel("bias along the exact change (bf16 ulp)")
ax.set_title("Bias of the fused update with bf16 weights (band: ± 2 standard errors)")
ax.legend(fontsize=8)
show(fig)

# %% [markdown]
# ## FORGE against the standard pipeline, after the last step

# %%
last = {(r.regime, r.method): r for r in rows if r.steps == STEPS[-1]}
show_table(["regime", "method", "max ulp", "median ulp", "bias ulp", "spread ulp", "rms / change"],
           [[r.regime, r.method, f"{r.max_ulp:.3g}", f"{r.median_ulp:.3g}", f"{r.bias_ulp:+.3g}",
             f"{r.spread_ulp:.3g}", f"{r.relative_rms:.3g}"] for r in last.values()])

methods = [m for m in COLORS if any(k[1] == m for k in last)]
fig, ax = plt.subplots(figsize=(12, 4.2))
width = 0.8 / len(methods)
for i, method in enumerate(methods):
    xs = [j for j, name in enumerate(REGIMES) if (name, method) in last]
    ax.bar(np.array(xs) + i * width, [last[list(REGIMES)[j], method].relative_rms for j in xs], width,
           color=COLORS[method], label=method)
ax.set_xticks(np.arange(len(REGIMES)) + width * (len(methods) - 1) / 2,
              [name.replace(", ", ",\n") for name in REGIMES], fontsize=7)
ax.set_yscale("log")
ax.set_xlabel("storage regime")
ax.set_ylabel("RMS error / RMS exact change (ratio)")
ax.set_title(f"Error relative to the weight's exact change after {STEPS[-1]} steps")
ax.legend(fontsize=8)
show(fig)
