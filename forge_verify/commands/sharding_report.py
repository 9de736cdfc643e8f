"""``forge-verify sharding``: the measured numbers behind the README's parallelism
matrix, from a real process group (gloo on the CPU, NCCL on GPUs).

* TP/SP against the unsharded model: the largest ulp distance of any rank's weight
  shard to the unsharded weight after each step, trained fused and trained plain
  (autograd's gradient, then the same rule): the row-parallel all-reduce's
  reordering, with or without FORGE.
* DP, CP, accumulation: the distance of a naive fused step per part, and of the two
  token_split alternatives, to the true trajectory.
"""

import forge_kernels as fk

from ..distributed import sharded_models

from ..checks.tables import render_table
from ..distributed import token_split_controls
from ..distributed.ranks import RankPool

RULES = (fk.AdamW(lr=1e-3, weight_decay=0.01), fk.SGD(lr=0.01, momentum=0.9))


def _worst(per_rank, path):
    return [max(result[path][i] for result in per_rank) for i in range(len(per_rank[0][path]))]


def tp_rows(pool, steps):
    rows = []
    for kind in sharded_models.MODELS:
        for rule in RULES:
            per_rank = pool.run(sharded_models.deviation_from_unsharded, kind, rule, steps)
            for path in ("fused", "plain"):
                rows.append((kind, type(rule).__name__, path, *(str(d) for d in _worst(per_rank, path))))
    return rows


def split_rows(pool, steps):
    rows = []
    for split in token_split_controls.SPLITS:
        for rule in RULES:
            per_rank = pool.run(token_split_controls.split_step_deviation, split, rule, steps)
            for method in per_rank[0]:
                ulp = max(r[method]["max_ulp"] for r in per_rank)
                relative = max(r[method]["relative"] for r in per_rank)
                rows.append((split, type(rule).__name__, method, f"{ulp:,}", f"{relative:.3g}"))
    return rows


def sharding_report(world_size=2, steps=3, backend=None) -> str:
    with RankPool(world_size, backend) as pool:
        header = f"{world_size} ranks ({pool.backend}), {steps} steps; rules: " + "; ".join(map(repr, RULES))
        tp = render_table(("model", "rule", "training", *(f"step {i} max ulp" for i in range(1, steps + 1))),
                          tp_rows(pool, steps))
        splits = render_table(("split", "rule", "step", "max ulp", "|w - w_true| / |w_true - w0|"),
                              split_rows(pool, steps))
    return (f"{header}\n\nTP/SP against the unsharded model (largest over ranks):\n{tp}\n\n"
            f"Tokens split across ranks or micro-batches, against the true trajectory (largest over ranks):\n"
            f"{splits}")
