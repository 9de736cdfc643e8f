"""The report runner executes notebooks headless and fails on an error; the performance
report plots recorded benchmark CSVs and says plainly when there are none."""

import csv
import json

import pytest

# The GPU machine runs this suite with its own python3, which has no notebook packages
# and cannot install them; the reports run on the CPU machines.
nbformat = pytest.importorskip("nbformat")
CellExecutionError = pytest.importorskip("nbclient.exceptions").CellExecutionError

from forge_verify.commands import benchmark_results, report  # noqa: E402
from forge_verify.commands.cli import main  # noqa: E402

PERFORMANCE = report.REPORTS / "performance.py"


def _write_results(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=benchmark_results.COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _sample_rows():
    """A made-up sample (not a measurement): three methods at three token counts; the
    captured one records no extra memory (an empty cell), as the benchmark writes it."""
    rows = []
    for method, scale in (("forge", 1.0), ("pytorch", 1.5), ("forge captured", 0.9)):
        for tokens in (256, 1024, 4096):
            median = scale * (0.1 + tokens / 10_000)
            peak = "" if method.endswith("captured") else int(scale * 2**30) + tokens
            rows.append(dict(gpu="NVIDIA H200", torch="2.11.0", triton="3.6.0", commit="abc1234", n=4096, k=4096,
                             tokens=tokens, regime="bf16 weight, bf16 state", method=method, median_ms=median,
                             min_ms=0.9 * median, max_ms=1.2 * median, peak_bytes=peak))
    return rows


def _outputs(ipynb) -> str:
    cells = json.loads(ipynb.read_text())["cells"]
    return "\n".join(json.dumps(cell.get("outputs", [])) for cell in cells)


def test_performance_report_plots_recorded_results(tmp_path):
    _write_results(tmp_path / "sample.csv", _sample_rows())
    written = report.execute(PERFORMANCE, {"MODE": "fast", "RESULTS": str(tmp_path / "*.csv")}, tmp_path / "out")
    figures = [p for p in written if p.suffix == ".png"]
    assert len(figures) == 2  # time and memory
    outputs = _outputs(tmp_path / "out" / "performance.ipynb")
    assert "9 rows from 1 file(s)" in outputs and "No benchmark results" not in outputs
    assert (tmp_path / "out" / "performance.html").stat().st_size > 0


def test_performance_report_says_when_nothing_is_recorded(tmp_path):
    report.execute(PERFORMANCE, {"MODE": "fast", "RESULTS": str(tmp_path / "*.csv")}, tmp_path)
    assert "No benchmark results recorded" in _outputs(tmp_path / "performance.ipynb")


def test_figures_have_labelled_axes_and_the_floor(tmp_path):
    _write_results(tmp_path / "sample.csv", _sample_rows())
    rows = benchmark_results.load_results([tmp_path / "sample.csv"])
    axes = benchmark_results.time_figure(rows).axes
    assert len(axes) == 1
    assert axes[0].get_xlabel() == "tokens per step" and "ms" in axes[0].get_ylabel()
    assert sorted(axes[0].get_legend_handles_labels()[1]) == ["floor", "forge", "forge captured", "pytorch"]
    memory = benchmark_results.memory_figure(rows).axes[0]
    # the captured rows record no memory, so only the other two methods are drawn there
    assert "MiB" in memory.get_ylabel() and len(memory.get_lines()) == 2


def test_memory_floor_counts_weight_state_and_activations():
    # fp32 weight and state: 2 * (4 + 8) bytes per parameter, plus bf16 x and dy read once.
    moved = 2 * 4096 * 4096 * 12 + 1024 * (4096 + 4096) * 2
    assert benchmark_results.floor_ms("NVIDIA H200", 4096, 4096, 1024, "fp32 weight, fp32 state") == \
        pytest.approx(1e3 * moved / 4.8e12, rel=1e-12)
    assert benchmark_results.floor_ms("NVIDIA H200", 64, 64, 8, "bf16 weight, q8 state, stochastic") == \
        pytest.approx(1e3 * (2 * 64 * 64 * (2 + 2.0625) + 8 * 128 * 2) / 4.8e12, rel=1e-12)
    assert benchmark_results.floor_ms("Some GPU", 64, 64, 8, "fp32") is None
    assert benchmark_results.floor_ms("NVIDIA H200", 64, 64, 8, "mixed") is None


def test_results_missing_a_column_are_refused(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("gpu,n,k\nH200,1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        benchmark_results.load_results([path])


def _notebook(tmp_path, body):
    source = tmp_path / "tiny.py"
    source.write_text('# %% tags=["parameters"]\nMODE = "full"\n\n# %%\n' + body + "\n")
    return source


def test_parameters_are_injected_after_the_parameters_cell(tmp_path):
    source = _notebook(tmp_path, 'assert MODE == "fast", MODE\nprint("mode", MODE)')
    report.execute(source, {"MODE": "fast"}, tmp_path / "out")
    cells = nbformat.read(tmp_path / "out" / "tiny.ipynb", as_version=4).cells
    assert cells[1]["metadata"]["tags"] == ["injected-parameters"] and cells[1]["source"] == "MODE = 'fast'"
    assert "mode fast" in _outputs(tmp_path / "out" / "tiny.ipynb")


def test_an_error_in_a_cell_fails_the_run(tmp_path, monkeypatch, capsys):
    source = _notebook(tmp_path, 'raise RuntimeError("planted")')
    with pytest.raises(CellExecutionError, match="planted"):
        report.execute(source, {"MODE": "fast"}, tmp_path / "out")
    assert "RuntimeError" in _outputs(tmp_path / "out" / "tiny.ipynb")
    assert not (tmp_path / "out" / "tiny.html").exists()
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    assert main(["report", "--mode", "fast", "--out", str(tmp_path / "out")]) == 1
    assert "1 of 1 report(s) FAILED: tiny.py" in capsys.readouterr().out


def test_a_report_needs_one_parameters_cell(tmp_path):
    source = tmp_path / "untagged.py"
    source.write_text('# %%\nMODE = "full"\n')
    with pytest.raises(ValueError, match="exactly one cell tagged 'parameters'"):
        report.execute(source, {"MODE": "fast"}, tmp_path)


def test_every_report_has_fast_and_full_settings():
    for source in report.report_sources():
        text = source.read_text()
        assert '# %% tags=["parameters"]\nMODE = "full"' in text, source.name
        if "SETTINGS = {" in text:
            assert '"fast": dict(' in text and '"full": dict(' in text, source.name
