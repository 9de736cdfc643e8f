"""`forge-verify check` runs from an installed package, not only from a checkout: the
properties ship inside the wheel as ``forge_verify.properties`` and the pytest plugin
brings the markers and fixtures a checkout's conftest.py would."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "kernels", "forge_verify", "properties")


def _install(tmp_path: Path) -> Path:
    """Build a wheel from a clean copy of the sources and install it, without
    dependencies (they are this interpreter's), into a folder of its own."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (ROOT / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
                   check=True, capture_output=True, timeout=300)
    target = tmp_path / "site"
    wheel = next((tmp_path / "wheel").glob("forge_verify-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return target


def test_check_runs_from_an_installed_package(tmp_path):
    site = _install(tmp_path)
    elsewhere = tmp_path / "elsewhere"  # no checkout, conftest.py or pyproject.toml around
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-m", "forge_verify.commands.cli", "check", "-k", "test_block_t_finding"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert str(site / "forge_verify" / "properties") in output, f"did not run the installed properties:\n{output}"
    assert "test_block_t_finding[fp32]" in output and "2 of 2 hold, 0 failed" in output, output[-4000:]
