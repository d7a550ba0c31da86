"""cim_int4.layercheck: one layer's verdict: its error metrics, its bound per compute mode, its code steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cim_int4.exporter import quantize_weight
from cim_int4.graphs._common import weight_matrix
from cim_int4.ops import reference

from cim_int4.layercheck import code_steps, expected, tensor_error


def test_int8_bound_holds_the_emulation_and_rejects_fp32_arithmetic() -> None:
    rng = np.random.default_rng(0)
    k, n, g = 512, 48, 32
    qw = quantize_weight(weight_matrix(rng, k, n), g)
    a = rng.standard_normal((3, k), dtype=np.float32)
    want, bound = expected(a, qw.packed, qw.scales, k, g, None, "int8")
    emulated = reference.emulate(a, qw.packed, qw.scales, k, g, compute="int8")
    assert np.all(np.abs(emulated - want) <= bound)
    # FP32 activations differ from int8 ones by far more than int8 rounding allows: a mode mix-up shows.
    exact = reference.matmul(a, qw.packed, qw.scales, k, g)
    assert np.max(np.abs(exact - want) / bound) > 2


def test_tensor_error_metrics() -> None:
    ref = np.array([3.0, 4.0])
    assert tensor_error(ref, ref) == (0.0, 0.0, 1.0, math.inf)
    rel, max_abs, cos, snr = tensor_error(ref, np.array([3.0, 4.5]))
    assert rel == pytest.approx(0.1) and max_abs == pytest.approx(0.5) and snr == pytest.approx(20.0)
    assert cos == pytest.approx((9 + 18) / (5 * math.hypot(3, 4.5)))
    # A mask's -inf on both sides is no difference; on one side only it is an infinite one.
    masked = np.array([3.0, -np.inf, 4.0])
    assert tensor_error(masked, masked.copy()) == (0.0, 0.0, 1.0, math.inf)
    assert tensor_error(masked, np.array([3.0, 0.0, 4.0]))[:2] == (math.inf, math.inf)



def test_code_steps_are_at_most_half_for_round_to_nearest_and_grow_when_codes_move() -> None:
    rng = np.random.default_rng(1)
    w = weight_matrix(rng, 64, 8)
    qw = quantize_weight(w, 32)
    assert code_steps(w, qw.packed, qw.scales, 64, 32) <= 0.5 + 1e-6
    q = reference.unpack(qw.packed)
    q[0, 0] = 7 if q[0, 0] < 0 else -8  # one code far from its weight
    from cim_int4.contract import pack

    assert code_steps(w, pack(q), qw.scales, 64, 32) > 1
