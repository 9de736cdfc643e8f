"""Errors raised by the kernels' launchers: by the call itself (``report="raise"``), or
later by ``UpdateReport.check()``, ``ForgeLinear.forge_check()`` or
``fk.check_updates(model)`` (``report="defer"``). The kernels decide what is written
either way; only when the host is told differs. ``check_nonnegative``: the argument check
the zeroth-order optimizers and GIFT's whitening share."""

import math
import numbers


def check_nonnegative(name, value, positive=False):
    """``value`` as a float, refusing (ValueError naming ``name``) anything but a finite real
    number ≥ 0 (> 0 when ``positive``); NaN, which a plain ``< 0`` lets pass, included."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite {'positive' if positive else 'non-negative'} number, got {value!r}")
    return float(value)


class NonFiniteInputError(FloatingPointError):
    """x or dY (or ``apply_rule``'s gradient) holds a NaN or an infinity; nothing was
    written (the update kernel read the device-side input check and stored nothing)."""


class NonFiniteUpdateError(FloatingPointError):
    """Some tiles' gradient or updated values were not finite.

    Those tiles were left exactly as they were (weight and every state slot);
    the other tiles took the step. ``tiles`` lists the skipped tiles as
    ``(row_start, row_stop, col_start, col_stop)`` of the weight.
    """

    def __init__(self, message, tiles):
        super().__init__(message)
        self.tiles = tiles


class NonFiniteLossError(FloatingPointError):
    """A zeroth-order optimizer's closure returned a NaN or an infinity; no step was taken
    and the draw counter did not advance (GRZO's weights were never touched; MeZO's were
    restored from the perturbation, see ``MeZO``)."""


class NoStepWarning(RuntimeWarning):
    """A zeroth-order step found no direction (GRZO, normalize="std": every per-example
    difference equal) and left the weights as they were."""


def reword(error: BaseException, before: str, after: str) -> None:
    """Put where a deferred error came from into its message (``args[0]``, which is what
    the non-finite errors print; their other attributes are kept)."""
    if error.args and isinstance(error.args[0], str):
        error.args = (before + error.args[0] + after,) + error.args[1:]
