"""Both compute modes on every kernel path against the exact NumPy emulation; the session override; edge values."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from cim_int4.exporter import SUPPORTED_GROUP_SIZES, quantize_weight
from cim_int4.ops import reference
from cim_int4.ops.library import library_path
from conftest import KERNEL_ENV, U32, available_kernels, op_attributes, op_model, random_weight

from cim_int4.contract import COMPUTE_CONFIG

KERNELS = available_kernels()
MODES = ("fp32", "int8")
COMPUTE_KEY = COMPUTE_CONFIG


def session(model, threads: int = 1, config: dict[str, str] | None = None) -> ort.InferenceSession:
    # Plain ORT options (no pinning): these tests are about results, not speed.
    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    so.intra_op_num_threads = threads
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def config_entries_supported() -> bool:
    # KernelInfo_GetConfigEntries came with ORT 1.24 (C API 24); older ORTs ignore the entry.
    return tuple(int(x) for x in ort.__version__.split(".")[:2]) >= (1, 24)


def emulation_tolerance(a: np.ndarray, qw, bias: np.ndarray | None) -> np.ndarray:
    """A few ulps of each output's magnitude: the emulation's only gap is the rare double rounding of its fma."""
    mag = np.abs(a.astype(np.float64)) @ np.abs(reference.dequantize(qw.packed, qw.scales, qw.k, qw.group_size))
    if bias is not None:
        mag = mag + np.abs(bias)
    return 4 * U32 * mag + 1e-37


def run(qw, bias, a: np.ndarray, mode: str, threads: int = 1, config: dict[str, str] | None = None) -> np.ndarray:
    model = op_model(op_attributes(qw, bias, compute=mode), [["M", qw.k]])
    (y,) = session(model, threads, config).run(None, {"A0": a})
    return y


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
def test_modes_match_the_emulation(kernel: str, mode: str, group_size: int, monkeypatch) -> None:
    monkeypatch.setenv(KERNEL_ENV, kernel)
    rng = np.random.default_rng(group_size)
    # K with a tail in the last group, N not a multiple of the 16-channel tile.
    for k, n in [(group_size * 3 + 5, 37), (group_size, 16), (7, 1)]:
        qw = quantize_weight(random_weight(rng, k, n), group_size)
        bias = rng.standard_normal(n).astype(np.float32)
        a = rng.standard_normal((129, k), dtype=np.float32)
        y = run(qw, bias, a, mode)
        for m in (1, 2, 5, 7, 16, 33, 128, 129):
            ym = run(qw, bias, a[:m], mode)
            # Row m of a batch is computed exactly as alone: same bits for every M.
            assert ym.tobytes() == y[:m].tobytes(), f"M={m} differs from the M=129 batch"
        emu = reference.emulate(a, qw.packed, qw.scales, k, group_size, bias, compute=mode)
        err = np.abs(y.astype(np.float64) - emu)
        assert (err <= emulation_tolerance(a, qw, bias)).all(), f"K={k} N={n}: max error {err.max():.3g}"


@pytest.mark.parametrize("mode", MODES)
def test_threads_and_repeats_give_the_same_bits(mode: str) -> None:
    rng = np.random.default_rng(5)
    qw = quantize_weight(random_weight(rng, 512, 200), 32)
    a = rng.standard_normal((9, 512), dtype=np.float32)
    model = op_model(op_attributes(qw, compute=mode), [["M", 512]])
    outs = [session(model, threads).run(None, {"A0": a})[0].tobytes() for threads in (1, 2, 3, 1, 2)]
    assert len(set(outs)) == 1


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_negative_scales_negate_exactly(kernel: str, mode: str, monkeypatch) -> None:
    # Every float step of both modes is odd in the scale, so flipping every scale's sign
    # flips every output's sign bit and nothing else.
    monkeypatch.setenv(KERNEL_ENV, kernel)
    rng = np.random.default_rng(11)
    qw = quantize_weight(random_weight(rng, 300, 45), 64)
    neg = type(qw)(k=qw.k, n=qw.n, group_size=qw.group_size, packed=qw.packed, scales=-qw.scales)
    a = rng.standard_normal((3, 300), dtype=np.float32)
    assert np.array_equal(run(neg, None, a, mode), -run(qw, None, a, mode))


def test_int8_is_within_its_documented_bound() -> None:
    # |y_int8 - exact| <= sum_g (amax_g / 254) sum_{k in g} |w_k| + float32 rounding.
    rng = np.random.default_rng(3)
    k, n, g = 1000, 50, 32
    qw = quantize_weight(random_weight(rng, k, n), g)
    a = rng.standard_normal((4, k), dtype=np.float32) * np.float32(3.0)
    y = run(qw, None, a, "int8")
    w = reference.dequantize(qw.packed, qw.scales, k, g)
    exact = a.astype(np.float64) @ w
    groups = -(-k // g)
    pad = np.zeros((4, groups * g))
    pad[:, :k] = np.abs(a)
    amax = pad.reshape(4, groups, g).max(axis=2)  # [M, groups]
    wpad = np.zeros((groups * g, n))
    wpad[:k] = np.abs(w)
    wsum = wpad.reshape(groups, g, n).sum(axis=1)  # [groups, N]
    bound = (amax / 254) @ wsum
    bound += (k + 2) * U32 * (np.abs(a) @ np.abs(w) + bound)
    err = np.abs(y - exact)
    assert (err <= bound).all()
    assert err.max() > 10 * (k + 2) * U32 * (np.abs(a) @ np.abs(w)).max() * 1e-3, "int8 mode looks like fp32"


def test_session_config_overrides_the_attribute() -> None:
    if not config_entries_supported():
        pytest.skip(f"onnxruntime {ort.__version__} has no KernelInfo_GetConfigEntries (needs >= 1.24)")
    rng = np.random.default_rng(8)
    qw = quantize_weight(random_weight(rng, 256, 20), 32)
    a = rng.standard_normal((2, 256), dtype=np.float32)
    as_int8 = run(qw, None, a, "int8")
    as_fp32 = run(qw, None, a, "fp32")
    assert as_int8.tobytes() != as_fp32.tobytes()
    assert run(qw, None, a, "fp32", config={COMPUTE_KEY: "int8"}).tobytes() == as_int8.tobytes()
    assert run(qw, None, a, "int8", config={COMPUTE_KEY: "fp32"}).tobytes() == as_fp32.tobytes()
    # No attribute means fp32.
    model = op_model(op_attributes(qw), [["M", 256]])
    assert session(model).run(None, {"A0": a})[0].tobytes() == as_fp32.tobytes()


def test_bad_compute_values_are_refused_naming_them() -> None:
    qw = quantize_weight(random_weight(np.random.default_rng(1), 64, 4), 32)
    with pytest.raises(Exception, match="attribute 'compute' is \"int4\""):
        session(op_model(op_attributes(qw, compute="int4"), [["M", 64]]))
    with pytest.raises(Exception, match="attribute 'compute'"):
        session(op_model(op_attributes(qw, compute=8), [["M", 64]]))
    if config_entries_supported():
        with pytest.raises(Exception, match="session config entry 'cim_int4.compute' is \"fast\""):
            session(op_model(op_attributes(qw), [["M", 64]]), config={COMPUTE_KEY: "fast"})


# ---------------------------------------------------------------- extreme values (huge, tiny and non-finite)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_huge_finite_scales_stay_exact(kernel: str, mode: str, monkeypatch) -> None:
    # The largest accepted scales (8 * |scale| finite) with an input spanning 60 binades.
    monkeypatch.setenv(KERNEL_ENV, kernel)
    k = 32
    q = np.full((1, k), 7, dtype=np.int8)
    q[0, 1] = -8
    from cim_int4.exporter.quantize import pack

    scales = np.array([[4.2e37]], dtype=np.float32)
    qw = quantize_weight(np.ones((k, 1), np.float32), 32)
    qw = type(qw)(k=k, n=1, group_size=32, packed=pack(q), scales=scales)
    a = np.zeros((1, k), dtype=np.float32)
    a[0, 0], a[0, 1] = 1e-30, 1.0
    y = run(qw, None, a, mode)
    exact = reference.matmul(a, qw.packed, qw.scales, k, 32)
    assert np.isfinite(y).all()
    assert abs(y[0, 0] - exact[0, 0]) <= 1e-6 * abs(exact[0, 0])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_no_overflow_where_float32_matmul_has_none(kernel: str, mode: str, monkeypatch) -> None:
    # a * q summed over a group before scaling overflows (32 * 2e36 * 8 > FLT_MAX); the
    # float32 MatMul of the dequantized weight does not (-5.12e36). Such outputs are
    # recomputed exactly; a real overflow stays infinite.
    monkeypatch.setenv(KERNEL_ENV, kernel)
    from cim_int4.exporter.quantize import pack

    k = 32
    qw = quantize_weight(np.ones((k, 2), np.float32), 32)
    qw = type(qw)(k=k, n=2, group_size=32, packed=pack(np.full((2, k), -8, np.int8)),
                  scales=np.array([[0.01], [1e30]], dtype=np.float32))
    a = np.full((1, k), 2e36, dtype=np.float32)
    y = run(qw, None, a, mode)
    assert y[0, 0] == pytest.approx(-5.12e36, rel=1e-6)
    assert y[0, 1] == -np.inf


@pytest.mark.parametrize("mode", MODES)
def test_misaligned_input_buffer(mode: str) -> None:
    # A NumPy view at byte offset 1: ORT hands the address through unchanged.
    rng = np.random.default_rng(2)
    qw = quantize_weight(random_weight(rng, 64, 20), 32)
    a = rng.standard_normal((3, 64), dtype=np.float32)
    raw = bytearray(a.nbytes + 1)
    shifted = np.frombuffer(raw, dtype=np.float32, count=a.size, offset=1).reshape(a.shape)
    shifted[...] = a
    assert shifted.ctypes.data % 4 != 0
    assert run(qw, None, shifted, mode).tobytes() == run(qw, None, a, mode).tobytes()


def test_nan_and_inf_inputs_propagate() -> None:
    rng = np.random.default_rng(4)
    qw = quantize_weight(random_weight(rng, 64, 3), 32)
    a = rng.standard_normal((3, 64), dtype=np.float32)
    a[0, 5], a[1, 40] = np.nan, np.inf
    for mode in MODES:
        y = run(qw, None, a, mode)
        exact = reference.matmul(a, qw.packed, qw.scales, 64, 32)
        assert np.isnan(y[0]).all()
        assert np.array_equal(np.isnan(y[1]), np.isnan(exact[1])) and np.array_equal(y[1][~np.isnan(y[1])],
                                                                                    exact[1][~np.isnan(exact[1])])
        assert np.isfinite(y[2]).all()
