"""Errors raised by the kernels' launchers."""


class NonFiniteInputError(FloatingPointError):
    """x or dY holds a NaN or an infinity; nothing was written."""


class NonFiniteUpdateError(FloatingPointError):
    """Some tiles' gradient or updated values were not finite.

    Those tiles were left exactly as they were (weight and every state slot);
    the other tiles took the step. ``tiles`` lists the skipped tiles as
    ``(row_start, row_stop, col_start, col_stop)`` of the weight.
    """

    def __init__(self, message, tiles):
        super().__init__(message)
        self.tiles = tiles
