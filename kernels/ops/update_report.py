"""What a fused update found, read back from the device once: ``UpdateReport``.

The update's kernels write their verdict to a small int32 status on the device (see
``finite_check``): non-finite input elements, and tiles skipped for their own
non-finite values; each tile's count of bad elements goes to ``flags``. The host
reads the status (a few words) once, and ``flags`` only on the error path, to name
the skipped tiles.
"""

import torch

from ..errors import NonFiniteInputError, NonFiniteUpdateError
from .finite_check import BAD_TILES


def non_finite_input_error(names, counts) -> NonFiniteInputError:
    """The error for inputs with ``counts[i]`` NaN or infinite elements in the input
    called ``names[i]`` (each input named with its count, e.g. "x: 1, dy: 0")."""
    per_input = ", ".join(f"{name}: {count}" for name, count in zip(names, counts))
    return NonFiniteInputError(f"non-finite inputs: NaN or infinite elements in {per_input}; nothing was updated")


# Said with a tile error when the step's inputs were not scanned (input_check="tiles"):
# a non-finite input element then shows up as the non-finite sums of the tiles it reaches.
UNSCANNED = (" x and dy were not scanned (input_check=\"tiles\"): a non-finite input element fails every tile "
             "whose sum it reaches.")


def _tile_note(input_names) -> str:
    return "" if input_names else UNSCANNED


def _raise_if_flagged(flags: torch.Tensor, grid, config, N: int, K: int, note: str = ""):
    bad = torch.nonzero(flags).flatten().tolist()
    if not bad:
        return
    # Flag i is slice i % split of program i // split (TileConfig.epilogue_split), its
    # column slices left to right or its row slices top to bottom (epilogue_axis).
    split = config.epilogue_split
    height, width = config.part_shape
    rows = config.epilogue_axis == "rows"
    tiles = []
    for tile_id in bad:
        program, part = divmod(tile_id, split)
        pid_n, pid_k = divmod(program, grid[1])
        r0 = pid_n * config.block_n + (part * height if rows else 0)
        c0 = pid_k * config.block_k + (0 if rows else part * width)
        tiles.append((r0, min(N, r0 + height), c0, min(K, c0 + width)))
    r0, r1, c0, c1 = tiles[0]
    raise NonFiniteUpdateError(
        f"{len(tiles)} of {grid[0] * grid[1] * split} weight tiles had a non-finite gradient, weight or state "
        f"after the rule (first: rows {r0}:{r1}, columns {c0}:{c1}). Those tiles were left unchanged; "
        "the other tiles took the step." + note, tiles)


class UpdateReport:
    """The outcome of one ``fused_weight_update`` or ``apply_rule`` call made with
    ``report="defer"``; ``check()`` raises what the call would have raised.

    The kernels have already decided what to write: a non-finite input means nothing
    was written, a non-finite tile was left unchanged. The report only tells the host.
    On a GPU the call has queued a copy of the status words into pinned host memory and
    recorded an event after it, so ``check()`` waits for that event alone (at once if
    the GPU has passed it) instead of draining the queue; ``done()`` says, without
    waiting, whether it has. On the CPU (the Triton interpreter) the kernels have run
    by the time the call returns.

    ``status`` and ``flags`` are the device tensors the kernels wrote (see
    ``forge_kernels.ops.finite_check`` for the layout); keep them unmodified.
    ``input_names`` names the checked inputs in status order (``("x", "dy")`` or
    ``("grad",)``), so that the error says which input held how many non-finite elements;
    ``()`` when no input was scanned (``input_check="tiles"``), which a tile error then says.
    """

    def __init__(self, status, flags, input_names, grid, config, shape, *, copy_async):
        self.status, self.flags = status, flags
        self._input_names, self._grid, self._config, self._shape = tuple(input_names), grid, config, shape
        self._host = self._event = None
        if copy_async and status.device.type == "cuda":
            stream = torch.cuda.current_stream(status.device)
            self._host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
            self._host.copy_(status, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def done(self) -> bool:
        """True once the status can be read without waiting (always on the CPU). A report
        made without the asynchronous copy (the ``"raise"`` path, checked at once) has no
        event to ask: it says True, and its ``check()`` synchronizes."""
        return self._event is None or self._event.query()

    def error_from(self, words):
        """The error ``check()`` raises for one replay's status ``words`` (a list of ints,
        read before a later replay reused them), or None for a clean update. Its
        non-finite tiles are counted, not named: the later replay has reused ``flags``
        (``NonFiniteUpdateError.tiles`` is then empty)."""
        counts = words[:len(self._input_names)]
        if any(counts):
            return non_finite_input_error(self._input_names, counts)
        if not words[BAD_TILES]:
            return None
        total = self._grid[0] * self._grid[1] * self._config.epilogue_split
        return NonFiniteUpdateError(
            f"{words[BAD_TILES]} of {total} weight tiles had a non-finite gradient, weight or state after the rule "
            "(not named: a later replay has reused the tile flags). Those tiles were left unchanged; the other "
            "tiles took the step." + _tile_note(self._input_names), [])

    def check(self) -> None:
        """Return if the update was clean; otherwise raise ``NonFiniteInputError``
        (nothing was written) or ``NonFiniteUpdateError`` (the listed tiles were left
        unchanged, the others stepped). Checking again raises again."""
        if self._event is not None:
            self._event.synchronize()
            words = self._host.tolist()
        else:
            words = self.status.tolist()  # CPU: no stream to wait for; GPU without a copy: one sync
        error = self.error_from(words)
        if isinstance(error, NonFiniteUpdateError):
            # the same error, tiles named
            _raise_if_flagged(self.flags, self._grid, self._config, *self._shape, note=_tile_note(self._input_names))
        if error is not None:
            raise error
