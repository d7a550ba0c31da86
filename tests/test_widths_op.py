"""Every code width, grid and scale dtype (float32, float16, int8 with super-scales) through ORT on every path.

CimInt4MatMul (attribute and input forms, both compute modes) against ``reference.emulate(bits=..., grid=...)``
and CimInt4Gather against ``reference.gather`` (bit for bit); bad widths, scale dtypes and
shapes refused with one line naming node and attribute. Run under the sanitizer stage of CI too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from cim_int4.ops import reference
from cim_int4.ops.tuning import VARIANT_ENV
from conftest import KERNEL_ENV, U32, available_kernels, op_model
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import make_session
from cim_int4.contract import (
    GATHER_OP_TYPE,
    GRID_BITS,
    OP_DOMAIN,
    OP_TYPE,
    OP_VERSION,
    SUPPORTED_BITS,
    groups_of,
    levels,
    pack,
    scale_values,
    supers_of,
)

KERNELS = available_kernels()
SCALE_DTYPES = (np.float32, np.float16, np.int8)
SCALE_IDS = ["f32", "f16", "i8"]
# (bits, grid): every width on the uniform grid, and the widths that have the normal grid on it.
WIDTHS = [(b, "uniform") for b in SUPPORTED_BITS] + [(b, "normal") for b in GRID_BITS]
WIDTH_IDS = [f"{b}" if g == "uniform" else f"{b}{g}" for b, g in WIDTHS]


@dataclass(frozen=True)
class Table:
    """Codes of one width and their scales, in the attribute format (rows = output channels)."""

    k: int
    n: int
    group_size: int
    bits: int
    packed: np.ndarray
    scales: np.ndarray
    super_scales: np.ndarray | None = None  # int8 scales' float16 super-scales
    grid: str = "uniform"

    @property
    def values(self) -> np.ndarray:
        """The scales the op computes with (float32)."""
        return scale_values(self.scales, self.super_scales)

    def attributes(self, **extra: object) -> dict[str, object]:
        tensors = {"packed": self.packed, "scales": self.scales}
        if self.super_scales is not None:
            tensors["super_scales"] = self.super_scales
        return {
            "K": self.k,
            "N": self.n,
            "group_size": self.group_size,
            "bits": self.bits,
            **({"grid": self.grid} if self.grid != "uniform" else {}),
            **{name: numpy_helper.from_array(value, name) for name, value in tensors.items()},
            **extra,
        }

    def initializers(self) -> list[onnx.TensorProto]:
        """Codes, scales (and super-scales) as initializers P, S (and D) of the input form."""
        arrays = [(self.packed, "P"), (self.scales, "S")]
        if self.super_scales is not None:
            arrays.append((self.super_scales, "D"))
        return [numpy_helper.from_array(value, name) for value, name in arrays]

    def inputs(self) -> list[str]:
        return ["P", "S"] + (["D"] if self.super_scales is not None else [])


def table(
    k: int, n: int, group_size: int, bits: int, scale_dtype: type, seed: int = 0, grid: str = "uniform"
) -> Table:
    """Random codes covering the whole range of the width and grid (padding: code 2^(bits-1)) and signed scales."""
    rng = np.random.default_rng([seed, bits, k, n])
    lv = levels(bits, grid)
    q = np.zeros((n, groups_of(k, group_size) * group_size), np.int16)
    q[:, :k] = lv[rng.integers(0, len(lv), (n, k))]
    q[0, : min(k, 2)] = (lv[0], lv[-1])[: min(k, 2)]  # the extreme codes
    groups = q.shape[1] // group_size
    if scale_dtype is np.int8:  # int8 over the whole range (-128 too), float16 super-scales of both signs, one zero
        scales = rng.integers(-128, 128, (n, groups)).astype(np.int8)
        supers = (rng.standard_normal((n, supers_of(groups))) * 0.05).astype(np.float16)
        supers[-1, 0] = 0
        return Table(k, n, group_size, bits, pack(q, bits, grid, pad_from=k), scales, supers, grid)
    scales = (rng.standard_normal((n, groups)) * 0.05).astype(scale_dtype)
    return Table(k, n, group_size, bits, pack(q, bits, grid, pad_from=k), scales, grid=grid)


def emulated(t: Table, a: np.ndarray, bias: np.ndarray | None, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The emulation of ``mode`` and a few ulps of each output's magnitude (its fma's rare double rounding)."""
    want = reference.emulate(a, t.packed, t.values, t.k, t.group_size, bias, mode, t.bits, t.grid)
    w = reference.dequantize(t.packed, t.values, t.k, t.group_size, t.bits, grid=t.grid)
    mag = np.abs(a.astype(np.float64)) @ np.abs(w) + (0 if bias is None else np.abs(bias))
    return want, 4 * U32 * mag + 1e-37


def run(model: onnx.ModelProto, a: np.ndarray, threads: int = 1) -> np.ndarray:
    return make_session(model, threads=threads).run(None, {"A0": a})[0]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("width", WIDTHS, ids=WIDTH_IDS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=SCALE_IDS)
@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_widths_match_the_emulation(
    kernel: str, width: tuple[int, str], scale_dtype: type, mode: str, monkeypatch
) -> None:
    monkeypatch.setenv(KERNEL_ENV, kernel)
    bits, grid = width
    rng = np.random.default_rng(bits)
    # K with a tail in the last group (and one chunk of 16 codes), N off the 16-channel tile
    # and the 64-channel strip; M = 1 (decode) and prefill's row blocks.
    for k, n, group_size in [(32 * 3 + 5, 37, 32), (16, 70, 16), (300, 17, 128), (7, 1, 32), (16 * 17, 20, 16)]:
        t = table(k, n, group_size, bits, scale_dtype, grid=grid)
        bias = rng.standard_normal(n).astype(np.float32)
        a = rng.standard_normal((13, k), dtype=np.float32)
        model = op_model(t.attributes(compute=mode, bias=numpy_helper.from_array(bias, "bias")), [["M", k]])
        y = run(model, a, threads=2)
        assert run(model, a[:1]).tobytes() == y[:1].tobytes(), "M=1 (decode) differs from the batch's row"
        want, tol = emulated(t, a, bias, mode)
        err = np.abs(y.astype(np.float64) - want)
        assert (err <= tol).all(), f"K={k} N={n} g={group_size}: max error {err.max():.3g}"


@pytest.mark.parametrize("width", WIDTHS, ids=WIDTH_IDS)
@pytest.mark.parametrize("scale_dtype", [np.float16, np.int8], ids=["f16", "i8"])
def test_every_path_gives_the_same_bits(width: tuple[int, str], scale_dtype: type) -> None:
    t = table(300, 45, 32, width[0], scale_dtype, grid=width[1])
    a = np.random.default_rng(1).standard_normal((3, 300), dtype=np.float32)
    for mode in ("fp32", "int8"):
        model = op_model(t.attributes(compute=mode), [["M", 300]])
        outs = {}
        for kernel in KERNELS:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(KERNEL_ENV, kernel)
                outs[kernel] = run(model, a).tobytes()
        assert len(set(outs.values())) == 1, f"{mode}: paths differ"


@pytest.mark.parametrize("width", WIDTHS, ids=WIDTH_IDS)
def test_two_strips_at_once_give_the_same_bits(width: tuple[int, str], monkeypatch) -> None:
    """A tuned variant that reads two strips at once (n4x2) takes the other widths with it.

    KernelTable::matmul_for runs every width's int8 decode over two strips when the 4-bit
    variant does; N = 600 is short strips paired across a window, then one alone and a tile.
    """
    t = table(300, 600, 32, width[0], np.int8, grid=width[1])
    a = np.random.default_rng(2).standard_normal((1, 300), dtype=np.float32)
    model = op_model(t.attributes(compute="int8"), [["M", 300]])
    monkeypatch.setenv(KERNEL_ENV, "portable")
    want = run(model, a).tobytes()
    monkeypatch.setenv(VARIANT_ENV, "n4x2-pf2k")  # a row of every SIMD table, not of the portable one
    for kernel in KERNELS:
        if kernel == "portable":
            continue
        monkeypatch.setenv(KERNEL_ENV, kernel)
        assert run(model, a).tobytes() == want, f"{kernel}: n4x2-pf2k's {width[0]}-bit decode differs from portable"


def input_form(t: Table, **attrs: object) -> onnx.ModelProto:
    """The same node with codes and scales as constant-initializer inputs (a tied LM head)."""
    node = helper.make_node(OP_TYPE, ["A0", *t.inputs()], ["Y0"], name="head", domain=OP_DOMAIN, K=t.k, N=t.n,
                            group_size=t.group_size, bits=t.bits, grid=t.grid, **attrs)
    graph = helper.make_graph(
        [node], "head", [helper.make_tensor_value_info("A0", TensorProto.FLOAT, ["m", t.k])],
        [helper.make_tensor_value_info("Y0", TensorProto.FLOAT, None)],
        initializer=t.initializers(),
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)], ir_version=8
    )


@pytest.mark.parametrize("width", [(8, "uniform"), (3, "uniform"), (4, "uniform"), (3, "normal")], ids=str)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=SCALE_IDS)
def test_table_inputs_equal_the_attribute_form(width: tuple[int, str], scale_dtype: type) -> None:
    t = table(96, 40, 32, width[0], scale_dtype, grid=width[1])
    a = np.random.default_rng(3).standard_normal((2, 96)).astype(np.float32)
    for mode in ("fp32", "int8"):
        want = run(op_model(t.attributes(compute=mode), [["M", 96]]), a)
        got = run(input_form(t, compute=mode), a)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def gather_model(t: Table) -> onnx.ModelProto:
    node = helper.make_node(GATHER_OP_TYPE, ["P", "ids", *t.inputs()[1:]], ["Y"], name="embed", domain=OP_DOMAIN,
                            K=t.k, group_size=t.group_size, bits=t.bits, grid=t.grid)
    graph = helper.make_graph(
        [node], "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        initializer=t.initializers(),
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)], ir_version=8
    )


@pytest.mark.parametrize("width", WIDTHS, ids=WIDTH_IDS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=SCALE_IDS)
def test_gather_matches_the_reference_bit_for_bit(width: tuple[int, str], scale_dtype: type) -> None:
    bits, grid = width
    for k, group_size in [(64, 32), (77, 16), (300, 128), (16 * 17, 16)]:
        t = table(k, 50, group_size, bits, scale_dtype, grid=grid)
        ids = np.array([[49, 0, 7], [-1, 3, 3]], np.int64)
        (y,) = make_session(gather_model(t), threads=1).run(None, {"ids": ids})
        want = reference.gather(t.packed, t.values, ids, k, group_size, bits, grid)
        np.testing.assert_array_equal(y.view(np.uint32), want.astype(np.float32).view(np.uint32))


# --- refused, with one line naming node and attribute ---------------------------------------------


def one_line_error(model: onnx.ModelProto, *patterns: str) -> None:
    with pytest.raises(Exception) as info:  # noqa: PT011 - ORT raises its own exception classes
        make_session(model, threads=1)
    message = str(info.value).strip().splitlines()[-1]
    for pattern in patterns:
        assert pattern in message, message


@pytest.mark.parametrize("bad", [0, 1, 7, 9, 16, -4])
def test_unsupported_bits_are_refused(bad: int) -> None:
    t = table(64, 8, 32, 4, np.float32)
    one_line_error(op_model(t.attributes(bits=bad), [["M", 64]]), "node 'op0'", "'bits'", "2, 3, 4, 5, 6, 8")
    one_line_error(gather_model(Table(64, 8, 32, bad, t.packed, t.scales)), "node 'embed'", "'bits'")


def test_bits_of_the_wrong_type_are_refused() -> None:
    t = table(64, 8, 32, 4, np.float32)
    one_line_error(op_model(t.attributes(bits="4"), [["M", 64]]), "node 'op0'", "'bits'")


@pytest.mark.parametrize(("data_bits", "node_bits"), [(4, 8), (8, 4), (3, 5), (6, 2)])
def test_codes_of_another_width_are_refused_naming_packed(data_bits: int, node_bits: int) -> None:
    t = table(64, 8, 32, data_bits, np.float16)
    one_line_error(op_model(t.attributes(bits=node_bits), [["M", 64]]), "node 'op0'", "'packed'", "bits=")
    wrong = Table(64, 8, 32, node_bits, t.packed, t.scales)
    one_line_error(input_form(wrong), "node 'head'", "'packed'")
    one_line_error(gather_model(wrong), "node 'embed'", "'packed'")


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint16])
def test_other_scale_dtypes_are_refused_naming_scales(dtype: type) -> None:
    t = table(64, 8, 32, 5, np.float32)
    bad = Table(64, 8, 32, 5, t.packed, t.scales.astype(dtype))
    one_line_error(op_model(bad.attributes(), [["M", 64]]), "node 'op0'", "'scales'", "float32, float16 or int8")
    one_line_error(input_form(bad), "node 'head'", "'scales'", "float32, float16 or int8")
    with pytest.raises(Exception, match="'scales'.*float32, float16 or int8"):
        make_session(gather_model(bad), threads=1).run(None, {"ids": np.array([0], np.int64)})


@pytest.mark.parametrize("bits", [2, 8])
def test_a_float16_scale_that_is_not_finite_is_refused(bits: int) -> None:
    t = table(64, 8, 32, bits, np.float16)
    t.scales[3, 1] = np.inf
    one_line_error(op_model(t.attributes(), [["M", 64]]), "node 'op0'", "'scales'", "row 3, group 1")


def test_int8_scales_without_super_scales_are_refused() -> None:
    t = table(300, 8, 32, 4, np.int8)
    alone = Table(300, 8, 32, 4, t.packed, t.scales)
    one_line_error(op_model(alone.attributes(), [["M", 300]]), "node 'op0'", "int8 'scales'", "'super_scales'",
                   "[8, 2]")
    one_line_error(input_form(alone), "node 'head'", "int8 'scales'", "'super_scales'")
    with pytest.raises(Exception, match="int8 'scales' but no input 'super_scales'"):
        make_session(gather_model(alone), threads=1).run(None, {"ids": np.array([0], np.int64)})


def test_an_empty_super_scales_input_of_a_gather_is_absent() -> None:
    t = table(300, 8, 32, 4, np.int8)
    node = helper.make_node(GATHER_OP_TYPE, ["P", "ids", "S", ""], ["Y"], name="embed", domain=OP_DOMAIN, K=t.k,
                            group_size=t.group_size, bits=t.bits)
    graph = helper.make_graph(
        [node], "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializer=t.initializers()[:2],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)], ir_version=8
    )
    with pytest.raises(Exception, match="int8 'scales' but no input 'super_scales'"):
        make_session(model, threads=1).run(None, {"ids": np.array([0], np.int64)})


def test_super_scales_with_float_scales_are_refused() -> None:
    t = table(300, 8, 32, 4, np.int8)
    wrong = Table(300, 8, 32, 4, t.packed, t.values.astype(np.float16), t.super_scales)
    one_line_error(op_model(wrong.attributes(), [["M", 300]]), "node 'op0'", "'super_scales'", "only int8 'scales'")


@pytest.mark.parametrize("shape", [(8, 1), (8, 3), (4, 4)])
def test_super_scales_of_the_wrong_shape_are_refused(shape: tuple[int, ...]) -> None:
    t = table(300, 8, 32, 4, np.int8)
    wrong = Table(300, 8, 32, 4, t.packed, t.scales, np.zeros(shape, np.float16))
    one_line_error(op_model(wrong.attributes(), [["M", 300]]), "node 'op0'", "'super_scales'", "[8, 2]")
    one_line_error(input_form(wrong), "node 'head'", "'super_scales'")


def test_a_super_scale_that_is_not_finite_is_refused() -> None:
    t = table(300, 8, 32, 4, np.int8)
    t.super_scales[5, 1] = np.nan
    one_line_error(op_model(t.attributes(), [["M", 300]]), "node 'op0'", "'super_scales'", "row 5, super-block 1")


@pytest.mark.parametrize("bits", [3, 6, 8])
def test_a_padding_code_other_than_q0_is_refused(bits: int) -> None:
    from cim_int4.contract import pack_codes, unpack_codes

    t = table(40, 8, 32, bits, np.float32)
    codes = unpack_codes(t.packed, bits)
    codes[2, 50] = 0
    bad = Table(40, 8, 32, bits, pack_codes(codes, bits), t.scales)
    one_line_error(op_model(bad.attributes(), [["M", 40]]), "node 'op0'", "'packed'", "k=50")


# --- the reference backend (onnxruntime-extensions) reads the same widths and scale dtypes ---------


@pytest.mark.parametrize("width", WIDTHS, ids=WIDTH_IDS)
@pytest.mark.parametrize("scale_dtype", [np.float16, np.int8], ids=["f16", "i8"])
def test_reference_backend_gives_the_library_bits(width: tuple[int, str], scale_dtype: type) -> None:
    pytest.importorskip("onnxruntime_extensions")
    bits, grid = width
    t = table(100, 20, 32, bits, scale_dtype, grid=grid)
    a = np.random.default_rng(4).standard_normal((3, 100)).astype(np.float32)
    for mode in ("fp32", "int8"):
        model = op_model(t.attributes(compute=mode), [["M", 100]])
        ours = run(model, a)
        ref = make_session(model, threads=1, backend="reference").run(None, {"A0": a})[0]
        want, tol = emulated(t, a, None, mode)
        np.testing.assert_array_equal(ref, want.astype(np.float32))
        assert (np.abs(ours.astype(np.float64) - want) <= tol).all()
    gather = make_session(gather_model(t), threads=1, backend="reference")
    ids = np.array([19, 0, 4], np.int64)
    want = reference.gather(t.packed, t.values, ids, 100, 32, bits, grid)
    np.testing.assert_array_equal(gather.run(None, {"ids": ids})[0], want)


# --- grids: refused where a width has none, and the grid's largest level bounds the scales --------


@pytest.mark.parametrize(("bits", "grid", "words"), [(4, "normal", "'bits' 2, 3"), (3, "lloyd", "expected one of")])
def test_a_grid_the_width_lacks_is_refused(bits: int, grid: str, words: str) -> None:
    t = table(64, 8, 32, bits, np.float32)
    bad = Table(64, 8, 32, bits, t.packed, t.scales, grid=grid)
    one_line_error(op_model(bad.attributes(), [["M", 64]]), "node 'op0'", "attribute 'grid'", words)
    one_line_error(gather_model(bad), "node 'embed'", "attribute 'grid'", words)


def test_the_normal_grid_bounds_scales_by_its_largest_level() -> None:
    t = table(64, 8, 32, 3, np.float32)
    t.scales[3, 1] = np.float32(np.finfo(np.float32).max / 6)  # 4 * |scale| finite, 8 * |scale| not
    make_session(op_model(t.attributes(), [["M", 64]]), threads=1)  # uniform: largest |q| 4
    normal = Table(64, 8, 32, 3, t.packed, t.scales, grid="normal")
    one_line_error(op_model(normal.attributes(), [["M", 64]]), "node 'op0'", "'scales'", "8*|scale|")
