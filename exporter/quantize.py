"""Symmetric INT4 quantization of a weight into the `CimInt4MatMul` attribute format (cim_int4.contract).

For a weight ``W`` of shape ``[K, N]`` (``y = x @ W``) and group size ``g``:

* ``groups = ceil(K / g)``, ``K_padded = groups * g``; K is padded with zeros.
* Per output channel ``n`` and group ``j`` over ``k in [j*g, (j+1)*g)``: a float32
  ``scale`` chosen by the export's scale rule (``scale_rules``: ``amax8`` = ``max|w| / 8``,
  ``signed``, ``mse``), then ``q = clamp(round(w / scale), -8, 7)`` (round half to even,
  as NumPy); ``scale = 0`` gives ``q = 0`` (an all-zero group has ``scale = 0``).
* A scale may be negative (the grid's 8th level then lies on the positive side). The op
  accepts any finite scale whose ``8 * |scale|`` is finite, whatever rule made it, so
  files written under any rule, or before rules existed, load the same way.
* ``packed``: uint8 ``[N, K_padded / 2]``. Row ``n`` holds channel ``n`` along K; element
  ``k`` is in byte ``k // 2``, **even k in the low nibble**, odd k in the high nibble,
  stored as the code ``q + 8`` (0..15). Padding elements are code 8 (q = 0).
* ``scales``: float32 ``[N, groups]``, row-major.
* ``bias`` (optional): float32 ``[N]``.

Dequantized, ``W[k, n] ~= scales[n, k // g] * (code(n, k) - 8)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract import DEFAULT_GROUP_SIZE, SUPPORTED_GROUP_SIZES, check_group_size, pack
from .scale_rules import check_scale_rule, group_scales

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_SCALE_RULE",
    "SUPPORTED_GROUP_SIZES",
    "QuantizedWeight",
    "check_group_size",
    "pack",
    "quantize",
    "quantize_weight",
]
# Chosen by measurement: docs/accuracy.md.
DEFAULT_SCALE_RULE = "auto"


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight in attribute form: ``packed`` uint8 [N, K_padded/2], ``scales`` float32 [N, groups]."""

    k: int
    n: int
    group_size: int
    packed: np.ndarray
    scales: np.ndarray


def quantize(
    w: np.ndarray, group_size: int = DEFAULT_GROUP_SIZE, scale_rule: str = DEFAULT_SCALE_RULE
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float ``[K, N]`` weight: ``q`` int8 [N, K_padded] in -8..7 and ``scales`` float32 [N, groups]."""
    check_group_size(group_size)
    check_scale_rule(scale_rule)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("weight has NaN or infinite values")
    k, n = w.shape
    groups = -(-k // group_size)
    wt = np.zeros((n, groups * group_size), dtype=np.float32)
    wt[:, :k] = w.T
    blocks = wt.reshape(n, groups, group_size)
    # Padding zeros never change a group's scale under any rule (all look at |w| extremes or
    # squared error, and a zero is exact on every grid).
    scales = group_scales(blocks, scale_rule)
    # scale 0 means every |w| of the group is below ~1e-44, so w / 1 rounds to q = 0.
    safe = np.where(scales != 0, scales, np.float32(1.0))[:, :, None]
    np.divide(blocks, safe, out=blocks)
    np.rint(blocks, out=blocks)
    q = np.clip(blocks, -8, 7, out=blocks).astype(np.int8)
    return q.reshape(n, groups * group_size), scales


# quantize() needs a few temporaries of the weight's size; big weights go in column blocks of this many bytes.
_BLOCK_BYTES = 32 << 20


def quantize_weight(
    w: np.ndarray, group_size: int = DEFAULT_GROUP_SIZE, scale_rule: str = DEFAULT_SCALE_RULE
) -> QuantizedWeight:
    """Quantize and pack a float ``[K, N]`` weight into the attribute format."""
    w = np.asarray(w, dtype=np.float32)
    check_group_size(group_size)
    check_scale_rule(scale_rule)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    k, n = w.shape
    groups = -(-k // group_size)
    packed = np.empty((n, groups * group_size // 2), dtype=np.uint8)
    scales = np.empty((n, groups), dtype=np.float32)
    # Output channels are independent under every scale rule: blocks of them bound the temporaries.
    step = max(1, _BLOCK_BYTES // max(1, 4 * groups * group_size))
    for n0 in range(0, n, step):
        q, s = quantize(w[:, n0 : n0 + step], group_size, scale_rule)
        packed[n0 : n0 + step] = pack(q)
        scales[n0 : n0 + step] = s
    return QuantizedWeight(k=k, n=n, group_size=group_size, packed=packed, scales=scales)
