"""The ``grid`` attribute: non-uniform levels for 2- and 3-bit codes, from the contract to an exported model.

The op's kernels are held to the reference for every grid in test_widths_op.py (and kernel_test.cpp);
here: the levels and their byte layout, rounding to them, the node's checks, quantizers and GPTQ on
a grid, and an export with ``grid="normal"`` run by the op against the reference backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import ExportOptions, export_with_summary, quantize_weight
from cim_int4.exporter.gptq import gptq_quantize, weighted_error
from cim_int4.ops import reference
from onnx import helper

from cim_int4 import make_session
from cim_int4.cli import build_parser, export_options
from cim_int4.contract import (
    GATHER_OP_TYPE,
    GRID_BITS,
    GRID_OP_VERSION,
    NORMAL_LEVELS_3,
    OP_VERSION,
    Int4Node,
    is_op_node,
    levels,
    max_level,
    pack,
    pack_codes,
    round_to_grid,
    unpack,
    unpack_codes,
)

MODELS = Path(__file__).parent / "models"


def test_levels_of_each_grid() -> None:
    assert levels(3, "normal").tolist() == [-8, -5, -3, -1, 1, 3, 5, 8]
    assert levels(2, "normal").tolist() == [-3, -1, 1, 3]
    assert levels(3).tolist() == list(range(-4, 4))
    assert levels(4, "uniform").tolist() == list(range(-8, 8))
    assert (max_level(3, "normal"), max_level(3), max_level(4)) == (8, 4, 8)
    with pytest.raises(ValueError, match="is for bits"):
        levels(4, "normal")
    with pytest.raises(ValueError, match="grid must be one of"):
        levels(3, "lloyd")


def test_normal_codes_are_the_level_indices_in_the_width_bit_stream() -> None:
    # Code c stands for NORMAL_LEVELS_3[c]; the bytes are those of the uniform layout of codes 0..7:
    # eight 3-bit codes in one 24-bit little-endian word, code j in bits 3j .. 3j+2.
    q = np.array([NORMAL_LEVELS_3], np.int16)
    packed = pack(q, 3, "normal")
    word = sum(c << (3 * c) for c in range(8))
    assert packed.tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
    assert np.array_equal(packed, pack_codes(np.arange(8)[None, :], 3))
    assert unpack(packed, 3, "normal").tolist() == [list(NORMAL_LEVELS_3)]
    with pytest.raises(ValueError, match="levels of grid 'normal'"):
        pack(np.array([[0, 1, 3, 5, 8, 1, 1, 1]]), 3, "normal")  # 0 is no level


def test_padding_is_the_code_of_two_to_the_b_minus_one_whatever_the_grid() -> None:
    q = np.array([[8, -8, 0, 0, 0, 0, 0, 0]], np.int16)  # two weights, then padding (q = 0 is no level)
    codes = unpack_codes(pack(q, 3, "normal", pad_from=2), 3)
    assert codes.tolist() == [[7, 0, 4, 4, 4, 4, 4, 4]]


def test_round_to_grid_takes_the_nearest_level_ties_inward() -> None:
    x = np.array([-9.0, -6.6, -6.5, -6.4, -2.0, -0.1, 0.0, 0.1, 2.0, 4.0, 6.5, 7.0, 100.0], np.float32)
    assert round_to_grid(x, 3, "normal").tolist() == [-8, -8, -5, -5, -1, -1, -1, 1, 1, 3, 5, 8, 8]
    # the uniform grid is clip(rint(x)) (half to even) as before
    u = np.array([-5.0, -0.5, 0.5, 1.5, 2.5, 3.6], np.float32)
    assert round_to_grid(u, 3).tolist() == [-4, -0, 0, 2, 2, 3]


def test_a_node_keeps_its_grid_and_refuses_one_its_width_lacks() -> None:
    qw = quantize_weight(_weight(), 32, "mse", 3, "int8", "normal")
    node = Int4Node("n", ("a",), ("y",), qw.k, qw.n, 32, qw.packed, qw.scales, bits=3, grid="normal",
                    super_scales=qw.super_scales).to_node()
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "grid")) == b"normal"
    back = Int4Node.from_node(node)
    assert back.grid == "normal" and np.array_equal(back.packed, qw.packed)
    uniform = Int4Node("u", ("a",), ("y",), qw.k, qw.n, 32, qw.packed, qw.scales, bits=3).to_node()
    assert not any(a.name == "grid" for a in uniform.attribute)  # the default is not written
    assert Int4Node.from_node(uniform).grid == "uniform"
    for attr in (helper.make_attribute("bits", 4), helper.make_attribute("grid", "lloyd")):
        bad = onnx.NodeProto()
        bad.CopyFrom(node)
        kept = [a for a in bad.attribute if a.name != attr.name]
        del bad.attribute[:]
        bad.attribute.extend([*kept, attr])
        with pytest.raises(ValueError, match="attribute '(grid|packed)'"):
            Int4Node.from_node(bad)


def _weight(k: int = 256, n: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


def _squared_error(w: np.ndarray, bits: int, grid: str, rule: str = "mse") -> float:
    qw = quantize_weight(w, 64, rule, bits, "float32", grid)
    wq = reference.dequantize(qw.packed, qw.scales, qw.k, 64, bits, grid=grid)
    return float(np.sum((wq - w) ** 2))


@pytest.mark.parametrize("bits", GRID_BITS)
def test_quantized_codes_are_levels_and_gaussian_weights_lose_less(bits: int) -> None:
    w = _weight()
    qw = quantize_weight(w, 64, "mse", bits, "int8", "normal")
    assert qw.grid == "normal"
    assert set(np.unique(unpack(qw.packed, bits, "normal")[:, : qw.k])) <= set(levels(bits, "normal").tolist())
    if bits == 3:
        # Gaussian groups of 64 under the mse rule: 2-4% less squared error than the uniform -4..3 (seeds
        # 0-3: 0.960-0.978x). Not much: each group's scale already adapts to its extreme (at one global
        # scale the levels lose 14% less); "signed" (extreme at -8) is 4-8% worse on this grid.
        assert _squared_error(w, 3, "normal") < 0.985 * _squared_error(w, 3, "uniform")


def test_padding_does_not_set_the_last_groups_scale_on_a_grid_without_zero() -> None:
    # K = 40 at group 32: the last group holds 8 weights and 24 padding zeros, which the normal grid
    # cannot represent; its scale is the rule's scale of the 8 weights alone.
    from cim_int4.exporter.scale_rules import group_scales

    w = _weight(40, 16, 5)
    for rule in ("mse", "balanced"):
        qw = quantize_weight(w, 32, rule, 3, "float32", "normal")
        alone = group_scales(np.ascontiguousarray(w[32:].T[:, None, :]), rule, 3, "normal")[:, 0]
        np.testing.assert_array_equal(qw.scales[:, 1], alone)


def test_gptq_on_the_grid_beats_rounding_to_it_on_its_own_objective() -> None:
    rng = np.random.default_rng(3)
    k, n = 128, 32
    x = rng.standard_normal((512, k)).astype(np.float32) @ rng.standard_normal((k, k)).astype(np.float32)
    xtx = (x.T @ x).astype(np.float64)
    w = _weight(k, n, 1)
    g = gptq_quantize(w, xtx, 64, "mse", bits=3, grid="normal", scale_dtype="float32")
    r = quantize_weight(w, 64, "mse", 3, "float32", "normal")
    assert g.grid == "normal"
    assert set(np.unique(unpack(g.packed, 3, "normal")[:, :k])) <= set(NORMAL_LEVELS_3)
    assert weighted_error(w, g, xtx) < 0.9 * weighted_error(w, r, xtx)


def test_export_with_the_normal_grid_runs_as_the_reference_says() -> None:
    model = onnx.load(MODELS / "llama.onnx")
    out, summary = export_with_summary(model, bits={".*mlp.*": 4, ".*": 3}, grid="normal")
    grids = {}
    for node in out.graph.node:
        if node.domain != "dbhoo.cim":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        grids[node.name] = (attrs.get("bits", 4), attrs.get("grid", b"uniform"))
    assert grids and all(g == (b"normal" if b == 3 else b"uniform") for b, g in grids.values()), grids
    assert any(b == 4 for b, _ in grids.values()) and any(b == 3 for b, _ in grids.values())
    gathers = [n for n in out.graph.node if n.op_type == GATHER_OP_TYPE]
    assert all(is_op_node(n) or n.op_type == GATHER_OP_TYPE for n in gathers)
    assert "'normal' grid's levels" in summary.format()
    # A library from before grids serves domain version 1 only: the model declares 2, so it refuses it
    # rather than read the codes as uniform; without a grid the model stays at version 1.
    assert [o.version for o in out.opset_import if o.domain == "dbhoo.cim"] == [GRID_OP_VERSION]
    plain, _ = export_with_summary(model, bits=3)
    assert [o.version for o in plain.opset_import if o.domain == "dbhoo.cim"] == [OP_VERSION]
    pytest.importorskip("onnxruntime_extensions")
    feeds = {}
    for inp in out.graph.input:
        shape = [d.dim_value or 3 for d in inp.type.tensor_type.shape.dim]
        if inp.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[inp.name] = np.random.default_rng(0).integers(0, 50, shape).astype(np.int64)
        else:
            feeds[inp.name] = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ours = make_session(out, threads=1).run(None, feeds)
    ref = make_session(out, threads=1, backend="reference").run(None, feeds)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))


def test_the_grid_option_and_flag() -> None:
    assert ExportOptions(grid="normal", bits=3).grid == "normal"
    with pytest.raises(ValueError, match="grid must be one of"):
        ExportOptions(grid="lloyd")
    with pytest.raises(ValueError, match="needs method 'rtn' or 'gptq'"):
        ExportOptions(grid="normal", method="awq")
    args = build_parser().parse_args(["export", "m.onnx", "-o", "o.onnx", "--bits", "3", "--grid", "normal"])
    assert export_options(args).grid == "normal"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "m.onnx", "-o", "o.onnx", "--grid", "lloyd"])
