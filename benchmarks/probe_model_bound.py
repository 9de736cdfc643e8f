"""A measured lower bound on FORGE's end-to-end step with its current epilogue.

``bench_model.py``'s decoder step (bf16 weights) with every linear weight frozen (forward,
attention and every dX as in both methods; no weight gradient), and after the backward
each linear weight stepped by the streaming epilogue kernel of
``probe_streaming_epilogue.py`` (the fused kernel's ``_tile_epilogue`` with its gradient
made in registers: no matrix work, no gradient read) at the fastest of its swept tiles for
that weight's shape, with bf16 state rounded stochastically (``bf16-sr``) or to nearest
(``bf16-rn``). A fused kernel that runs this epilogue also does the weight gradient's
matrix work, so no FORGE step with this epilogue is expected to beat this one (a
measurement over the swept tiles, not a proof over all). Against ``torch captured`` and
``forge captured`` (bench_model's methods) in the same process, all in CUDA graphs.

The ``overlapped`` rows launch each weight's epilogue on a second stream as soon as its
layer's backward has computed dX (a module backward hook; the second stream waits for
that point, so dX has read the old weight), the main stream joining it at the end of the
step: what updates overlapped with the rest of the backward could reach, where the
plain bound runs them after the backward on one stream, as FORGE's layers do now.

    python3 benchmarks/probe_model_bound.py [--layers 2] [--tokens 512,4096]
"""

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402
import probe_streaming_epilogue as pse  # noqa: E402

bu = pse.bu


def streaming_step(w, regime, entry):
    """A launch of the streaming epilogue stepping bf16 weight ``w`` in place, with its own
    bf16 state, at the swept tile ``entry``."""
    layer = SimpleNamespace(w=w, rounding=bu.REGIMES[regime][2])
    return pse.synthetic_step(layer, bu.rule().init_state(w, state_format="bf16"), entry)[0]


def fastest_entry(w, regime):
    """The swept streaming tile that steps a weight of ``w``'s shape fastest, and its time."""
    return min((bu.timed(streaming_step(w, regime, entry))[0], entry) for entry in pse.SWEEP)


def bound_step(layers, tokens, regime, entries, overlapped=False):
    """The frozen-weight step with each linear weight stepped by its streaming epilogue:
    after the backward, or with ``overlapped`` on a second stream as each dX is made."""
    model = bm.build(layers, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    side = torch.cuda.Stream()
    epilogues = []
    for m in linears:
        m.weight.requires_grad_(False)
        epilogue = streaming_step(m.weight.data, regime, entries[tuple(m.weight.shape)])
        epilogues.append(epilogue)
        if overlapped:
            def on_side_stream(module, grad_input, grad_output, epilogue=epilogue):
                side.wait_stream(torch.cuda.current_stream())  # after this layer's dX has read the weight
                with torch.cuda.stream(side):
                    epilogue()
            m.register_full_backward_hook(on_side_stream)
    others = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(others, lr=1e-4, weight_decay=0.01, fused=True, capturable=True)
    x = torch.randn(1, tokens, bm.HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step_fn():
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()
        if overlapped:
            torch.cuda.current_stream().wait_stream(side)
        else:
            for epilogue in epilogues:
                epilogue()
    return model, bm.torch_graph(step_fn)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    configs = json.loads(bu.CONFIGS_FILE.read_text())
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.layers} blocks", flush=True)
    with torch.device("meta"):
        shapes = {tuple(m.weight.shape) for m in bm.Block().modules() if isinstance(m, nn.Linear)}
    entries = {}
    for regime in ("bf16-sr", "bf16-rn"):
        entries[regime] = {}
        for shape in sorted(shapes):
            ms, entry = fastest_entry(torch.randn(shape, device="cuda").bfloat16() * 0.02, regime)
            entries[regime][shape] = entry
            print(f"streaming epilogue {regime} {shape}: {entry} {ms:.4f} ms", flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = {}
        for label, make in (("torch captured", lambda: bm.variant("bf16", "torch captured", args.layers, tokens,
                                                                   configs)),
                            ("forge captured bf16-sr", lambda: bm.variant("bf16", "forge captured", args.layers,
                                                                           tokens, configs)),
                            ("forge captured bf16-rn", lambda: bm.variant("bf16-rn", "forge captured",
                                                                           args.layers, tokens, configs)),
                            ("bound bf16-sr", lambda: bound_step(args.layers, tokens, "bf16-sr",
                                                                 entries["bf16-sr"])),
                            ("bound bf16-rn", lambda: bound_step(args.layers, tokens, "bf16-rn",
                                                                 entries["bf16-rn"])),
                            ("bound bf16-sr overlapped", lambda: bound_step(args.layers, tokens, "bf16-sr",
                                                                            entries["bf16-sr"], overlapped=True)),
                            ("bound bf16-rn overlapped", lambda: bound_step(args.layers, tokens, "bf16-rn",
                                                                            entries["bf16-rn"], overlapped=True))):
            model, step = make()
            rows[label] = bm.measure(step, 3, args.steps)[0]
            del model, step
            torch.cuda.empty_cache()
            print(f"T={tokens:5d} {label:26s} {rows[label]:.3f} ms  torch captured / this "
                  f"{rows['torch captured'] / rows[label]:.3f}x", flush=True)


if __name__ == "__main__":
    main()
