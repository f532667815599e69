"""Result files: Markdown/CSV/JSON tables and learning-curve plots in the paper's style."""

from __future__ import annotations

import csv
import itertools
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from capg_rec._json import json_text

__all__ = ["value_at", "mean_se", "write_csv", "write_json", "json_text", "markdown_table", "plot_curves",
           "legend_below", "method_colors", "METHOD_COLORS"]

METHOD_COLORS = {"V-PG": "tab:red", "V-PG-SwR": "tab:orange", "CA-PG": "tab:blue", "CA-PG-SwR": "tab:green"}


def value_at(history: Sequence[Mapping], step: int) -> float:
    """Policy value at ``step``, or at the last evaluation before it (an interrupted run: its
    value at the interruption, as the paper reports)."""
    before = [row for row in history if row["step"] <= step]
    return before[-1]["policy_value"]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (NaN for a single value: undefined, ``null`` in JSON)."""
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def mean_pm_se(mean: float, se: float, digits: int) -> str:
    """``mean ± se`` to ``digits`` decimals; ``n/a`` for an undefined standard error (one seed)."""
    return f"{mean:.{digits}f} ± {'n/a' if math.isnan(se) else f'{se:.{digits}f}'}"


def write_csv(path: str | os.PathLike, rows: Sequence[Mapping]) -> None:
    """``rows`` (every key of any row is a column, in the order first seen: a resumed run's older rows may lack
    some) as CSV; an undefined value, None, NaN or a key a row lacks, is an empty cell."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in rows for key in row)), restval="")
        writer.writeheader()
        writer.writerows({key: "" if isinstance(value, float) and math.isnan(value) else value
                          for key, value in row.items()} for row in rows)


def write_json(path: str | os.PathLike, obj: object) -> None:
    Path(path).write_text(json_text(obj, indent=1), encoding="utf-8")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_curves(panels: Mapping[str, Mapping[str, Sequence[Sequence[Mapping]]]], path: str | os.PathLike, *,
                optimum: float | Mapping[str, float | None] | None = None, ylabel: str = "policy value (greedy ESR)",
                sharey: bool = True) -> None:
    """One panel per setting; in each, every seed's learning curve as a thin line coloured by
    method (as the paper's figures), a dot at the end of a run that met a gradient overflow, and the best
    achievable value as a dashed line (``optimum``: one for every panel, or per panel title; None: none).
    ``panels[title][method] = [history, ...]``; ``sharey=False`` for panels in different units."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False, sharey=sharey)
    colors = method_colors([method for methods in panels.values() for method in methods])
    for ax, (title, methods) in zip(axes[0], panels.items()):
        for method, histories in methods.items():
            color = colors[method]
            for i, history in enumerate(histories):
                steps = [row["step"] for row in history]
                values = [row["policy_value"] for row in history]
                ax.plot(steps, values, color=color, alpha=0.8, lw=1.0, label=method if i == 0 else None)
                finite = [(x, y) for x, y in zip(steps, values) if y is not None and math.isfinite(y)]
                if history[-1].get("overflows", 0) and finite:  # at the last finite value (an overflow ends in NaN)
                    ax.plot(*finite[-1], "o", color=color, ms=4)
        best = optimum.get(title) if isinstance(optimum, Mapping) else optimum
        if best is not None:
            ax.axhline(best, color="gray", ls="--", lw=0.8, label="best possible (optimal LSR)")
        ax.set_title(textwrap.fill(title, 44), fontsize=9)  # an environment's name can be long
        ax.set_xlabel("gradient steps")
        ax.grid(alpha=0.3)
    for ax in axes[0] if not sharey else axes[0][:1]:
        ax.set_ylabel(textwrap.fill(ylabel, 32))  # within the panel's height
    legend_below(fig, axes[0], fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def method_colors(methods: Sequence[str]) -> dict[str, str]:
    """One colour per method, the same in every panel: :data:`METHOD_COLORS`' for the paper's four, the other
    tab10 colours in turn for the rest (found by review: an unknown method took the next colour of matplotlib's
    cycle for each seed, other methods' among them)."""
    spare = itertools.cycle([c for c in (f"tab:{n}" for n in ("purple", "brown", "pink", "olive", "cyan", "blue",
                                                              "orange", "green", "red"))
                             if c not in METHOD_COLORS.values()])  # not gray: the best value's
    return {method: METHOD_COLORS.get(method) or next(spare) for method in dict.fromkeys(methods)}


def legend_below(fig, axes, *, fontsize: float = 8) -> None:
    """One legend of every panel's labels under the panels (over none of their curves), then a tight layout that
    leaves it room."""
    labels: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    rows = 0
    if labels:  # as many columns as the figure's width holds (a label is ~0.6 em a character, plus its line)
        points = fig.get_size_inches()[0] * 72
        columns = max(1, min(len(labels), int(points // (0.6 * fontsize * max(map(len, labels)) + 3 * fontsize))))
        rows = -(-len(labels) // columns)
        fig.legend(list(labels.values()), list(labels), loc="lower center", ncol=columns, fontsize=fontsize,
                   frameon=False)
    width, height = fig.get_size_inches()
    below = rows * fontsize * 1.6 / 72 + (0.1 if rows else 0.0)  # inches: the figure grows by the legend
    fig.set_size_inches(width, height + below)
    fig.tight_layout(rect=(0, below / (height + below), 1, 1))
