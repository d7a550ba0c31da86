"""GPTQ in NumPy: round each weight column in turn and push its error onto the columns not yet rounded.

For a weight ``W`` [K, N] (``y = x @ W``) and the calibration inputs' ``H = sum x x^T`` [K, K],
GPTQ (Frantar et al., 2022, the optimal-brain-quantization sweep) minimises the layer's
output error ``||x (W - Q)||^2 = tr((W - Q)^T H (W - Q))`` greedily: input channels k are
taken in order; channel k's row of every output channel is rounded, and its rounding error,
divided by ``U[k, k]``, is spread over the rows after it along ``U[k, k+1:]``, where ``U`` is
the upper Cholesky factor of ``H^-1`` (the inverse Hessian restricted to the channels left).

Details, as in the reference implementation:

* dampening: ``H + damp * mean(diag H) * I`` (keeps ``H`` invertible; ``damp`` -> inf is RTN);
  channels that were zero on every calibration row get ``H[k, k] = 1`` (their rounding then
  moves nothing else: plain round-to-nearest there);
* lazy block updates: inside a block of ``block`` channels the spread is done column by
  column; the rest of the weight is updated once per block with one matrix product;
* groups: a group's scale is chosen (by the export's scale rule) when the sweep reaches its
  first channel, from the weights as the sweep has updated them (groups found on the fly); the
  ``mse`` rule weighs each channel's squared error by ``H[k, k]`` (``Factor.importance``: the
  layer's output error without the cross terms), not equally (docs/methods.md);
* scales are rounded to the stored dtype (int8 by default, float16, float32; float32 for the
  whole weight when float16 cannot hold one of them or of its super-scales) as soon as they are
  chosen, so the sweep rounds and spreads the error against the scales the op will read. int8
  scales: when the sweep reaches the first group of a run of ``SUPER_GROUPS`` groups, the run's
  float16 super-scale is taken from the rule's scales (weighted as above) of the run's weights as
  the sweep has updated them so far (``contract.int8_scales``; with ``act_order``, whose scales are all chosen
  first, from the weights before the sweep), and each scale chosen in the run is rounded to an
  int8 multiple of it (``contract.int8_multiple``: within +-127, a nonzero scale never 0);
* ``act_order``: channels are swept by decreasing ``H[k, k]`` ("static groups": every group's
  scale is chosen first, from the original weights, so the groups stay the op's contiguous K
  groups whatever the order).

Output channels are independent given ``H``: they are swept in blocks of rows to bound memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract import (
    DEFAULT_BITS,
    DEFAULT_GRID,
    SUPER_GROUPS,
    check_bits,
    check_grid,
    int8_multiple,
    int8_scales,
    int8_steps,
    round_to_grid,
    row_bytes,
    supers_of,
)
from .quantize import DEFAULT_SCALE_DTYPE, QuantizedWeight, pack, stored_dtype, stored_scales
from .scale_rules import group_scales

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK = 128
# Output channels swept at once (float32 rows of K_padded).
_ROW_BLOCK_BYTES = 32 << 20


def _rounded(w: np.ndarray, scale: np.ndarray, bits: int, grid: str = DEFAULT_GRID) -> np.ndarray:
    """Signed codes of ``w`` at ``scale``, ``bits`` wide on ``grid`` (the contract's rounding: scale 0 gives 0)."""
    safe = np.where(scale != 0, scale, np.float32(1.0))
    return round_to_grid(w / safe, bits, grid)


def _lower_inverse(lower: np.ndarray) -> np.ndarray:
    """Inverse of a lower-triangular matrix, by halves (``n^3 / 3`` flops in matrix products; NumPy has no trtri)."""
    n = len(lower)
    if n <= 128:
        return np.linalg.inv(lower)
    h = n // 2
    a, c, b = lower[:h, :h], lower[h:, :h], lower[h:, h:]
    ai, bi = _lower_inverse(a), _lower_inverse(b)
    out = np.zeros_like(lower)
    out[:h, :h], out[h:, h:] = ai, bi
    out[h:, :h] = -(bi @ (c @ ai))
    return out


def upper_inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper ``U`` with ``U^T U = (H + damp * mean(diag H) * I)^-1``; channels never seen get ``H[k, k] = 1``.

    With ``J`` the reversal, ``J H J = L L^T`` gives ``H^-1 = (J L^-1 J)^T (J L^-1 J)``, and
    ``J L^-1 J`` is upper triangular: one Cholesky and one triangular inverse.
    """
    h = np.array(h, dtype=np.float64)
    diag = np.diagonal(h).copy()
    dead = diag <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    mean = float(np.mean(np.diagonal(h)))
    for attempt in range(8):
        damped = h + (damp * 10**attempt) * mean * np.eye(len(h))
        try:
            lower = np.linalg.cholesky(damped[::-1, ::-1])
        except np.linalg.LinAlgError:
            continue
        return _lower_inverse(lower)[::-1, ::-1].copy()
    raise np.linalg.LinAlgError("H is not positive definite even with 10^7 times the dampening")


@dataclass(frozen=True)
class Factor:
    """What GPTQ needs of a layer input's ``H``: the sweep order and ``U`` in that order (shared by its readers)."""

    k: int
    perm: np.ndarray  # input channels (K padded to whole groups) in sweep order
    u: np.ndarray  # float32 upper [Kp, Kp]
    # float32 [Kp], input channel order: H[k, k], floored at 1% of its mean (channels never seen get that),
    # the weight of each channel in the mse rule's error when the sweep picks a group's scale.
    importance: np.ndarray | None = None


def factor(xtx: np.ndarray, group_size: int, damp: float = DEFAULT_DAMP, act_order: bool = False) -> Factor:
    """The Factor of ``xtx`` = sum of x x^T [K, K] over the calibration rows, K padded to whole groups."""
    k = len(xtx)
    kp = -(-k // group_size) * group_size
    h = np.zeros((kp, kp))
    h[:k, :k] = xtx
    perm = np.argsort(-np.diagonal(h), kind="stable") if act_order else np.arange(kp)
    diag = np.diagonal(h)
    floor = 0.01 * float(diag[:k].mean()) if k and diag[:k].mean() > 0 else 1.0
    importance = np.maximum(diag, floor).astype(np.float32)
    return Factor(k, perm, upper_inverse_cholesky(h[np.ix_(perm, perm)], damp).astype(np.float32), importance)


def gptq_quantize(
    w: np.ndarray,
    xtx: np.ndarray | Factor,
    group_size: int,
    scale_rule: str,
    *,
    damp: float = DEFAULT_DAMP,
    block: int = DEFAULT_BLOCK,
    act_order: bool = False,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
) -> QuantizedWeight:
    """GPTQ of a float ``[K, N]`` weight given ``xtx`` = sum of x x^T [K, K] on the calibration rows (or its Factor).

    ``bits``: the code width (contract.SUPPORTED_BITS) and ``grid`` what its codes stand for; the sweep
    is the same for every one, only the levels (``q_range(bits)`` uniform, else the grid's) and the
    scale rule's divisor (the largest level) change.
    """
    check_grid(grid, check_bits(bits))
    w = np.asarray(w, dtype=np.float32)
    k, n = w.shape
    f = xtx if isinstance(xtx, Factor) else factor(xtx, group_size, damp, act_order)
    if f.k != k or len(f.u) % group_size:
        raise ValueError(f"H is for K={f.k} in groups of {len(f.u)}, the weight has K={k}, group_size={group_size}")
    groups = -(-k // group_size)
    kp = groups * group_size
    perm, u = f.perm, f.u
    static = not np.array_equal(perm, np.arange(kp))
    # The block holds whole groups, so a group's scale is chosen from weights the block has updated.
    block = max(group_size, block - block % group_size)
    packed = np.empty((n, row_bytes(kp, bits)), dtype=np.uint8)
    step = max(1, _ROW_BLOCK_BYTES // (4 * kp))
    int8 = scale_dtype == "int8"
    scales = np.empty((n, groups), dtype=np.float32 if int8 else np.dtype(scale_dtype))
    supers = np.empty((n, supers_of(groups)), dtype=np.float16) if int8 else None
    try:
        for r0 in range(0, n, step):
            wt = np.zeros((min(step, n - r0), kp), dtype=np.float32)
            wt[:, :k] = w[:, r0 : r0 + step].T
            # int8: every run's super-scale from the weights before the sweep; without act order the
            # sweep sets each run's again when it gets there (_sweep).
            rows_supers = np.empty((len(wt), supers.shape[1]), dtype=np.float16) if int8 else None
            chosen = _Chooser(scale_rule, scale_dtype, bits, rows_supers, grid, f.importance, group_size)
            if rows_supers is not None:
                rows_supers[:] = _super_scales(chosen.rule_scales(wt.reshape(len(wt), groups, group_size), 0))
            s = chosen(wt.reshape(len(wt), groups, group_size), 0) if static else None
            q, s = _sweep(wt[:, perm], u, perm, group_size, chosen, block, s)
            codes = np.empty_like(q)
            codes[:, perm] = q
            packed[r0 : r0 + step] = pack(codes.astype(np.int8), bits, grid, pad_from=k)
            scales[r0 : r0 + step] = s
            if supers is not None:
                supers[r0 : r0 + step] = rows_supers
    except _NotStorable:  # float16 cannot hold a (super-)scale of this weight: all float32, as quantize_weight does
        return gptq_quantize(w, f, group_size, scale_rule, block=block, scale_dtype="float32", bits=bits, grid=grid)
    return QuantizedWeight(
        k=k, n=n, group_size=group_size, packed=packed, scales=scales, bits=bits, super_scales=supers, grid=grid
    )


def _super_scales(scales: np.ndarray) -> np.ndarray:
    """float16 super-scales [rows, supers] of the rule's ``scales`` [rows, groups]."""
    encoded = int8_scales(scales)
    if encoded is None:
        raise _NotStorable
    return encoded[1]


class _NotStorable(Exception):
    """A chosen scale that the stored dtype cannot hold (quantize.stored_dtype)."""


@dataclass(frozen=True)
class _Chooser:
    """A group's scale by the export's rule, as stored (float32 values of the stored dtype).

    ``supers``: int8 scales' float16 super-scales of the rows swept [rows, supers].
    """

    scale_rule: str
    scale_dtype: str
    bits: int
    supers: np.ndarray | None = None
    grid: str = DEFAULT_GRID
    importance: np.ndarray | None = None  # Factor.importance: the mse rule's weights per input channel
    group_size: int = 0

    def rule_scales(self, blocks: np.ndarray, g0: int) -> np.ndarray:
        """The rule's float scales of ``blocks`` [rows, groups, group_size], the groups from ``g0`` on."""
        weights = None
        if self.importance is not None:
            span = self.importance[g0 * self.group_size : (g0 + blocks.shape[1]) * self.group_size]
            weights = span.reshape(1, blocks.shape[1], self.group_size)
        return group_scales(blocks, self.scale_rule, self.bits, self.grid, weights)

    def __call__(self, blocks: np.ndarray, g0: int) -> np.ndarray:
        """Scales [rows, groups] of ``blocks`` [rows, groups, group_size], the groups from ``g0`` on, as stored."""
        s = self.rule_scales(blocks, g0)
        if self.supers is not None:
            step = int8_steps(self.supers, g0 + s.shape[1])[:, g0:]
            return int8_multiple(s, step).astype(np.float32) * step
        if stored_dtype(s, self.scale_dtype) != self.scale_dtype:
            raise _NotStorable
        return stored_scales(s, self.scale_dtype).astype(np.float32)

    def start_run(self, blocks: np.ndarray, run: int) -> None:
        """int8 scales: run ``run``'s super-scales from its groups' weights ``blocks`` [rows, groups, group_size]."""
        if self.supers is not None:
            self.supers[:, run] = _super_scales(self.rule_scales(blocks, run * SUPER_GROUPS))[:, 0]


def _sweep(
    wt: np.ndarray,
    u: np.ndarray,
    perm: np.ndarray,
    group_size: int,
    chosen: _Chooser,
    block: int,
    static: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Codes [rows, Kp] (swept order) and scales [rows, groups] for rows ``wt`` [rows, Kp] in swept order."""
    rows, kp = wt.shape
    scales = static if static is not None else np.zeros((rows, kp // group_size), dtype=np.float32)
    q = np.empty((rows, kp), dtype=np.float32)
    for i1 in range(0, kp, block):
        i2 = min(i1 + block, kp)
        w1 = wt[:, i1:i2].copy()
        err1 = np.empty_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = perm[col] // group_size
            if static is None and col % group_size == 0:
                if g % SUPER_GROUPS == 0:  # a run's first group: its super-scale from the weights as updated so far
                    end = min(col + SUPER_GROUPS * group_size, kp)
                    run = np.concatenate([w1[:, i : i + end - col], wt[:, i2:end]], axis=1)
                    chosen.start_run(run.reshape(rows, -1, group_size), g // SUPER_GROUPS)
                scales[:, g] = chosen(w1[:, None, i : i + group_size], g)[:, 0]
            s = scales[:, g]
            c = w1[:, i]
            qc = _rounded(c, s, chosen.bits, chosen.grid)
            q[:, col] = qc
            e = (c - qc * s) / u1[i, i]
            w1[:, i + 1 :] -= np.outer(e, u1[i, i + 1 :])
            err1[:, i] = e
        wt[:, i2:] -= err1 @ u[i1:i2, i2:]
    return q, scales


def weighted_error(w: np.ndarray, qw: QuantizedWeight, xtx: np.ndarray) -> float:
    """The layer's output error on the calibration rows, ``tr(E^T H E)`` with ``E = dequantized - w``."""
    from ..ops.reference import dequantize

    w = np.asarray(w, dtype=np.float64)
    total = 0.0
    step = max(1, _ROW_BLOCK_BYTES // (8 * max(1, len(w))))
    for n0 in range(0, qw.n, step):
        e = dequantize(qw.packed[n0 : n0 + step], qw.scales[n0 : n0 + step], qw.k, qw.group_size, qw.bits, grid=qw.grid)
        e = e - w[:, n0 : n0 + step]
        total += float(np.einsum("kn,kn->", xtx @ e, e))
    return total
