"""NumPy reference of the `CimInt4MatMul` and `CimInt4Gather` ops: the oracle for every kernel and compute mode.

It reads the attribute format of ``cim_int4.contract`` (docs/contract.md); the byte order
itself is pinned by tests that spell out bytes, not by a round trip.

Two levels:

* ``matmul`` / ``dequantize``: what the attributes mean, in float64 (no rounding).
* ``emulate``: the exact arithmetic a compute mode performs, so kernels can be held to
  it within a few FP32 ulps (the only gap: NumPy has no fused multiply-add, emulated in
  float64, which can round twice in rare ties).

Compute modes (attribute ``compute``; absent means ``"fp32"``), per output ``y[m, n]``,
groups ``g`` of ``group_size`` k in order, the q of each code (``c - 2^(b-1)`` for ``bits`` b
on the uniform grid, else the code's level: ``contract.levels``) and weight scale ``s[n, g]``
(float16 scales read as float32):

* ``"fp32"``: ``t = 0; for k in g: t = fma(a[m, k], q, t)``; ``acc = fma(t, s, acc)``.
* ``"int8"``: each row of A is quantized per group (``quantize_activations``):
  ``amax = max|a|``, ``qa = rint(a * (127 / amax))`` (int8, |qa| <= 127, 0 where amax = 0),
  ``as = amax / 127``, ``bsum = sum qa`` (a group with amax = 0 or 127 / amax overflowing
  counts as zero). Then per group the exact integer
  ``d = sum qa * q`` (the op forms it as ``sum qa * (q + z) - z * bsum`` with u8 ``q + z``) and
  ``acc = fma(float(d), as * s, acc)``.

Both end with ``y = acc + bias`` (when there is a bias). All float operations are float32.
A gated node (attribute ``gated``) then outputs ``gated(y, activation)``: the activation of the
first half times the second, exact in float64 here; the op's float32 activation stays within
``gated_bound`` of it.
"""

from __future__ import annotations

import numpy as np

from ..contract import COMPUTE_MODES, DEFAULT_BITS, DEFAULT_GRID, GATED_ACTIVATIONS, check_compute, scale_values, unpack

__all__ = [
    "COMPUTE_MODES", "GATED_ACTIVATIONS", "dequantize", "emulate", "error_bound", "gate", "gated", "gated_bound",
    "matmul", "quantize_activations", "unpack",
]


def dequantize(
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    group_size: int,
    bits: int = DEFAULT_BITS,
    super_scales: np.ndarray | None = None,
    grid: str = DEFAULT_GRID,
) -> np.ndarray:
    """The float64 weight ``[K, N]`` that the attributes stand for (int8 ``scales`` with their ``super_scales``)."""
    if np.asarray(scales).dtype == np.int8 and super_scales is None:
        raise ValueError("int8 scales need their super_scales (contract.scale_values)")
    q = unpack(packed, bits, grid).astype(np.float64)
    n = q.shape[0]
    per_element = np.repeat(scale_values(scales, super_scales).astype(np.float64), group_size, axis=1)
    if per_element.shape != q.shape:
        raise ValueError(f"scales {scales.shape} do not match packed {packed.shape} for group_size {group_size}")
    return (q * per_element)[:, :k].T.reshape(k, n)


def matmul(
    a: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    group_size: int,
    bias: np.ndarray | None = None,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
) -> np.ndarray:
    """``a @ W (+ bias)`` in float64 for ``a`` [..., K]: what the op computes, without rounding."""
    a = np.asarray(a, dtype=np.float64)
    if a.shape[-1] != k:
        raise ValueError(f"a has last dimension {a.shape[-1]}, expected K={k}")
    y = a @ dequantize(packed, scales, k, group_size, bits, grid=grid)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    return y


def error_bound(
    a: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    group_size: int,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
) -> np.ndarray:
    """Worst-case FP32 rounding error of any summation order of ``a @ W``, elementwise.

    A float32 dot product of length K, summed in any order and then scaled, is within
    ``(K + 2) * u * sum_k |a_k * w_k|`` of the exact value (Higham, Accuracy and
    Stability of Numerical Algorithms, eq. 3.5), with u = 2**-24. A wrong nibble
    order or a wrong scale breaks it by orders of magnitude.
    """
    u = 2.0**-24
    absw = np.abs(dequantize(packed, scales, k, group_size, bits, grid=grid))
    return (k + 2) * u * (np.abs(np.asarray(a, dtype=np.float64)) @ absw)


def gate(g: np.ndarray, up: np.ndarray, activation: str) -> np.ndarray:
    """What a gated node makes of its two halves, in float64: ``act(g) * up`` (contract.GATED_FORMULAS)."""
    g = np.asarray(g, dtype=np.float64)
    if activation == "silu":
        t = g
    elif activation == "gelu_tanh":
        t = 2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)
    else:
        raise ValueError(f"gated activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
    with np.errstate(over="ignore", invalid="ignore"):  # exp overflows to inf: g / inf, NaN for infinite g
        return g / (1 + np.exp(-t)) * np.asarray(up, dtype=np.float64)


def gated(y: np.ndarray, activation: str | None) -> np.ndarray:
    """A node's output from its full product ``y`` [..., N]: ``y`` itself, or with ``gated`` the gate of its halves."""
    if activation is None:
        return y
    h = y.shape[-1] // 2
    return gate(y[..., :h], y[..., h:], activation)


# Largest |act'(g)| of every gated activation (silu 1.0998, gelu_tanh 1.1289): how far an error
# in the gate's input can move its output.
GATE_SLOPE = 1.13


def gated_bound(y: np.ndarray, bound: np.ndarray, activation: str | None) -> np.ndarray:
    """Bound on a gated output's error given ``y`` [..., N] and the elementwise ``bound`` of its full product.

    ``|act(g + e)(u + f) - act(g) u| <= GATE_SLOPE |e| (|u| + |f|) + |act(g)| |f|``, plus 16 float32
    ulps of the result for the activation's own rounding (exp and a division). None: ``bound``.
    """
    if activation is None:
        return bound
    h = y.shape[-1] // 2
    g, u = np.asarray(y[..., :h], np.float64), np.asarray(y[..., h:], np.float64)
    e, f = bound[..., :h], bound[..., h:]
    act = np.abs(gate(g, np.ones_like(g), activation))
    return GATE_SLOPE * e * (np.abs(u) + f) + act * f + 16 * 2.0**-24 * np.abs(act * u)


def _fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """float32 fma(x, y, z), computed in float64 (exact product) and rounded once more to float32."""
    return (x.astype(np.float64) * y.astype(np.float64) + z.astype(np.float64)).astype(np.float32)


def _padded_rows(a: np.ndarray, k: int, group_size: int) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    if a.shape[-1] != k:
        raise ValueError(f"a has last dimension {a.shape[-1]}, expected K={k}")
    rows = a.reshape(-1, k)
    groups = -(-k // group_size)
    out = np.zeros((rows.shape[0], groups * group_size), dtype=np.float32)
    out[:, :k] = rows
    return out


def quantize_activations(a: np.ndarray, k: int, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 mode's A: ``qa`` int8 [M, K_padded], ``as`` float32 [M, groups], ``bsum`` int32 [M, groups]."""
    rows = _padded_rows(a, k, group_size)
    m = rows.shape[0]
    blocks = rows.reshape(m, -(-k // group_size), group_size)  # explicit: an empty A has m = 0
    amax = np.abs(blocks).max(axis=2)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = (np.float32(127) / amax).astype(np.float32)
        # A group counts as zero when amax is 0 or so small that 127 / amax overflows; a
        # non-finite amax (inf or NaN in A) gives scale = amax, so the output is not finite.
        normal = np.isfinite(amax) & (amax > 0) & np.isfinite(inv)
        qa = np.where(normal[:, :, None], np.rint(blocks * np.where(normal, inv, 0)[:, :, None]), 0).astype(np.int8)
        ascale = np.where(normal, amax / np.float32(127), np.where(np.isfinite(amax), 0, amax)).astype(np.float32)
    bsum = qa.astype(np.int32).sum(axis=2)
    return qa.reshape(m, blocks.shape[1] * group_size), ascale, bsum


def emulate(
    a: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    group_size: int,
    bias: np.ndarray | None = None,
    compute: str = "fp32",
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
) -> np.ndarray:
    """float32 ``a @ W (+ bias)`` with exactly the arithmetic of compute mode ``compute`` (see the module doc)."""
    check_compute(compute)
    a = np.asarray(a, dtype=np.float32)
    lead = a.shape[:-1]
    q = unpack(packed, bits, grid).astype(np.int32)  # [N, K_padded]
    scales = np.asarray(scales, dtype=np.float32)
    n, groups = scales.shape
    acc = np.zeros((int(np.prod(lead, dtype=np.int64)), n), dtype=np.float32)
    if compute == "fp32":
        rows = _padded_rows(a, k, group_size)
        wq = q.astype(np.float32)
        for g in range(groups):
            t = np.zeros_like(acc)
            for kk in range(g * group_size, min((g + 1) * group_size, k)):
                t = _fma32(rows[:, kk : kk + 1], wq[None, :, kk], t)
            acc = _fma32(t, scales[None, :, g], acc)
    else:
        qa, ascale, _ = quantize_activations(a, k, group_size)
        for g in range(groups):
            sl = slice(g * group_size, (g + 1) * group_size)
            d = qa[:, sl].astype(np.int64) @ q[:, sl].T.astype(np.int64)  # exact: the op's u8 form gives the same
            s = (ascale[:, g : g + 1] * scales[None, :, g]).astype(np.float32)
            acc = _fma32(d.astype(np.float32), s, acc)
    if bias is not None:
        acc = (acc + np.asarray(bias, dtype=np.float32)).astype(np.float32)
    return acc.reshape(*lead, n)


def gather(
    packed: np.ndarray,
    scales: np.ndarray,
    indices: np.ndarray,
    k: int,
    group_size: int,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
) -> np.ndarray:
    """CimInt4Gather: float32 rows ``scale * q(code)`` at ``indices`` (negative counts from the end).

    ``packed`` uint8 [rows, K_padded*bits/8] and ``scales`` [rows, groups] are the same
    format as CimInt4MatMul's (row = output channel). Each element is one float32 product, so
    the op matches this to the bit. Raises IndexError for an index outside [-rows, rows-1].
    """
    packed = np.asarray(packed, dtype=np.uint8)
    rows = packed.shape[0]
    packed = packed.reshape(rows, -1)
    scales = np.asarray(scales, dtype=np.float32).reshape(rows, -1)
    indices = np.asarray(indices)
    flat = indices.reshape(-1).astype(np.int64)
    bad = (flat < -rows) | (flat >= rows)
    if bad.any():
        raise IndexError(f"index {flat[bad][0]} is outside [{-rows}, {rows - 1}]")
    flat = np.where(flat < 0, flat + rows, flat)
    q = unpack(packed[flat], bits, grid).astype(np.float32)  # [count, K_padded]
    per_element = np.repeat(scales[flat], group_size, axis=1)
    y = (q * per_element)[:, :k]
    return y.reshape(*indices.shape, k)
