"""The CimInt4MatMul attribute format, pinned: quantization rule, nibble order, padding, exported bytes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from cim_int4.exporter import (
    DEFAULT_SCALE_RULE,
    SCALE_RULES,
    SUPPORTED_GROUP_SIZES,
    export_int4,
    pack,
    quantize,
    quantize_weight,
)
from cim_int4.ops import reference
from cim_int4.ops.names import OP_DOMAIN, OP_TYPE
from onnx import TensorProto, helper, numpy_helper

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
        (np.zeros((2, 3), dtype=np.int8), "K_padded even"),
        (np.zeros(4, dtype=np.int8), "K_padded even"),
        (np.array([[8, 0]], dtype=np.int8), "-8..7"),
        (np.array([[0, -9]], dtype=np.int8), "-8..7"),
    ],
)
def test_pack_rejects_bad_codes(q: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack(q)


# ---------------------------------------------------------------- quantization rule


def test_negative_max_gives_minus_8_and_positive_max_clamps_to_7() -> None:
    # One group of 16 in each of two channels; max|w| = 2 so scale = 0.25.
    w = np.zeros((16, 2), dtype=np.float32)
    w[:3, 0] = [-2.0, 1.0, 0.25]  # -max -> -8 exactly
    w[:3, 1] = [2.0, -1.0, -0.25]  # +max -> round(8) = 8, clamped to 7
    q, scales = quantize(w, 16, "amax8")
    np.testing.assert_array_equal(scales, np.array([[0.25], [0.25]], dtype=np.float32))
    np.testing.assert_array_equal(q[0, :3], [-8, 4, 1])
    np.testing.assert_array_equal(q[1, :3], [7, -4, -1])
    assert q.min() == -8 and q.max() == 7


def test_all_zero_group_gives_scale_zero_and_code_zero() -> None:
    w = np.zeros((32, 2), dtype=np.float32)
    w[16:, 0] = np.linspace(-1.0, 1.0, 16, dtype=np.float32)  # channel 0: group 0 zero, group 1 not
    with np.errstate(all="raise"):  # a 0/0 inside quantize would raise here
        q, scales = quantize(w, 16, "amax8")
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
    _, scales = quantize(w, 16, "amax8")
    expected = np.array([[1.0, 0.5, 0.0625], [0.375, 0.75, np.float32(1e-3) / np.float32(8)]], dtype=np.float32)
    np.testing.assert_array_equal(scales, expected)
    assert scales.dtype == np.float32


def test_rounding_is_half_to_even() -> None:
    # max|w| = 8 makes scale exactly 1, so w / scale = w and every .5 is an exact tie.
    w = np.array([8.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 6.5, -7.5, 0.49, 4.51, 0, 0, 0, 0], dtype=np.float32)
    q, scales = quantize(w[:, None], 16, "amax8")
    assert scales[0, 0] == 1.0
    np.testing.assert_array_equal(q[0], [7, 0, 2, 2, 4, 0, -2, -2, 6, -8, 0, 5, 0, 0, 0, 0])


def test_k_padding_uses_code_8() -> None:
    k, n, g = 40, 3, 32  # groups = 2, K_padded = 64: 24 padding elements per row
    w = np.random.default_rng(5).standard_normal((k, n)).astype(np.float32) + 3.0  # no code 8 by accident
    qw = quantize_weight(w, g, "amax8")
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
    qw = quantize_weight(w, group_size, "amax8")
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
    assert qw.scales.dtype == np.float32 and qw.scales.shape == (3, 4)


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

    out = export_int4(model, group_size=g, scale_rule="amax8", quiet=True)
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


# ---------------------------------------------------------------- scale rules, each against an oracle written here

ORACLE_DIVISORS = (6.5, 7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5, 8.75, 9.0, 9.5, 10.5)
ORACLE_FLIPPED = (7.75, 8.0, 8.25, 8.5)


def groups_of(w: np.ndarray, g: int) -> np.ndarray:
    """float64 groups [N, groups, g] of a [K, N] weight, K padded with zeros (the contract, written again)."""
    k, n = w.shape
    padded = np.zeros((-(-k // g) * g, n))
    padded[:k] = w
    return padded.T.reshape(n, -1, g)


def each_group(w: np.ndarray, g: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """(channel, group index, float64 group) in K order per channel."""
    blocks = groups_of(w, g)
    for n in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            yield n, j, blocks[n, j]


def extreme(group: np.ndarray) -> float:
    """The value of largest magnitude, the positive one on a tie."""
    hi, lo = float(group.max()), float(group.min())
    return hi if hi >= -lo else lo


def codes(group: np.ndarray, scale: float) -> np.ndarray:
    return np.zeros_like(group) if scale == 0 else np.clip(np.rint(group / scale), -8, 7)


def sq_error(group: np.ndarray, scale: float) -> float:
    return float(((group - scale * codes(group, scale)) ** 2).sum())


def oracle_candidates(group: np.ndarray) -> list[float]:
    """The mse rule's documented candidates for one group, each at the least-squares step of its codes."""
    m = extreme(group)
    out = []
    for s in [m / -d for d in ORACLE_DIVISORS] + [m / d for d in ORACLE_FLIPPED]:
        q = codes(group, s)
        out.append(float(group @ q / (q @ q)) if q @ q > 0 else s)
    return out


def random_groups(rng: np.random.Generator, k: int = 96, n: int = 24) -> np.ndarray:
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, ::5] = rng.laplace(size=(k, len(range(0, n, 5)))).astype(np.float32)  # heavier tails in some channels
    w[:, 3] *= 1e-3
    w[5, 7] = -w[:, 7].min() if w[:, 7].min() < 0 else w[5, 7]  # a +/- tie
    return w


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_every_rule_keeps_the_code_contract(rule: str, rng: np.random.Generator) -> None:
    w = random_groups(rng, k=80)  # K = 80: the last group of 32 is half padding
    q, scales = quantize(w, 32, rule)
    blocks = groups_of(w, 32)
    assert scales.dtype == np.float32 and scales.shape == (24, 3)
    assert np.isfinite(8 * scales.astype(np.float64)).all()
    expected = np.clip(np.rint(blocks.astype(np.float32) / scales[:, :, None]), -8, 7).reshape(24, -1)
    np.testing.assert_array_equal(q, expected)
    assert (q[:, 80:] == 0).all()  # padding stays code 8


def test_signed_rule_maps_the_largest_magnitude_to_minus_8(rng: np.random.Generator) -> None:
    w = random_groups(rng)
    q, scales = quantize(w, 32, "signed")
    for n, j, group in each_group(w, 32):
        assert scales[n, j] == np.float32(np.float32(extreme(group)) / np.float32(-8.0))
        assert q[n, 32 * j + int(np.argmax(np.abs(group) * (1 + 1e-9 * (group > 0))))] == -8
    assert (scales < 0).any() and (scales > 0).any()


def test_signed_rule_tie_takes_the_positive_value() -> None:
    w = np.zeros((16, 1), dtype=np.float32)
    w[2, 0], w[9, 0] = -3.0, 3.0
    q, scales = quantize(w, 16, "signed")
    assert scales[0, 0] == np.float32(-0.375)
    assert q[0, 9] == -8 and q[0, 2] == 7  # -3 / -0.375 = 8, clamped


def test_mse_rule_is_the_best_documented_candidate(rng: np.random.Generator) -> None:
    w = random_groups(rng)
    _, scales = quantize(w, 32, "mse")
    for n, j, group in each_group(w, 32):
        got = sq_error(group, float(scales[n, j]))
        best = min(sq_error(group, s) for s in oracle_candidates(group))
        # Searched in float32: ties may round either way; 1e-4 is far below the gap between candidates.
        assert got <= best * (1 + 1e-4) + 1e-30, (n, j, got, best)
        assert got <= sq_error(group, extreme(group) / -8) * (1 + 1e-4) + 1e-30


def test_balanced_rule_beats_every_candidate_on_its_objective(rng: np.random.Generator) -> None:
    balance = 0.03
    w = random_groups(rng, k=256, n=16)
    _, scales = quantize(w, 32, "balanced")
    carry = 0.0
    for n, j, group in each_group(w, 32):
        carry = 0.0 if j == 0 else carry

        def objective(s: float, group: np.ndarray = group, carry: float = carry) -> float:
            e = group - s * codes(group, s)
            return float(e @ e + balance * (carry + e.sum()) ** 2)

        m = extreme(group)
        grid = [m / -d for d in ORACLE_DIVISORS] + [m / d for d in ORACLE_FLIPPED]
        got = objective(float(scales[n, j]))
        best = min(objective(s) for s in grid)
        assert got <= best * (1 + 1e-3) + 1e-12, (n, j, got, best)
        carry += float((group - scales[n, j] * codes(group, float(scales[n, j]))).sum())


def test_balanced_rule_cancels_the_error_sum_along_each_channel(rng: np.random.Generator) -> None:
    # What an input >= 0 sees: the error summed over K. Per-group rules leave it a random walk.
    w = rng.standard_normal((4096, 64)).astype(np.float32)

    def channel_sums(rule: str) -> np.ndarray:
        q, scales = quantize(w, 32, rule)
        return (reference.dequantize(pack(q), scales, 4096, 32) - w).sum(axis=0)

    balanced, signed, mse = (np.abs(channel_sums(r)).mean() for r in ("balanced", "signed", "mse"))
    assert balanced < 0.2 * signed and balanced < 0.2 * mse, (balanced, signed, mse)


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_rules_handle_zero_tiny_and_huge_groups(rule: str) -> None:
    w = np.zeros((64, 3), dtype=np.float32)
    w[32:, 0] = 1e-42  # subnormal
    w[:, 1] = np.linspace(-3.4e38, 3.0e38, 64, dtype=np.float32)  # near FLT_MAX
    with np.errstate(divide="raise", invalid="raise"):  # no 0/0, no inf - inf
        q, scales = quantize(w, 32, rule)
    assert np.isfinite(8 * scales.astype(np.float64)).all() and np.isfinite(8 * scales).all()
    assert scales[2].tolist() == [0.0, 0.0] and (q[2] == 0).all()
    assert scales[0, 0] == 0.0
    deq = reference.dequantize(pack(q), scales, 64, 32)
    assert np.isfinite(deq).all()
    assert np.linalg.norm(deq[:, 1] - w[:, 1]) < 0.2 * np.linalg.norm(w[:, 1].astype(np.float64))


def test_unknown_scale_rule_is_a_one_line_error() -> None:
    rules = r"\('amax8', 'signed', 'mse', 'balanced', 'auto'\)"
    with pytest.raises(ValueError, match=rf"scale_rule must be one of {rules}, got 'median'"):
        quantize(np.ones((32, 1), dtype=np.float32), 32, "median")


def test_default_scale_rule_is_a_known_rule() -> None:
    assert DEFAULT_SCALE_RULE in SCALE_RULES


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


def test_auto_without_feeds_is_balanced_up_to_group_32_and_signed_above(rng: np.random.Generator) -> None:
    # Measured on real pretrained LLMs (docs/real-llm.md): balanced and mse clip the large weights
    # of 128-weight groups, which those models need; at group 32 balanced is at least RTN.
    from cim_int4.exporter.scale_rules import auto_rule

    w = random_groups(rng, k=256, n=8)
    for group, rule in [(16, "balanced"), (32, "balanced"), (64, "signed"), (128, "signed"), (256, "signed")]:
        assert auto_rule(group) == rule
        assert np.array_equal(quantize(w, group, "auto")[1], quantize(w, group, rule)[1]), group
