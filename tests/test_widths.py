"""Code widths other than 4 and float16 scales: quantize, the ``bits`` option, the export's nodes and summary."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import ExportOptions, export_with_summary, quantize, quantize_weight
from cim_int4.exporter.scale_rules import SCALE_RULES
from cim_int4.exporter.widths import bits_per_weight, parse_bits, width_of
from cim_int4.ops import reference

from cim_int4.cli import build_parser, export_options
from cim_int4.contract import SUPPORTED_BITS, Int4Node, is_op_node, q_range

MODELS = Path(__file__).parent / "models"


def _weight(k: int = 96, n: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


def _error(w: np.ndarray, bits: int, rule: str, scale_dtype: str = "float32") -> float:
    qw = quantize_weight(w, 32, rule, bits, scale_dtype)
    return float(np.sum((reference.dequantize(qw.packed, qw.scales, qw.k, 32, bits) - w) ** 2))


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_signed_maps_the_largest_magnitude_to_the_lowest_code(bits: int) -> None:
    w = _weight()
    q, scales = quantize(w, 32, "signed", bits, "float32")
    lo, hi = q_range(bits)
    assert q.min() >= lo and q.max() <= hi
    blocks = w.T.reshape(w.shape[1], -1, 32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], -1)[..., 0]
    np.testing.assert_allclose(scales * lo, extreme, rtol=1e-6)
    # round to nearest on the grid: within half a step inside it, one step where the top code clips
    deq = reference.dequantize(*_packed(q, scales, bits), w.shape[0], 32, bits)
    step = np.repeat(scales, 32, axis=1).T
    inside = (w / step <= hi + 0.5) & (w / step >= lo - 0.5)
    err = np.abs(deq - w)
    assert np.all(err[inside] <= np.abs(step[inside]) * 0.5 * (1 + 1e-5))
    assert np.all(err <= np.abs(step) * (1 + 1e-5))


def _packed(q: np.ndarray, scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    from cim_int4.contract import pack

    return pack(q, bits), scales


@pytest.mark.parametrize("rule", [r for r in SCALE_RULES if r != "auto"])
def test_error_falls_with_every_extra_bit(rule: str) -> None:
    w = _weight()
    errors = [_error(w, b, rule) for b in SUPPORTED_BITS]
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_mse_search_is_never_worse_than_signed_at_any_width(bits: int) -> None:
    w = _weight(seed=bits)
    assert _error(w, bits, "mse") <= _error(w, bits, "signed") * (1 + 1e-6)


@pytest.mark.parametrize("bits", (3, 4, 8))
def test_float16_scales_are_rounded_before_the_codes_are_chosen(bits: int) -> None:
    w = _weight(seed=3)
    q, scales = quantize(w, 32, "mse", bits, "float16")
    assert scales.dtype == np.float16
    stored = np.repeat(scales.astype(np.float32), 32, axis=1)
    lo, hi = q_range(bits)
    expected = np.clip(np.rint(w.T / np.where(stored != 0, stored, 1)), lo, hi)
    np.testing.assert_array_equal(q, expected)
    # float16 scales cost accuracy only at the scales' rounding (~1e-3 relative)
    assert _error(w, bits, "mse", "float16") < _error(w, bits, "mse") * 1.02 + 1e-9


def test_float16_scales_stay_finite_for_huge_weights() -> None:
    w = _weight() * np.float32(1e6)
    _, scales = quantize(w, 32, "signed", 4, "float16")
    assert np.all(np.isfinite(scales))


def test_bits_option_parsing_and_matching() -> None:
    assert parse_bits("3") == 3 and parse_bits("auto") == "auto"
    pairs = parse_bits(".*lm_head.*=8, .*mlp.*=3")
    assert pairs == ((".*lm_head.*", 8), (".*mlp.*", 3))
    assert width_of(pairs, "/model/lm_head/MatMul") == 8 and width_of(pairs, "attn") == 4
    for bad in ("7", "x=9", "lm_head", "[=3"):
        with pytest.raises(ValueError):
            parse_bits(bad)
    with pytest.raises(ValueError, match="bits_budget needs bits='auto'"):
        ExportOptions(bits_budget=4.0)
    with pytest.raises(ValueError, match="scale_dtype"):
        ExportOptions(scale_dtype="bfloat16")
    with pytest.raises(ValueError, match="method 'awq' quantizes at 4 bits"):
        ExportOptions(method="awq", bits=3)
    assert ExportOptions(method="gptq", bits=3).bits == 3  # GPTQ sweeps at any width
    assert ExportOptions(bits={"a": 8}).bits == (("a", 8),)


def test_cli_flags_reach_the_options() -> None:
    args = build_parser().parse_args(["export", "m.onnx", "-o", "o.onnx", "--bits", "a=8", "--scale-dtype", "float16"])
    options = export_options(args)
    assert options.bits == (("a", 8),) and options.scale_dtype == "float16"
    args = build_parser().parse_args(["export", "m.onnx", "-o", "o.onnx"])
    assert export_options(args) == ExportOptions()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "m.onnx", "-o", "o.onnx", "--bits", "7"])
    assert isinstance(args, argparse.Namespace)


def test_bits_per_weight() -> None:
    assert bits_per_weight(4096, 4096, 32, 4, "float32") == 5.0
    assert bits_per_weight(4096, 4096, 32, 4, "float16") == 4.5
    assert bits_per_weight(4096, 4096, 32, 3, "float16") == 3.5
    assert bits_per_weight(40, 8, 32, 4, "float32") == (64 * 4 + 2 * 32) / 40  # K padded to whole groups
    assert bits_per_weight(40, 8, 32, None, "float32") == 32.0


def test_export_writes_each_layer_at_its_width() -> None:
    model = onnx.load(MODELS / "llama.onnx")
    out, summary = export_with_summary(model, bits={".*mlp.*": 8, ".*q_proj.*": 2}, scale_dtype="float16")
    widths = {}
    for node in out.graph.node:
        if is_op_node(node) and len(node.input) == 1:  # attribute form (a tied head reads its table's)
            read = Int4Node.from_node(node)
            widths[node.name] = read.bits
            assert read.scales.dtype == np.float16
    assert widths and all(
        b == (8 if "mlp" in name else 2 if "q_proj" in name else 4) for name, b in widths.items()
    ), widths
    text = summary.format()
    assert "8-bit" in text and "2-bit" in text and "bits per weight of the quantized layers" in text
    one = export_with_summary(model, bits=3)[1]
    assert {r.bits for r in one.rewritten} == {3}
    bpw = 8 * sum(r.bytes_after for r in one.rewritten if not r.tied) / sum(r.k * r.n for r in one.rewritten)
    assert f"{bpw:.3f}" in one.format()


def test_default_export_writes_no_bits_attribute_and_int8_scales() -> None:
    model = onnx.load(MODELS / "llama.onnx")
    out, _ = export_with_summary(model)
    nodes = [n for n in out.graph.node if n.domain == "dbhoo.cim"]
    assert nodes and not any(a.name == "bits" for n in nodes for a in n.attribute)
    tensors = [a for n in nodes for a in n.attribute if a.name in ("scales", "super_scales")]
    dtypes = {(a.name, onnx.numpy_helper.to_array(a.t).dtype) for a in tensors}
    assert dtypes == {("scales", np.dtype(np.int8)), ("super_scales", np.dtype(np.float16))}
