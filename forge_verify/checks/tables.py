"""Plain-text tables for the command-line reports."""


def render_table(header, rows) -> str:
    """Left-aligned columns under a dashed rule; every cell a string."""
    lines = [tuple(header), *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
