"""Helpers the report notebooks share: figures rendered by Agg (no display needed) and
shown as PNG, tables shown as Markdown."""

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from IPython.display import Image, Markdown, display  # noqa: E402


def show(fig) -> None:
    """Display ``fig`` as a PNG output of the cell, and release it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    display(Image(data=buffer.getvalue(), format="png"))


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def show_table(header, rows) -> None:
    display(Markdown(markdown_table(header, rows)))


def say(text: str) -> None:
    """A sentence of the report's output (rendered as Markdown)."""
    display(Markdown(text))
