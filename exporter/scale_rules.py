"""Scale rules: how the exporter picks each group's scale (the codes then follow from the contract).

Every rule returns one float32 scale per group; ``quantize`` then sets
``q = clamp(round(w / scale), -8, 7)``. A rule may return a negative scale: the grid
``scale * [-8 .. 7]`` then has its extra level (8 steps) on the positive side.

* ``"amax8"``: ``max|w| / 8``. The design's first rule, kept so old exports can be
  reproduced. The largest positive weight is clipped to 7 steps (12.5% short), which
  biases the error negative and adds up over K when the inputs are non-negative.
* ``"signed"``: ``m / -8`` where ``m`` is the weight of largest magnitude (the positive
  one on a tie), so ``m`` maps exactly to -8 (llama.cpp Q4_0, ORT MatMulNBits symmetric).
* ``"mse"``: the scale that minimises the group's squared error ``sum (w - s*q)^2`` over
  the candidates ``m / -d`` for every ``d`` in ``MSE_DIVISORS`` and ``m / +d`` for ``d``
  in ``MSE_FLIPPED_DIVISORS`` (only above 7.5 steps does the sign decide which side is
  clipped). Each candidate's codes ``q`` are scored at their least-squares scale
  ``<w, q> / <q, q>``, and the best such scale is the group's (re-rounding at it can only
  lower the error). Searched in float32 on weights normalised by ``|m|``.
* ``"balanced"``: the same search, groups taken in K order along each output channel,
  minimising ``sum e^2 + BALANCE * (c + sum e)^2`` where ``e = w - s*q`` and ``c`` is the
  channel's error sum over the groups before. An input with mean ``mu`` and variance
  ``sigma^2`` sees ``sigma^2 * sum e^2 + mu^2 * (sum e)^2`` per channel: the second term,
  which ReLU/GELU/SiLU outputs make large, is what per-group rules leave to chance. Each
  candidate is also tried at its best step for that objective (scored with the codes that
  step rounds to).
* ``"auto"`` (the default): ``balanced`` for groups of up to AUTO_BALANCED_MAX_GROUP
  (32, the default group size) and ``signed`` for larger groups (``auto_rule``); with
  calibration inputs (export ``feeds=``) the exporter runs the model with every layer under
  each rule of ``AUTO_CHOICES`` (``balanced``, ``signed``, ``mse``) and keeps the rule whose
  outputs are closer to FP32 on those inputs (``exporter.methods.calibrate``; under the
  export's method). No rule that differs from round-to-nearest can
  be better on every model without looking at its inputs: the errors of different
  layers add or cancel by chance (docs/accuracy.md). Why ``signed`` above group 32: on
  two real pretrained LLMs (docs/real-llm.md) ``balanced`` and ``mse`` at group 128 clip
  the large weights of a group, which such models need: their perplexity gap to FP32 was
  1.7-2.1x round-to-nearest's, while at group 32 ``balanced`` was at or below it.
"""

from __future__ import annotations

import numpy as np

from ..contract import DEFAULT_BITS, DEFAULT_GRID, max_level, round_to_grid

SCALE_RULES = ("amax8", "signed", "mse", "balanced", "auto")
# What "auto" means without calibration inputs (up to AUTO_BALANCED_MAX_GROUP; "signed" above),
# and the rules it chooses between with them.
AUTO_RULE = "balanced"
AUTO_BALANCED_MAX_GROUP = 32
AUTO_CHOICES = ("balanced", "signed", "mse")

# Weight of the squared running error sum in the balanced rule's objective (per unit of the
# squared error): about the smallest that still cancels the sum. On 4096x4096 with 1% 10x
# outlier columns and inputs >= 0, 0.01 and 0.03 both cut 1 - cosine to 0.35x signed's (0.003:
# 0.38x); on real LLM weights a larger weight costs squared error (over mse's: +0.7% at 0.003,
# +2.9% at 0.01, +7.5% at 0.03), and in perplexity 0.03 was no better than round-to-nearest
# (1.05x / 0.99x its gap on two LLMs) while 0.01 beat mse on both (docs/real-llm.md).
BALANCE = 0.01

# Where m lands, in steps. Measured on Gaussian, Laplace and uniform groups of 16..128: a grid
# of step 0.05 over 5..12 (both signs everywhere) lowers the squared error by 0.1-0.6% only.
MSE_DIVISORS = (6.5, 7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5, 8.75, 9.0, 9.5, 10.5)
# The flipped sign (m clipped to +7 steps) wins for <0.5% of groups, all at these divisors.
MSE_FLIPPED_DIVISORS = (7.75, 8.0, 8.25, 8.5)

# Weight elements searched per NumPy pass of the mse rule (x16 candidates: 1 MiB of float32).
_MSE_CHUNK_ELEMENTS = 1 << 14


def check_scale_rule(scale_rule: str) -> None:
    """Raise ValueError unless ``scale_rule`` is one of SCALE_RULES."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")


def auto_rule(group_size: int) -> str:
    """The rule "auto" uses without calibration inputs for groups of ``group_size`` weights."""
    return AUTO_RULE if group_size <= AUTO_BALANCED_MAX_GROUP else "signed"


def signed_extreme(blocks: np.ndarray) -> np.ndarray:
    """Per group (last axis) the value of largest magnitude, the positive one on a tie."""
    hi, lo = blocks.max(axis=-1), blocks.min(axis=-1)
    return np.where(hi >= -lo, hi, lo)


def group_scales(
    blocks: np.ndarray,
    scale_rule: str,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """float32 scales [..., groups] for float32 ``blocks`` [..., groups, group_size]: ``scale_rule``, ``bits`` wide.

    At other widths than 4, or on a non-uniform ``grid``, every rule is the same with ``8`` read as
    the grid's largest ``|q|`` (``2^(b-1)`` uniform): ``amax8`` is ``max|w| / top``, ``signed`` maps
    ``m`` to ``-top``, and ``mse``/``balanced`` search the divisors scaled by ``top / 8``, rounding to
    the grid's levels.

    ``weights`` (broadcastable to ``blocks``, >= 0): the ``mse`` rule minimises ``sum h (w - s q)^2``
    instead (GPTQ passes each input channel's ``H[k, k]``); the other rules ignore it.
    """
    check_scale_rule(scale_rule)
    if scale_rule == "auto":
        scale_rule = auto_rule(blocks.shape[-1])
    offset = np.float32(max_level(bits, grid))
    if scale_rule == "amax8":
        return (np.abs(blocks).max(axis=-1) / offset).astype(np.float32)
    if scale_rule == "signed":
        return (signed_extreme(blocks) / -offset).astype(np.float32)
    if scale_rule == "balanced":
        return _balanced_scales(blocks, bits, grid)
    flat = blocks.reshape(-1, blocks.shape[-1])
    h = None if weights is None else np.broadcast_to(weights, blocks.shape).reshape(flat.shape).astype(np.float32)
    rows = max(1, _MSE_CHUNK_ELEMENTS // max(1, flat.shape[1]))
    out = np.empty(flat.shape[0], dtype=np.float32)
    for start in range(0, flat.shape[0], rows):
        part = None if h is None else h[start : start + rows]
        out[start : start + rows] = _mse_scales(flat[start : start + rows], bits=bits, grid=grid, weights=part)
    return out.reshape(blocks.shape[:-1])


def _balanced_scales(blocks: np.ndarray, bits: int = DEFAULT_BITS, grid: str = DEFAULT_GRID) -> np.ndarray:
    """The balanced rule for float32 ``blocks`` [N, groups, g]: groups in K order, one column of N at a time."""
    n, groups, _ = blocks.shape
    scales = np.empty((n, groups), dtype=np.float32)
    carry = np.zeros(n, dtype=np.float64)  # the error sum so far along each output channel
    for j in range(groups):
        b = np.ascontiguousarray(blocks[:, j, :])
        s = _mse_scales(b, carry, bits, grid)
        scales[:, j] = s
        # The codes exactly as quantize() will make them, so the carry is the true error sum.
        q = round_to_grid(b / np.where(s != 0, s, np.float32(1.0))[:, None], bits, grid)
        carry += (b - q * s[:, None]).sum(axis=1, dtype=np.float64)
    return scales


def _mse_scales(
    blocks: np.ndarray,
    carry: np.ndarray | None = None,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """The mse rule for float32 ``blocks`` [R, g], or the balanced one given each row's ``carry`` (module doc);
    ``weights`` [R, g] (mse only): each element's weight in the squared error."""
    m = signed_extreme(blocks)
    am = np.abs(m)
    live = am > 0
    # v: each group divided by |m| and oriented so that its extreme is exactly +1; code
    # range [-7, 8] there puts the 8th level on the extreme's side, [-8, 7] is the flip.
    # Divided, not multiplied by 1/|m|: that reciprocal overflows for subnormal groups.
    safe_am = np.where(live, am, np.float32(1.0))
    v = blocks / safe_am[:, None] * np.sign(m)[:, None]
    hv = v if weights is None else weights * v
    vv = np.einsum("ij,ij->i", hv, v)
    # All candidates at once: axis 0 of every array below is the candidate.
    flip = np.array([False] * len(MSE_DIVISORS) + [True] * len(MSE_FLIPPED_DIVISORS))
    offset = max_level(bits, grid)
    # The 4-bit divisors (around 8 steps) scaled to the grid's largest |q|; exactly them at 4 bits.
    divisors = np.array(MSE_DIVISORS + MSE_FLIPPED_DIVISORS, dtype=np.float32)[:, None, None]
    if offset != 8:
        divisors = (divisors * np.float32(offset / 8)).astype(np.float32)
    lo = np.where(flip, np.float32(-offset), np.float32(1 - offset))[:, None, None]
    hi = np.where(flip, np.float32(offset - 1), np.float32(offset))[:, None, None]

    def rounded(x: np.ndarray) -> np.ndarray:
        """Codes of ``x`` per candidate: the uniform range above, or a grid's levels (symmetric: flips are alike)."""
        return np.clip(np.rint(x), lo, hi) if grid == DEFAULT_GRID else round_to_grid(x, bits, grid)

    def score(q: np.ndarray, t: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(objective, step) per candidate and row for codes ``q``; ``t`` None: the least-squares step."""
        vq = np.einsum("crg,rg->cr", q, hv)
        qq = np.einsum("crg,crg->cr", q, q) if weights is None else np.einsum("crg,crg,rg->cr", q, q, weights)
        if t is None:
            # For fixed codes q the best step is <v,q>/<q,q>, leaving vv - <v,q>^2/<q,q>;
            # re-rounding at that step can only lower the error further.
            t = vq / np.where(qq > 0, qq, np.float32(1.0))
            return vv - vq * t, t
        bias = dc - t * np.einsum("crg->cr", q)
        return vv - 2 * t * vq + t * t * qq + np.float32(BALANCE) * bias * bias, t

    q = rounded(v * divisors)
    if carry is None:
        err, step = score(q, None)
    else:
        # carry in v units; a group far smaller than the carry cannot cancel it, so cap it
        dc = (np.clip(carry / safe_am * np.sign(m), -1e6, 1e6) + v.sum(axis=1)).astype(np.float32)
        base = np.broadcast_to(np.float32(1.0) / divisors[:, :, 0], q.shape[:2])
        err0, _ = score(q, base)
        # Each candidate's codes at the step that is best for them under the balanced
        # objective, scored with the codes that step rounds to (re-rounding moves the sum).
        sq = np.einsum("crg->cr", q)
        den = np.einsum("crg,crg->cr", q, q) + np.float32(BALANCE) * sq * sq
        t = (np.einsum("crg,rg->cr", q, v) + np.float32(BALANCE) * sq * dc) / np.where(den > 0, den, 1)
        t = np.where(t > 0, t, base).astype(np.float32)
        err1, _ = score(rounded(v / t[:, :, None]), t)
        err, step = np.concatenate([err0, err1]), np.concatenate([base, t])
        flip = np.concatenate([flip, flip])
    err = np.where(step > 0, err, np.inf)
    best = np.argmin(err, axis=0)  # first of equals: the documented candidate order
    rows = np.arange(len(v))
    best_t, best_flip = step[best, rows], flip[best]
    # Back to weight units: code -8 falls on the extreme's side, so the scale's sign is
    # opposite to m's, unless flipped.
    sign = np.where(best_flip, np.sign(m), -np.sign(m)).astype(np.float32)
    scales = (sign * am * best_t).astype(np.float32)
    # A step of |m|/6.5 or so cannot overflow 8|s| unless |m| is near FLT_MAX; use signed there.
    with np.errstate(over="ignore"):
        finite = np.isfinite(np.float32(offset) * scales)
    return np.where(live & finite, scales, (m / np.float32(-offset)).astype(np.float32)).astype(np.float32)
