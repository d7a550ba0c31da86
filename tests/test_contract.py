"""cim_int4.contract: the code format byte for byte, Int4Node written and read back, its one-line errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cim_int4.exporter import (
    pack,
    quantize_weight,
)
from cim_int4.ops import reference
from onnx import helper, numpy_helper

from cim_int4.contract import (
    ATTRIBUTES,
    GATHER,
    GATHER_OP_TYPE,
    MATMUL,
    MATMUL_SHARED,
    OP_DOMAIN,
    OP_TYPE,
    SUPPORTED_BITS,
    Int4Node,
    SharedInt4Node,
    check_compute,
    check_group_size,
    code_offset,
    q_range,
    unpack,
    unpack_codes,
)

# ---------------------------------------------------------------- pack / unpack


def test_pack_unpack_round_trip(rng: np.random.Generator) -> None:
    q = rng.integers(-8, 8, size=(5, 64)).astype(np.int8)
    packed = pack(q)
    assert packed.dtype == np.uint8 and packed.shape == (5, 32)
    np.testing.assert_array_equal(reference.unpack(packed), q)
    # Every code value occurs, so no nibble value is special-cased by accident.
    assert set(np.unique(q)) == set(range(-8, 8))


def test_nibble_order_pinned_byte_for_byte() -> None:
    # code = q + 8; byte b holds k = 2b in the low nibble and k = 2b + 1 in the high one.
    q = np.array([[-8, 7, 0, 1, -1, 3, 5, -6]], dtype=np.int8)
    # codes 0,15 | 8,9 | 7,11 | 13,2  ->  0xF0, 0x98, 0xB7, 0x2D
    assert pack(q).tobytes() == bytes([0xF0, 0x98, 0xB7, 0x2D])
    np.testing.assert_array_equal(reference.unpack(np.array([[0xF0, 0x98, 0xB7, 0x2D]], dtype=np.uint8)), q)


def test_pack_rows_are_output_channels() -> None:
    q = np.array([[0, 0], [-8, 7]], dtype=np.int8)
    assert pack(q).tobytes() == bytes([0x88, 0xF0])


@pytest.mark.parametrize(
    ("q", "message"),
    [
        (np.zeros((2, 3), dtype=np.int8), "a multiple of 8"),
        (np.zeros(4, dtype=np.int8), "a multiple of 8"),
        (np.array([[8, 0]], dtype=np.int8), "-8..7"),
        (np.array([[0, -9]], dtype=np.int8), "-8..7"),
    ],
)
def test_pack_rejects_bad_codes(q: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack(q)



# ---------------------------------------------------------------- Int4Node


def _node(**changes: object) -> Int4Node:
    qw = quantize_weight(np.random.default_rng(0).standard_normal((40, 3)).astype(np.float32), 32)
    fields = dict(
        name="mm", inputs=("x",), outputs=("y",), k=qw.k, n=qw.n, group_size=32,
        packed=qw.packed, scales=qw.scales, bias=np.ones(3, np.float32), compute="int8",
    )
    fields.update(changes)
    return Int4Node(**fields)  # type: ignore[arg-type]


def test_to_node_then_from_node_gives_the_same_values() -> None:
    written = _node()
    node = written.to_node()
    assert (node.op_type, node.domain, node.name) == (OP_TYPE, OP_DOMAIN, "mm")
    # 4 bits: no attribute; not gated: none either; float scales: no super-scales
    assert {a.name for a in node.attribute} == {a.name for a in ATTRIBUTES} - {"bits", "grid", "gated", "super_scales"}
    read = Int4Node.from_node(node)
    got = (read.k, read.n, read.group_size, read.compute, read.inputs, read.outputs)
    assert got == (40, 3, 32, "int8", ("x",), ("y",))
    for name in ("packed", "scales", "bias"):
        assert getattr(read, name).tobytes() == getattr(written, name).tobytes()


def test_absent_optional_attributes_read_as_their_defaults() -> None:
    node = _node(bias=None, compute=None).to_node()
    assert {a.name for a in node.attribute} == {"K", "N", "group_size", "packed", "scales"}
    node.attribute.remove(next(a for a in node.attribute if a.name == "group_size"))
    read = Int4Node.from_node(node)
    assert (read.group_size, read.compute, read.bias, read.bits) == (32, "fp32", None, 4)


def _without(node: onnx.NodeProto, name: str) -> onnx.NodeProto:
    node.attribute.remove(next(a for a in node.attribute if a.name == name))
    return node


def _set(node: onnx.NodeProto, name: str, value: object) -> onnx.NodeProto:
    if any(a.name == name for a in node.attribute):
        _without(node, name)
    node.attribute.append(helper.make_attribute(name, value))
    return node


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (lambda n: _without(n, "K"), "attribute 'K' is missing or not an int"),
        (lambda n: _set(n, "N", 0), "attribute 'N' is 0, expected >= 1"),
        (lambda n: _set(n, "group_size", 48), "attribute 'group_size' is 48, expected one of"),
        (lambda n: _set(n, "compute", "int4"), "attribute 'compute' is 'int4'"),
        (lambda n: _without(n, "packed"), "attribute 'packed' is missing or not a tensor"),
        (lambda n: _set(n, "scales", numpy_helper.from_array(np.ones((3, 2), np.float64))), "element type float64"),
        (lambda n: _set(n, "bits", 7), "attribute 'bits' is 7, expected one of"),
        (lambda n: _set(n, "bits", 8), "attribute 'packed' has shape"),
        (lambda n: _set(n, "bias", numpy_helper.from_array(np.ones(4, np.float32))), "attribute 'bias' has shape"),
        (lambda n: _set(n, "packed", numpy_helper.from_array(np.full((3, 32), 0x77, np.uint8))), "padding code"),
        (lambda n: _set(n, "scales", numpy_helper.from_array(np.full((3, 2), np.inf, np.float32))), "not finite"),
    ],
)
def test_from_node_names_the_node_and_attribute_in_one_line(broken, message: str) -> None:
    node = broken(_node().to_node())
    with pytest.raises(ValueError, match=message) as info:
        Int4Node.from_node(node)
    assert str(info.value).startswith(f"{OP_TYPE} node 'mm': ") and "\n" not in str(info.value)


def test_unpack_codes_is_q_plus_8() -> None:
    q = np.array([[-8, 7, 0, 1]], dtype=np.int8)
    np.testing.assert_array_equal(unpack_codes(pack(q)), q + 8)


# One row of 16 codes per width, spelled out bit by bit: the contract's byte order.
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_each_width_packs_each_row_as_a_little_endian_bit_stream(bits: int) -> None:
    lo, hi = q_range(bits)
    q = np.clip([[lo, hi, 0, 1, -1, lo + 1, hi - 1, 0, 1, 2, -2, lo, hi, 0, 0, 1]], lo, hi).astype(np.int8)
    stream = "".join(format(int(c), f"0{bits}b")[::-1] for c in q[0].astype(int) + code_offset(bits))
    expected = [int(stream[i : i + 8][::-1], 2) for i in range(0, len(stream), 8)]
    packed = pack(q, bits)
    assert packed.tolist() == [expected]
    np.testing.assert_array_equal(unpack(packed, bits), q)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_round_trips_every_code_of_a_width(bits: int) -> None:
    lo, hi = q_range(bits)
    q = np.random.default_rng(bits).integers(lo, hi + 1, size=(7, 256)).astype(np.int8)
    np.testing.assert_array_equal(unpack(pack(q, bits), bits), q)
    with pytest.raises(ValueError, match="q values must lie in"):
        pack(np.full((1, 16), hi + 1), bits)


def test_a_node_of_another_width_with_float16_scales_reads_back() -> None:
    q = np.random.default_rng(0).integers(-4, 4, size=(3, 64)).astype(np.int8)
    q[:, 40:] = 0
    node = Int4Node("mm", ("a",), ("y",), 40, 3, 32, pack(q, 3), np.ones((3, 2), np.float16), bits=3)
    proto = node.to_node()
    assert [a.i for a in proto.attribute if a.name == "bits"] == [3]
    back = Int4Node.from_node(proto)
    assert back.bits == 3 and back.scales.dtype == np.float16
    np.testing.assert_array_equal(unpack(back.packed, 3), q)
    # 4 bits is the default: no attribute, so int4 files stay as they were.
    assert "bits" not in [a.name for a in _node().to_node().attribute]


def test_checks_name_what_they_expected() -> None:
    with pytest.raises(ValueError, match="group_size must be one of"):
        check_group_size(48)
    with pytest.raises(ValueError, match="compute must be one of"):
        check_compute("int4")
    assert MATMUL.attribute("packed").dtypes == ("uint8",)


def test_shared_nodes_name_their_tensors_as_inputs_and_take_only_their_attributes() -> None:
    # The tied LM head and the int4 embedding read one copy of the codes and scales: as inputs, never attributes.
    bias = np.arange(3, dtype=np.float32)
    head = SharedInt4Node("head", ("x", "p", "s"), ("y",), 64, 32, MATMUL_SHARED, n=3, bias=bias, compute="int8")
    node = head.to_node()
    assert (node.op_type, node.domain, list(node.input)) == (OP_TYPE, OP_DOMAIN, ["x", "p", "s"])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert set(attrs) == {"K", "N", "group_size", "bias", "compute"} and attrs["compute"] == b"int8"
    np.testing.assert_array_equal(numpy_helper.to_array(attrs["bias"]), bias)
    gather = SharedInt4Node("emb", ("p", "ids", "s"), ("h",), 64, 32, GATHER, n=3, bias=bias, compute="int8").to_node()
    assert gather.op_type == GATHER_OP_TYPE and list(gather.input) == ["p", "ids", "s"]
    assert {a.name for a in gather.attribute} == {"K", "group_size"}  # N, bias, compute are the MatMul's
    with pytest.raises(ValueError, match="'emb' takes inputs"):
        SharedInt4Node("emb", ("p", "s"), ("h",), 64, 32, GATHER).to_node()
