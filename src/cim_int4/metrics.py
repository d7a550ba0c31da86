"""How close outputs are to their references: the package's one cosine (validation and the sensitivity analysis),
and the KL divergence of an LLM's next-token distributions (``bits="auto"``'s damage on logits).

The rule for non-finite values, everywhere: at a position where both sides hold the same
non-finite value (the -inf of an attention mask, or NaN and NaN) they agree, and the position
stays out of the sums; a non-finite value on one side only (or two different ones) is a
disagreement, and the row's cosine is 0. Two all-zero rows agree (cosine 1); a zero row
against a non-zero one does not (0).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

# Elements of each side converted to float64 at a time (an LLM's logits are one row of 25M and more).
_CHUNK = 1 << 20


def _rows(
    reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray], classes: bool = False
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """[rows, -1] views of each float output and its reference, a row per index of the first axis.

    ``classes``: [rows, -1, n] views, the last axis (n) kept apart.
    """
    for ref, out in zip(reference, outputs, strict=True):
        ref, out = np.asarray(ref), np.asarray(out)
        if ref.dtype.kind != "f" or ref.size == 0:
            continue
        rows = 1 if ref.ndim < 2 else ref.shape[0]
        shape = (rows, -1, ref.shape[-1]) if classes else (rows, -1)
        yield ref.reshape(shape), out.reshape(shape)


def cosines(r: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Cosine of each row of ``r`` [rows, n] with the same row of ``o`` (sums in float64), under the module's rule."""
    rows, n = r.shape
    dot, rr, oo = np.zeros(rows), np.zeros(rows), np.zeros(rows)
    clash = np.zeros(rows, dtype=bool)
    step = max(1, _CHUNK // max(rows, 1))
    for c in range(0, max(n, 1), step):
        rc, oc = r[:, c : c + step].astype(np.float64), o[:, c : c + step].astype(np.float64)
        finite = np.isfinite(rc) & np.isfinite(oc)
        if not finite.all():
            same = (rc == oc) | (np.isnan(rc) & np.isnan(oc))
            clash |= (~finite & ~same).any(axis=1)
            rc, oc = np.where(finite, rc, 0.0), np.where(finite, oc, 0.0)
        dot += np.einsum("ij,ij->i", rc, oc)
        rr += np.einsum("ij,ij->i", rc, rc)
        oo += np.einsum("ij,ij->i", oc, oc)
    nr, no = np.sqrt(rr), np.sqrt(oo)
    both = nr * no
    cos = dot / np.where(both > 0, both, 1.0)
    return np.where(clash, 0.0, np.where(both > 0, cos, (nr == 0) & (no == 0)))


def cosine(reference: np.ndarray, output: np.ndarray) -> float:
    """Cosine of two whole tensors (flattened) under the module's rule."""
    r = np.asarray(reference, np.float64).reshape(1, -1)
    return float(cosines(r, np.asarray(output, np.float64).reshape(1, -1))[0])


def row_cosines(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> np.ndarray:
    """Cosine similarity of every row (index of the first axis) of every float output with its reference."""
    found = [cosines(r, o) for r, o in _rows(reference, outputs)]
    return np.concatenate(found) if found else np.ones(0)


def kl_divergences(r: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Per row of ``r`` [rows, positions, n]: the mean over positions of ``KL(softmax(r) || softmax(o))``.

    float64, a chunk of positions at a time. A class with probability 0 on the reference side (``-inf``)
    adds nothing; anything else non-finite, or probability only the output side takes away, is ``inf``.
    """
    rows, positions, n = r.shape
    total = np.zeros(rows)
    step = max(1, _CHUNK // max(rows * n, 1))
    for p in range(0, positions, step):
        lr = _log_softmax(r[:, p : p + step].astype(np.float64))
        lo = _log_softmax(o[:, p : p + step].astype(np.float64))
        pr = np.exp(lr)
        with np.errstate(invalid="ignore"):
            terms = np.where(pr > 0, pr * (lr - lo), 0.0)
        kl = terms.sum(axis=-1)
        total += np.where(np.isnan(kl), np.inf, kl).sum(axis=1)
    return total / max(positions, 1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """``log(softmax(x))`` along the last axis (NaN where a position has no finite maximum or holds NaN)."""
    top = x.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = x - top
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def row_kl(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> np.ndarray:
    """``kl_divergences`` of every row (index of the first axis) of every float output, the last axis the classes."""
    found = [kl_divergences(r, o) for r, o in _rows(reference, outputs, classes=True)]
    return np.concatenate(found) if found else np.zeros(0)


def row_rel_l2(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> np.ndarray:
    """``||out - ref|| / ||ref||`` of every row (index of the first axis) of every float output."""
    found = []
    for r, o in _rows(reference, outputs):
        r, o = r.astype(np.float64), o.astype(np.float64)
        d, n = np.linalg.norm(o - r, axis=1), np.linalg.norm(r, axis=1)
        found.append(np.where(n > 0, d / np.where(n > 0, n, 1.0), np.where(d > 0, np.inf, 0.0)))
    return np.concatenate(found) if found else np.zeros(0)


def worst(cosines: np.ndarray) -> float:
    """The lowest of row cosines; 1.0 when there is none (no float output)."""
    return float(min(cosines, default=1.0))


def worst_cosine(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> float:
    """Worst cosine similarity between float outputs and their references, per index of the first axis."""
    return worst(row_cosines(reference, outputs))


def worst_rel_l2(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> float:
    """Worst ``||out - ref|| / ||ref||`` over float outputs, per index of the first axis."""
    return float(max(row_rel_l2(reference, outputs), default=0.0))
