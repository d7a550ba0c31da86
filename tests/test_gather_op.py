"""CimInt4Gather against the NumPy reference, and CimInt4MatMul reading its codes/scales as inputs.

Run under the sanitizer stage of CI too (.ci/run): every bad index must be an ORT error,
never a read outside the table.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cim_int4.ops import reference
from conftest import KERNEL_ENV, available_kernels, op_attributes, quantized
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import make_session
from cim_int4.contract import GATHER_OP_TYPE, OP_DOMAIN, OP_TYPE, OP_VERSION


def table(rows: int, k: int, group_size: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random codes (every nibble value, padding code 8) and signed scales of a [rows, k] int4 table."""
    rng = np.random.default_rng(seed)
    groups = -(-k // group_size)
    codes = rng.integers(0, 16, (rows, groups * group_size), dtype=np.uint8)
    codes[:, k:] = 8
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = (rng.standard_normal((rows, groups)) * 0.02).astype(np.float32)
    return packed, scales


def gather_model(
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    group_size: int = 32,
    index_type: int = TensorProto.INT64,
    index_shape: list | None = None,
    as_inputs: tuple[str, ...] = (),
) -> onnx.ModelProto:
    """One CimInt4Gather; the table is initializers unless named in ``as_inputs`` (then graph inputs)."""
    node = helper.make_node(GATHER_OP_TYPE, ["P", "ids", "S"], ["Y"], name="embed", domain=OP_DOMAIN, K=k,
                            group_size=group_size)
    inputs = [helper.make_tensor_value_info("ids", index_type, index_shape)]
    inits = []
    for name, value in (("P", packed), ("S", scales)):
        if name in as_inputs:
            elem = TensorProto.UINT8 if value.dtype == np.uint8 else TensorProto.FLOAT
            inputs.append(helper.make_tensor_value_info(name, elem, [None] * value.ndim))
        else:
            inits.append(numpy_helper.from_array(value, name))
    graph = helper.make_graph([node], "gather", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializer=inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)], ir_version=8
    )


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize(
    ("rows", "k", "group_size"),
    [(1, 16, 16), (7, 32, 32), (50, 72, 32), (33, 33, 32), (9, 640, 32), (5, 100, 64), (3, 300, 128), (4, 257, 256)],
)
@pytest.mark.parametrize("index_type", [TensorProto.INT64, TensorProto.INT32])
def test_rows_match_the_reference_bit_for_bit(rows: int, k: int, group_size: int, index_type: int) -> None:
    packed, scales = table(rows, k, group_size, seed=rows + k)
    session = make_session(gather_model(packed, scales, k, group_size, index_type), threads=1)
    dtype = np.int64 if index_type == TensorProto.INT64 else np.int32
    rng = np.random.default_rng(k)
    for shape in [(), (1,), (1, 1), (2, 3), (1, 40)]:
        ids = rng.integers(-rows, rows, shape).astype(dtype)  # negative ones count from the end
        y = session.run(None, {"ids": ids})[0]
        assert y.shape == (*shape, k)
        np.testing.assert_array_equal(bits(y), bits(reference.gather(packed, scales, ids, k, group_size)))


def test_long_prompts_split_over_threads_and_match() -> None:
    packed, scales = table(300, 640)
    ids = np.random.default_rng(1).integers(0, 300, (2, 500)).astype(np.int64)
    for threads in (1, 2):
        y = make_session(gather_model(packed, scales, 640), threads=threads).run(None, {"ids": ids})[0]
        np.testing.assert_array_equal(bits(y), bits(reference.gather(packed, scales, ids, 640, 32)))


def test_empty_indices_give_an_empty_output() -> None:
    packed, scales = table(4, 64)
    y = make_session(gather_model(packed, scales, 64), threads=1).run(None, {"ids": np.zeros((2, 0), np.int64)})[0]
    assert y.shape == (2, 0, 64)


def test_the_blocked_layout_of_matmulnbits_reads_the_same() -> None:
    # [rows, groups, group_size/2]: the genai builder's (and MatMulNBits') shape of the same bytes.
    packed, scales = table(10, 96)
    ids = np.array([[3, -1, 0]], np.int64)
    flat = make_session(gather_model(packed, scales, 96), threads=1).run(None, {"ids": ids})[0]
    blocked = make_session(gather_model(packed.reshape(10, 3, 16), scales, 96), threads=1).run(None, {"ids": ids})[0]
    np.testing.assert_array_equal(bits(flat), bits(blocked))


@pytest.mark.parametrize("bad", [10, -11, 2**40, -(2**40)])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_an_index_out_of_range_is_an_error_naming_the_node(bad: int, dtype: type) -> None:
    if dtype is np.int32 and abs(bad) > 2**31:
        pytest.skip("not an int32")
    packed, scales = table(10, 64)
    session = make_session(gather_model(packed, scales, 64, 32, helper.np_dtype_to_tensor_dtype(np.dtype(dtype))),
                           threads=1)
    with pytest.raises(Exception, match=rf"{GATHER_OP_TYPE} node 'embed': indices element out of data bounds, "
                                        rf"idx={bad} must be within the inclusive range \[-10,9\]"):
        session.run(None, {"ids": np.array([[0, bad, 1]], dtype)})


def test_float_indices_are_refused() -> None:
    packed, scales = table(10, 64)
    with pytest.raises(Exception, match="indices"):
        make_session(gather_model(packed, scales, 64, 32, TensorProto.FLOAT), threads=1).run(
            None, {"ids": np.zeros((1, 2), np.float32)}
        )


@pytest.mark.parametrize(
    ("packed_shape", "scales_shape", "k", "match"),
    [
        ((10, 16), (10, 1), 64, "input 'packed' has shape \\[10, 16\\]"),
        ((10, 32), (10, 3), 64, "input 'scales' is ONNX element type 1 with shape \\[10, 3\\]"),
        ((10, 32), (9, 2), 64, "input 'scales'"),
    ],
)
def test_a_table_of_the_wrong_shape_fails_at_load(packed_shape: tuple, scales_shape: tuple, k: int, match: str) -> None:
    packed = np.full(packed_shape, 0x88, np.uint8)
    scales = np.ones(scales_shape, np.float32)
    with pytest.raises(Exception, match=f"{GATHER_OP_TYPE} node 'embed': {match}"):
        make_session(gather_model(packed, scales, k), threads=1)


def test_a_table_fed_at_run_time_is_checked_per_call() -> None:
    packed, scales = table(10, 64)
    session = make_session(gather_model(packed, scales, 64, as_inputs=("P", "S")), threads=1)
    ids = np.array([[2, -3]], np.int64)
    y = session.run(None, {"ids": ids, "P": packed, "S": scales})[0]
    np.testing.assert_array_equal(bits(y), bits(reference.gather(packed, scales, ids, 64, 32)))
    with pytest.raises(Exception, match="input 'packed' has shape \\[10, 16\\]"):
        session.run(None, {"ids": ids, "P": packed[:, :16].copy(), "S": scales})


@pytest.mark.parametrize("attribute", ["K", "group_size"])
def test_bad_attributes_fail_at_load(attribute: str) -> None:
    packed, scales = table(10, 64)
    model = gather_model(packed, scales, 64)
    for a in model.graph.node[0].attribute:
        if a.name == attribute:
            a.i = 0 if attribute == "K" else 48
    with pytest.raises(Exception, match=f"attribute '{attribute}'"):
        make_session(model, threads=1)


# CimInt4MatMul with its codes and scales as constant-initializer inputs (a table shared with a gather).


def matmul_model(k: int, n: int, attrs: dict, inputs: tuple[str, ...], inits: list, a_shape: list) -> onnx.ModelProto:
    node = helper.make_node(OP_TYPE, ["A", *inputs], ["Y"], name="head", domain=OP_DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], "head", [helper.make_tensor_value_info("A", TensorProto.FLOAT, a_shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializer=inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)], ir_version=8
    )


def input_form(qw, bias=None, blocked: bool = False, **overrides: object) -> onnx.ModelProto:  # noqa: ANN001
    attrs = op_attributes(qw, bias, packed=None, scales=None, **overrides)
    packed = qw.packed.reshape(qw.n, -1, qw.group_size // 2) if blocked else qw.packed
    inits = [numpy_helper.from_array(packed, "P"), numpy_helper.from_array(qw.scales, "S")]
    return matmul_model(qw.k, qw.n, attrs, ("P", "S"), inits, ["m", qw.k])


@pytest.mark.parametrize(("k", "n"), [(64, 1000), (72, 50), (640, 33)])
@pytest.mark.parametrize("compute", ["fp32", "int8"])
@pytest.mark.parametrize("blocked", [False, True])
def test_matmul_with_table_inputs_equals_the_attribute_form(k: int, n: int, compute: str, blocked: bool) -> None:
    qw = quantized(k, n)
    bias = np.linspace(-1, 1, n, dtype=np.float32)
    a = np.random.default_rng(2).standard_normal((3, k)).astype(np.float32)
    by_attrs = matmul_model(k, n, op_attributes(qw, bias, compute=compute), (), [], ["m", k])
    by_inputs = input_form(qw, bias, blocked, compute=compute)
    for kernel in available_kernels():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(KERNEL_ENV, kernel)
            want = make_session(by_attrs, threads=1).run(None, {"A": a})[0]
            got = make_session(by_inputs, threads=2).run(None, {"A": a})[0]
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=kernel)


def test_matmul_refuses_both_attributes_and_inputs() -> None:
    qw = quantized(64, 16)
    inits = [numpy_helper.from_array(qw.packed, "P"), numpy_helper.from_array(qw.scales, "S")]
    model = matmul_model(64, 16, op_attributes(qw), ("P", "S"), inits, ["m", 64])
    with pytest.raises(Exception, match="also attributes of those names; give one or the other"):
        make_session(model, threads=1)


def test_matmul_table_inputs_must_be_constant() -> None:
    qw = quantized(64, 16)
    model = input_form(qw)
    scales_type = helper.np_dtype_to_tensor_dtype(qw.scales.dtype)
    model.graph.input.append(helper.make_tensor_value_info("S", scales_type, [16, 2]))  # now overridable
    with pytest.raises(Exception, match="input 2 'scales' must be a constant initializer"):
        make_session(model, threads=1)


def test_matmul_table_inputs_of_the_wrong_shape_fail_at_load() -> None:
    qw = quantized(64, 16)
    model = input_form(qw)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones((16, 3), qw.scales.dtype), "S"))
    with pytest.raises(Exception, match=rf"{OP_TYPE} node 'head': input 'scales' has shape \[16, 3\]"):
        make_session(model, threads=1)


def test_matmul_with_two_inputs_is_refused() -> None:
    qw = quantized(64, 16)
    attrs = op_attributes(qw, packed=None, scales=None)
    model = matmul_model(64, 16, attrs, ("P",), [numpy_helper.from_array(qw.packed, "P")], ["m", 64])
    with pytest.raises(Exception, match="has 2 inputs, expected 1"):
        make_session(model, threads=1)
