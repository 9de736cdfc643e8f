"""One weight-gradient + optimizer step of a linear layer on the GPU: FORGE's fused update
against PyTorch, per weight shape, token count and storage regime.

Methods (AdamW, lr 1e-3, weight decay 0.01; bf16 activations x (T, K) and dy (T, N)):

* ``forge``: ``fk.fused_weight_update`` as users call it (argument checks, the device
  input check, and the outcome read back once: ``report="raise"``, the default);
* ``forge deferred``: the same with ``report="defer"``, no synchronization; each call
  checks the previous call's report first, as a fused layer does at its next step;
* ``forge kernel``: the same kernel launched alone (a diagnostic: what the checks cost);
  ``--tune`` also replays it from a CUDA graph and ranks configs by that time, since a
  launch whose host work outlasts the kernel (the Hopper kernel's descriptors) makes the
  eager median the host's time;
* ``forge kernel replayed``: the same kernel replayed from a CUDA graph (its GPU time);
* ``forge captured``: the call (input check, fused kernel, ``report="defer"``) captured
  once in a CUDA graph with its step as a ``StepScalars``; each timed step is
  ``StepScalars.set(step)`` (host scalars, one 40-byte copy) and one graph replay;
* ``forge captured unscanned``: the same with ``input_check="tiles"``: no input scan, a
  non-finite input fails the tiles it reaches instead of the whole step;
* ``torch``: cuBLAS dW = dyᵀx, then ``torch.optim.AdamW(fused=True)``;
* ``torch captured``: the same two in one CUDA graph, ``AdamW(fused=True, capturable=True)``;
* ``torch hook``: PyTorch's optimizer-in-backward, one optimizer stepping from a
  ``register_post_accumulate_grad_hook`` while autograd computes dW;
* ``torchao 8-bit``: cuBLAS dW, then torchao's ``AdamW8bit`` (q8 regime, if it runs).

Regimes: ``fp32`` (fp32 weight and state), ``bf16-sr`` (bf16 weight and state,
stochastic rounding; torch rounds to nearest), ``bf16-rn`` (bf16 weight and state rounded
to nearest, as torch rounds them: the like-for-like bf16 comparison), ``q8`` (bf16 weight,
8-bit state with stochastic codes; torch keeps bf16 state, torchao 8-bit state).

Times are medians of ``triton.testing.do_bench`` (L2 flushed before each call), pooled
over ``--rounds`` rounds that time every method of a row in turn, the order reversed each
other round: at 16,384 tokens an H100 runs at its power cap and read the first method of a
row 1.5-8 % faster than the same method at the row's end (``probe_replay.py``,
results/h100-probe-replay-ffdcdf6.log), so a fixed order favours whichever comes first.
Peak is the largest extra device memory during one step. The floor is the larger of (bytes
that must move) / (copy bandwidth) and (matrix FLOPs) / (bf16 matrix rate), both
measured in the same run. Writes a CSV (one row per shape, tokens, regime, method)
and prints a table.

    python3 benchmarks/bench_update.py --out benchmarks/results/h200.csv
    python3 benchmarks/bench_update.py --tune --out /tmp/tune.csv   # sweep tile configs
"""

import argparse
import ast
import csv
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from checkout import forge_kernels  # noqa: E402

forge_kernels()
import forge_kernels as fk  # noqa: E402
from forge_kernels.ops.fused_weight_update import _Epilogue  # noqa: E402

SHAPES = [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336)]
TOKENS = [256, 512, 1024, 4096, 16384]
REGIMES = {  # name: (weight dtype, state format, FORGE's rounding of bf16 stores and q8 codes)
    "fp32": (torch.float32, "fp32", "stochastic"),
    "bf16-sr": (torch.bfloat16, "bf16", "stochastic"),
    "bf16-rn": (torch.bfloat16, "bf16", "nearest"),
    "q8": (torch.bfloat16, "q8", "stochastic"),
}
CONFIGS_FILE = HERE / "tuned_configs.json"
# Tile configs the sweep tries: (block_n, block_k, block_t, num_warps, num_stages[, maxnreg[,
# epilogue_split]]). The first sweep (results/tuning/h200-late-store-address.*) ruled out
# 4-warp and 64-token-block 64x64 tiles; the next added 128x128 tiles with a split epilogue;
# h200-pairs-tune (after the paired Philox draw) found split epilogues with a register cap
# fastest for bf16 below 4,096 tokens.
CANDIDATES = [(64, 64, 64, 8, 3), (64, 64, 64, 8, 3, 128), (64, 64, 32, 8, 4, 128), (128, 64, 128, 8, 3),
              (64, 128, 64, 8, 3, 128), (128, 64, 64, 8, 3, None, 2), (64, 128, 64, 8, 3, None, 2),
              (64, 128, 64, 8, 3, 128, 2), (64, 64, 64, 4, 3, None, 4),
              (128, 128, 64, 8, 3, None, 2), (128, 128, 64, 8, 3, None, 4), (128, 128, 64, 8, 4, None, 4),
              (128, 128, 128, 8, 3, None, 4), (128, 256, 64, 8, 3, None, 4)]


def rule():
    return fk.AdamW(lr=1e-3, weight_decay=0.01)


def state_bytes_per_param(regime: str) -> float:
    w_dtype, state_format, _ = REGIMES[regime]
    state = rule().init_state(torch.zeros(64, 4096, dtype=w_dtype), state_format=state_format)
    return sum(t.numel() * t.element_size() for t in state.values()) / (64 * 4096)


def floor_ms(n, k, t, regime, bandwidth, matrix_rate):
    """The larger of the memory time (x and dy read once; weight and state read and written
    once) and the matrix time (2 T N K FLOPs)."""
    w_bytes = torch.finfo(REGIMES[regime][0]).bits // 8
    moved = 2 * t * (n + k) + 2 * n * k * (w_bytes + state_bytes_per_param(regime))
    return max(moved / bandwidth, 2.0 * t * n * k / matrix_rate) * 1e3


def measure_ceilings():
    """(copy bandwidth in bytes/s counting read + write, bf16 matrix rate in FLOP/s)."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    copy_ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    del a, b, x, y
    return 2 * 2**30 / (copy_ms * 1e-3), 2 * n**3 / (mm_ms * 1e-3)


class Layer:
    """Inputs, weight and state of one benchmark case (random data: never zeros)."""

    def __init__(self, n, k, t, regime, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w_dtype, self.state_format, self.rounding = REGIMES[regime]
        self.x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
        self.dy = (torch.randn(t, n, device="cuda", generator=gen) * 1e-3).bfloat16()
        self.w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(w_dtype)

    def fresh_state(self, r):
        state = r.init_state(self.w, state_format=self.state_format)
        if self.state_format != "q8":  # a nonzero second moment, as after some steps
            for name in r.slots:
                state[name].normal_(0.0, 1e-4).abs_()
        return state


def torch_grad(layer):
    """cuBLAS dW in the weight's dtype (fp32 output straight from the GEMM where torch offers it)."""
    if layer.w.dtype == torch.float32:
        try:
            return torch.mm(layer.dy.t(), layer.x, out_dtype=torch.float32)
        except TypeError:
            return torch.mm(layer.dy.t(), layer.x).float()
    return torch.mm(layer.dy.t(), layer.x)


def kernel_step(layer, config, r=None, state=None):
    """The fused kernel launched alone (no argument checks, no non-finite report); the
    returned callable keeps its ``_Epilogue`` as ``.epilogue`` (its grid, its status words)."""
    r = rule() if r is None else r
    state = layer.fresh_state(r) if state is None else state
    epilogue = _Epilogue(layer.w, state, r, 1, config, layer.rounding, 0, 1.0, None)

    def step():
        return epilogue.fused(layer.x, layer.dy, layer.w)
    step.epilogue = epilogue
    return step


def capture(fn):
    """A CUDA graph of ``fn``, after one warm-up call on a side stream (compilation,
    optimizer state); returns (graph, what the captured call returned). The graph holds
    ``fn``: it replays raw addresses, and tensors ``fn`` allocated before the capture (a
    fused step's status words and flags) would otherwise be freed with it and taken by
    later allocations; a kernel that then reads nonzero status skips every store and
    replays too fast (results/tuning/h100-replay-fix-ffe373b.log)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        returned = fn()
    graph.captured_fn = fn
    return graph, returned


CAPTURED = ("forge captured", "forge captured unscanned", "forge kernel replayed", "torch captured")  # their memory sits in the graph's pool: not measured per step


def captured_step(layer, config, r, state, seed=1, input_check="step"):
    """The fused call captured once; each call sets the next step's scalars and replays."""
    scalars = fk.StepScalars(r, seed=seed, device="cuda").set(1)
    graph, _ = capture(lambda: fk.fused_weight_update(layer.x, layer.dy, layer.w, state, r, scalars, seed=seed,
                                                      config=config, rounding=layer.rounding, report="defer",
                                                      input_check=input_check))
    steps = itertools.count(2)

    def step():
        scalars.set(next(steps))
        graph.replay()
    return step


def methods(layer, regime, config):
    """name -> zero-argument callable taking one step."""
    r = rule()
    found = {}
    state = layer.fresh_state(r)
    seed = iter(range(1, 10**9))

    def forge():
        fk.fused_weight_update(layer.x, layer.dy, layer.w, state, r, 1, config=config, seed=next(seed),
                               rounding=layer.rounding)
    found["forge"] = forge

    pending = []

    def forge_deferred():
        if pending:
            pending.pop().check()
        pending.append(fk.fused_weight_update(layer.x, layer.dy, layer.w, state, r, 1, config=config,
                                              seed=next(seed), rounding=layer.rounding, report="defer"))
    found["forge deferred"] = forge_deferred

    found["forge kernel"] = kernel_step(layer, config, r, state)
    found["forge kernel replayed"] = capture(kernel_step(layer, config, r, state))[0].replay
    found["forge captured"] = captured_step(layer, config, r, state)
    if not config.in_kernel_check:  # that config scans inside the kernel: nothing to leave out
        found["forge captured unscanned"] = captured_step(layer, config, r, state, input_check="tiles")

    param = torch.nn.Parameter(layer.w.clone())
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)

    def torch_step():
        param.grad = torch_grad(layer)
        opt.step()
        param.grad = None
    found["torch"] = torch_step

    captured_param = torch.nn.Parameter(layer.w.clone())
    captured_opt = torch.optim.AdamW([captured_param], lr=1e-3, weight_decay=0.01, fused=True, capturable=True)

    def torch_captured_step():
        captured_param.grad = torch_grad(layer)
        captured_opt.step()
    found["torch captured"] = capture(torch_captured_step)[0].replay

    hooked = torch.nn.Parameter(layer.w.clone())
    hook_opt = torch.optim.AdamW([hooked], lr=1e-3, weight_decay=0.01, fused=True)

    def step_in_backward(p):
        hook_opt.step()
        p.grad = None
    hooked.register_post_accumulate_grad_hook(step_in_backward)

    class WeightGrad(torch.autograd.Function):
        """Backward yields dW = dyᵀx; forward costs nothing, so only the backward is timed."""

        @staticmethod
        def forward(ctx, w):
            return w.new_zeros(())

        @staticmethod
        def backward(ctx, _):
            return torch_grad(layer)

    found["torch hook"] = lambda: WeightGrad.apply(hooked).backward()

    if regime == "q8":
        try:
            from torchao.optim import AdamW8bit
            ao_param = torch.nn.Parameter(layer.w.clone())
            ao_opt = AdamW8bit([ao_param], lr=1e-3, weight_decay=0.01)

            def torchao_step():
                ao_param.grad = torch_grad(layer)
                ao_opt.step()
                ao_param.grad = None
            torchao_step()
            found["torchao 8-bit"] = torchao_step
        except Exception as error:  # reported, not hidden: the row is absent and the reason printed
            print(f"torchao 8-bit unavailable: {type(error).__name__}: {error}", file=sys.stderr)
    return found


def peak_extra_bytes(fn):
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def readings(fn):
    """``do_bench``'s times of ``fn`` in ms, one per call, L2 flushed before each."""
    return do_bench(fn, warmup=25, rep=200, return_mode="all")


def summary(times):
    return statistics.median(times), min(times), max(times)


def timed(fn):
    return summary(readings(fn))


def in_rounds(items, rounds):
    """(round, item) for each item once per round, the order reversed each other round: at
    its power cap a GPU reads what runs first faster (``probe_replay.py``), so one fixed
    order would favour one method."""
    items = list(items)
    for round_ in range(rounds):
        for item in (items if round_ % 2 == 0 else items[::-1]):
            yield round_, item


def timed_in_rounds(found, rounds):
    """name -> (median, min, max) of every reading of each method of ``found``, taken in
    ``rounds`` rounds (``in_rounds``)."""
    times = {name: [] for name in found}
    for _, name in in_rounds(found, rounds):
        times[name].extend(readings(found[name]))
    return {name: summary(t) for name, t in times.items()}


def host_us(fn, calls=50):
    """Host time per call in microseconds, the GPU drained before and after: 50 launches
    queue without filling the launch queue, so this is what the host spends, not the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def kernel_times(step):
    """A kernel step timed as launched (eager) and as one CUDA-graph replay, and its host
    cost: where the host takes longer than the GPU the eager median is the host's time,
    and only the replay measures the kernel."""
    eager = timed(step)
    replayed = timed(capture(step)[0].replay)
    return eager, replayed, host_us(step)


def oracle_pairs(n, k, t, regime, config):
    """(name, fused, oracle) for each tensor of one step of ``config`` on a fresh layer:
    they must be bitwise equal (a fast kernel must compute the same function)."""
    layer = Layer(n, k, t, regime, seed=1)
    r = rule()
    w_a, w_b = layer.w.clone(), layer.w.clone()
    s_a = layer.fresh_state(r)
    s_b = {name: v.clone() for name, v in s_a.items()}
    fk.fused_weight_update(layer.x, layer.dy, w_a, s_a, r, 1, config=config, seed=3, rounding=layer.rounding)
    fk.fused_weight_update(layer.x, layer.dy, w_b, s_b, r, 1, config=config, seed=3, rounding=layer.rounding,
                           oracle=True)
    return [("w", w_a, w_b)] + [(name, s_a[name], s_b[name]) for name in s_a]


def captured_pairs(n, k, t, regime, config, input_check="step"):
    """(name, captured, uncaptured) for each tensor after steps 1-3 of ``config`` on a fresh
    layer, the captured ones a StepScalars graph with ``input_check`` (the ``forge
    captured`` method's "step", or "tiles", the ``unscanned`` one's) replayed at steps 2 and
    3 after its warm-up's step 1, the uncaptured ones stepped with the default check: they
    must be bitwise equal (on finite inputs the two checks store the same bits)."""
    layer = Layer(n, k, t, regime, seed=1)
    r = rule()
    w_c = layer.w.clone()
    s_c = layer.fresh_state(r)
    s_p = {name: v.clone() for name, v in s_c.items()}
    scalars = fk.StepScalars(r, seed=3, device="cuda").set(1)
    graph, _ = capture(lambda: fk.fused_weight_update(layer.x, layer.dy, w_c, s_c, r, scalars, seed=3, config=config,
                                                      rounding=layer.rounding, report="defer",
                                                      input_check=input_check))
    w_p = layer.w.clone()
    fk.fused_weight_update(layer.x, layer.dy, w_p, s_p, r, 1, config=config, seed=3,
                           rounding=layer.rounding)  # the warm-up's step
    for step in (2, 3):
        scalars.set(step)
        graph.replay()
        fk.fused_weight_update(layer.x, layer.dy, w_p, s_p, r, step, config=config, seed=3,
                               rounding=layer.rounding)
    return [("w", w_c, w_p)] + [(name, s_c[name], s_p[name]) for name in s_c]


def check_fused_equals_oracle(n, k, t, regime, config):
    """The benchmarked config gives the oracle's bits, and its captured steps, with the
    input scan and without it (the two captured methods), the uncaptured steps' bits
    (checked in that order: the first mismatch is reported)."""
    checks = (("fused != oracle", oracle_pairs),
              ("captured != uncaptured", captured_pairs),
              ("captured unscanned != uncaptured", lambda *row: captured_pairs(*row, input_check="tiles")))
    for what, pairs in checks:
        for name, got, expected in pairs(n, k, t, regime, config):
            # Bitwise, whatever the dtype (torch.equal alone would let -0.0 match 0.0).
            if not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
                raise AssertionError(f"{what} ({name}) for {regime} {n}x{k} T={t} {config}")


def tuned_config(configs, regime, t):
    """The tuned config for the regime at the nearest tuned token count at or below t."""
    entries = configs.get(regime, {})
    keys = sorted(int(key) for key in entries)
    chosen = max([key for key in keys if key <= t] or keys[:1])
    return fk.TileConfig(*entries[str(chosen)])


def torch_and_tuned(layer, regime, t, configs):
    """(torch captured ms, the tuned config, its fused kernel replayed ms) on one layer:
    the two references the probes time their variants against."""
    config = tuned_config(configs, regime, t)
    found = methods(layer, regime, config)
    return timed(found["torch captured"])[0], config, timed(found["forge kernel replayed"])[0]


def tune(shape, tokens, regimes, candidates, bandwidth, matrix_rate, writer, meta):
    """Sweep ``candidates`` per regime and token count on one shape; returns the best of each."""
    n, k = shape
    best = {}
    for regime in regimes:
        best[regime] = {}
        for t in tokens:
            layer = Layer(n, k, t, regime)
            floor = floor_ms(n, k, t, regime, bandwidth, matrix_rate)
            results = []
            for candidate in candidates:
                try:
                    config = fk.TileConfig(*candidate)
                except ValueError as error:  # a tile this kernel does not take: said, and swept past
                    print(f"  {regime} T={t} {candidate}: {error}", file=sys.stderr)
                    continue
                if REGIMES[regime][1] == "q8" and config.part_shape[1] < fk.q8.BLOCK:
                    continue
                try:
                    step = kernel_step(layer, config)
                    compiled = step()
                    eager, replayed, host = kernel_times(step)
                except Exception as error:  # e.g. out of shared memory: that config is not a candidate here
                    print(f"  {regime} T={t} {candidate}: {type(error).__name__}", file=sys.stderr)
                    continue
                # n_spills is Triton's: the kernel's local memory in 4-byte words.
                registers = f"{getattr(compiled, 'n_regs', '?')} regs, {getattr(compiled, 'n_spills', '?')} spills"
                # Ranked by the replayed time: the kernel's own, whatever its launch costs the host.
                results.append((replayed[0], eager[0], host, candidate, registers))
                for method, (median, low, high) in ((f"forge kernel {candidate}", eager),
                                                    (f"forge kernel replayed {candidate}", replayed)):
                    writer.writerow({**meta, "n": n, "k": k, "tokens": t, "regime": regime, "method": method,
                                     "median_ms": f"{median:.5f}", "min_ms": f"{low:.5f}", "max_ms": f"{high:.5f}",
                                     "peak_bytes": "", "floor_ms": f"{floor:.5f}"})
            results.sort()
            best[regime][str(t)] = list(results[0][3])
            for replayed_ms, eager_ms, host, c, registers in results:
                print(f"tune {regime:8s} T={t:6d} {str(c):28s} replayed {replayed_ms:.4f} ms "
                      f"{replayed_ms / floor:5.2f}x floor  eager {eager_ms:.4f} ms  host {host:5.1f} us  {registers}",
                      flush=True)
            del layer
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="CSV to write")
    parser.add_argument("--tune", action="store_true", help=f"sweep tile configs; write {CONFIGS_FILE.name} "
                                                           "next to --out")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--rounds", type=int, default=2, help="rounds of timing per row, the method order "
                                                                 "reversed each other round (default 2)")
    parser.add_argument("--candidates", default=None, help="with --tune: configs to sweep instead of CANDIDATES, "
                                                           "as Python tuples separated by ';'")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        sys.exit("bench_update.py measures on a GPU; none is visible here")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    regimes = args.regimes.split(",")

    bandwidth, matrix_rate = measure_ceilings()
    commit = os.environ.get("FORGE_COMMIT")  # set it where the tree is a copy without its git history
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit}
    print(f"{meta}; copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matrix rate {matrix_rate / 1e12:.0f} TFLOP/s",
          flush=True)
    fields = ["gpu", "torch", "triton", "commit", "n", "k", "tokens", "regime", "method", "median_ms", "min_ms",
              "max_ms", "peak_bytes", "floor_ms"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        if args.tune:
            candidates = ([ast.literal_eval(c) for c in args.candidates.split(";")] if args.candidates
                          else CANDIDATES)
            best = tune(shapes[0], tokens, regimes, candidates, bandwidth, matrix_rate, writer, meta)
            target = Path(args.out).with_name(CONFIGS_FILE.name)
            target.write_text(json.dumps({"gpu": meta["gpu"], "triton": meta["triton"], "shape": list(shapes[0]),
                                          **best}, indent=1) + "\n")
            print(f"wrote {target}")
            return 0
        configs = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() else {}
        rows, checked = [], set()
        for n, k in shapes:
            for t in tokens:
                for regime in regimes:
                    config = tuned_config(configs, regime, t) if configs else fk.PINNED
                    if (n, k, regime, config) not in checked:  # every timed config, once per shape
                        check_fused_equals_oracle(n, k, 512, regime, config)
                        checked.add((n, k, regime, config))
                    layer = Layer(n, k, t, regime)
                    floor = floor_ms(n, k, t, regime, bandwidth, matrix_rate)
                    found = methods(layer, regime, config)
                    for method, (median, low, high) in timed_in_rounds(found, args.rounds).items():
                        peak = "" if method in CAPTURED else peak_extra_bytes(found[method])
                        rows.append((n, k, t, regime, method, median, peak, floor))
                        writer.writerow({**meta, "n": n, "k": k, "tokens": t, "regime": regime, "method": method,
                                         "median_ms": f"{median:.5f}", "min_ms": f"{low:.5f}",
                                         "max_ms": f"{high:.5f}", "peak_bytes": peak, "floor_ms": f"{floor:.5f}"})
                    handle.flush()
                    del layer
                    gc.collect()
                    torch.cuda.empty_cache()
    print_table(rows)
    return 0


def print_table(rows):
    torch_time = {(n, k, t, regime): median for n, k, t, regime, method, median, _, _ in rows if method == "torch"}
    captured_time = {(n, k, t, regime): median for n, k, t, regime, method, median, _, _ in rows
                     if method == "torch captured"}
    print(f"{'shape':>11} {'T':>6} {'regime':>8} {'method':>14} {'median ms':>10} {'vs torch':>9} "
          f"{'/ floor':>8} {'extra MB':>9}")
    for n, k, t, regime, method, median, peak, floor in rows:
        ratio = torch_time[(n, k, t, regime)] / median
        extra = f"{peak / 2**20:>9.1f}" if peak != "" else f"{'-':>9}"
        against_captured = ""
        if method.startswith("forge captured") and (n, k, t, regime) in captured_time:
            against_captured = f"  ({captured_time[(n, k, t, regime)] / median:.2f}x torch captured)"
        print(f"{n:>5}x{k:<5} {t:>6} {regime:>8} {method:>14} {median:>10.4f} {ratio:>8.2f}x "
              f"{median / floor:>8.2f} {extra}{against_captured}")


if __name__ == "__main__":
    sys.exit(main())
