"""Symmetric quantization of a weight into the `CimInt4MatMul` attribute format (cim_int4.contract).

Written for 4 bits below; at another width b (``bits``) read 8 as ``2^(b-1)``, -8..7 as
``q_range(b)`` and the nibbles as the contract's little-endian bit stream; on a non-uniform
``grid`` (contract.GRIDS) read -8..7 as its levels, rounding to the nearest (``round_to_grid``). With
``scale_dtype="int8"`` (the default) each scale is rounded to an int8 fraction of its
super-block's float16 super-scale (``contract.int8_scales``) *before* the codes are chosen, so the
codes fit the scale the file actually stores; a weight whose super-scales float16 cannot hold
(beyond +-65504, or so small that float16 moves one by more than 2^-9 of itself) keeps float32
scales, all of them. ``scale_dtype="float16"`` rounds each scale to float16 the same way (float32
for a weight with a scale float16 cannot hold).

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

from ..contract import (
    DEFAULT_BITS,
    DEFAULT_GRID,
    DEFAULT_GROUP_SIZE,
    SCALE_DTYPES,
    SUPER_GROUPS,
    SUPPORTED_GROUP_SIZES,
    check_bits,
    check_grid,
    check_group_size,
    int8_scales,
    pack,
    q_range,
    round_to_grid,
    scale_values,
)
from .scale_rules import auto_rule, check_scale_rule, group_scales

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_SCALE_DTYPE",
    "DEFAULT_SCALE_RULE",
    "SUPPORTED_GROUP_SIZES",
    "QuantizedWeight",
    "check_group_size",
    "check_scale_dtype",
    "fits_float16",
    "pack",
    "quantize",
    "quantize_weight",
]
# Chosen by measurement: docs/accuracy.md (scale rule) and docs/widths.md (scale dtype: int8 scales
# cost 0.31 bit per weight at group 32 instead of float16's 0.5 and float32's 1.0, within the noise
# in accuracy on the accuracy table and two real LLMs, and decode reads fewer bytes).
DEFAULT_SCALE_RULE = "auto"
DEFAULT_SCALE_DTYPE = "int8"
_FLOAT16_MAX = np.float32(np.finfo(np.float16).max)


def check_scale_dtype(scale_dtype: str) -> str:
    """``scale_dtype`` if the op stores scales of that type (contract.SCALE_DTYPES), else ValueError."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    return scale_dtype


# A float16 scale may move a code by at most this fraction of its step (normal float16 rounds by <= 2^-11;
# below ~3e-5 subnormals round coarser).
_FLOAT16_SLACK = 2.0**-9


def fits_float16(scales: np.ndarray) -> bool:
    """Whether float16 holds every scale to within ``_FLOAT16_SLACK`` of its value (none overflows or underflows)."""
    a = np.abs(scales[scales != 0]).astype(np.float32)
    if a.size == 0:
        return True
    if float(a.max()) > float(_FLOAT16_MAX):
        return False
    return bool(np.all(np.abs(a.astype(np.float16).astype(np.float32) - a) <= a * np.float32(_FLOAT16_SLACK)))


def stored_dtype(scales: np.ndarray, scale_dtype: str) -> str:
    """The dtype ``scales`` are stored in: ``scale_dtype``, except float32 when float16 cannot hold them."""
    return "float32" if scale_dtype == "float16" and not fits_float16(scales) else scale_dtype


def stored_scales(scales: np.ndarray, scale_dtype: str) -> np.ndarray:
    """``scales`` as the op stores them, of ``scale_dtype`` (float16: clamped to its finite range)."""
    if scale_dtype == "float16":
        return np.clip(scales, -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16)
    return scales.astype(np.float32, copy=False)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight in attribute form: ``packed`` uint8 [N, K_padded*bits/8], ``scales`` float32/float16 [N, groups].

    ``super_scales`` (float16 [N, supers]) set: the scales (float32 values) are stored as int8
    fractions of these (``contract.scale_values``).
    """

    k: int
    n: int
    group_size: int
    packed: np.ndarray
    scales: np.ndarray
    bits: int = DEFAULT_BITS
    super_scales: np.ndarray | None = None
    grid: str = DEFAULT_GRID

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and stored scales (what a node of this weight streams per token)."""
        if self.super_scales is None:
            return self.packed.nbytes + self.scales.nbytes
        return self.packed.nbytes + self.scales.size + self.super_scales.nbytes


def quantize(
    w: np.ndarray,
    group_size: int = DEFAULT_GROUP_SIZE,
    scale_rule: str = DEFAULT_SCALE_RULE,
    bits: int = DEFAULT_BITS,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    grid: str = DEFAULT_GRID,
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float ``[K, N]`` weight: ``q`` int8 [N, K_padded] (levels of ``grid``, ``q_range(bits)`` when
    uniform) and ``scales`` [N, groups].

    ``scales`` are of ``scale_dtype`` (float32 or float16; float32 when a scale would overflow or underflow
    float16; int8: the float32 values of the int8 scales); the codes are those of the stored scales.
    """
    q, scales, _ = _quantize(w, group_size, scale_rule, bits, scale_dtype, grid)
    return q, scales


def _quantize(
    w: np.ndarray, group_size: int, scale_rule: str, bits: int, scale_dtype: str, grid: str = DEFAULT_GRID
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``quantize``, and the super-scales of int8 scales (else None; float32 scales when they cannot be int8)."""
    check_group_size(group_size)
    check_scale_rule(scale_rule)
    check_grid(grid, check_bits(bits))
    check_scale_dtype(scale_dtype)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("weight has NaN or infinite values")
    k, n = w.shape
    groups = -(-k // group_size)
    wt = np.zeros((n, groups * group_size), dtype=np.float32)
    wt[:, :k] = w.T
    blocks = wt.reshape(n, groups, group_size)
    # Padding zeros never change a group's scale on the uniform grid (every rule looks at |w| extremes
    # or squared error, and zero is a level); the normal grid has no zero level, so there the last
    # group's scale comes from its weights alone (the balanced rule without its carry there).
    scales = group_scales(blocks, scale_rule, bits, grid)
    tail = k - (groups - 1) * group_size
    if grid != DEFAULT_GRID and tail < group_size:
        rule = auto_rule(group_size) if scale_rule == "auto" else scale_rule  # the rule of the other groups
        scales[:, -1] = group_scales(np.ascontiguousarray(blocks[:, -1:, :tail]), rule, bits, grid)[:, 0]
    super_scales = None
    if scale_dtype == "int8":
        encoded = int8_scales(scales)
        if encoded is not None:
            super_scales = encoded[1]
            scales = scale_values(*encoded)
    else:
        scales = stored_scales(scales, stored_dtype(scales, scale_dtype))
    # scale 0 means every |w| of the group is below ~1e-44 (float16: ~3e-8), so w / 1 rounds to q = 0
    # (float16: to 0 or a code whose product with scale 0 is 0 all the same).
    stored = scales.astype(np.float32)
    safe = np.where(stored != 0, stored, np.float32(1.0))[:, :, None]
    np.divide(blocks, safe, out=blocks)
    if grid == DEFAULT_GRID:
        q = np.clip(np.rint(blocks, out=blocks), *q_range(bits), out=blocks).astype(np.int8)
    else:
        q = round_to_grid(blocks, bits, grid).astype(np.int8)
    return q.reshape(n, groups * group_size), scales, super_scales


# quantize() needs a few temporaries of the weight's size; big weights go in column blocks of this many bytes.
_BLOCK_BYTES = 32 << 20


def quantize_weight(
    w: np.ndarray,
    group_size: int = DEFAULT_GROUP_SIZE,
    scale_rule: str = DEFAULT_SCALE_RULE,
    bits: int = DEFAULT_BITS,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    grid: str = DEFAULT_GRID,
) -> QuantizedWeight:
    """Quantize and pack a float ``[K, N]`` weight into the attribute format: ``bits`` wide, ``scale_dtype`` scales,
    codes standing for the levels of ``grid``."""
    w = np.asarray(w, dtype=np.float32)
    check_group_size(group_size)
    check_scale_rule(scale_rule)
    check_grid(grid, check_bits(bits))
    check_scale_dtype(scale_dtype)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    k, n = w.shape
    groups = -(-k // group_size)
    int8 = scale_dtype == "int8"
    packed = np.empty((n, groups * group_size * bits // 8), dtype=np.uint8)
    scales = np.empty((n, groups), dtype=np.float32 if int8 else scale_dtype)
    supers = np.empty((n, -(-groups // SUPER_GROUPS)), dtype=np.float16) if int8 else None
    # Output channels are independent under every scale rule: blocks of them bound the temporaries.
    step = max(1, _BLOCK_BYTES // max(1, 4 * groups * group_size))
    for n0 in range(0, n, step):
        q, s, d = _quantize(w[:, n0 : n0 + step], group_size, scale_rule, bits, scale_dtype, grid)
        if s.dtype != scales.dtype or (int8 and d is None):  # float16 cannot hold them: all scales float32
            return quantize_weight(w, group_size, scale_rule, bits, "float32", grid)
        packed[n0 : n0 + step] = pack(q, bits, grid, pad_from=k)
        scales[n0 : n0 + step] = s
        if supers is not None:
            supers[n0 : n0 + step] = d
    return QuantizedWeight(
        k=k, n=n, group_size=group_size, packed=packed, scales=scales, bits=bits, super_scales=supers, grid=grid
    )
