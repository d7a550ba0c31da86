"""exporter.quantize: the quantization rule, K padding, and an exported node pinned byte for byte."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cim_int4.exporter import (
    SUPPORTED_GROUP_SIZES,
    export_int4,
    pack,
    quantize,
    quantize_weight,
)
from cim_int4.ops import reference
from onnx import TensorProto, helper, numpy_helper

from cim_int4.contract import OP_DOMAIN, OP_TYPE

# ---------------------------------------------------------------- quantization rule


def test_negative_max_gives_minus_8_and_positive_max_clamps_to_7() -> None:
    # One group of 16 in each of two channels; max|w| = 2 so scale = 0.25.
    w = np.zeros((16, 2), dtype=np.float32)
    w[:3, 0] = [-2.0, 1.0, 0.25]  # -max -> -8 exactly
    w[:3, 1] = [2.0, -1.0, -0.25]  # +max -> round(8) = 8, clamped to 7
    q, scales = quantize(w, 16, "amax8", scale_dtype="float32")
    np.testing.assert_array_equal(scales, np.array([[0.25], [0.25]], dtype=np.float32))
    np.testing.assert_array_equal(q[0, :3], [-8, 4, 1])
    np.testing.assert_array_equal(q[1, :3], [7, -4, -1])
    assert q.min() == -8 and q.max() == 7


def test_all_zero_group_gives_scale_zero_and_code_zero() -> None:
    w = np.zeros((32, 2), dtype=np.float32)
    w[16:, 0] = np.linspace(-1.0, 1.0, 16, dtype=np.float32)  # channel 0: group 0 zero, group 1 not
    with np.errstate(all="raise"):  # a 0/0 inside quantize would raise here
        q, scales = quantize(w, 16, "amax8", scale_dtype="float32")
    assert np.isfinite(scales).all()
    np.testing.assert_array_equal(scales[:, 0], [0.0, 0.0])
    assert scales[0, 1] == np.float32(1.0 / 8.0)
    assert scales[1, 1] == 0.0
    np.testing.assert_array_equal(q[0, :16], 0)
    np.testing.assert_array_equal(q[1], 0)
    assert (pack(q)[1] == 0x88).all()
    deq = reference.dequantize(pack(q), scales, 32, 16)
    assert np.isfinite(deq).all() and (deq[:16] == 0).all()


def test_scale_is_max_abs_over_8_per_group_and_channel() -> None:
    w = np.zeros((48, 2), dtype=np.float32)
    w[5, 0], w[20, 0], w[40, 0] = -8.0, 4.0, 0.5  # channel 0 groups: max 8, 4, 0.5
    w[0, 1], w[31, 1], w[47, 1] = 3.0, -6.0, -1e-3
    _, scales = quantize(w, 16, "amax8", scale_dtype="float32")
    expected = np.array([[1.0, 0.5, 0.0625], [0.375, 0.75, np.float32(1e-3) / np.float32(8)]], dtype=np.float32)
    np.testing.assert_array_equal(scales, expected)
    assert scales.dtype == np.float32


def test_rounding_is_half_to_even() -> None:
    # max|w| = 8 makes scale exactly 1, so w / scale = w and every .5 is an exact tie.
    w = np.array([8.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 6.5, -7.5, 0.49, 4.51, 0, 0, 0, 0], dtype=np.float32)
    q, scales = quantize(w[:, None], 16, "amax8", scale_dtype="float32")
    assert scales[0, 0] == 1.0
    np.testing.assert_array_equal(q[0], [7, 0, 2, 2, 4, 0, -2, -2, 6, -8, 0, 5, 0, 0, 0, 0])


def test_k_padding_uses_code_8() -> None:
    k, n, g = 40, 3, 32  # groups = 2, K_padded = 64: 24 padding elements per row
    w = np.random.default_rng(5).standard_normal((k, n)).astype(np.float32) + 3.0  # no code 8 by accident
    qw = quantize_weight(w, g, "amax8", scale_dtype="float32")
    assert qw.packed.shape == (n, 32) and qw.scales.shape == (n, 2)
    # Elements 40..63 are bytes 20..31; both nibbles are padding, code 8 each.
    assert (qw.packed[:, 20:] == 0x88).all()
    assert not (qw.packed[:, :20] == 0x88).all()
    # The padding does not enter the scale: it is that of elements 32..39 alone.
    np.testing.assert_array_equal(qw.scales[:, 1], np.abs(w[32:]).max(axis=0) / np.float32(8))


@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
def test_dequantized_weight_is_within_half_a_step(group_size: int, rng: np.random.Generator) -> None:
    k, n = 300, 5
    w = rng.standard_normal((k, n)).astype(np.float32)
    qw = quantize_weight(w, group_size, "amax8", scale_dtype="float32")
    deq = reference.dequantize(qw.packed, qw.scales, k, group_size)
    assert deq.shape == (k, n)
    # Round to nearest: |w - deq| <= scale / 2, except where w / scale > 7.5 rounds to 8 and is
    # clamped to 7 (error up to one scale). Float rounding of w / scale allows a relative 1e-6.
    step = np.repeat(qw.scales.astype(np.float64), group_size, axis=1)[:, :k].T
    err = np.abs(w - deq)
    clamped = w > 7.5 * step
    assert (err[~clamped] <= step[~clamped] * 0.5 * (1 + 1e-6)).all()
    assert (err[clamped] <= step[clamped] * (1 + 1e-6)).all()
    np.testing.assert_array_equal(deq[clamped], 7 * step[clamped])


@pytest.mark.parametrize(
    ("w", "group_size", "message"),
    [
        (np.zeros((64, 4), dtype=np.float32), 48, "group_size must be one of"),
        (np.zeros((64, 4), dtype=np.float32), 0, "group_size must be one of"),
        (np.zeros(64, dtype=np.float32), 32, "2-D"),
        (np.zeros((2, 32, 4), dtype=np.float32), 32, "2-D"),
        (np.array([[np.nan], [0.0]], dtype=np.float32), 32, "NaN or infinite"),
        (np.array([[np.inf], [0.0]], dtype=np.float32), 32, "NaN or infinite"),
        (np.array([[-np.inf], [0.0]], dtype=np.float32), 32, "NaN or infinite"),
    ],
)
def test_quantize_validates_its_input(w: np.ndarray, group_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(w, group_size)


def test_quantize_weight_fields() -> None:
    w = np.ones((50, 3), dtype=np.float64)  # float64 input is converted, not rejected
    qw = quantize_weight(w, 16)
    assert (qw.k, qw.n, qw.group_size) == (50, 3, 16)
    assert qw.packed.dtype == np.uint8 and qw.packed.shape == (3, 32)
    # The default scale dtype: int8 fractions of a float16 super-scale per 8 groups (values kept as float32).
    assert qw.scales.dtype == np.float32 and qw.scales.shape == (3, 4)
    assert qw.super_scales is not None and qw.super_scales.dtype == np.float16 and qw.super_scales.shape == (3, 1)


@pytest.mark.parametrize("scale_dtype", ["float16", "int8"])
def test_scales_float16_cannot_hold_stay_float32(scale_dtype: str) -> None:
    """A weight whose (super-)scales overflow float16 (or sink below its precision) keeps float32 scales, all."""
    rng = np.random.default_rng(3)
    for factor in (1e6, 1e-7):
        w = rng.standard_normal((64, 40)).astype(np.float32)
        w[:, 7] *= np.float32(factor)  # one output channel far outside float16's range
        qw = quantize_weight(w, 32, "signed", scale_dtype=scale_dtype)
        assert qw.scales.dtype == np.float32 and qw.super_scales is None, factor
        ref = quantize_weight(w, 32, "signed", scale_dtype="float32")
        np.testing.assert_array_equal(qw.packed, ref.packed)
        np.testing.assert_array_equal(qw.scales, ref.scales)
    plain = quantize_weight(rng.standard_normal((64, 40)).astype(np.float32), 32, "signed", scale_dtype=scale_dtype)
    assert (plain.scales.dtype == np.float16) if scale_dtype == "float16" else (plain.super_scales is not None)


# ---------------------------------------------------------------- an exported node, byte for byte


def test_exported_node_attributes_pinned_byte_for_byte() -> None:
    k, n, g = 20, 2, 16  # groups = 2, K_padded = 32, 16 bytes per row
    w = np.zeros((k, n), dtype=np.float32)
    # Channel 0, group 0: w = (k - 8) / 2 -> max 4, scale 0.5, q = k - 8, code = k.
    w[:16, 0] = (np.arange(16) - 8) * 0.5
    # Channel 0, group 1 (k = 16..19): max 1, scale 0.125; q = 8 -> 7, -8, 2, 0.
    w[16:, 0] = [1.0, -1.0, 0.25, 0.0]
    # Channel 1: group 0 all zero (scale 0, code 8); group 1: only k = 19, -3 -> scale 0.375, q = -8.
    w[19, 1] = -3.0
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "pin",
        [x],
        [y],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    out = export_int4(model, group_size=g, scale_rule="amax8", scale_dtype="float32", quiet=True)
    (node,) = out.graph.node
    assert (node.op_type, node.domain, node.name) == (OP_TYPE, OP_DOMAIN, "mm")
    attrs = {a.name: a for a in node.attribute}
    assert set(attrs) == {"K", "N", "group_size", "packed", "scales", "compute"}
    assert attrs["compute"].s == b"fp32"
    assert (attrs["K"].i, attrs["N"].i, attrs["group_size"].i) == (20, 2, 16)

    packed = attrs["packed"].t
    assert packed.data_type == TensorProto.UINT8 and list(packed.dims) == [2, 16]
    expected_packed = bytes.fromhex(
        # channel 0: codes 0..15 | codes 15, 0, 10, 8 then 12 padding codes 8
        "1032547698badcfe"
        + "0f8a888888888888"
        # channel 1: 16 codes 8 | codes 8, 8, 8, 0 then padding
        + "8888888888888888"
        + "8808888888888888"
    )
    assert numpy_helper.to_array(packed).tobytes() == expected_packed

    scales = attrs["scales"].t
    assert scales.data_type == TensorProto.FLOAT and list(scales.dims) == [2, 2]
    expected_scales = np.array([[0.5, 0.125], [0.0, 0.375]], dtype="<f4").tobytes()
    assert numpy_helper.to_array(scales).astype("<f4").tobytes() == expected_scales
    assert not any(t.name == "w" for t in out.graph.initializer)
    onnx.checker.check_model(out)


def test_quantize_weight_in_column_blocks_is_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    # Big weights are quantized a block of output channels at a time to bound the temporaries.
    import sys

    module = sys.modules["cim_int4.exporter.quantize"]
    w = np.random.default_rng(11).standard_normal((1000, 300)).astype(np.float32)
    whole = quantize_weight(w, 64)
    monkeypatch.setattr(module, "_BLOCK_BYTES", 4096)  # one channel (16 groups of 64) per block
    blocks = quantize_weight(w, 64)
    assert blocks.packed.tobytes() == whole.packed.tobytes()
    assert blocks.scales.tobytes() == whole.scales.tobytes()
