"""cim_int4.metrics: the one cosine and its documented rule for zero rows and non-finite values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cim_int4.layercheck import tensor_error
from cim_int4.metrics import cosine, row_cosines, worst_cosine


def test_cosine_of_parallel_and_orthogonal_rows() -> None:
    assert cosine(np.array([1.0, 2.0]), np.array([2.0, 4.0])) == pytest.approx(1.0)
    assert cosine(np.array([1.0, 0.0]), np.array([0.0, 3.0])) == 0.0


def test_zero_rows_agree_only_with_zero_rows() -> None:
    assert cosine(np.zeros(3), np.zeros(3)) == 1.0
    assert cosine(np.zeros(3), np.ones(3)) == 0.0


def test_equal_non_finite_values_agree_and_stay_out_of_the_sums() -> None:
    ref = np.array([1.0, -np.inf, 2.0, np.nan])
    assert cosine(ref, np.array([1.0, -np.inf, 2.0, np.nan])) == pytest.approx(1.0)
    assert cosine(ref, np.array([2.0, -np.inf, 4.0, np.nan])) == pytest.approx(1.0)


def test_non_finite_on_one_side_is_a_disagreement() -> None:
    assert cosine(np.array([1.0, 2.0]), np.array([1.0, np.inf])) == 0.0
    assert cosine(np.array([1.0, np.inf]), np.array([1.0, -np.inf])) == 0.0


def test_rows_are_indices_of_the_first_axis_and_the_worst_is_their_minimum() -> None:
    ref = np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)
    out = np.array([[1.0, 0.0], [1.0, -1.0]], np.float32)
    np.testing.assert_allclose(row_cosines([ref], [out]), [1.0, 0.0], atol=1e-12)
    assert worst_cosine([ref], [out]) == pytest.approx(0.0)
    assert worst_cosine([np.arange(3)], [np.arange(3)]) == 1.0, "integer outputs are not compared"


def test_validation_reports_the_same_cosine() -> None:
    ref, out = np.array([1.0, -np.inf, 3.0]), np.array([1.5, -np.inf, 2.0])
    assert tensor_error(ref, out)[2] == cosine(ref, out)
    rel, _, cos, _ = tensor_error(np.array([1.0, 2.0]), np.array([1.0, np.nan]))
    assert math.isinf(rel) and cos == 0.0


def test_row_kl_is_the_mean_over_positions_of_each_rows_next_token_kl() -> None:
    """``row_kl``: KL(softmax(ref) || softmax(out)) along the last axis, averaged over positions, per first index."""
    from cim_int4.metrics import row_kl

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 3, 5)).astype(np.float32) * 4
    out = ref + rng.normal(size=ref.shape).astype(np.float32)
    p = np.exp(ref - ref.max(-1, keepdims=True)).astype(np.float64)
    p /= p.sum(-1, keepdims=True)
    q = np.exp(out - out.max(-1, keepdims=True)).astype(np.float64)
    q /= q.sum(-1, keepdims=True)
    want = (p * np.log(p / q)).sum(-1).mean(-1)
    np.testing.assert_allclose(row_kl([ref], [out]), want, rtol=1e-5)
    np.testing.assert_allclose(row_kl([ref], [ref + 3.0]), [0.0, 0.0], atol=1e-12)  # a shift changes nothing
    assert row_kl([np.arange(3)], [np.arange(3)]).size == 0, "integer outputs are not compared"


def test_row_kl_of_masked_classes() -> None:
    """A class both sides mask (-inf) adds nothing; one the output alone masks, or a NaN, is an infinite divergence."""
    from cim_int4.metrics import row_kl

    ref = np.array([[[1.0, -np.inf, 2.0]]])
    assert row_kl([ref], [ref.copy()])[0] == pytest.approx(0.0)
    assert row_kl([np.array([[[1.0, 0.5, 2.0]]])], [ref])[0] == math.inf
    assert row_kl([ref], [np.array([[[1.0, np.nan, 2.0]]])])[0] == math.inf
