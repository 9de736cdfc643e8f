"""Recorded GPU benchmark results (``benchmarks/results/*.csv``) for the performance
report: loading, the memory-traffic floor, and the figures.

One CSV row per (configuration, method) with the columns in ``COLUMNS``; times in
milliseconds, ``peak_bytes`` the device memory the step allocates beyond what was
allocated before it (``benchmarks/bench_update.py``). An optional ``floor_ms`` column is
the floor the benchmark computed from the bandwidth and matrix rate it measured in the
same run; it is preferred to the datasheet floor here.
"""

import csv
import re
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt

COLUMNS = ("gpu", "torch", "triton", "commit", "n", "k", "tokens", "regime", "method",
           "median_ms", "min_ms", "max_ms", "peak_bytes")
_INTEGER = ("n", "k", "tokens")
_REAL = ("median_ms", "min_ms", "max_ms")

#: peak HBM bandwidth by GPU name (bytes/s), from the vendor's datasheet
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
#: AdamW state bytes per parameter by state format (two slots; q8: codes plus a block exponent)
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "q8": 2.0625}
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0}
#: (weight, state) formats of the regime names ``benchmarks/bench_update.py`` records
_BENCHMARK_REGIMES = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "bf16-sr": ("bf16", "bf16"),
                      "bf16-rn": ("bf16", "bf16"), "q8": ("bf16", "q8")}
ACTIVATION_BYTES = 2.0  # bf16 activations, as the benchmarks use


def load_results(paths) -> list:
    """Rows of every CSV in ``paths``, numbers parsed; a missing column is an error."""
    rows = []
    for path in sorted(Path(p) for p in paths):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = set(COLUMNS) - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: missing columns {sorted(missing)}")
            for record in reader:
                row = dict(record, source=str(path))
                row.update({c: int(record[c]) for c in _INTEGER})
                row.update({c: float(record[c]) for c in _REAL})
                # Empty for a method whose memory is not measured per step (a CUDA-graph replay:
                # its memory was allocated in the graph's pool at capture).
                row["peak_bytes"] = int(record["peak_bytes"]) if record["peak_bytes"] else None
                row["floor_ms"] = float(record["floor_ms"]) if record.get("floor_ms") else None
                rows.append(row)
    return rows


def storage(regime: str):
    """(weight format, state format) named by a regime string such as "bf16 weight, q8 state"
    (the deviation study's names) or a single format ("fp32", "bf16": weight and state
    alike); None when the string names neither."""
    weight = re.search(r"\b(fp32|bf16) weight", regime)
    state = re.search(r"\b(fp32|bf16|q8) state", regime)
    if weight and state:
        return weight[1], state[1]
    return _BENCHMARK_REGIMES.get(regime.strip())


def bandwidth(gpu: str):
    return next((value for name, value in PEAK_BANDWIDTH.items() if name in gpu), None)


def row_floor_ms(row):
    """The floor recorded with the row (measured ceilings), else the datasheet floor."""
    if row.get("floor_ms") is not None:
        return row["floor_ms"]
    return floor_ms(row["gpu"], row["n"], row["k"], row["tokens"], row["regime"])


def floor_ms(gpu: str, n: int, k: int, tokens: int, regime: str):
    """The memory-traffic floor of one fused AdamW step: weight and state read and written
    once, activations (x and dy) read once, at the GPU's peak bandwidth; None where the GPU
    or the regime is not known."""
    formats, peak = storage(regime), bandwidth(gpu)
    if formats is None or peak is None:
        return None
    weight, state = formats
    moved = 2 * n * k * (WEIGHT_BYTES[weight] + STATE_BYTES[state]) + tokens * (n + k) * ACTIVATION_BYTES
    return 1e3 * moved / peak


def _groups(rows):
    groups = defaultdict(lambda: defaultdict(list))
    for row in rows:
        groups[row["gpu"], row["n"], row["k"], row["regime"]][row["method"]].append(row)
    return groups


def _grid(count):
    columns = min(count, 2)
    rows = -(-count // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.2 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, axes.flat


def time_figure(rows):
    """Median step time (min-max bars) against tokens, one panel per GPU, shape and regime,
    with the memory-traffic floor where it is known."""
    groups = _groups(rows)
    fig, axes = _grid(len(groups))
    for ax, ((gpu, n, k, regime), methods) in zip(axes, sorted(groups.items())):
        for method, points in sorted(methods.items()):
            points = sorted(points, key=lambda r: r["tokens"])
            tokens = [r["tokens"] for r in points]
            median = [r["median_ms"] for r in points]
            spread = [[r["median_ms"] - r["min_ms"] for r in points], [r["max_ms"] - r["median_ms"] for r in points]]
            ax.errorbar(tokens, median, yerr=spread, marker="o", ms=4, capsize=3, label=method)
        by_tokens = {r["tokens"]: row_floor_ms(r) for points in methods.values() for r in points}
        tokens = sorted(by_tokens)
        floor = [by_tokens[t] for t in tokens]
        if None not in floor:
            ax.plot(tokens, floor, color="black", ls=":", label="floor")
        ax.set_yscale("log")
        _label_panel(ax, "time per step (ms, median; bars: min-max)", gpu, n, k, regime)
    fig.tight_layout()
    return fig


def _label_panel(ax, ylabel, gpu, n, k, regime):
    """Tokens on a log2 axis, the quantity, the case, the methods."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{gpu}: {n}×{k}, {regime}", fontsize=9)
    ax.legend(fontsize=8)


def memory_figure(rows):
    """Extra device memory of a step against tokens, one panel per GPU, shape and regime."""
    groups = _groups(rows)
    fig, axes = _grid(len(groups))
    for ax, ((gpu, n, k, regime), methods) in zip(axes, sorted(groups.items())):
        for method, points in sorted(methods.items()):
            points = sorted((r for r in points if r["peak_bytes"] is not None), key=lambda r: r["tokens"])
            if not points:
                continue
            ax.plot([r["tokens"] for r in points], [r["peak_bytes"] / 2**20 for r in points], marker="o", ms=4,
                    label=method)
        _label_panel(ax, "extra device memory during the step (MiB)", gpu, n, k, regime)
    fig.tight_layout()
    return fig
