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
# # Performance, from recorded benchmark results
#
# Plotted from the CSVs under `benchmarks/results/` (columns `gpu, torch, triton,
# commit, n, k, tokens, regime, method, median_ms, min_ms, max_ms, peak_bytes` and
# optionally `floor_ms`), which GPU runs of `benchmarks/bench_update.py` record; nothing
# is measured here, and nothing is claimed without a recorded row. `peak_bytes` is the
# memory a step allocates beyond what was allocated before it. The dotted line is the
# floor of one fused AdamW step: the larger of the bytes that must move (weight and state
# read and written once, bf16 activations read once) over the bandwidth and the matrix
# FLOPs over the bf16 matrix rate, both measured in the benchmark's own run where the CSV
# records `floor_ms`, else the memory term alone at the datasheet bandwidth
# (`forge_verify.commands.benchmark_results.row_floor_ms`).

# %% tags=["parameters"]
MODE = "full"  # the same in both modes: this report only reads recorded results
RESULTS = "benchmarks/results/*.csv"

# %%
import glob

from forge_verify.commands.benchmark_results import load_results, memory_figure, row_floor_ms, time_figure
from forge_verify.commands.notebook import say, show, show_table

paths = sorted(glob.glob(RESULTS))
rows = load_results(paths)
if not rows:
    say(f"**No benchmark results recorded**: no rows in `{RESULTS}`. There is nothing to plot, and no "
        "performance figure is claimed.")
else:
    say(f"{len(rows)} rows from {len(paths)} file(s): " + ", ".join(f"`{p}`" for p in paths) + ".")
    versions = sorted({(r["gpu"], r["torch"], r["triton"], r["commit"]) for r in rows})
    show_table(["gpu", "torch", "triton", "commit"], versions)

# %%
if rows:
    show(time_figure(rows))
    unknown = sorted({(r["gpu"], r["regime"]) for r in rows if row_floor_ms(r) is None})
    if unknown:
        say("No memory-traffic floor drawn for (gpu, regime) " + ", ".join(f"`{u}`" for u in unknown)
            + ": its peak bandwidth or its storage formats are not known to `forge_verify.commands.benchmark_results`.")

# %%
if rows:
    show(memory_figure(rows))

# %%
if rows:
    show_table(["gpu", "n × k", "regime", "tokens", "method", "median ms", "min ms", "max ms", "extra MiB",
                "floor ms"],
               [[r["gpu"], f"{r['n']}×{r['k']}", r["regime"], r["tokens"], r["method"], f"{r['median_ms']:.4g}",
                 f"{r['min_ms']:.4g}", f"{r['max_ms']:.4g}", "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}",
                 (lambda f: "-" if f is None else f"{f:.4g}")(row_floor_ms(r))]
                for r in sorted(rows, key=lambda r: (r["gpu"], r["n"], r["k"], r["regime"], r["tokens"],
                                                     r["method"]))])
