"""Record the layer-level sharding verdicts the exactness summary report shows
(``reports/data/parallelism.csv``): for every rule family, storage regime and
tensor-/sequence-parallel layout, whether each rank's fused update equals the matching
slice of the unsharded fused update, bitwise, over several steps, on a real process
group, with both engines (DTensor ``parallelize_module`` and Megatron-style layers).

    forge-verify sharding --record reports/data/parallelism.csv

A verdict is ``exact`` when every rank matched at every step with both engines,
``refused`` when the library refuses the layout for that regime (a q8 shard that would
split a block), ``FAILED`` otherwise. Unlike ``sharding.layers_match_slice`` the job
never raises on a mismatch: a rank that stopped early would leave its peers waiting in
the next collective.
"""

import csv
from datetime import date

import torch
import torch.distributed as dist

import forge_kernels as fk
from forge_kernels.ops.stochastic_round import stream_seed

from .deviation import REGIMES
from .distributed import RankPool
from .gate_cases import RULES
from .problems import Problem, make_inputs
from .sharding import (LAYOUTS, SHARDINGS, LayerCase, _fused_layer, _linear, _sharded_layer, _snapshot, device,
                       expected_slices)

STEPS = 2
#: a problem every layout can shard on 2 ranks: q8 row shards need whole 32-column blocks
PROBLEM = dict(tokens=24, out_features=40, in_features=128, dtype=torch.bfloat16, steps=STEPS, seed=11)
LAYOUT_NAMES = {"column": "TP column", "row": "TP row", "column_sp": "TP column + SP", "row_sp": "TP row + SP"}


def _slice_equal(local: dict, whole: dict, rows, cols) -> bool:
    if set(local) != set(whole):
        return False
    for key, expected in expected_slices(whole, rows, cols).items():
        got, expected = local[key], expected.contiguous()
        if got.shape != expected.shape or not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
            return False
    return True


def verdicts_job(regime_names: list) -> dict:
    """Job (every rank): {(rule, regime, layout): verdict}, agreed across ranks."""
    out = {}
    for regime_name in regime_names:
        regime = REGIMES[regime_name]
        case = LayerCase(Problem(**PROBLEM), regime)
        inputs = make_inputs(case.problem, device(), regime)
        layer_seed = stream_seed(regime.seed, 1, 0)
        for rule_name, rule in RULES.items():
            whole = fk.ForgeLinear.from_linear(_linear(inputs.weight), rule, config=None,
                                               state_format=regime.state_format, rounding=regime.rounding,
                                               seed=layer_seed)
            layers = {}
            for engine, layout in SHARDINGS:
                try:
                    layers[engine, layout] = _sharded_layer(case, engine, layout, rule, inputs.weight, layer_seed)
                except ValueError:  # the library refuses this layout for this regime (the same on every rank)
                    layers[engine, layout] = None
            ok = {key: layer is not None for key, layer in layers.items()}
            for x, dy in inputs.batches:
                whole(x).backward(dy)
                expected = _snapshot(whole)
                for key, layer in layers.items():
                    if layer is None:
                        continue
                    module, operands, rows, cols = layer
                    x_local, dy_local = operands(x, dy)
                    module(x_local).backward(dy_local)
                    ok[key] = ok[key] and _slice_equal(_snapshot(_fused_layer(module)), expected, rows, cols)
            for layout in LAYOUTS:
                engines = [key for key in layers if key[1] == layout]
                if all(layers[key] is None for key in engines):
                    verdict = 2  # refused
                else:
                    verdict = int(all(ok[key] for key in engines))
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
