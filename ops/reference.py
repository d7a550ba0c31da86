"""NumPy reference of the `CimInt4MatMul` op: the oracle for every kernel.

It reads the attribute format documented in ``cim_int4.exporter.quantize`` and is
written independently of the exporter's packer, so a round-trip test checks both.
"""

from __future__ import annotations

import numpy as np


def unpack(packed: np.ndarray) -> np.ndarray:
    """Codes of ``packed`` uint8 [N, B] as int8 q [N, 2*B] in -8..7 (byte b: k=2b low nibble, k=2b+1 high)."""
    packed = np.asarray(packed, dtype=np.uint8)
    n, nbytes = packed.shape
    out = np.empty((n, nbytes * 2), dtype=np.int8)
    out[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
    out[:, 1::2] = (packed >> 4).astype(np.int8) - 8
    return out


def dequantize(packed: np.ndarray, scales: np.ndarray, k: int, group_size: int) -> np.ndarray:
    """The float64 weight ``[K, N]`` that the attributes stand for."""
    q = unpack(packed).astype(np.float64)
    n = q.shape[0]
    per_element = np.repeat(np.asarray(scales, dtype=np.float64), group_size, axis=1)
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
) -> np.ndarray:
    """``a @ W (+ bias)`` in float64 for ``a`` [..., K]: what the op computes, without rounding."""
    a = np.asarray(a, dtype=np.float64)
    if a.shape[-1] != k:
        raise ValueError(f"a has last dimension {a.shape[-1]}, expected K={k}")
    y = a @ dequantize(packed, scales, k, group_size)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    return y


def error_bound(a: np.ndarray, packed: np.ndarray, scales: np.ndarray, k: int, group_size: int) -> np.ndarray:
    """Worst-case FP32 rounding error of any summation order of ``a @ W``, elementwise.

    A float32 dot product of length K, summed in any order and then scaled, is within
    ``(K + 2) * u * sum_k |a_k * w_k|`` of the exact value (Higham, Accuracy and
    Stability of Numerical Algorithms, eq. 3.5), with u = 2**-24. A wrong nibble
    order or a wrong scale breaks it by orders of magnitude.
    """
    u = 2.0**-24
    absw = np.abs(dequantize(packed, scales, k, group_size))
    return (k + 2) * u * (np.abs(np.asarray(a, dtype=np.float64)) @ absw)
