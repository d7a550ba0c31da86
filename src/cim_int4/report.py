"""Tables, JSON and plots of results: the one place both ``cim-int4 bench`` and ``cim-int4 validate`` render with.

Callers turn their results into plain cells and series; this module knows nothing about
benchmarks or models. matplotlib is imported only when a plot is drawn (it comes with the
``bench`` extra); without it, ``MissingPlotting`` says what to install.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np


class MissingPlotting(Exception):
    """matplotlib is not installed; the message says how to get it."""


def text_table(
    header: Sequence[str],
    lines: Sequence[Sequence[str]],
    left: Collection[int] = (0,),
    block_column: int | None = None,
) -> str:
    """``lines`` of cells under ``header``, columns padded; ``left`` columns align left, the others right.

    With ``block_column``, a blank line goes before every line whose cell in that column
    is not empty (one block per case).
    """
    widths = [max([len(h), *(len(line[i]) for line in lines)]) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [fmt(header), "  ".join("-" * w for w in widths)]
    for line in lines:
        if block_column is not None and line[block_column] and len(out) > 2:
            out.append("")
        out.append(fmt(line))
    return "\n".join(out)


def _finite_or_none(value: object) -> object:
    # JSON has no NaN or Infinity; None says "not measured" to any reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def write_json(data: Mapping, path: str | os.PathLike) -> None:
    """Write ``data`` as indented JSON (NaN and infinities as null)."""
    Path(path).write_text(json.dumps(_finite_or_none(dict(data)), indent=1) + "\n")


def check_plotting() -> None:
    """Raise MissingPlotting unless matplotlib can be imported; call it before long work that ends in a plot."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingPlotting("--plot needs matplotlib: pip install matplotlib (or the package's [bench] extra)")


def _figure(width: float, height: float):
    check_plotting()
    from matplotlib.figure import Figure  # lazily: only plots need matplotlib

    return Figure(figsize=(width, height), layout="constrained")


def plot_bars(
    path: str | os.PathLike,
    labels: Sequence[str],
    panels: Sequence[tuple[str, Mapping[str, Sequence[float]], bool]],
    title: str,
    reference_line: tuple[int, float] | None = None,
) -> None:
    """Grouped horizontal bars, one row per label, panels side by side sharing the rows.

    Each panel is (x-axis label, series name -> one value per label (NaN: none), log scale).
    ``reference_line`` (panel index, x) draws a dashed vertical line, e.g. at 100%.
    """
    series_names = list(dict.fromkeys(name for _, series, _ in panels for name in series))
    height = max(3.0, 0.28 * len(labels) * max(len(series_names), 2) / 2 + 1.5)
    fig = _figure(14, height)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    bar = 0.8 / max(len(series_names), 1)
    ypos = np.arange(len(labels))
    for ax, (xlabel, series, log) in zip(axes, panels, strict=True):
        for i, name in enumerate(series_names):
            values = series.get(name, [np.nan] * len(labels))
            ax.barh(ypos - 0.4 + bar * (i + 0.5), values, height=bar, label=name)
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
    if reference_line is not None:
        axes[reference_line[0]].axvline(reference_line[1], color="grey", linewidth=0.8, linestyle="--")
    axes[0].set_yticks(ypos, labels)
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=max(len(series_names), 1))
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def plot_by_depth(
    path: str | os.PathLike,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    title: str,
    marked: Sequence[int] = (),
) -> None:
    """One line per series over positions 0..n-1 (layer depth), log y axis; ``marked`` positions get a red line."""
    fig = _figure(max(6.0, min(16.0, 0.18 * len(labels) + 4)), 4.5)
    ax = fig.subplots()
    x = np.arange(len(labels))
    for name, values in series.items():
        ax.plot(x, values, marker=".", label=name)
    for i in marked:
        ax.axvline(i, color="red", linewidth=1.0, linestyle="--")
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_xlabel("quantized layer, in graph order")
    if len(labels) <= 40:
        ax.set_xticks(x, labels, rotation=90, fontsize=7)
    ax.legend()
    ax.set_title(title)
    fig.savefig(path, dpi=110)


def plot_lines(
    path: str | os.PathLike,
    panels: Sequence[tuple[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]]],
    xlabel: str,
    title: str,
    log_y: bool = False,
) -> None:
    """Panels side by side, each (y-axis label, series name -> (x values, y values)) drawn as lines with markers.

    A series name keeps its colour across panels.
    """
    fig = _figure(6 * len(panels), 5)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    for ax, (ylabel, series) in zip(axes, panels, strict=True):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=name)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
