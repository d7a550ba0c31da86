"""The resident memory a loaded session adds, per variant, each measured in a fresh process.

The parent writes the variant's model and the feeds to a temporary folder and starts
``python -m cim_int4.bench.memory``. The child imports ORT and this package and reads the
feeds, then records ``VmRSS`` (the baseline), resets the peak (``/proc/self/clear_refs``),
creates a session from the file (1 thread, the variant's environment and session config),
runs it once and records ``VmRSS`` and ``VmHWM`` again. So the figures include everything
a loaded model costs (the file ORT read, its copies of the weights, our repacked copy,
arenas and the first run's buffers) and nothing the parent process holds. On tiny models
the fixed overhead of a session dominates; the ratios mean something on real-sized weights.

Both are reported as ratios to the model's int4 weight bytes (packed codes + scales of
the CimInt4MatMul export of the same graph), for every variant alike; the net ratio
first subtracts what a session of a one-node model adds (``empty_session_bytes``), the
part that does not grow with the weights.

With ``external_data`` the model file keeps its tensors in ``<model>.data`` (export's
``--external-data``): ORT then holds one copy of the weights instead of two (docs/design.md,
"Session memory"); the row's variant name says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ..graphs import IR_VERSION, OPSET
from .errors import BenchError
from .variants import Variant

CHILD_TIMEOUT_S = 600
# The child's code lives in a module nothing imports, so ``python -m`` runs it fresh.
CHILD_MODULE = "cim_int4.bench.memory_child"
# Appended to the variant's name in a row measured from a model saved with external data.
EXTERNAL_DATA_SUFFIX = " (external data)"


@dataclass(frozen=True)
class MemoryResult:
    """Resident memory of one variant's session of one workload."""

    workload: str
    variant: str
    int4_bytes: int  # packed codes + scales of the workload's CimInt4MatMul export: the denominator
    baseline_rss: int  # the child's RSS before loading (interpreter, ORT, numpy)
    session_bytes: int  # RSS after creating the session and one run, minus the baseline
    peak_bytes: int  # highest RSS during load and run, minus the baseline
    peak_reset: bool  # False: the kernel refused to reset the peak, so it may predate the load
    empty_bytes: int = 0  # what a session of an empty model adds (empty_session_bytes), the same in every row

    @property
    def session_ratio(self) -> float:
        return self.session_bytes / self.int4_bytes if self.int4_bytes else float("nan")

    @property
    def net_ratio(self) -> float:
        """(session - empty session) / int4 weight bytes: what grows with the weights."""
        return (self.session_bytes - self.empty_bytes) / self.int4_bytes if self.int4_bytes else float("nan")

    @property
    def peak_ratio(self) -> float:
        return self.peak_bytes / self.int4_bytes if self.int4_bytes else float("nan")


def _in_child(
    label: str,
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    variant: Variant | None,
    external_data: bool = False,
) -> dict:
    from ..exporter import save_model

    with tempfile.TemporaryDirectory(prefix="cim-int4-memory-") as tmp:
        path, feeds_path = Path(tmp) / "model.onnx", Path(tmp) / "feeds.npz"
        save_model(model, path, external_data=external_data)
        np.savez(feeds_path, **feeds)
        env = {**os.environ, **dict(variant.env if variant else ())}
        config = json.dumps(dict(variant.config if variant else ()))
        cmd = [sys.executable, "-m", CHILD_MODULE, str(path), str(feeds_path), config]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise BenchError(f"memory of {label}: no answer in {CHILD_TIMEOUT_S} s") from e
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"memory of {label}: the measuring process failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def empty_session_bytes() -> int:
    """RSS that a session of a one-node model (Identity) adds: the fixed cost of any session, not of its weights."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "empty", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    got = _in_child("an empty session", model, {"x": np.zeros(1, np.float32)}, None)
    return got["rss"] - got["baseline"]


def measure_memory(
    workload: str,
    variant: Variant,
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    int4_bytes: int,
    empty_bytes: int = 0,
    external_data: bool = False,
) -> MemoryResult:
    """Resident memory of a session of ``model`` as ``variant`` runs it, measured in a fresh process.

    ``external_data``: load it from a file whose tensors are in ``<model>.data``.
    """
    name = variant.name + (EXTERNAL_DATA_SUFFIX if external_data else "")
    got = _in_child(f"{name} on {workload}", model, feeds, variant, external_data)
    return MemoryResult(
        workload=workload,
        variant=name,
        int4_bytes=int4_bytes,
        baseline_rss=got["baseline"],
        session_bytes=got["rss"] - got["baseline"],
        peak_bytes=got["peak"] - got["baseline"],
        peak_reset=got["reset"],
        empty_bytes=empty_bytes,
    )
