"""ChunkFT's parallel and host-state options: bad input refused by name, and prefetching
(state_store="host", prefetch=True) giving the plain host store's bits."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import forge_kernels as fk
from forge_verify.checks.chunkft import ChunkProblem


def _two_linears():
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 64))


@pytest.mark.parametrize("shards, error, match", [
    ({"9.weight": fk.WeightSlice(0, 0, (6, 4))}, ValueError, r"not trainable parameters"),
    ({"0.weight": (0, 0)}, TypeError, r"shards\['0.weight'\] must be a forge_kernels.WeightSlice"),
    ({"0.weight": fk.WeightSlice(4, 0, (8, 4))}, ValueError, r"shards\['0.weight'\]: a \(6, 4\) weight at \(4, 0\) "
                                                             r"does not fit"),
    ({"0.bias": fk.WeightSlice(1, 0, (2, 6))}, ValueError, r"shards\['0.bias'\]: a 1-D parameter is placed as one row"),
])
def test_bad_shards_are_refused_by_name(shards, error, match):
    with pytest.raises(error, match=match):
        fk.ChunkFT(_two_linears(), fk.SGD(lr=0.1), chunks=2, shards=shards)


def test_q8_shards_off_the_blocks_and_shards_of_other_modules_are_refused():
    with pytest.raises(ValueError, match=r"shards\['1.weight'\]: q8 state keeps blocks of 32 columns"):
        fk.ChunkFT(_two_linears(), fk.AdamW(lr=0.1), chunks=2, state_format="q8",
                   shards={"1.weight": fk.WeightSlice(0, 3, (64, 12))})
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"shards names \['0.weight'\]: ChunkFT steps shards of nn.Linear"):
        fk.ChunkFT(model, fk.SGD(lr=0.1), chunks=2, shards={"0.weight": fk.WeightSlice(0, 0, (16, 4))})


def test_data_parallel_and_prefetch_misuse_is_refused():
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        fk.ChunkFT(_two_linears(), fk.SGD(lr=0.1), chunks=2, process_group=object())
    with pytest.raises(ValueError, match="prefetch=True .* needs state_store='host'"):
        fk.ChunkFT(_two_linears(), fk.SGD(lr=0.1), chunks=2, prefetch=True)
    with pytest.raises(TypeError, match="prefetch must be True or False"):
        fk.ChunkFT(_two_linears(), fk.SGD(lr=0.1), chunks=2, state_store="host", prefetch=1)


def test_a_shard_checkpoint_is_refused_on_another_shard():
    saved = fk.ChunkFT(_two_linears(), fk.SGD(lr=0.1), chunks=2,
                       shards={"0.weight": fk.WeightSlice(0, 0, (12, 4))}).state_dict()
    other = fk.ChunkFT(_two_linears(), fk.SGD(lr=0.1), chunks=2,
                       shards={"0.weight": fk.WeightSlice(6, 0, (12, 4))})
    with pytest.raises(ValueError, match=r"another configuration: \['shards'\]"):
        other.load_state_dict(saved)


# Random order with switch_every 2 is slow only for time (the cyclic case switches at every step).
@pytest.mark.parametrize("order, switch_every, steps", [("cyclic", 1, 6),
                                                       pytest.param("random", 2, 14, marks=pytest.mark.slow)])
def test_prefetch_gives_the_host_stores_bits_and_prefetches_the_next_chunk(order, switch_every, steps):
    problem = ChunkProblem(vocab=6, width=5, hidden=7, batch=1, length=3, seed=4)
    runs, prefetches = [], 0
    for prefetch in (False, True):
        model = problem.model()
        ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-2), chunks=3, order=order, switch_every=switch_every,
                         state_store="host", prefetch=prefetch)
        for t, (tokens, targets) in enumerate(problem.batches(steps)):
            before = ctl.active_chunk
            ctl.step(lambda: F.cross_entropy(model(tokens).reshape(-1, 6), targets.reshape(-1)))
            following = ctl.active_chunk
            visited = ctl.chunk_steps[following] > 0
            if prefetch and following != before and visited:
                # The next chunk's state was copied ahead, into fresh tensors; the finished one is on the host.
                assert ctl.prefetched_chunk == following, (t, before, following)
                prefetches += 1
            elif prefetch and following != before:
                assert ctl.prefetched_chunk is None, t  # nothing to copy before a first visit
        runs.append(([p.detach().clone() for p in model.parameters()], ctl.state_dict()))
    assert prefetches >= 2  # the run revisits chunks, so there was state to copy ahead
    (weights_a, saved_a), (weights_b, saved_b) = runs
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(weights_a, weights_b))
    assert saved_a["state"].keys() == saved_b["state"].keys()
    for key, state in saved_a["state"].items():
        for slot, tensor in state.items():
            other = saved_b["state"][key][slot]
            assert tensor.dtype == other.dtype == torch.float32  # offloaded in fp32
            # On CUDA the chunk prefetched at the end is on the device in one run, on the host in the other.
            assert torch.equal(tensor.cpu().view(torch.int32), other.cpu().view(torch.int32)), (key, slot)


def test_state_bytes_follow_the_chunk():
    problem = ChunkProblem(vocab=6, width=5, hidden=7, batch=1, length=3, seed=4)
    model = problem.model()
    ctl = fk.ChunkFT(model, fk.AdamW(lr=1e-2), chunks=2, state_store="host", prefetch=True)
    for tokens, targets in problem.batches(2):
        ctl.step(lambda: F.cross_entropy(model(tokens).reshape(-1, 6), targets.reshape(-1)))
    params = dict(model.named_parameters())
    total = sum(8 * (stop - start) * (params[n].shape[1 - d] if params[n].dim() == 2 else 1)
                for c in range(2) for n, d, start, stop in ctl.chunk_slices(c))  # two fp32 moments
    held = ctl.state_bytes()
    assert held["device"] + held["host"] == total
    # After two steps chunk 0 is active again (prefetched back), chunk 1 offloaded.
    active = sum(8 * (stop - start) * (params[n].shape[1 - d] if params[n].dim() == 2 else 1)
                 for n, d, start, stop in ctl.chunk_slices(0))
    assert (held["device"], held["host"]) == (active, total - active)
