"""cim_int4.report: the text table, JSON and plot writers that bench and validate share."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from cim_int4.cli import main
from cim_int4.report import MissingPlotting, check_plotting, plot_bars, plot_by_depth, text_table, write_json

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
PNG = b"\x89PNG\r\n\x1a\n"


def test_text_table_pads_aligns_and_separates_blocks() -> None:
    table = text_table(
        ("case", "variant", "ms"),
        [("a", "fp32", "1.5"), ("", "cim-int4 int8", "10.25"), ("bb", "fp32", "2")],
        left={0, 1},
        block_column=0,
    )
    lines = table.splitlines()
    assert lines[0] == "case  variant" + " " * 11 + "ms"
    assert lines[1] == "----  -------------  -----"
    assert lines[2] == "a     fp32" + " " * 13 + "1.5"
    assert lines[3] == "      cim-int4 int8  10.25"
    assert lines[4] == ""  # a new block starts where the block column is filled
    assert lines[5] == "bb    fp32" + " " * 15 + "2"
    assert text_table(("x",), []).splitlines() == ["x", "-"]


def test_write_json_turns_non_finite_numbers_into_null(tmp_path) -> None:
    out = tmp_path / "r.json"
    write_json({"a": [1.0, math.nan], "b": {"c": math.inf}, "d": "text"}, out)
    assert json.loads(out.read_text()) == {"a": [1.0, None], "b": {"c": None}, "d": "text"}


@needs_matplotlib
def test_plots_are_written_as_png(tmp_path) -> None:
    bars = tmp_path / "bars.png"
    plot_bars(
        bars,
        ["case 1", "case 2"],
        [("ms", {"fp32": [1.0, 2.0], "cim-int4 int8": [0.5, np.nan]}, True), ("%", {"fp32": [50.0, 60.0]}, False)],
        title="t",
        reference_line=(1, 100.0),
    )
    depth = tmp_path / "depth.png"
    plot_by_depth(depth, ["l0", "l1", "l2"], {"err": [0.1, 0.2, 0.3]}, ylabel="rel", title="t", marked=[1])
    assert bars.read_bytes()[:8] == PNG and depth.read_bytes()[:8] == PNG


def test_missing_matplotlib_is_one_line_saying_what_to_install(monkeypatch, tmp_path, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(MissingPlotting, match="pip install matplotlib"):
        check_plotting()
    # validate checks before any work: the models need not even exist.
    assert main(["validate", "a.onnx", "b.onnx", "--plot", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install matplotlib" in err
