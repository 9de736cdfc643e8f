"""benchmarks/bench_update.py's ``capture`` keeps the captured callable as long as its
graph lives. A CUDA graph replays raw addresses: before e6e331b ``capture(kernel_step(...))``
let the step, and with it the fused kernel's status words and flags, be freed right after
the capture, and its replays then ran on memory later allocations took (benchmarks/README.md,
"Operand traffic through L2, and TMA multicast"). The capture needs a GPU; here torch's CUDA
stream and graph calls are stand-ins that record what ran, so the test runs anywhere."""

import contextlib
import gc
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_update as bu  # noqa: E402  (a benchmark script, not a package)


class _Graph:
    """Stands in for ``torch.cuda.CUDAGraph`` (a Python class there too: attributes allowed)."""


class _Stream:
    def wait_stream(self, other):
        pass


class _Step:
    """A captured callable whose lifetime the test watches (as ``kernel_step``'s closure
    owns the fused kernel's ``_Epilogue``)."""

    def __init__(self):
        self.calls = []

    def __call__(self):
        self.calls.append("call")
        return len(self.calls)


def test_the_graph_keeps_the_captured_callable_alive(monkeypatch):
    inside = []

    @contextlib.contextmanager
    def graph(g):
        inside.append(g)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)

    step = _Step()
    alive = weakref.ref(step)
    captured, returned = bu.capture(step)
    assert returned == 2 and step.calls == ["call", "call"]  # the warm-up call, then the captured one
    assert inside == [captured]
    del step
    gc.collect()
    assert alive() is not None, "the graph must hold the callable whose memory it replays"
    del captured, inside[:]
    gc.collect()
    assert alive() is None  # and nothing else does
