"""The worker and thread policy (``forge_verify/distributed/workers.py``) that
``forge-verify check``, ``make test`` (pytest-xdist's ``-n auto``) and the rank pools
share, and the pytest plugin that hands it to xdist without requiring xdist."""

import os
import subprocess
import sys

import forge_kernels as fk
from forge_verify import pytest_plugin
from forge_verify.distributed import workers


def test_default_workers_is_one_per_usable_core_capped_at_8_when_compiled(monkeypatch):
    for cores in (1, 2, 16):
        monkeypatch.setattr(workers, "usable_cores", lambda cores=cores: cores)
        expected = cores if fk.interpreting() else min(cores, 8)
        assert workers.default_workers() == expected


def test_threads_per_process_shares_the_cores_and_never_drops_to_zero(monkeypatch):
    monkeypatch.setattr(workers, "usable_cores", lambda: 8)
    assert [workers.threads_per_process(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_xdist_auto_takes_the_shared_worker_count(monkeypatch):
    monkeypatch.setattr(pytest_plugin, "default_workers", lambda: 3)
    assert pytest_plugin.pytest_xdist_auto_num_workers(config=None) == 3


def test_the_plugin_loads_without_xdist(tmp_path):
    """Its xdist hook is optional: with xdist off, pytest must still start."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-p", "no:benchmark", "-p", "forge_verify.pytest_plugin", str(tmp_path / "test_one.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
