"""Units of GIFT (``fk.gift``): the covariance window, the format registry, power-of-two
scales, NVFP4's shape rule."""

import pytest
import torch
from torch import nn

import forge_kernels as fk


def test_covariance_tracker_is_the_windows_mean_of_x_transpose_x():
    layer = nn.Linear(6, 3)
    tracker = fk.gift.CovarianceTracker([layer])
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 6, generator=g) for _ in range(3)]
    for x in xs:
        layer(x)
    with torch.no_grad():
        layer(torch.randn(4, 6, generator=g))  # evaluation passes are not recorded
    rows = torch.cat([x.reshape(-1, 6) for x in xs]).double()
    assert tracker.rows(layer) == 30
    torch.testing.assert_close(tracker.covariance(layer).double(), rows.T @ rows / 30, rtol=1e-6, atol=1e-6)
    tracker.reset(layer)
    assert tracker.rows(layer) == 0
    with pytest.raises(RuntimeError):
        tracker.covariance(layer)
    tracker.remove()
    layer(xs[0])
    assert tracker.rows(layer) == 0


def test_covariance_tracker_sums_in_fp32_under_autocast():
    """A forward under bf16 autocast (as mixed-precision training runs it) records the fp32
    product of its fp32 input, not autocast's bf16 one."""
    layer = nn.Linear(64, 8)
    tracker = fk.gift.CovarianceTracker([layer])
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
        layer(x)
    total, rows = tracker.window(layer)
    assert total.dtype == torch.float32 and rows == 64
    assert torch.equal(total, x.T @ x + x.T @ x)


def test_the_transform_runs_in_fp32_under_autocast():
    """GIFT's transform and its inverse give the same bits inside bf16 autocast as outside
    (a backward called inside autocast runs them there)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 32, generator=g)
    T = fk.gift.Whitening.from_covariance(x.T @ x / 256, 8)
    G = torch.randn(16, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = T.apply(G), T.invert(G)
    assert inside[0].dtype == torch.float32
    assert torch.equal(inside[0], T.apply(G)) and torch.equal(inside[1], T.invert(G))


def test_round_trip_knows_its_formats():
    assert sorted(fk.gift.FORMATS) == ["e4m3", "e5m2", "nvfp4"]
    with pytest.raises(ValueError):
        fk.gift.round_trip(torch.ones(16), "int8")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_power_of_two_scale_is_the_largest_power_of_two_not_above_the_current_scale(fmt):
    module = fk.gift.FORMATS[fmt]
    for amax in (1e-37, 1e-30, 0.3, 1.0, 3.0, 448.0, 5e4, 3e38):  # 1e-37: the current scale clamped to FLT_MAX
        current = float(module.scale_for(torch.tensor(amax)))
        power = float(module.scale_for(torch.tensor(amax), power_of_two=True))
        assert power <= current < 2 * power and power == 2.0 ** round(torch.log2(torch.tensor(power)).item())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["current", "power_of_two"])
def test_a_tiny_tensor_round_trips_to_finite_values(fmt, scaling):
    """amax below format max / FLT_MAX (1.3e-36 for E4M3, 1.7e-34 for E5M2): max / amax
    overflows fp32, so the scale is clamped to FLT_MAX (its power of two 2**127), as
    Transformer Engine clamps it; unclamped, the zeros encoded as 0 · inf = NaN."""
    module = fk.gift.FORMATS[fmt]
    x = torch.zeros(16)
    x[0], x[1] = 1e-37, -3e-38
    scale = module.scale_for(module.tensor_amax(x), power_of_two=scaling == "power_of_two")
    assert float(scale) == (torch.finfo(torch.float32).max if scaling == "current" else 2.0 ** 127)
    decoded = module.decode(module.encode(x, scale), scale)
    assert bool(torch.isfinite(decoded).all()) and bool((decoded[2:] == 0).all())
    assert float((decoded - x).abs().max()) <= 2.0 ** -3 * 1e-37  # within a half step of the top binade


def test_nvfp4_needs_whole_blocks_along_the_last_dimension():
    with pytest.raises(ValueError):
        fk.gift.nvfp4.quantize(torch.ones(4, 24))
    assert fk.gift.nvfp4.quantize(torch.ones(4, 32)).codes.shape == (4, 16)
    assert fk.gift.nvfp4.quantize(torch.ones(4, 32)).block_scales.shape == (4, 2)


def test_range_hits_count_what_leaves_the_normal_range_under_current_scaling():
    # amax 1: E4M3's scale is 448, its smallest normal 2**-6; E5M2's 57344 and 2**-14
    x = torch.tensor([1.0, 2.0 ** -20, 0.0, -2.0 ** -16, 2.0 ** -14, 2.0 ** -30])
    assert fk.gift.range_hits(x, "e4m3") == 3  # 2**-20, -2**-16, 2**-30 (not 0, not 2**-14)
    assert fk.gift.range_hits(x, "e5m2") == 1  # 2**-30 only
    assert fk.gift.range_hits(torch.zeros(5), "e4m3") == 0
    # amax 1e-37: the scale is FLT_MAX (not inf, which counted every nonzero element as above
    # the range); 1e-44 · FLT_MAX = 3.4e-6 is below both formats' smallest normal
    tiny = torch.tensor([1e-37, -3e-38, 1e-44, 0.0])
    assert fk.gift.range_hits(tiny, "e4m3") == 1 and fk.gift.range_hits(tiny, "e5m2") == 1
    # amax 2e-30: fl(448 / amax) · amax rounds to 448.00003, which still encodes as 448 (no hit;
    # it was counted as one above the range)
    inexact = torch.tensor([1e-30, 2e-30, 0.0])
    assert float(inexact[1] * fk.gift.e4m3.scale_for(inexact[1])) > 448.0
    assert fk.gift.e4m3.values(fk.gift.e4m3.quantize(inexact).codes)[1] == 448.0
    assert fk.gift.range_hits(inexact, "e4m3") == 0 and fk.gift.range_hits(inexact, "e5m2") == 0


@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "fp32"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shards_are_whole_units_and_cover_every_tensor_once(fmt, world):
    """The reduce-scatter exchange's cut (``shards.py``): per tensor, world equal shards of
    whole codec units (NVFP4: blocks of 16, so no block is split), together covering the
    tensor's elements once, padded by fewer than world units; messages hold every tensor."""
    from forge_kernels.communication.codecs import CODECS
    from forge_kernels.communication.shards import ShardLayout

    codec = CODECS[fmt, "current"]
    numels = (1, 16, 17, 37, 100, 5, 4096)
    layout = ShardLayout.of(codec, numels, world)
    assert layout.message_units == sum(layout.shard_units)
    assert list(layout.offsets) == [sum(layout.shard_units[:t]) for t in range(len(numels))]
    for t, numel in enumerate(numels):
        spans = [layout.elements(t, j) for j in range(world)]
        assert all(start % codec.unit == 0 and stop % codec.unit == 0 for start, stop in spans)
        assert [start for start, _ in spans] == [0] + [stop for _, stop in spans[:-1]]  # contiguous
        units = -(-numel // codec.unit)
        assert units <= layout.shard_units[t] * world < units + world


@pytest.mark.parametrize("numel", [0, 37])
@pytest.mark.parametrize("key", ["e4m3-current", "e5m2-current", "nvfp4-current", "fp32-current"])
def test_codec_amax_lives_on_the_gradients_device(key, numel, monkeypatch):
    """The hook stacks every tensor's amax with a flag made on the gradients' device and
    all-reduces the stack, so each codec's amax must be on that device too, also for an
    empty tensor and for the identity codec (on CUDA a host amax made ``torch.stack``
    fail: seen on the H200). The meta device stands in for CUDA on a CPU machine; it holds
    no values, so the finiteness checks (which read one, and have their own tests) are
    stood down here."""
    from forge_kernels.communication import nvfp4
    from forge_kernels.communication._fp8 import PerTensorFP8
    from forge_kernels.communication.codecs import CODECS

    monkeypatch.setattr(PerTensorFP8, "refuse_non_finite", lambda self, x: None)
    monkeypatch.setattr(nvfp4, "_check", lambda x: None)
    fmt, scaling = key.split("-")
    assert CODECS[fmt, scaling].amax(torch.empty(numel, device="meta")).device.type == "meta"


class _Bucket:
    """What ``gift_hook`` reads of DDP's ``GradBucket``: a bucket of no parameters, whose
    reduction issues no collective, so the hook runs without a process group."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer

    def parameters(self):
        return []

    def is_last(self):
        return False


@pytest.mark.parametrize("config, device, threaded", [("cpu:gloo,cuda:gloo", "cpu", True), ("cuda:nccl", "cpu", False),
                                                      ("cpu:gloo,cuda:gloo", "meta", False)])
def test_overlap_by_default_only_where_the_thread_works(config, device, threaded, monkeypatch):
    """The default (None) reduces on the communication thread for a gloo group with CPU
    gradients, inline elsewhere: the thread's current CUDA device is cuda:0 on every rank.
    NCCL is stood in for by the group's backend configuration, CUDA gradients by the meta
    device."""
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: config)
    state = fk.gift.GiftState(None, "e4m3", layers=())
    buffer = torch.zeros(4, device=device)
    future = fk.gift.gift_hook(state, _Bucket(buffer))
    assert future.wait() is buffer
    assert (state._worker is not None) == threaded
    state.close()


def test_overlap_is_refused_where_the_thread_does_not_work(monkeypatch):
    """``overlap=True`` with NCCL: refused at construction when the group exists, else at
    the first bucket; with gloo, refused for gradients off the CPU (the meta device stands
    in for CUDA)."""
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "cuda:nccl")
    state = fk.gift.GiftState(None, "e4m3", layers=(), overlap=True)  # no group yet: checked at the first bucket
    with pytest.raises(ValueError, match="not a group of cuda:nccl"):
        fk.gift.gift_hook(state, _Bucket(torch.zeros(4)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="overlap=True reduces on a thread"):
        fk.gift.GiftState(None, "e4m3", layers=(), overlap=True)
    assert fk.gift.GiftState(None, "e4m3", layers=(), overlap=False).overlap is False
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    state = fk.gift.GiftState(None, "e4m3", layers=(), overlap=True)
    with pytest.raises(ValueError, match="not meta gradients"):
        fk.gift.gift_hook(state, _Bucket(torch.zeros(4, device="meta")))
    with pytest.raises(ValueError, match="overlap must be"):
        fk.gift.GiftState(None, "e4m3", layers=(), overlap="yes")


@pytest.mark.parametrize("changed", [{"fmt": "nvfp4"}, {"scaling": "power_of_two"}, {"rank": 8}, {"damping": 1.0},
                                     {"error_feedback": False}, {"transform": "identity"}, {"unselected": "fp32"}])
def test_a_state_loads_only_into_the_configuration_it_was_saved_with(changed):
    """Residuals made by one format, factors of one rank, damping and transform mean nothing
    to another state: loading them was accepted silently (a state without error feedback,
    or with unselected="fp32", even kept the plain route's residuals unsent). The exchange
    may differ (the shard residuals fold in)."""
    layer = nn.Linear(16, 8, bias=False)
    arguments = {"fmt": "e4m3", "rank": 4, "damping": 1e-3}
    saved = fk.gift.GiftState(None, layers=[layer], **arguments).state_dict([layer.weight])
    other = fk.gift.GiftState(None, layers=[layer], **{**arguments, **changed})
    with pytest.raises(ValueError, match=f"saved with {next(iter(changed))} "):
        other.load_state_dict(saved, [layer.weight])
    fk.gift.GiftState(None, layers=[layer], exchange="all_gather", **arguments).load_state_dict(saved, [layer.weight])


def test_a_selection_state_loads_only_into_the_same_selection():
    """A selection's counts mean something only for its count, warm-up and counted format
    (a state past another warm-up never freezes), and a state without a selection has
    none to load them into: refused, naming the selection."""
    layers = [nn.Linear(8, 4) for _ in range(3)]
    saved = fk.gift.GiftState(None, "e4m3", layers=fk.gift.RangeHitSelection(layers, 1, 10)).state_dict(
        [layer.weight for layer in layers])
    for other in (fk.gift.RangeHitSelection(layers, 1, 5), fk.gift.RangeHitSelection(layers, 2, 10),
                  fk.gift.RangeHitSelection(layers, 1, 10, fmt="e5m2"), ()):
        with pytest.raises(ValueError, match="saved with selection "):
            fk.gift.GiftState(None, "e4m3", layers=other).load_state_dict(saved, [layer.weight for layer in layers])
    fk.gift.GiftState(None, "e4m3", layers=fk.gift.RangeHitSelection(layers, 1, 10)).load_state_dict(
        saved, [layer.weight for layer in layers])


def test_a_state_saved_without_its_configuration_is_refused_until_vouched_for():
    """A state saved before the configuration was kept cannot be checked: an E4M3 state with
    error feedback loaded into an NVFP4 one without, keeping residuals it never sends. It
    is refused, the state left as it was, with the line that vouches for it (as the fused
    layers refuse a checkpoint without its rule's record); once vouched for, it loads."""
    weight = nn.Parameter(torch.zeros(64))
    legacy = fk.gift.GiftState(None, "e4m3", layers=()).state_dict([weight])
    del legacy["config"]
    legacy["residuals"] = {0: torch.full((64,), 1e-3)}
    target = fk.gift.GiftState(None, "nvfp4", layers=(), error_feedback=False)
    with pytest.raises(ValueError, match=r"records no configuration.*saved\['config'\] = state\.configuration\(\)"):
        target.load_state_dict(legacy, [weight])
    assert target.residuals == {}
    legacy["config"] = target.configuration()
    target.load_state_dict(legacy, [weight])
    assert set(target.residuals) == {id(weight)}


def test_a_bucket_reducer_saved_without_its_configuration_is_refused_until_vouched_for():
    legacy = fk.gift.GiftSplitReducer("e4m3", None).state_dict()
    del legacy["config"]
    legacy["residuals"] = {(0, 64): torch.full((64,), 1e-3)}
    target = fk.gift.GiftSplitReducer("nvfp4", None, error_feedback=False)
    vouch = r"saved\['config'\] = reducer\.state\.configuration"
    with pytest.raises(ValueError, match=r"records no configuration.*" + vouch):
        target.load_state_dict(legacy)
    assert target.state.residuals == {}
    legacy["config"] = target.state.configuration()
    target.load_state_dict(legacy)
    assert set(target.state.residuals) == {(0, 64)}


def test_a_bucket_reducer_loads_only_into_the_configuration_it_was_saved_with():
    saved = fk.gift.GiftSplitReducer("e4m3", None, damping=0.5).state_dict()
    with pytest.raises(ValueError, match="saved with damping 0.5"):
        fk.gift.GiftSplitReducer("e4m3", None).load_state_dict(saved)
    fk.gift.GiftSplitReducer("e4m3", None, damping=0.5, exchange="all_gather").load_state_dict(saved)


class _SecondRankOfTwo:
    """torch.distributed as rank 1 of a 2-rank gloo group sees it, without a group: the
    all-reduces leave the tensors as they are (rank 0 recorded a window), the broadcast of
    the factors' rank gives ``rank``, and every broadcast's device is recorded."""

    def __init__(self, monkeypatch, rank: int):
        self.rank, self.devices = rank, []
        for name, value in (("get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo"),
                            ("get_world_size", lambda group=None: 2),
                            ("get_rank", lambda group=None: 1), ("get_process_group_ranks", lambda group: [0, 1]),
                            ("all_reduce", self.all_reduce), ("broadcast", self.broadcast)):
            monkeypatch.setattr(torch.distributed, name, value)

    def all_reduce(self, tensor, op=None, group=None):
        if tensor.dtype == torch.int64:
            tensor.fill_(1)  # some rank recorded a window

    def broadcast(self, tensor, src, group=None):
        if tensor.dtype == torch.int64:
            tensor.fill_(self.rank)  # the source's factors' rank
        else:
            self.devices.append(tensor.device.type)


def _refresh_without_a_window(kind):
    """The factors a rank that recorded no input receives, on a meta layer (the meta device
    stands in for CUDA): through ``agreed_whitening``, ``GiftState.refresh``, or
    ``GiftSplitReducer.refresh`` with an empty part."""
    layer = nn.Linear(16, 8, bias=False, device="meta")
    if kind == "hook":
        state = fk.gift.GiftState(None, "e4m3", 4, layers=[layer])
        state.refresh(0)
        return state.whitenings[0]
    if kind == "split":
        reducer = fk.gift.GiftSplitReducer("e4m3", None, rank=4)
        reducer.refresh([(torch.empty(0, 16, device="meta"), None)])
        return reducer.whitening
    return fk.gift.agreed_whitening(None, 16, 4, 1e-3, device=layer.weight.device)[0]


@pytest.mark.parametrize("kind", ["agreed_whitening", "hook", "split"])
def test_factors_are_received_on_the_gradients_device(kind, monkeypatch):
    """A rank other than the group's first receives the factors on the device of its
    gradients, where the first rank computes them: since d5f160e they were received on the
    collectives' bookkeeping device (the CPU for any backend but "nccl"), so with gloo and
    CUDA gradients the first rank broadcast CUDA factors into the others' CPU ones, and
    ``G @ U`` failed on those; a rank that recorded no window took the CPU even before."""
    monkeypatch.setattr(fk.gift.Whitening, "digest", lambda self: "")  # meta tensors have no bytes
    wire = _SecondRankOfTwo(monkeypatch, 4)
    whitening = _refresh_without_a_window(kind)
    assert whitening.rank == 4
    assert {t.device.type for t in whitening.tensors()} == {"meta"} and set(wire.devices) == {"meta"}


def test_a_recorded_covariance_gives_factors_on_its_device(monkeypatch):
    """The same with a covariance recorded on this rank: the factors are received on its
    device (the first rank computes them on the all-reduced covariance's)."""
    wire = _SecondRankOfTwo(monkeypatch, 3)
    A = torch.empty(16, 16, device="meta")
    whitening, _ = fk.gift.agreed_whitening(A, 16, 4, 1e-3)
    assert whitening.rank == 3 and {t.device.type for t in whitening.tensors()} == {"meta"}
    assert set(wire.devices) == {"meta"}


@pytest.fixture
def group_made_without_a_backend_name(tmp_path):
    """This process as the one rank of a group made as ``init_process_group()`` makes it,
    without a backend name: ``get_backend`` reports "undefined" there. Which backends it
    has depends on the machine: torch gives such a group its accelerator's backend alone
    (``get_backend_config()`` is "cuda:nccl" on the H200 machine, torch 2.11) or, without
    an accelerator, gloo ("cpu:gloo", torch 2.13 on the CPU machines)."""
    torch.distributed.init_process_group(store=torch.distributed.FileStore(str(tmp_path / "store"), 1),
                                         rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _reduces_cpu_tensors() -> bool:
    """Whether the default group all-reduces a CPU tensor at all (asked of torch, not of the
    group's backend names)."""
    try:
        torch.distributed.all_reduce(torch.ones(1))
    except RuntimeError:
        return False
    return True


def test_overlap_follows_the_backend_serving_the_gradients_device(group_made_without_a_backend_name):
    """The default reduced inline and ``overlap=True`` was refused ("not undefined") in a
    group made without a backend name, though gloo reduces its CPU gradients there on a
    machine without an accelerator: the choice goes by the backend serving the gradients'
    device, not the group's one name. Where the group cannot reduce CPU tensors at all (a
    CUDA machine: NCCL alone), the default reduces inline and ``overlap=True`` is refused.
    The meta device stands in for a device the group does not serve by gloo."""
    default = fk.gift.GiftState(None, "e4m3", layers=())
    if _reduces_cpu_tensors():
        assert default.overlapping(torch.device("cpu"))
        assert fk.gift.GiftState(None, "e4m3", layers=(), overlap=True).overlapping(torch.device("cpu"))
    else:
        assert not default.overlapping(torch.device("cpu"))
        with pytest.raises(ValueError, match="overlap=True reduces on a thread"):
            fk.gift.GiftState(None, "e4m3", layers=(), overlap=True).overlapping(torch.device("cpu"))
    assert not fk.gift.GiftState(None, "e4m3", layers=()).overlapping(torch.device("meta"))


@pytest.mark.parametrize("config, expected", [("cpu:gloo", "cpu"), ("cpu:gloo,cuda:gloo", "cpu"),
                                              ("cpu:gloo,cuda:nccl", "cpu"), ("cuda:nccl", "cuda")])
def test_bookkeeping_collectives_go_where_the_group_serves_them(config, expected, monkeypatch):
    """Counts, flags and factor ranks travel on the CPU where a backend of the group serves
    CPU tensors, else on the current GPU: also for a group made without a backend name,
    which ``get_backend`` calls "undefined" (torch 2.11 gives it ``cuda:nccl`` alone on a
    CUDA machine: the whitening's counts went to the CPU there, which nothing served)."""
    from forge_kernels._collectives import wire_device
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert wire_device().type == expected
