"""What every demo writes: its result as JSON and its loss plot as a PNG, drawn headless."""

import json
from pathlib import Path


def headless_pyplot():
    """matplotlib's pyplot on the Agg backend: demos run where there is no display, and the
    import stays out of the commands that never plot."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
    return pyplot


def write_demo(out: Path, name: str, result: dict, plot) -> dict:
    """``out/<name>.json`` and ``out/<name>_loss.png`` (drawn by ``plot(result, path)``);
    returns ``result``."""
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{name}_loss.png")
    return result
