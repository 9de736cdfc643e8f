"""Where each (tensor, chunk) optimizer state lives, and the copies between host and device.

``state_store="device"`` keeps every state on its parameter's device. ``"host"`` keeps
an inactive chunk's state in host memory (pinned when CUDA is present) in its own
format, fp32 staying fp32: the round trip is a copy, bitwise (the anchor offloads fp32
moments as bf16, a lossy round). With ``prefetch``, the next chunk's state is copied
to the device as soon as a step ends, so that the copy overlaps the next forward: on
CUDA on a side stream, non-blocking from pinned memory, the compute stream waiting on
it only when the backward first reads the state. On the CPU the same code makes the
same fresh copies, offload and prefetch, synchronously (tests/test_chunkft.py and
tests/test_chunkft_parallel.py compare the bits with the device store's).
"""

import torch


def _cuda(tensors):
    return next((t.device for t in tensors if t.device.type == "cuda"), None)


def _to_host(tensor):
    """A fresh host copy in the tensor's own dtype: into pinned memory, non-blocking, from
    CUDA; synchronous from the CPU, where the state already is, so that the CPU tier runs
    the copy a GPU runs (tests/test_chunkft.py would miss a lossy one otherwise)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
    return host.copy_(tensor, non_blocking=tensor.is_cuda)


class ChunkStates:
    """{(parameter name, chunk): {slot: tensor}} and the moves between host and device."""

    def __init__(self, prefetch: bool):
        self.prefetch = prefetch
        self._states = {}
        self._offloaded = set()  # keys whose state is in the host store
        self._side_stream = None
        self._prefetch_done = None  # CUDA event: the side stream's copies have finished
        self._prefetch_done_device = None
        self._offload_done = None   # CUDA event: the last offload's copies have finished
        #: the chunk whose state was copied ahead to the device (None: none in flight or kept)
        self.prefetched = None

    def __contains__(self, key):
        return key in self._states

    def get(self, key) -> dict:
        """A state to compute with on its device (the stream waits for a prefetch)."""
        self._wait_prefetch()
        return self._states[key]

    def put(self, key, state: dict) -> None:
        self._states[key] = state

    def readable(self) -> dict:
        """Every state, all copies finished (host tensors included): for checkpoints."""
        self._wait_prefetch()
        if self._offload_done is not None:
            self._offload_done.synchronize()
            self._offload_done = None
        return self._states

    def replace(self, states: dict) -> None:
        self.readable()
        self._states, self.prefetched, self._offloaded = states, None, set()

    def nbytes(self) -> dict:
        """{"device": bytes, "host": bytes} of the states held: "host" those in the host
        store (offloaded), "device" the rest, on their parameters' devices (on a CPU-only
        machine both are host memory; the split still says what a GPU would hold)."""
        out = {"device": 0, "host": 0}
        for key, state in self._states.items():
            where = "host" if key in self._offloaded else "device"
            out[where] += sum(t.numel() * t.element_size() for t in state.values())
        return out

    def _wait_prefetch(self):
        if self._prefetch_done is not None:
            torch.cuda.current_stream(self._prefetch_done_device).wait_event(self._prefetch_done)
            self._prefetch_done = None

    def to_device(self, keys, device_of) -> None:
        """Bring these states to their parameters' devices (nothing to do if prefetched)."""
        for key in keys:
            self._offloaded.discard(key)
            if key in self._states:
                device = device_of(key)
                self._states[key] = {slot: t if t.device == device else t.to(device)
                                     for slot, t in self._states[key].items()}

    def offload(self, keys) -> None:
        """Move these states to host memory, in their own dtypes (non-blocking into pinned
        memory on CUDA: host reads wait in ``readable``)."""
        moved = [t for key in keys if key in self._states for t in self._states[key].values()]
        device = _cuda(moved)
        for key in keys:
            if key in self._states:
                self._states[key] = {slot: _to_host(t) for slot, t in self._states[key].items()}
                self._offloaded.add(key)
        if device is not None:
            self._offload_done = torch.cuda.current_stream(device).record_event()

    def prefetch_chunk(self, chunk, keys, device_of) -> None:
        """Copy chunk's existing states to their devices ahead of its step, into fresh
        tensors (on CUDA on a side stream that first waits for everything queued, the
        offload that wrote the host copy included)."""
        keys = [key for key in keys if key in self._states]
        if not keys:
            return
        self._offloaded.difference_update(keys)
        device = next((device_of(key) for key in keys if device_of(key).type == "cuda"), None)
        if device is None:
            for key in keys:
                self._states[key] = {slot: torch.empty_like(t, device=device_of(key)).copy_(t)
                                     for slot, t in self._states[key].items()}
            self.prefetched = chunk
            return
        current = torch.cuda.current_stream(device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream):
            for key in keys:
                copies = {}
                for slot, t in self._states[key].items():
                    copy = torch.empty_like(t, device=device_of(key))
                    copy.copy_(t, non_blocking=True)
                    copy.record_stream(current)  # used and freed on the compute stream
                    copies[slot] = copy
                self._states[key] = copies
        self._prefetch_done = self._side_stream.record_event()
        self._prefetch_done_device = device
        self.prefetched = chunk
