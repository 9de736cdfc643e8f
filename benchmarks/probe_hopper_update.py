"""A Hopper form of the fused update, in Gluon, timed and compared bit for bit with
the portable kernel: does prefetching the tile's weight and state by TMA, while the
tile's matrix work runs, bring the fused step nearer the memory floor?

The portable kernel (``_fused_weight_update_kernel``) loads the tile's weight and state
after the token loop, into registers, so HBM idles during the matrix work and the
loads' latency is exposed in the epilogue (loading them before the loop, into
registers, was slower: results/tuning/h200-early-loads-q8-bits.log). Here the weight
and state tiles are copied by TMA into shared memory at the start of the tile, the
token loop runs on TMA-fed wgmma, and the epilogue reads its operands from shared
memory, applies the same rule code (``RULE``, ``sr_bf16_with``: it rounds stochastically
only; the same Philox words) and writes the results back by TMA. AdamW, fp32 or bf16 weight and
state, whole weights (no slices), host scalars.

    python3 benchmarks/probe_hopper_update.py [--shapes 4096x4096] [--tokens 256,1024] \
        [--variants "block_n,block_k,block_t,stages,warps;..."]

Each variant is first compared bit for bit with the portable kernel on the same inputs
(at (64, 64, 64, 4, 3) and at the tuned config), then timed beside torch and the
portable kernel's tuned config. GPU only (Hopper); not part of the library. Its second,
persistent warp-specialized kernel (written here at f01bdb7) became the library's
``TileConfig(kernel="hopper")``, whose Philox words and layouts this one now shares.
Results: benchmarks/README.md, "A Hopper form in Gluon".
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import config_tuple, forge_kernels  # noqa: E402

fk = forge_kernels()
from forge_kernels.ops.finite_check import STATUS_WORDS, is_finite  # noqa: E402
from forge_kernels.ops.stochastic_round import stream_seed  # noqa: E402
from forge_kernels.ops.fused_weight_update import _BAD_TILES, _to_storage  # noqa: E402
from forge_kernels.ops.hopper_common import _epilogue_layout, _words  # noqa: E402
from forge_kernels.ops.hopper_update import _operand_descriptor, _tile_descriptor  # noqa: E402


@gluon.jit
def _rule_and_round(g, w, m, v, off_n, off_k, N, K, global_k, h0, h1, h2, h3, h4, h5, h6, h7, seed,
                    RULE: gl.constexpr, VARIANT: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr,
                    STOCHASTIC: gl.constexpr, epi: gl.constexpr, num_warps: gl.constexpr):
    """The portable epilogue's arithmetic on one AdamW tile held in layout ``epi``: the
    rule in fp32, the stores' rounding with the same Philox words, and the count of
    non-finite elements inside the weight (the tile is stored only when it is 0)."""
    BLOCK_N: gl.constexpr = g.shape[0]
    BLOCK_K: gl.constexpr = g.shape[1]
    w, m, v, unused = RULE(w.to(gl.float32), g, m.to(gl.float32), v.to(gl.float32), v.to(gl.float32),
                           h0, h1, h2, h3, h4, h5, h6, h7, VARIANT)
    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))
    cols = off_k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, epi))
    r0 = (rows[:, None] * 0 + cols[None, :]).to(gl.uint32, bitcast=True)  # placeholders: nothing drawn
    r1 = r0
    r2 = r0
    if STOCHASTIC and (W_BF16 or S_BF16):
        r0, r1, r2, r3 = _words(seed, off_n, off_k, global_k, BLOCK_N, BLOCK_K, True, num_warps)
    w = _to_storage(w, r0, W_BF16, STOCHASTIC)
    m = _to_storage(m, r1, S_BF16, STOCHASTIC)
    v = _to_storage(v, r2, S_BF16, STOCHASTIC)
    inside = (rows < N)[:, None] & (cols < K)[None, :]
    finite = is_finite(g) & is_finite(w.to(gl.float32)) & is_finite(m.to(gl.float32)) & is_finite(v.to(gl.float32))
    num_bad = gl.sum(gl.sum(gl.where(inside & ~finite, 1, 0), axis=1), axis=0)
    return w, m, v, num_bad


@gluon.jit
def _one_partition_kernel(dy_desc, x_desc, w_desc, m_desc, v_desc, flag_ptr, status_ptr, T, N, K, global_k,
                          h0, h1, h2, h3, h4, h5, h6, h7, seed,
                          RULE: gl.constexpr, VARIANT: gl.constexpr, W_BF16: gl.constexpr, S_BF16: gl.constexpr,
                          STOCHASTIC: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    off_n = pid_n * BLOCK_N
    off_k = pid_k * BLOCK_K

    # The epilogue's operands, fetched while the token loop runs.
    epi_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(epi_bar, count=1)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, w_desc.block_type.shape, w_desc.layout)
    m_smem = gl.allocate_shared_memory(m_desc.dtype, m_desc.block_type.shape, m_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    mbarrier.expect(epi_bar, w_desc.block_type.nbytes + m_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [off_n, off_k], epi_bar, w_smem)
    tma.async_copy_global_to_shared(m_desc, [off_n, off_k], epi_bar, m_smem)
    tma.async_copy_global_to_shared(v_desc, [off_n, off_k], epi_bar, v_smem)

    # The token loop: dW tile = dyᵀ x over BLOCK_T tokens at a time, NUM_STAGES buffers.
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [NUM_STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES] + x_desc.block_type.shape, x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(i), count=1)
    nbytes: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                         instr_shape=[16, BLOCK_K // (num_warps // 4), 16])
    acc = gl.zeros((BLOCK_N, BLOCK_K), dtype=gl.float32, layout=mma_layout)
    num_t = gl.cdiv(T, BLOCK_T)
    for i in gl.static_range(NUM_STAGES - 1):
        pred = i < num_t
        mbarrier.expect(bars.index(i), nbytes, pred=pred)
        tma.async_copy_global_to_shared(dy_desc, [i * BLOCK_T, off_n], bars.index(i), dy_bufs.index(i), pred)
        tma.async_copy_global_to_shared(x_desc, [i * BLOCK_T, off_k], bars.index(i), x_bufs.index(i), pred)
    for i in range(num_t):
        s = i % NUM_STAGES
        mbarrier.wait(bars.index(s), (i // NUM_STAGES) & 1)
        dy_t = dy_bufs.index(s).permute((1, 0))
        acc = warpgroup_mma(dy_t, x_bufs.index(s), acc, is_async=True)
        # One wgmma in flight: the one before it has finished with its buffers.
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, dy_t, x_bufs.index(s)))
        j = i + NUM_STAGES - 1
        pred = j < num_t
        sj = j % NUM_STAGES
        mbarrier.expect(bars.index(sj), nbytes, pred=pred)
        tma.async_copy_global_to_shared(dy_desc, [j * BLOCK_T, off_n], bars.index(sj), dy_bufs.index(sj), pred)
        tma.async_copy_global_to_shared(x_desc, [j * BLOCK_T, off_k], bars.index(sj), x_bufs.index(sj), pred)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    # The epilogue, in a row-major blocked layout (16-byte rows per thread).
    inputs_ok = (gl.load(status_ptr) == 0) & (gl.load(status_ptr + 1) == 0)
    epi: gl.constexpr = _epilogue_layout(BLOCK_K, num_warps)
    g = gl.convert_layout(acc, epi)
    mbarrier.wait(epi_bar, 0)
    w, m, v, num_bad = _rule_and_round(g, w_smem.load(epi), m_smem.load(epi), v_smem.load(epi), off_n, off_k, N, K,
                                       global_k, h0, h1, h2, h3, h4, h5, h6, h7, seed, RULE, VARIANT, W_BF16, S_BF16,
                                       STOCHASTIC, epi, num_warps)
    tile_ok = (num_bad == 0) & inputs_ok
    if tile_ok:
        w_smem.store(w)
        m_smem.store(m)
        v_smem.store(v)
        fence_async_shared()
        tma.async_copy_shared_to_global(w_desc, [off_n, off_k], w_smem)
        tma.async_copy_shared_to_global(m_desc, [off_n, off_k], m_smem)
        tma.async_copy_shared_to_global(v_desc, [off_n, off_k], v_smem)
    gl.atomic_add(status_ptr + _BAD_TILES, 1, mask=(num_bad > 0) & inputs_ok)
    gl.store(flag_ptr + pid_n * gl.num_programs(1) + pid_k, num_bad)
    tma.store_wait(pendings=0)


class HopperStep:
    """One AdamW step of the Gluon kernel on (x, dy, w, state); host scalars."""

    def __init__(self, x, dy, w, state, rule, step, seed, block_n=64, block_k=64, block_t=64, stages=3, warps=4,
                 rounding="stochastic"):
        T, K = x.shape
        N = w.shape[0]
        self.grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
        self.words = torch.zeros(STATUS_WORDS + self.grid[0] * self.grid[1], dtype=torch.int32, device=w.device)
        self.args = (_operand_descriptor(dy, [block_t, block_n]), _operand_descriptor(x, [block_t, block_k]),
                     _tile_descriptor(w, [block_n, block_k]), _tile_descriptor(state["exp_avg"], [block_n, block_k]),
                     _tile_descriptor(state["exp_avg_sq"], [block_n, block_k]),
                     self.words[STATUS_WORDS:], self.words[:STATUS_WORDS], T, N, K, K,
                     *rule.scalars(step), stream_seed(seed, step))
        self.meta = dict(RULE=rule.update, VARIANT=rule.variant, W_BF16=w.dtype == torch.bfloat16,
                         S_BF16=state["exp_avg"].dtype == torch.bfloat16, STOCHASTIC=rounding == "stochastic",
                         NUM_STAGES=stages, num_warps=warps, enable_fp_fusion=False)

    def __call__(self):
        return _one_partition_kernel[self.grid](*self.args, **self.meta)


def _same_bits(pairs) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)


def _copy(state):
    return {name: value.clone() for name, value in state.items()}


def compare(layer, r, variant, configs, seed=3):
    """{portable config: whether the Gluon kernel's weight and state equal its bits},
    from the same weight and state."""
    state = layer.fresh_state(r)
    w_g, s_g = layer.w.clone(), _copy(state)
    HopperStep(layer.x, layer.dy, w_g, s_g, r, 1, seed, *variant)()
    found = {}
    for config in configs:
        w_p, s_p = layer.w.clone(), _copy(state)
        fk.fused_weight_update(layer.x, layer.dy, w_p, s_p, r, 1, config=fk.TileConfig(*config), seed=seed)
        found[config] = _same_bits([(w_g, w_p)] + [(s_g[name], s_p[name]) for name in s_p])
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096")
    parser.add_argument("--tokens", default="256,1024")
    parser.add_argument("--regimes", default="fp32,bf16-sr")
    parser.add_argument("--variants", default="64,64,64,3,4;64,64,64,4,4;64,64,64,2,4;64,64,64,3,8;"
                                              "128,64,64,3,8;64,128,64,3,8")
    args = parser.parse_args()
    import bench_update as bu
    nearest = [regime for regime in args.regimes.split(",") if bu.REGIMES[regime][2] != "stochastic"]
    if nearest:
        parser.error(f"--regimes: this prototype and its comparison round stochastically, not as {nearest} do")
    print(f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    bandwidth, matrix_rate = bu.measure_ceilings()
    tuned = bu.json.loads(bu.CONFIGS_FILE.read_text())
    variants = [tuple(int(v) for v in c.split(",")) for c in args.variants.split(";")]
    r = bu.rule()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for regime in args.regimes.split(","):
            for t in (int(v) for v in args.tokens.split(",")):
                layer = bu.Layer(n, k, t, regime)
                tuned_config = config_tuple(bu.tuned_config(tuned, regime, t))
                floor = bu.floor_ms(n, k, t, regime, bandwidth, matrix_rate)
                rows = []
                found = bu.methods(layer, regime, fk.TileConfig(*tuned_config))
                for name in ("torch", "torch captured", "forge kernel"):
                    config = str(tuned_config) if name == "forge kernel" else ""
                    rows.append((name, config, bu.timed(found[name])[0], ""))
                for variant in variants if t > 0 else ():  # a TMA descriptor needs a nonempty x and dy
                    try:
                        same = compare(layer, r, variant, [(64, 64, 64, 4, 3), tuned_config])
                        step = HopperStep(layer.x, layer.dy, layer.w.clone(), layer.fresh_state(r), r, 1, 3, *variant)
                        compiled = step()
                        note = (f"{compiled.n_regs} regs {compiled.n_spills} spills smem {compiled.metadata.shared}; "
                                f"bits == portable " + ", ".join(f"{c}: {s}" for c, s in same.items()))
                        rows.append(("gluon", str(variant), bu.timed(step)[0], note))
                    except Exception as error:  # a variant that fails to build is reported, not hidden
                        rows.append(("gluon", str(variant), float("nan"), f"{type(error).__name__}: {error}"[:300]))
                for name, config, ms, note in rows:
                    print(f"{regime:7s} {n}x{k} T={t:5d} {name:14s} {config:28s} {ms:.4f} ms "
                          f"({ms / floor:.2f}x floor {floor:.4f}) {note}", flush=True)


if __name__ == "__main__":
    main()
