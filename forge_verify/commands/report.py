"""``forge-verify report``: execute the notebooks in ``reports/`` headless.

Each report is a jupytext percent-format ``.py`` file with one cell tagged
``parameters`` (``MODE = "full"``). The runner converts it to a notebook, inserts a cell
with the chosen parameters right after that one (as papermill does, tagged
``injected-parameters``), executes it with nbclient (a timeout per cell; an error in
any cell fails the run) and writes the executed ``.ipynb``, its HTML and every figure
as a PNG under ``build/reports/`` (ignored by git).
"""

import base64
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source checkout: reports/ is not installed
REPORTS = ROOT / "reports"
BUILD = ROOT / "build" / "reports"
MODES = ("fast", "full")
CELL_TIMEOUT_S = 1200


def report_sources() -> list:
    return sorted(REPORTS.glob("*.py"))


def _inject(notebook, parameters: dict, new_code_cell) -> None:
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"a report needs exactly one cell tagged 'parameters', found {len(tagged)}")
    source = "\n".join(f"{name} = {value!r}" for name, value in parameters.items())
    cell = new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    notebook.cells.insert(tagged[0] + 1, cell)


def _figures(notebook):
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                yield base64.b64decode(png)


def execute(source: Path, parameters: dict, out_dir: Path = BUILD, cell_timeout: int = CELL_TIMEOUT_S) -> list:
    """Execute one report; returns the paths written (.ipynb, .html, figures).
    Raises ``CellExecutionError`` or ``CellTimeoutError`` when a cell fails."""
    # Imported here, not at the top: the rest of the CLI (check, gate) must run on machines
    # without the notebook packages, such as the GPU machine, which cannot install them.
    import jupytext
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    notebook = jupytext.read(source)
    _inject(notebook, parameters, nbformat.v4.new_code_cell)
    client = NotebookClient(notebook, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    # Local sockets (IPC) rather than TCP on localhost: nothing listens on the network.
    # Their path is absolute, since the kernel runs in ROOT, wherever the caller is.
    client.km = client.create_kernel_manager()
    client.km.transport = "ipc"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / source.stem
    ipynb, html = stem.with_suffix(".ipynb"), stem.with_suffix(".html")
    try:
        with tempfile.TemporaryDirectory(prefix="forge-report-") as sockets:
            client.km.ip = str(Path(sockets) / "kernel")
            client.execute()
    finally:  # a failed run leaves its partly executed notebook, with the traceback, to read
        nbformat.write(notebook, ipynb)
    html.write_text(HTMLExporter().from_notebook_node(notebook)[0])
    written = [ipynb, html]
    for number, png in enumerate(_figures(notebook), start=1):
        figure = out_dir / f"{source.stem}_figure{number}.png"
        figure.write_bytes(png)
        written.append(figure)
    return written


def add_parser(commands) -> None:
    report = commands.add_parser("report", help="execute the reports/ notebooks headless into .ipynb and HTML "
                                                "under build/reports/")
    report.add_argument("--mode", choices=MODES, default="full",
                        help="the parameters: 'fast' (the CI setting) or 'full' (default)")
    report.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="run only this report (file stem, e.g. deviation); repeatable")
    report.add_argument("--cell-timeout", type=int, default=CELL_TIMEOUT_S,
                        help=f"seconds allowed per cell (default {CELL_TIMEOUT_S})")
    report.add_argument("--out", type=Path, default=BUILD, help=f"output folder (default {BUILD})")


def run(args) -> int:
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    sources = [s for s in report_sources() if args.only is None or s.stem in args.only]
    unknown = set(args.only or ()) - {s.stem for s in sources}
    if unknown or not sources:
        print(f"forge-verify report: no report named {sorted(unknown)} in {REPORTS}", file=sys.stderr)
        return 2
    failed = []
    for source in sources:
        print(f"{source.relative_to(ROOT)} ({args.mode}) ...", flush=True)
        try:
            written = execute(source, {"MODE": args.mode}, args.out, args.cell_timeout)
        except (CellExecutionError, CellTimeoutError) as error:
            print(f"FAILED: {source.name}: {error}", file=sys.stderr)
            failed.append(source.name)
            continue
        for path in written:
            print(f"  {path}")
    if failed:
        print(f"forge-verify report: {len(failed)} of {len(sources)} report(s) FAILED: {', '.join(failed)}")
        return 1
    print(f"forge-verify report: {len(sources)} report(s) written to {args.out}")
    return 0
