"""ChunkFT planning: the chunks are disjoint, cover every trainable element exactly once,
and each is within one row/column (one q8 block of columns for q8 column cuts) of its
byte budget: every boundary lies within half a cut of i·total/chunks."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from forge_verify.checks import chunkft
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe


@st.composite
def _tensors(draw):
    count = draw(st.integers(1, 6))
    out = []
    for i in range(count):
        shape = tuple(draw(st.lists(fst.sizes(70), min_size=1, max_size=2)))
        dtype = draw(st.sampled_from((torch.float32, torch.bfloat16)))
        out.append((f"t{i}", shape, dtype))
    return out


@given(data=st.data())
def test_chunks_cover_every_element_once_within_a_cut_of_their_budget(data):
    tensors = data.draw(_tensors(), label="tensors")
    rule = data.draw(fst.RULES[data.draw(st.sampled_from(sorted(fst.RULES)), label="family")], label="rule")
    state_format = data.draw(st.sampled_from(("fp32", "bf16", "q8")), label="state_format")
    split = data.draw(st.sampled_from(("rows", "cols")), label="split")
    along_rows = data.draw(st.sets(st.sampled_from([n for n, s, _ in tensors if len(s) == 2] or ["none"])),
                           label="embeddings")
    granules = sum(-(-s[d] // (32 if state_format == "q8" and (d == 1 or len(s) == 1) else 1))
                   for _, s, _ in tensors for d in [1 if len(s) == 2 and split == "cols" else 0])
    chunks = data.draw(st.integers(1, max(1, min(8, granules // 2))), label="chunks")
    try:
        chunkft.plan_covers(tensors, rule, state_format, split, chunks, along_rows=along_rows)
    except ValueError as error:
        # Only a chunk left empty (rows far over the budget) may be refused, by name.
        assert "empty" in str(error), error
    observe(0)
