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
# # Exactness summary: rules × storage regimes × parallelism
#
# Each cell says what holds for one rule in one storage regime:
#
# * **exact**: the fused update equals the materialized oracle (same tile loop, dW
#   stored, same epilogue) bit for bit, weight and every state slot, *and* lies inside
#   the proven enclosure of the exact step
#   ([proofs/fp32_exactness.md](../proofs/fp32_exactness.md),
#   [proofs/reference_enclosure.md](../proofs/reference_enclosure.md));
# * **bound**: inside the proven enclosure, but not bitwise the oracle;
# * **refused**: the library raises instead of computing;
# * **FAILED**: neither holds — a defect.
#
# The single-device column is measured when this notebook runs (backend named below).
# Parallel layouts come from `reports/data/parallelism.csv`, recorded by
# `forge-verify sharding --record` on a real process group (columns `rule, regime,
# parallelism, verdict, evidence`; the evidence column names where and when it ran).
# Data and context parallelism and accumulation are not exact by construction: the
# README's parallelism matrix gives their measured deviations and refusals.

# %% tags=["parameters"]
MODE = "full"  # "fast" is the CI setting (forge-verify report --mode fast)

# %%
import csv
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import forge_kernels as fk
from forge_verify.checks import claims
from forge_verify.checks.problems import REGIMES, Problem
from forge_verify.commands.notebook import say, show, show_table
from forge_verify.gate.cases import CONFIG, RULES, Case
from forge_verify.gate.measure import enclosure_measure

SETTINGS = {
    "fast": dict(seeds=(0,), steps=1, activations=(torch.bfloat16,)),
    "full": dict(seeds=(0, 1), steps=3, activations=(torch.float32, torch.bfloat16)),
}[MODE]
BACKEND = "interpreter" if fk.interpreting() else "gpu"
DEVICE = fk.kernel_device()
where = "on the Triton CPU interpreter" if fk.interpreting() else f"compiled on {torch.cuda.get_device_name()}"
say(f"Mode **{MODE}**; kernels {where}; "
    f"config `{CONFIG}`; seeds {SETTINGS['seeds']}, {SETTINGS['steps']} step(s), activations "
    f"{', '.join(str(d).replace('torch.', '') for d in SETTINGS['activations'])}.")

# %% [markdown]
# ## Single device, measured now
#
# Problems: 20 tokens, a 20 × 40 weight (two tiles each way with the config above, both
# ragged). "Enclosure use" is the largest |kernel − centre| / radius of the enclosure
# over the weight and every state slot: the proof says it is at most 1. Values near 1
# are expected wherever a store rounds: the enclosure's store term is the worst case of
# one rounding (half a bf16 ulp to nearest, one ulp stochastically, a q8 level), which
# single elements reach, and a value stored as exactly 0 sits on an enclosure clamped at 0.

# %%
verdicts, use = {}, np.zeros((len(RULES), len(REGIMES)))
for i, (rule_name, rule) in enumerate(RULES.items()):
    for j, (regime_name, regime) in enumerate(REGIMES.items()):
        exact = inside = True
        for seed in SETTINGS["seeds"]:
            for dtype in SETTINGS["activations"]:
                problem = Problem(tokens=20, out_features=20, in_features=40, dtype=dtype,
                                  steps=SETTINGS["steps"], seed=seed)
                try:
                    claims.fused_matches_oracle(problem, rule, CONFIG, DEVICE, regime=regime)
                except AssertionError:
                    exact = False
                case = Case(rule_name, rule, regime_name, regime, problem)
                stats = enclosure_measure(case, DEVICE, BACKEND)[3]["statistics"]
                inside &= stats["outside_enclosure"] == 0
                use[i, j] = max(use[i, j], stats["enclosure_use"])
        verdicts[rule_name, regime_name] = "exact" if exact and inside else "bound" if inside else "FAILED"

show_table(["rule"] + list(REGIMES), [[r] + [verdicts[r, g] for g in REGIMES] for r in RULES])
failed = [k for k, v in verdicts.items() if v != "exact"]
say(f"**{len(verdicts) - len(failed)} of {len(verdicts)}** rule × regime cells exact on one device"
    + (f"; not exact: {failed}" if failed else "."))

# %%
fig, ax = plt.subplots(figsize=(10, 4.2))
image = ax.imshow(use, vmin=0, vmax=1, cmap="viridis", aspect="auto")
ax.set_xticks(range(len(REGIMES)), [name.replace(", ", ",\n") for name in REGIMES], fontsize=7)
ax.set_yticks(range(len(RULES)), list(RULES))
ax.set_xlabel("storage regime")
ax.set_ylabel("rule")
for (i, j), value in np.ndenumerate(use):
    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8, color="white" if value < 0.6 else "black")
fig.colorbar(image, ax=ax, label="enclosure use (|kernel − centre| / radius; proven ≤ 1)")
ax.set_title("How much of the proven error radius the fused update uses (single device)")
show(fig)

# %% [markdown]
# ## Refused by design
#
# Each row is attempted now; the message is the library's own.

# %%
def attempt(make):
    try:
        make()
    except (TypeError, ValueError) as error:
        return "refused", str(error).split(";")[0]
    return "accepted", "-"


weight = torch.zeros(20, 40, device=DEVICE)
x, dy = torch.randn(8, 40, device=DEVICE), torch.randn(8, 20, device=DEVICE)
q8_rule = fk.AdamW()
rows = [
    ("q8 state with block_k = 16 (a tile must hold whole 32-element blocks)",
     *attempt(lambda: fk.fused_weight_update(x, dy, weight.clone(), q8_rule.init_state(weight, "q8"), q8_rule, 1,
                                             config=fk.TileConfig(block_k=16)))),
    ("float16 activations",
     *attempt(lambda: fk.fused_weight_update(x.half(), dy.half(), weight.clone(), fk.SGD(lr=0.1).init_state(weight),
                                             fk.SGD(lr=0.1), 1))),
    ("float64 weight",
     *attempt(lambda: fk.fused_weight_update(x, dy, weight.double(), {}, fk.SGD(lr=0.1), 1))),
    ("Adam with (coupled L2) weight_decay", *attempt(lambda: fk.Adam(weight_decay=0.01))),
]
show_table(["what", "verdict", "message"], rows)

# %% [markdown]
# ## Parallel layouts

# %%
PARALLELISM = Path("reports/data/parallelism.csv")
if not PARALLELISM.exists():
    say(f"**No parallel verdicts recorded**: `{PARALLELISM}` does not exist, so tensor-, sequence- and "
        "data-parallel columns are not shown. Nothing about sharded runs is claimed here until the sharding "
        "harness records its verdicts there (one row per rule, regime and layout, with the test that is "
        "its evidence).")
else:
    with PARALLELISM.open() as f:
        records = list(csv.DictReader(f))
    layouts = sorted({r["parallelism"] for r in records})
    cell = {(r["rule"], r["regime"], r["parallelism"]): r["verdict"] for r in records}
    show_table(["rule", "regime", "single device (now)"] + layouts,
               [[r, g, verdicts[r, g]] + [cell.get((r, g, p), "not measured") for p in layouts]
                for r in RULES for g in REGIMES])
    for evidence in sorted({r["evidence"] for r in records}):
        say(f"Evidence: {evidence}")
