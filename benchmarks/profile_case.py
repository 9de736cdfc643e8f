"""One fused-kernel case launched a few times, for a profiler to pick one launch:

    ncu --clock-control none --kernel-name regex:_fused_weight_update_kernel --launch-skip 3 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section InstructionStats --section ComputeWorkloadAnalysis \
        python3 benchmarks/profile_case.py bf16-sr stochastic 256

Arguments: regime (fp32, bf16-sr, q8), rounding (stochastic, nearest, none), tokens (0
runs the epilogue alone), and optionally a config as the sweeps print it (default, or
``tuned``: the tuned config for the token count) and a shape as ``OUTxIN`` (default
4096x4096).

    ncu ... --kernel-name regex:'pingpong_kernel|split_kernel' ... python3 benchmarks/profile_case.py \
        fp32 none 1024 "64,128,32,4,2,None,4,hopper"
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as bu  # noqa: E402  (maps this tree's kernels/ to forge_kernels)
from checkout import parse_config  # noqa: E402

from forge_kernels.ops.fused_weight_update import _Epilogue  # noqa: E402


def main():
    regime, rounding, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rounding = None if rounding == "none" else rounding
    if len(sys.argv) > 4 and sys.argv[4] != "tuned":
        config = bu.fk.TileConfig(*parse_config(sys.argv[4]))
    else:
        config = bu.tuned_config(json.loads(bu.CONFIGS_FILE.read_text()), regime, tokens)
    out_features, in_features = map(int, (sys.argv[5] if len(sys.argv) > 5 else "4096x4096").split("x"))
    layer = bu.Layer(out_features, in_features, max(tokens, 1), regime)
    if tokens == 0:
        layer.x, layer.dy = layer.x[:0], layer.dy[:0]
    r = bu.fk.AdamW(lr=1e-3, weight_decay=0.01)
    epilogue = _Epilogue(layer.w, layer.fresh_state(r), r, 1, config, rounding, 0, 1.0, None)
    for _ in range(4):
        handle = epilogue.fused(layer.x, layer.dy, layer.w)
    torch.cuda.synchronize()
    print(regime, rounding, tokens, config, "regs", handle.n_regs, "spills", handle.n_spills,
          "smem", handle.metadata.shared, flush=True)


if __name__ == "__main__":
    main()
