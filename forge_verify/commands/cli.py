"""forge-verify: check the FORGE kernels' numerical claims (properties, the kernel-change
gate, error-bound reports) and run the demos and studies."""

import argparse
import copy
import os
import sys

import torch

import forge_kernels as fk

from ..checks.deviation import RULES as DEVIATION_RULES, deviation_table, format_rows
from ..checks.problems import Problem
from ..checks.profiles import PROFILE_VARIABLE
from ..distributed.parallel_verdicts import record_parallel_verdicts
from ..gate import baseline as gate
from . import chunk_demo, demo, report, zo_demo
from .check import DETAILS, run_check
from .sharding_report import sharding_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="forge-verify", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="run the exactness properties and print a verdict table "
                                              "(GPU when present, else the Triton CPU interpreter)")
    check.add_argument("--profile", default=None,
                       help=f"hypothesis profile (dev, ci, nightly); default: ${PROFILE_VARIABLE} or ci")
    check.add_argument("-k", dest="keyword", default=None, help="only properties matching this pytest -k expression")
    check.add_argument("-n", "--workers", type=int, default=None,
                       help="processes to run the properties in (pytest-xdist; default: one per core, at most 8 "
                            "on a GPU machine; 1 runs them in this process)")
    check.add_argument("--details", default=DETAILS,
                       help=f"file for every test's full id, case and verdict (default {DETAILS})")
    deviation = commands.add_parser("deviation", help="measure each storage regime's drift from the exact "
                                                      "(mpmath) trajectory: FORGE vs the materialized pipeline")
    deviation.add_argument("--steps", default="1,10,100", help="checkpoints, comma-separated (default 1,10,100)")
    deviation.add_argument("--size", type=int, default=8, help="the weight is size x size (default 8)")
    deviation.add_argument("--tokens", type=int, default=32, help="tokens per step (default 32)")
    deviation.add_argument("--rule", choices=sorted(DEVIATION_RULES), default="adamw",
                           help="rule family, in the configuration forge_verify.checks.deviation.RULES names "
                                "(default adamw)")
    deviation.add_argument("--lr", type=float, default=None, help="learning rate (default: the rule's, above)")
    deviation.add_argument("--seed", type=int, default=0, help="problem seed (default 0)")
    demo_parser = commands.add_parser("demo", help="train a small GPT on shipped text: FORGE fused vs oracle (bitwise) "
                                                   "vs torch.optim.AdamW (loss, memory); writes a plot")
    demo_parser.add_argument("--size", choices=sorted(demo.SIZES), default="small",
                             help="model and batch size (default small)")
    demo_parser.add_argument("--steps", type=int, default=None, help="training steps (default: the size's)")
    demo_parser.add_argument("--out", default=None, help="output folder (default: $OUT, else ./demo_out)")
    chunk = commands.add_parser("chunk-demo", help="fine-tune the tiny GPT with ChunkFT and with full "
                                                   "torch.optim.AdamW: loss curves and memory; writes a plot")
    chunk.add_argument("--steps", type=int, default=chunk_demo.DEFAULT_STEPS,
                       help=f"training steps (default {chunk_demo.DEFAULT_STEPS})")
    chunk.add_argument("--chunks", type=int, default=chunk_demo.DEFAULT_CHUNKS,
                       help=f"ChunkFT chunks (default {chunk_demo.DEFAULT_CHUNKS})")
    chunk.add_argument("--state-store", choices=("device", "host"), default="host",
                       help="where inactive chunks' state lives (default host, prefetched)")
    chunk.add_argument("--out", default=None, help="output folder (default: $OUT, else ./demo_out)")
    sharding = commands.add_parser("sharding", help="measure TP/SP against the unsharded model, and data/context "
                                                    "parallelism and accumulation against the true step, on N ranks")
    sharding.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    sharding.add_argument("--steps", type=int, default=3, help="steps per trajectory (default 3)")
    sharding.add_argument("--record", metavar="CSV", default=None,
                          help="instead, record the layer-level TP/SP verdicts per rule and regime to CSV "
                               "(reports/data/parallelism.csv feeds the exactness summary report)")
    gate.add_parser(commands)
    report.add_parser(commands)
    zo_demo.add_parser(commands)
    args = parser.parse_args(argv)

    if args.command == "check":
        # The main job is deterministic unless asked otherwise.
        os.environ[PROFILE_VARIABLE] = args.profile or os.environ.get(PROFILE_VARIABLE, "ci")
        extra = ["-k", args.keyword] if args.keyword else []
        return run_check(extra_args=extra, details_path=args.details, workers=args.workers)
    if args.command == "deviation":
        checkpoints = tuple(int(s) for s in args.steps.split(","))
        rule = copy.copy(DEVIATION_RULES[args.rule])
        if args.lr is not None:
            rule.lr = args.lr
        problem = Problem(args.tokens, args.size, args.size, torch.bfloat16, max(checkpoints), args.seed)
        print(f"{rule!r}; weight {args.size}x{args.size}, {args.tokens} bf16 tokens per step, seed {args.seed}; "
              f"backend: {'Triton interpreter (CPU)' if fk.interpreting() else 'GPU'}")
        print(format_rows(deviation_table(rule, problem, checkpoints)))
        return 0
    if args.command == "demo":
        out = args.out or demo.default_out()
        result = demo.run_demo(args.size, steps=args.steps, out=out)
        print(demo.format_result(result))
        print(f"wrote {os.path.join(out, 'demo.json')} and {os.path.join(out, 'demo_loss.png')}")
        return 0 if result["fused_equals_oracle_bitwise"] else 1
    if args.command == "chunk-demo":
        out = args.out or demo.default_out()
        result = chunk_demo.run_chunk_demo(args.steps, args.chunks, out=out, state_store=args.state_store)
        print(chunk_demo.format_result(result))
        print(f"wrote {os.path.join(out, 'chunk_demo.json')} and {os.path.join(out, 'chunk_demo_loss.png')}")
        return 0
    if args.command == "sharding":
        if args.record:
            print(record_parallel_verdicts(args.record, args.ranks))
            return 0
        print(sharding_report(args.ranks, args.steps))
        return 0
    if args.command == "gate":
        return gate.run(args)
    if args.command == "report":
        return report.run(args)
    if args.command == "zo-demo":
        return zo_demo.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
