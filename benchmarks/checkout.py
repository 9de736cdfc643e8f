"""``forge_kernels`` for the benchmark scripts: the installed package where there is one,
otherwise this checkout's ``kernels/`` loaded under that name (the lent GPU machine has
its own torch and Triton and nothing installed from this project)."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def forge_kernels():
    """The ``forge_kernels`` module, imported or mapped from the checkout once."""
    if "forge_kernels" not in sys.modules:
        try:
            import forge_kernels  # noqa: F401
        except ImportError:
            spec = importlib.util.spec_from_file_location("forge_kernels", ROOT / "kernels" / "__init__.py",
                                                          submodule_search_locations=[str(ROOT / "kernels")])
            module = importlib.util.module_from_spec(spec)
            sys.modules["forge_kernels"] = module
            spec.loader.exec_module(module)
    return sys.modules["forge_kernels"]


def parse_config(text: str) -> tuple:
    """A tile config's fields from ``64,128,64,8,3,128,2``, ``64,32,128,4,2,None,1,hopper`` or
    ``128,128,64,8,3,None,8,hopper,rows`` or ``128,256,64,16,3,None,4,portable,columns,None,tma``
    or ``128,128,64,8,4,None,8,hopper,rows,1,pointers,True`` (parentheses, quotes and spaces,
    as the sweeps print configs, are allowed)."""
    values = [v.strip().strip("'\"") for v in text.strip().strip("()").split(",")]
    words = ("hopper", "portable", "rows", "columns", "pointers", "tma")
    flags = {"True": True, "False": False}
    return tuple(None if v == "None" else v if v in words else flags[v] if v in flags else int(v) for v in values)


def config_tuple(config) -> tuple:
    """``config``'s fields in order, without the trailing ones at their defaults: a tree
    whose ``TileConfig`` predates a field takes the tuple (``TileConfig(*fields)``) and
    means the same by it."""
    values = dataclasses.astuple(config)
    defaults = [field.default for field in dataclasses.fields(config)]
    while values and values[-1] == defaults[len(values) - 1]:
        values = values[:-1]
    return values
