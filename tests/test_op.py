"""The C++ CimInt4MatMul op against the NumPy reference, on every kernel path; shape inference; bad attributes."""

from __future__ import annotations

import numpy as np
import pytest
from cim_int4.exporter import SUPPORTED_GROUP_SIZES, quantize_weight
from cim_int4.ops import reference
from conftest import KERNEL_ENV, available_kernels, op_attributes, op_bound, op_model, quantized, random_weight

from cim_int4 import make_session

KERNELS = available_kernels()

# Inputs of the sweep model, one CimInt4MatMul node each: 1-D, 2-D with M = 1, 3, 64 and
# 100 (K * M >= 65536 for K = 1000 switches the wrapper to smaller tasks), 3-D.
SWEEP_SHAPES = [(), (1,), (3,), (64,), (100,), (2, 5), (4, 16)]


def _declared(lead: tuple[int, ...], k: int) -> list[int | str]:
    # Leading dims symbolic so one model takes any M; K static, as the exporter's models have it.
    return [f"d{i}" for i in range(len(lead))] + [k]


def run_op(
    qw, bias: np.ndarray | None, inputs: list[np.ndarray], threads: int, monkeypatch, kernel: str
) -> list[np.ndarray]:
    monkeypatch.setenv(KERNEL_ENV, kernel)
    model = op_model(op_attributes(qw, bias), [_declared(a.shape[:-1], qw.k) for a in inputs])
    sess = make_session(model, threads=threads)
    return sess.run(None, {f"A{i}": a for i, a in enumerate(inputs)})


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
@pytest.mark.parametrize("k", [1, 100, 256, 1000])
@pytest.mark.parametrize("n", [1, 7, 33, 129])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_op_matches_reference(kernel: str, group_size: int, k: int, n: int, with_bias: bool, monkeypatch) -> None:
    rng = np.random.default_rng(k * 1000 + n)
    qw = quantize_weight(random_weight(rng, k, n), group_size)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    inputs = [rng.standard_normal((*lead, k), dtype=np.float32) for lead in SWEEP_SHAPES]

    ys = run_op(qw, bias, inputs, 1, monkeypatch, kernel)
    for a, y in zip(inputs, ys, strict=True):
        assert y.shape == (*a.shape[:-1], n) and y.dtype == np.float32
        exact = reference.matmul(a, qw.packed, qw.scales, k, group_size, bias)
        # Any summation order of float32 products stays within Higham's bound (plus one
        # rounding for the bias); a wrong code, scale or channel breaks it by far.
        bound = op_bound(a, qw, bias)
        err = np.abs(y - exact)
        assert (err <= bound).all(), f"shape {a.shape}: max excess {(err - bound).max():.3g}"

    # The wrapper splits output channels over the pool; each output's sum is unchanged.
    ys2 = run_op(qw, bias, inputs, 2, monkeypatch, kernel)
    for y, y2 in zip(ys, ys2, strict=True):
        assert y.tobytes() == y2.tobytes(), "threads=2 must give bitwise the same output as threads=1"


@pytest.mark.parametrize("kernel", KERNELS)
def test_swapped_nibbles_break_the_bound(kernel: str, monkeypatch) -> None:
    # The sweep's bound is tight enough to see a layout error: the same data read with
    # the two nibbles of each byte swapped lands far outside it.
    rng = np.random.default_rng(7)
    qw = quantized(256, 16, 32, seed=3)
    a = rng.standard_normal((3, 256), dtype=np.float32)
    (y,) = run_op(qw, None, [a], 1, monkeypatch, kernel)
    bound = op_bound(a, qw)
    exact = reference.matmul(a, qw.packed, qw.scales, 256, 32)
    assert (np.abs(y - exact) <= bound).all()
    swapped = ((qw.packed & 0x0F) << 4) | (qw.packed >> 4)
    wrong = reference.matmul(a, swapped, qw.scales, 256, 32)
    # Bound ~ 1e-5 of |a| @ |W|; swapping moves an output by about its own size.
    assert (np.abs(y - wrong) > 100 * bound).mean() > 0.9


@pytest.mark.parametrize("kernel", KERNELS)
def test_extreme_codes_and_zero_scales(kernel: str, monkeypatch) -> None:
    # Codes 0 and 15 only, plus an all-zero group: the ends of the nibble range and scale 0.
    k, n, g = 64, 9, 16
    w = np.where(np.arange(k * n).reshape(k, n) % 2 == 0, -1.0, 1.0).astype(np.float32)
    w[16:32] = 0.0
    qw = quantize_weight(w, g, "amax8")  # +-1 groups: -1 -> code 0, +1 -> 8 clamped to code 15
    codes = reference.unpack(qw.packed) + 8
    assert set(np.unique(codes)) == {0, 8, 15}
    a = np.random.default_rng(0).standard_normal((5, k), dtype=np.float32)
    (y,) = run_op(qw, None, [a], 1, monkeypatch, kernel)
    exact = reference.matmul(a, qw.packed, qw.scales, k, g)
    assert (np.abs(y - exact) <= op_bound(a, qw)).all()


def test_auto_kernel_is_one_of_the_named_ones(monkeypatch) -> None:
    qw = quantized(1000, 33, 32, seed=4)
    a = np.random.default_rng(4).standard_normal((3, 1000), dtype=np.float32)
    named = {kernel: run_op(qw, None, [a], 1, monkeypatch, kernel)[0].tobytes() for kernel in KERNELS}
    (auto,) = run_op(qw, None, [a], 1, monkeypatch, "auto")
    monkeypatch.delenv(KERNEL_ENV)
    sess = make_session(op_model(op_attributes(qw), [["M", 1000]]), threads=1)
    (default,) = sess.run(None, {"A0": a})
    assert auto.tobytes() in named.values()
    assert default.tobytes() == auto.tobytes(), "unset CIM_INT4_KERNEL must mean auto"


def test_unknown_kernel_name_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(KERNEL_ENV, "no_such_isa")
    with pytest.raises(Exception, match=r"CIM_INT4_KERNEL=no_such_isa.*available: .*portable"):
        make_session(op_model(op_attributes(quantized(32, 2)), [[1, 32]]), threads=1)


# ---------------------------------------------------------------- shape inference


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        (["M", 100], ["M", 7]),
        ([2, "S", 100], [2, "S", 7]),
        ([100], [7]),
        ([3, 100], [3, 7]),
        (["B", 2, "S", 100], ["B", 2, "S", 7]),
    ],
)
def test_output_shape_is_inferred(declared: list, expected: list) -> None:
    sess = make_session(op_model(op_attributes(quantized(100, 7)), [declared]), threads=1)
    assert sess.get_outputs()[0].shape == expected


def test_unnamed_unknown_dim_stays_unknown() -> None:
    # ORT stores a dim with neither value nor symbol as the value -1, then warns on every
    # run that -1 is not the real size; the op must keep such a dim unknown.
    sess = make_session(op_model(op_attributes(quantized(100, 7)), [[None, 100]]), threads=1)
    dim = sess.get_outputs()[0].shape[0]
    assert dim is None or isinstance(dim, str), f"output dim 0 reported as {dim!r}"
    assert sess.get_outputs()[0].shape[1] == 7
    (y,) = sess.run(None, {"A0": np.ones((2, 100), dtype=np.float32)})
    assert y.shape == (2, 7)


def test_static_wrong_last_dim_is_refused_naming_k() -> None:
    # The op's shape inference refuses it, but ORT (1.32) drops errors of a custom op's
    # shape inference and loads the model; then the first run must refuse it.
    model = op_model(op_attributes(quantized(100, 7)), [["M", 99]])
    try:
        sess = make_session(model, threads=1)
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception classes
        assert "K=100" in str(e)
        return
    with pytest.raises(Exception, match=r"K=100"):
        sess.run(None, {"A0": np.ones((1, 99), dtype=np.float32)})


# ---------------------------------------------------------------- bad attributes


def _bad_attribute_cases() -> list:
    k, n, g = 100, 7, 32  # groups = 4, K_padded = 128, 64 bytes per row
    qw = quantized(k, n, g)
    bad_padding_low = qw.packed.copy()
    bad_padding_low[2, 50] = 0x87  # k = 100 (first padding element), low nibble: code 7
    bad_padding_high = qw.packed.copy()
    bad_padding_high[0, 63] = 0x08  # k = 127 (last element), high nibble: code 0
    nan_scale = qw.scales.copy()
    nan_scale[3, 1] = np.nan
    inf_scale = qw.scales.copy()
    inf_scale[0, 0] = np.inf
    huge_scale = qw.scales.copy()
    huge_scale[6, 3] = 1e38  # finite, but 8 * scale is not
    cases = {
        "packed one byte short": ("packed", dict(packed=qw.packed[:, :-1].copy())),
        "packed one row short": ("packed", dict(packed=qw.packed[:-1].copy())),
        "packed flattened": ("packed", dict(packed=qw.packed.reshape(-1))),
        "packed float": ("packed", dict(packed=qw.packed.astype(np.float32))),
        "packed int8": ("packed", dict(packed=qw.packed.view(np.int8))),
        "packed missing": ("packed", dict(packed=None)),
        "packed padding low nibble": ("packed", dict(packed=bad_padding_low)),
        "packed padding high nibble": ("packed", dict(packed=bad_padding_high)),
        # K = 97 keeps 4 groups, so shapes match, but codes of k = 97..99 are not padding.
        "K smaller than the data": ("packed", dict(K=97)),
        "scales transposed": ("scales", dict(scales=qw.scales.T.copy())),
        "scales one group short": ("scales", dict(scales=qw.scales[:, :-1].copy())),
        "scales float64": ("scales", dict(scales=qw.scales.astype(np.float64))),
        "scales missing": ("scales", dict(scales=None)),
        "scales NaN": ("scales", dict(scales=nan_scale)),
        "scales inf": ("scales", dict(scales=inf_scale)),
        "scales 8x overflows": ("scales", dict(scales=huge_scale)),
        "K missing": ("K", dict(K=None)),
        "K zero": ("K", dict(K=0)),
        "N missing": ("N", dict(N=None)),
        "N zero": ("N", dict(N=0)),
        "group_size 48": ("group_size", dict(group_size=48)),
        "group_size 512": ("group_size", dict(group_size=512)),
        "bias too long": ("bias", dict(bias=np.zeros(n + 1, dtype=np.float32))),
        "bias 2-D": ("bias", dict(bias=np.zeros((1, n), dtype=np.float32))),
        "bias float64": ("bias", dict(bias=np.zeros(n, dtype=np.float64))),
        "bias NaN": ("bias", dict(bias=np.full(n, np.nan, dtype=np.float32))),
    }
    params = [pytest.param(qw, attr, overrides, id=case) for case, (attr, overrides) in cases.items()]
    params.append(
        pytest.param(
            qw,
            "bias",
            dict(bias=[1.0] * n),
            id="bias as a float list",
        )
    )
    return params


@pytest.mark.parametrize(("qw", "attribute", "overrides"), _bad_attribute_cases())
def test_bad_attribute_is_refused_naming_it(qw, attribute: str, overrides: dict) -> None:
    model = op_model(op_attributes(qw, **overrides), [["M", qw.k]])
    with pytest.raises(Exception, match=f"attribute '{attribute}'"):
        make_session(model, threads=1)


def test_valid_attributes_load() -> None:
    # The control for the cases above: the unmodified attributes, with a bias, are accepted.
    qw = quantized(100, 7, 32)
    make_session(op_model(op_attributes(qw, np.ones(7, dtype=np.float32)), [["M", 100]]), threads=1)


# ---------------------------------------------------------------- run-time input checks


def test_wrong_last_dim_at_run_time_names_k_and_session_survives() -> None:
    qw = quantized(100, 7)
    sess = make_session(op_model(op_attributes(qw), [["M", "K"]]), threads=2)
    with pytest.raises(Exception, match=r"K=100"):
        sess.run(None, {"A0": np.ones((2, 99), dtype=np.float32)})
    a = np.random.default_rng(0).standard_normal((2, 100), dtype=np.float32)
    (y,) = sess.run(None, {"A0": a})
    exact = reference.matmul(a, qw.packed, qw.scales, 100, 32)
    assert (np.abs(y - exact) <= op_bound(a, qw)).all()


@pytest.mark.parametrize(("shape", "declared"), [((0, 100), ["M", 100]), ((2, 0, 100), [2, "S", 100])])
def test_empty_leading_dim_gives_empty_output(shape: tuple[int, ...], declared: list) -> None:
    sess = make_session(op_model(op_attributes(quantized(100, 7), np.ones(7, np.float32)), [declared]), threads=2)
    (y,) = sess.run(None, {"A0": np.zeros(shape, dtype=np.float32)})
    assert y.shape == (*shape[:-1], 7) and y.dtype == np.float32
