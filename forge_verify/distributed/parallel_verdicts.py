"""Record the layer-level sharding verdicts the exactness summary report shows
(``reports/data/parallelism.csv``): for every rule family, storage regime and
tensor-/sequence-parallel layout, whether each rank's fused update equals the matching
slice of the unsharded fused update, bitwise, over several steps, on a real process
group, with both engines (DTensor ``parallelize_module`` and Megatron-style layers).

    forge-verify sharding --record reports/data/parallelism.csv

A verdict is ``exact`` when every rank matched at every step with both engines,
``refused`` when the library refuses the layout for that regime (a q8 shard that would
split a block), ``FAILED`` otherwise. The steps are ``sharding.sharded_steps``, as in
the property; unlike the property the job never raises on a mismatch, since a rank that
stopped early would leave its peers waiting in the next collective.
"""

import csv
from datetime import date

import torch
import torch.distributed as dist

import forge_kernels as fk

from ..checks.catalog import CATALOG
from ..checks.problems import REGIMES, Problem
from ..numerics.bits import first_difference
from .ranks import RankPool
from .sharding import ENGINES, LAYOUTS, LayerCase, device, sharded_steps

STEPS = 2
#: a problem every layout can shard on 2 ranks: q8 row shards need whole 32-column blocks
PROBLEM = dict(tokens=24, out_features=40, in_features=128, dtype=torch.bfloat16, steps=STEPS, seed=11)
LAYOUT_NAMES = {"column": "TP column", "row": "TP row", "column_sp": "TP column + SP", "row_sp": "TP row + SP"}


def _equal(local: dict, expected: dict) -> bool:
    return set(local) == set(expected) and all(first_difference(local[k], expected[k]) is None for k in expected)


def verdicts_job(regime_names: list) -> dict:
    """Job (every rank): {(rule, regime, layout): verdict}, agreed across ranks."""
    out = {}
    for regime_name in regime_names:
        case = LayerCase(Problem(**PROBLEM), REGIMES[regime_name])
        for rule_name, rule in ((entry.name, entry.gate) for entry in CATALOG):
            ok, refused = {}, set()
            for engine, layout, _, local, expected in sharded_steps(case, rule, allow_refusal=True):
                if local is None:
                    refused.add((engine, layout))
                else:
                    ok[engine, layout] = ok.get((engine, layout), True) and _equal(local, expected)
            for layout in LAYOUTS:
                engines = [(engine, layout) for engine in ENGINES]
                if all(key in refused for key in engines):
                    verdict = 2
                else:
                    verdict = int(all(ok.get(key, False) for key in engines))
                agreed = torch.tensor([verdict], device=device())
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
                out[rule_name, regime_name, layout] = {0: "FAILED", 1: "exact", 2: "refused"}[int(agreed)]
    return out


def record_parallel_verdicts(path: str, world_size: int = 2, backend=None) -> str:
    """Run the verdicts on ``world_size`` ranks and write them as CSV; returns a summary."""
    with RankPool(world_size, backend) as pool:
        verdicts = pool.run(verdicts_job, list(REGIMES), timeout_s=1800)[0]
        used_backend = pool.backend
    evidence = (f"forge-verify sharding --record, {world_size} ranks ({used_backend}, "
                f"{'CPU interpreter' if fk.interpreting() else torch.cuda.get_device_name()}), {date.today()}: "
                f"DTensor and Megatron-style, {STEPS} steps, weight {PROBLEM['out_features']}x"
                f"{PROBLEM['in_features']}, {PROBLEM['tokens']} bf16 tokens; the same claim is "
                "properties/test_sharding_exactness.py")
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["rule", "regime", "parallelism", "verdict", "evidence"])
        for (rule, regime, layout), verdict in sorted(verdicts.items()):
            writer.writerow([rule, regime, LAYOUT_NAMES[layout], verdict, evidence])
    counts = {v: sum(1 for x in verdicts.values() if x == v) for v in ("exact", "refused", "FAILED")}
    return f"wrote {path}: " + ", ".join(f"{n} {v}" for v, n in counts.items())
