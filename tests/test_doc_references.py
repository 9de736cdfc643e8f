"""What README.md, benchmarks/HISTORY.md and proofs/ cite exists: every dotted ``forge_verify.*`` /
``forge_kernels.*`` name imports, every ``path.py::name`` names a function or class in that file,
every test named in backticks is defined, and every repository path (globs allowed) matches a file.
A claim is backed only by what it names; a rename must not leave the name behind."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "HISTORY.md", *sorted((ROOT / "proofs").glob("*.md"))]

_DOTTED = re.compile(r"\b(forge_(?:verify|kernels)(?:\.[A-Za-z_]\w*)+)")
_TOP = r"(?:tests|properties|forge_verify|kernels|benchmarks|reports|proofs|requirements|\.ci)/"
#: tests/test_x.py::test_y (a trailing * is a prefix, [params] are dropped)
_DEFINITION = re.compile(rf"\b({_TOP}[\w/]+\.py)::(\w+\*?)")
#: `test_y`, `test_y*`, `::test_y`, `test_y[case]` on their own in backticks
_TEST_NAME = re.compile(r"`(?:::)?(test_\w+\*?)(?:\[[^`\]]*\])?`")
#: a repository path; `*` globs, `{a,b}` alternatives (each must match)
_PATH = re.compile(rf"`({_TOP}[\w./*{{}},-]*)")


def _resolves(dotted: str) -> bool:
    """Import the longest importable prefix, then look the rest up as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def _alternatives(pattern: str) -> list:
    """'a.{csv,log}' -> ['a.csv', 'a.log'] (nested braces are not used)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [expanded for choice in match[1].split(",")
            for expanded in _alternatives(pattern[:match.start()] + choice + pattern[match.end():])]


def _matches(pattern: str) -> bool:
    return any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()


def _defines(names: set, name: str) -> bool:
    return any(n.startswith(name[:-1]) for n in names) if name.endswith("*") else name in names


def _definitions(path: Path) -> set:
    return set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", path.read_text(), re.M))


def _defined_tests() -> set:
    return {name for folder in ("tests", "properties") for path in (ROOT / folder).rglob("*.py")
            for name in _definitions(path) if name.startswith("test_")}


def dangling(document: Path) -> list:
    """(line, reference) for each reference in ``document`` that names nothing."""
    tests, found = _defined_tests(), []
    for number, line in enumerate(document.read_text().splitlines(), start=1):
        found += [(number, m[1]) for m in _DOTTED.finditer(line) if not _resolves(m[1])]
        for m in _DEFINITION.finditer(line):
            path = ROOT / m[1]
            if not path.is_file() or not _defines(_definitions(path), m[2]):
                found.append((number, m[0]))
        found += [(number, m[1]) for m in _TEST_NAME.finditer(line) if not _defines(tests, m[1])]
        for m in _PATH.finditer(line):
            if not all(_matches(pattern) for pattern in _alternatives(m[1].rstrip(".,"))):
                found.append((number, m[1]))
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_cited_name_exists(document):
    missing = dangling(document)
    assert not missing, "\n".join(f"{document.name}:{line}: {reference} names nothing" for line, reference in missing)


def test_a_dangling_reference_is_found(tmp_path):
    """Not vacuous: each kind of reference, renamed, is reported."""
    document = tmp_path / "claims.md"
    document.write_text("`forge_verify.numerics.reference.reference_step`\n"
                        "`forge_verify.checks.catalog.reference_step`\n"
                        "`tests/test_interval.py::test_no_such_test`, `test_no_such_test_either`\n"
                        "`tests/test_interval.py::test_underflow_*`, `forge_verify/gate/no_such_file.py`\n"
                        "`forge_verify/gate/{baseline,cases}.py`, `forge_verify/gate/{nothing,none}.py`\n")
    assert dangling(document) == [(1, "forge_verify.numerics.reference.reference_step"),
                                  (3, "tests/test_interval.py::test_no_such_test"),
                                  (3, "test_no_such_test_either"),
                                  (4, "forge_verify/gate/no_such_file.py"),
                                  (5, "forge_verify/gate/{nothing,none}.py")]
