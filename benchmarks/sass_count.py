"""The fused kernel's SASS, compiled offline for sm_90 (no GPU needed: the Triton wheel
carries ptxas and nvdisasm): registers, spill stores and static instruction counts per
tile config, and per element of the tile. The epilogue is straight-line code (no loop
over the tile), so the static count per element tracks what Nsight Compute counts per
element on the H200 (benchmarks/README.md: 104-139 executed for fp32 and bf16 at 256
tokens, of which the token loop is a small part). A diagnostic for kernel changes on
a machine without a GPU; times come only from the GPU.

    python3 benchmarks/sass_count.py [--regimes fp32,bf16-sr,q8] [--configs "64,128,64,8,3,128,2;..."]
    python3 benchmarks/sass_count.py --regimes fp32,bf16-sr --configs "64,32,128,4,2,None,1,hopper"
    python3 benchmarks/sass_count.py --rule rmsprop-centered --configs "64,64,64,16,3,None,2,hopper,rows"

A config ending in ``hopper`` compiles the Hopper kernel (Gluon, ``ops/hopper_update.py``;
fp32 and bf16 state only) instead of the portable one, for AdamW or ``--rule``'s rule
(one, two or three state slots). ``--streaming`` compiles
``probe_streaming_epilogue.py``'s kernel instead (the same epilogue on a gradient made in
its own layout: no matrix work, no accumulator to convert) at each config's tile, warps,
register cap and epilogue split, beside which the fused kernel's counts show what the
fusion adds per element.

Counts depend on the Triton version (the H200 image has 3.6; the CPU set-up 3.9).
"""

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (also when a parent process interprets)

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import forge_kernels, parse_config  # noqa: E402

fk = forge_kernels()
from forge_kernels.ops.fused_weight_update import _fused_weight_update_kernel as KERNEL  # noqa: E402

HERE = Path(__file__).resolve().parent
STORAGE = {"fp32": ("fp32", "fp32", False), "bf16-sr": ("bf16", "bf16", True), "bf16-rn": ("bf16", "bf16", False),
           "q8": ("bf16", "u8", True)}
INTEGER_ARGS = ("T", "N", "K", "KB", "stride_xt", "stride_dyt")
# --rule, for the Hopper kernel: AdamW (two state slots) by default, or a rule with one or three.
HOPPER_RULES = {"adamw": lambda: fk.AdamW(), "sgd-momentum": lambda: fk.SGD(momentum=0.9),
                "rmsprop-centered": lambda: fk.RMSprop(centered=True, momentum=0.9)}


def _epilogue_arguments(regime: str, stochastic: bool) -> tuple:
    """(types, compile-time values) of the epilogue's arguments, which the fused kernel and
    the streaming probe's kernel both take: AdamW, two state slots, as a launch on the
    H200 passes them."""
    weight, state, _ = STORAGE[regime]
    exponents = "i8" if regime == "q8" else weight
    rule = fk.AdamW()
    signature = dict(w_ptr=f"*{weight}", s0_ptr=f"*{state}", s1_ptr=f"*{state}", s2_ptr=f"*{weight}",
                     e0_ptr=f"*{exponents}", e1_ptr=f"*{exponents}", e2_ptr=f"*{weight}", flag_ptr="*i32",
                     status_ptr="*i32", N="i32", K="i32", KB="i32", row0="i32", col0="i32", global_k="i32",
                     grad_scale="fp32", **{f"h{i}": "fp32" for i in range(8)}, seed="i64",
                     scalars_ptr=f"*{weight}", seed_ptr=f"*{weight}", grad_scale_ptr=f"*{weight}")
    constants = dict(RULE=rule.update, VARIANT=rule.variant, HAS_S0=True, HAS_S1=True, HAS_S2=False,
                     W_BF16=weight == "bf16", S_BF16=state == "bf16", S_Q8=regime == "q8", STOCHASTIC=stochastic,
                     NONNEGATIVE=2, ALIGNED_PAIRS=True, DEVICE_SCALARS=False, DEVICE_GRAD_SCALE=False)
    return signature, constants


def _compile(kernel, signature: dict, constants: dict, integers: tuple, warps: int, stages: int, maxnreg):
    """``kernel`` for sm_90, specialized as a launch on the H200 would specialize it: 16-byte
    aligned pointers and ``integers`` multiples of 16."""
    signature = {name: "constexpr" if name in constants else signature[name] for name in kernel.arg_names}
    aligned = [i for i, name in enumerate(kernel.arg_names) if signature[name].startswith("*") or name in integers]
    source = ASTSource(kernel, signature, constexprs=constants, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    options = dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options), maxnreg


def compile_sm90(regime: str, config: tuple, stochastic: bool, square_sums: bool = False):
    """The kernel for AdamW on a 4096-wide weight in ``regime``, specialized as a launch
    on the H200 would specialize it (16-byte aligned pointers, unit inner strides); with
    ``square_sums``, keeping each tile's sum of squares (``fused_weight_update(..., square_sums=)``)."""
    block_n, block_k, block_t, warps, stages = config[:5]
    maxnreg = config[5] if len(config) > 5 else None
    split = config[6] if len(config) > 6 else 1
    rows = len(config) > 8 and config[8] == "rows"
    tma = len(config) > 10 and config[10] == "tma"
    signature, constants = _epilogue_arguments(regime, stochastic)
    signature.update(x_ptr="*bf16", dy_ptr="*bf16", T="i32", stride_xt="i32", stride_dyt="i32", sums_ptr="*fp32")
    constants.update(stride_xk=1, stride_dyn=1, SQUARE_SUMS=square_sums, BLOCK_N=block_n, BLOCK_K=block_k,
                     BLOCK_T=block_t, SPLIT=split, ROWS=rows, TMA=tma)
    if tma:  # operand_loads="tma": the blocks through host tensor descriptors
        signature.update(x_desc=f"tensordesc<bf16[{block_t}, {block_k}]>", dy_desc=f"tensordesc<bf16[{block_t}, {block_n}]>")
    else:
        constants.update(x_desc=None, dy_desc=None)
    return _compile(KERNEL, signature, constants, INTEGER_ARGS, warps, stages, maxnreg)


def compile_streaming_sm90(regime: str, config: tuple, stochastic: bool, square_sums: bool = False):
    """``probe_streaming_epilogue``'s kernel at ``config``'s block_n, block_k, warps, register
    cap and epilogue split (column parts), specialized as ``compile_sm90`` specializes."""
    if regime == "q8" or square_sums:
        raise SystemExit("--streaming: fp32 and bf16 state only, without --square-sums")
    import probe_streaming_epilogue as streaming  # imports bench_update: only when asked for
    maxnreg = config[5] if len(config) > 5 else None
    split = config[6] if len(config) > 6 else 1
    signature, constants = _epilogue_arguments(regime, stochastic)
    constants.update(BLOCK_N=config[0], BLOCK_K=config[1], SPLIT=split, ROWS=False)
    return _compile(streaming._synthetic_gradient_epilogue_kernel, signature, constants, ("N", "K", "KB"),
                    config[3], 1, maxnreg)


def ptxas_usage(ptx: str, maxnreg) -> tuple:
    """(registers, spill-store bytes) as ptxas reports them for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    cap = [f"--maxrregcount={maxnreg}"] if maxnreg else []
    report = ""
    # The wheel carries two assemblers; the PTX of newer Triton needs the newer one.
    for name in ("ptxas", "ptxas-blackwell"):
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        done = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", f.name, "-o", os.devnull] + cap,
                              capture_output=True, text=True)
        if done.returncode == 0:
            report = done.stderr
            break
    os.unlink(f.name)
    registers = re.findall(r"Used (\d+) registers", report)
    spills = re.findall(r"(\d+) bytes spill stores", report)
    return int(registers[0]) if registers else None, int(spills[0]) if spills else None


def compile_hopper_sm90(regime: str, config: tuple, stochastic: bool, square_sums: bool = False,
                        rule: str = "adamw"):
    """The Hopper kernel for ``rule`` (a ``HOPPER_RULES`` name) on a 4096 x 4096 weight in
    ``regime``, with the descriptors and argument types a launch on the H200 would give it
    (device scalars, as in a captured step)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from forge_kernels.ops import hopper_update

    if regime == "q8":
        raise SystemExit("the Hopper kernel keeps fp32 or bf16 state; q8 runs on the portable kernel")
    stages = config[4]
    weight = torch.float32 if regime == "fp32" else torch.bfloat16
    x, dy = (torch.empty(256, 4096, dtype=torch.bfloat16) for _ in range(2))
    w = torch.empty(4096, 4096, dtype=weight)
    rule = HOPPER_RULES[rule]()
    layout = rule.slot_layout  # a slot the rule does not keep gets the weight, as a launch passes it
    slots = [torch.empty(4096, 4096, dtype=weight) if name is not None else w for name in layout]
    tile = fk.TileConfig(*config)
    descriptors = hopper_update.descriptors(tile, x, dy, w, slots)
    kernel = hopper_update.kernel_for(tile)
    pointer = "*fp32" if regime == "fp32" else "*bf16"
    signature = dict(zip(["dy_desc", "x_desc", "w_desc", "s0_desc", "s1_desc", "s2_desc"],
                         map(mangle_type, descriptors)))
    signature.update(w_ptr=pointer, s0_ptr=pointer, s1_ptr=pointer, s2_ptr=pointer, flag_ptr="*i32",
                     status_ptr="*i32", T="i32", N="i32", K="i32", row0="i32", col0="i32", global_k="i32",
                     grad_scale="fp32", **{f"h{i}": "fp32" for i in range(8)}, seed="i64", scalars_ptr="*fp32",
                     seed_ptr="*i64",  # a StepScalars' float32 values and int64 key
                     grad_scale_ptr=pointer, sums_ptr="*fp32",
                     # the split kernel's in-kernel input check (TileConfig.in_kernel_check)
                     x_ptr="*bf16", dy_ptr="*bf16", stride_xt="i32", stride_dt="i32", tickets_ptr="*i32")
    constants = dict(RULE=rule.update, VARIANT=rule.variant, HAS_S0=layout[0] is not None,
                     HAS_S1=layout[1] is not None, HAS_S2=layout[2] is not None, W_BF16=regime != "fp32",
                     S_BF16=regime != "fp32", STOCHASTIC=stochastic, ALIGNED=True, DEVICE_SCALARS=True,
                     DEVICE_GRAD_SCALE=False, NUM_STAGES=stages, SQUARE_SUMS=square_sums,
                     **hopper_update.structure_constants(tile))
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else signature[name] for name in names}
    # As a launch specializes them: 16-byte aligned pointers, and T, N, K (256, 4096, 4096) and the
    # row strides (4096) multiples of 16.
    aligned = [i for i, name in enumerate(names) if signature[name].startswith("*")
               or name in ("T", "N", "K", "stride_xt", "stride_dt")]
    source = GluonASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                            attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tile.num_warps, enable_fp_fusion=False,
                                       launch_cooperative_grid=tile.in_kernel_check)), None


def sass_listing(cubin: bytes) -> list:
    """The kernel's instructions, one string each, from ``cuobjdump -sass`` (trailing
    padding included). Not Triton's ``asm["sass"]``: triton 3.6's parser matches
    four-digit addresses and so stops at the 4,096th instruction (our bf16 and q8 kernels
    are longer)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.+?)\s*;", text)


def instruction_mix(instructions: list) -> collections.Counter:
    """Opcode counts, predicates and modifiers dropped (``@!P0 IMAD.WIDE.U32`` is ``IMAD``)."""
    mix = collections.Counter()
    for text in instructions:
        text = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
        mix[text.split()[0].split(".")[0]] += 1
    return mix


def portable_entry(entries: dict) -> tuple:
    """The tuned config at the fewest tokens among those of the portable kernel (this tool
    compiles that kernel; the Hopper kernel is Gluon, built from another source), or the
    pinned config (``fk.PINNED``, the exactness tier's) for a regime whose entries all run
    the Hopper kernel (fp32's, since the in-flight tile took its 16,384-token entry)."""
    for tokens in sorted(entries, key=int):
        if len(entries[tokens]) < 8 or entries[tokens][7] == "portable":
            return tuple(entries[tokens])
    return dataclasses.astuple(fk.PINNED)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--regimes", default="fp32,bf16-sr,q8")
    parser.add_argument("--configs", default=None, help="';'-separated tuples, 'hopper' last for the Hopper kernel "
                                                        "(default: the tuned portable config at the fewest tokens, "
                                                        "or the pinned one where the regime has none)")
    parser.add_argument("--nearest", action="store_true", help="round-to-nearest instead of stochastic rounding")
    parser.add_argument("--listing-sha", action="store_true",
                        help="also print a sha256 of the SASS instructions (the same code before and after a change)")
    parser.add_argument("--streaming", action="store_true",
                        help="compile the streaming epilogue kernel (probe_streaming_epilogue.py) at each config instead")
    parser.add_argument("--rule", default="adamw", choices=sorted(HOPPER_RULES),
                        help="the rule the Hopper kernel's configs compile for (the portable kernel's: AdamW)")
    parser.add_argument("--square-sums", action="store_true",
                        help="the kernel keeping its tiles' sums of squares (previous-norm clipping's norm)")
    args = parser.parse_args()
    tuned = json.loads((HERE / "tuned_configs.json").read_text())
    print(f"triton {triton.__version__}, sm_90, AdamW, 4096-wide weight")
    for regime in args.regimes.split(","):
        configs = ([parse_config(c) for c in args.configs.split(";")] if args.configs
                   else [portable_entry(tuned[regime])])
        for config in configs:
            hopper = config[7:8] == ("hopper",) and not args.streaming
            compile_for = compile_streaming_sm90 if args.streaming else compile_hopper_sm90 if hopper else compile_sm90
            options = dict(square_sums=True) if args.square_sums else {}
            if args.rule != "adamw":
                if not hopper:
                    raise SystemExit("--rule: for the Hopper kernel's configs (the portable kernel compiles AdamW)")
                options["rule"] = args.rule
            compiled, maxnreg = compile_for(regime, config, stochastic=STORAGE[regime][2] and not args.nearest,
                                            **options)
            registers, spills = ptxas_usage(compiled.asm["ptx"], maxnreg)
            listing = sass_listing(compiled.asm["cubin"])
            mix = instruction_mix(listing)
            # A layout conversion between threads goes through shared memory, between barriers.
            conversions = compiled.asm["ttgir"].count("ttg.convert_layout")
            total = sum(mix.values())
            # The ping-pong Hopper kernel holds its consumer's code twice (two warpgroups, a tile each).
            per_element = total * config[3] * 32 / (config[0] * config[1]) / (2 if hopper and config[3] == 4 else 1)
            top = " ".join(f"{op}:{n}" for op, n in mix.most_common(10))
            kind = "streaming " if args.streaming else ""
            print(f"{regime:7s} {str(config):30s} {kind}registers {registers} spill bytes {spills} instructions {total} "
                  f"({per_element:.0f} per element per thread-lane) layout conversions {conversions} "
                  f"barriers {mix['BAR']} wgmma {mix['HGMMA']} shared {compiled.metadata.shared} | {top}", flush=True)
            if args.listing_sha:
                print(f"  sass sha256 {hashlib.sha256(chr(10).join(listing).encode()).hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
