"""The harness's layers: no module imports a layer above its own, and forge_kernels never
imports forge_verify (README, "Layout")."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "forge_verify"
#: each subpackage's layer; a module may import its own layer and those below
LAYERS = {"numerics": 0, "models": 0, "checks": 1, "distributed": 2, "gate": 3, "commands": 4}
TOP = 5  # forge_verify/pytest_plugin.py sits above everything


def _layer(parts) -> int:
    """The layer of forge_verify.<parts>: its subpackage's, 0 for the package's own
    ``__init__`` (it re-exports numerics), TOP for a top-level module."""
    if parts[0] in LAYERS:
        return LAYERS[parts[0]]
    return 0 if parts == ("__init__",) else TOP


def _imports(path: Path):
    """(line, absolute module name) of every forge_verify module ``path`` imports."""
    package = ["forge_verify", *path.relative_to(HARNESS).parent.parts]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.startswith("forge_verify"):
                targets = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
                yield from ((node.lineno, t) for t in targets)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("forge_verify"))


MODULES = sorted(p for p in HARNESS.rglob("*.py"))


def test_every_subpackage_has_a_layer():
    folders = {p.relative_to(HARNESS).parts[0] for p in MODULES if len(p.relative_to(HARNESS).parts) > 1}
    assert folders == set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_higher_layer(path):
    own = _layer(path.relative_to(HARNESS).with_suffix("").parts)
    for line, module in _imports(path):
        parts = module.split(".")[1:]
        if not parts:
            continue  # "import forge_verify" reads the package's own exports (layer 0)
        target = _layer(tuple(parts))
        assert target <= own, f"{path.relative_to(ROOT)}:{line} imports {module} (layer {target} > {own})"


def test_forge_kernels_never_imports_forge_verify():
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("forge_verify") for n in names), f"{path.relative_to(ROOT)} imports {names}"
