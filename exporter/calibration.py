"""Calibration inputs and what the calibrated methods learn from them: per layer input, ``X^T X`` and ``mean |x|``.

Feeds (``export_int4(feeds=...)``) are an ``.npz`` file or a dict of input arrays (one batch),
or an iterable of such dicts (one batch each, e.g. one text window each). Every batch is
checked against the model's inputs (names, element types, ranks and fixed dimensions)
with a one-line error that names the batch and the input.

The pass (``collect``) runs the FP32 model in ONNX Runtime once per batch, with the input
tensor of every layer of interest exposed as an extra graph output; after each run every
input ``x`` (rows of K channels) is folded into its ``Stats`` at once and dropped, so only
one batch's activations are alive at a time. Layers that read the same tensor (q, k and v
projections) share one ``Stats``. State held: ``8 K^2`` bytes (float64 ``X^T X``) per distinct
input tensor, all at once; ``collect`` reports that figure (``Calibration.state_bytes``).

``split`` holds some batches out: ``auto`` fits the calibrated methods on one part and
compares them on the other (a GPTQ fitted on few rows matches them better than it will
match new inputs), then refits the chosen one on all of them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ..graphs.feeds import load_feeds

Feeds = Mapping[str, np.ndarray]
FeedSource = str | os.PathLike | Feeds | Iterable[Feeds]
# Statistics of every layer input past this size go to a temporary folder while an analysis goes over
# them one at a time (``spilled``): an LLM's X^T X are hundreds of MB.
SPILL_BYTES = 64 << 20


def _check(feeds: dict[str, np.ndarray], model: onnx.ModelProto, where: str) -> dict[str, np.ndarray]:
    """``feeds`` if they match ``model``'s graph inputs (names, dtypes, ranks, fixed dims); else ValueError."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input}
    needed = [n for n in inputs if n not in initializers]
    missing = [n for n in needed if n not in feeds]
    unknown = [n for n in feeds if n not in inputs]
    if missing or unknown:
        raise ValueError(f"{where}: model inputs {needed}; missing {missing}, not inputs of the model {unknown}")
    for name, value in feeds.items():
        t = inputs[name].type.tensor_type
        if t.elem_type:
            expected = helper.tensor_dtype_to_np_dtype(t.elem_type)
            if value.dtype != expected:
                raise ValueError(f"{where}: input {name!r} is {value.dtype}, the model expects {np.dtype(expected)}")
        if t.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            fixed = all(d is None or d == v for d, v in zip(dims, value.shape, strict=False))
            if value.ndim != len(dims) or not fixed:
                shown = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
                raise ValueError(f"{where}: input {name!r} has shape {list(value.shape)}, the model expects {shown}")
    return feeds


def feed_batches(source: FeedSource, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """The calibration batches of ``source`` (.npz path, dict, or iterable of dicts), each checked against ``model``.

    An iterable is read once into a list (inputs are small next to the activations they make,
    which ``collect`` never holds for more than one batch).
    """
    if isinstance(source, str | os.PathLike):
        return [_check(load_feeds(source), model, str(source))]
    if isinstance(source, Mapping):
        return [_check({k: np.asarray(v) for k, v in source.items()}, model, "feeds")]
    if isinstance(source, np.ndarray | bytes) or not isinstance(source, Iterable):
        raise ValueError(
            f"feeds must be an .npz path, a dict of input arrays or an iterable of them, got {type(source).__name__}"
        )
    batches = []
    for i, batch in enumerate(source):
        if not isinstance(batch, Mapping):
            raise ValueError(f"feeds[{i}]: expected a dict of input arrays, got {type(batch).__name__}")
        batches.append(_check({k: np.asarray(v) for k, v in batch.items()}, model, f"feeds[{i}]"))
    if not batches:
        raise ValueError("feeds: the iterable gave no batch")
    return batches


@dataclass
class Stats:
    """What a layer input ``x`` (K channels) looked like over the calibration rows."""

    xtx: np.ndarray  # float32 [K, K]: sum over rows of x x^T
    abs_sum: np.ndarray  # float64 [K]: sum over rows of |x|
    rows: int = 0

    @property
    def mean_abs(self) -> np.ndarray:
        """Mean |x| per input channel."""
        return self.abs_sum / max(self.rows, 1)

    def add(self, x: np.ndarray) -> None:
        """Fold a batch of rows ``x`` [..., K] in."""
        rows = x.reshape(-1, x.shape[-1])
        finite = rows if np.all(np.isfinite(rows)) else np.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
        f32 = finite.astype(np.float32, copy=False)
        self.xtx += f32.T @ f32  # float32 sums: relative error ~1e-4 at 10^4 rows, far below GPTQ's dampening
        self.abs_sum += np.abs(f32).sum(axis=0, dtype=np.float64)
        self.rows += rows.shape[0]

    def __add__(self, other: Stats) -> Stats:
        return Stats(self.xtx + other.xtx, self.abs_sum + other.abs_sum, self.rows + other.rows)


class SpilledStats(Mapping[str, Stats]):
    """``Stats`` per layer input kept in a temporary folder (removed with the object), read back on each access."""

    def __init__(self, stats: Mapping[str, Stats]) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="cim-int4-stats-")
        self._files: dict[str, tuple[Path, int]] = {}
        self._last: tuple[str, Stats] | None = None
        for i, (name, s) in enumerate(stats.items()):
            path = Path(self._folder.name) / f"{i}.npz"
            np.savez(path, xtx=s.xtx, abs_sum=s.abs_sum)
            self._files[name] = (path, s.rows)

    def __getitem__(self, name: str) -> Stats:
        if self._last is not None and self._last[0] == name:  # q, k and v ask for one input in a row
            return self._last[1]
        path, rows = self._files[name]
        with np.load(path, allow_pickle=False) as f:
            stats = Stats(f["xtx"], f["abs_sum"], rows)
        self._last = (name, stats)
        return stats

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def state_bytes(stats: Mapping[str, Stats]) -> int:
    """The bytes ``stats`` hold in memory (``X^T X`` and ``sum |x|`` of every input)."""
    return sum(s.xtx.nbytes + s.abs_sum.nbytes for s in stats.values())


def spilled(stats: Mapping[str, Stats], threshold: int | None = None) -> Mapping[str, Stats]:
    """``stats`` moved to a SpilledStats when over ``threshold`` bytes (SPILL_BYTES) and the disk takes them."""
    if state_bytes(stats) <= (SPILL_BYTES if threshold is None else threshold):
        return stats
    try:
        return SpilledStats(stats)
    except OSError:
        return stats


@dataclass
class Calibration:
    """Stats per layer input tensor name, and what the pass cost."""

    stats: Mapping[str, Stats]
    runs: int
    state_bytes: int


def expose(model: onnx.ModelProto, tensors: Iterable[str]) -> None:
    """Add main-graph tensors ``tensors`` to ``model``'s outputs (in place), so that a session can return them."""
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(
        helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in tensors if t not in present
    )


# Rows of one batch: (batch index, rows along its first axis, None for all of them).
Part = tuple[int, slice | None]


def rows_of(x: np.ndarray, rows: slice | None, batch_rows: int) -> np.ndarray:
    """``x``'s rows of a part, where its first axis is the batch's (else all of it: a reshaped input cannot be cut)."""
    if rows is None or x.ndim < 2 or x.shape[0] != batch_rows:
        return x
    return x[rows]


def batch_rows(batch: Feeds) -> int:
    sizes = {np.shape(v)[0] if np.ndim(v) else 0 for v in batch.values()}
    return sizes.pop() if len(sizes) == 1 else 0


def collect(
    session: ort.InferenceSession,
    tensors: Mapping[str, int],
    batches: Sequence[Feeds],
    held: Sequence[Part] = (),
    outputs: Sequence[str] = (),
    keep: Callable[[int, list[np.ndarray]], None] | None = None,
) -> tuple[Calibration, Calibration | None]:
    """Stats of every float32 tensor in ``tensors`` (name -> K, outputs of ``session``'s model; see ``expose``).

    One ORT run per batch; each batch's activations are folded in and dropped before the next.
    Rows in ``held`` go to the second Calibration (None without ``held``), the others to the first.
    ``outputs`` are fetched in the same run and handed to ``keep(batch index, values)``.
    """
    names = list(tensors)

    def empty() -> dict[str, Stats]:
        return {t: Stats(np.zeros((k, k), np.float32), np.zeros(k)) for t, k in tensors.items()}

    fit, out = empty(), (empty() if held else None)
    known = {i.name for i in session.get_inputs()}
    for b, batch in enumerate(batches):
        if not names and not outputs:
            continue  # nothing to fetch (ORT would return every output for an empty list)
        values = session.run([*outputs, *names], {k: v for k, v in batch.items() if k in known})
        if keep is not None:
            keep(b, values[: len(outputs)])
        values = values[len(outputs) :]
        rows = batch_rows(batch)
        held_rows = [r for i, r in held if i == b]
        for name, x in zip(names, values, strict=True):
            if x.shape[-1] != tensors[name]:
                raise ValueError(f"layer input {name!r} has {x.shape[-1]} channels, expected {tensors[name]}")
            if not held_rows:
                fit[name].add(x)
                continue
            assert out is not None
            cut = held_rows[0]
            if cut is None or rows_of(x, cut, rows) is x:
                out[name].add(x)  # the whole batch is held out (or cannot be cut)
                continue
            out[name].add(rows_of(x, cut, rows))
            fit[name].add(np.delete(x, np.arange(rows)[cut], axis=0))
        del values
    state = state_bytes(fit)
    first = Calibration(fit, len(batches), state)
    return first, (None if out is None else Calibration(out, 0, state))


def split(batches: Sequence[Feeds]) -> list[Part]:
    """The held-out rows: every other batch, or the odd rows (first axis) of a single batch; [] if neither."""
    if len(batches) > 1:
        return [(b, None) for b in range(1, len(batches), 2)]
    if batch_rows(batches[0]) >= 2:
        return [(0, slice(1, None, 2))]
    return []
