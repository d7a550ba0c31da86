"""ONNX Runtime sessions with the op library loaded and intra-op threads pinned to cores."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
import onnxruntime as ort

from .library import library_path

ModelSource = str | os.PathLike | bytes | onnx.ModelProto
BACKENDS = ("native", "reference")


@functools.lru_cache(maxsize=1)
def _allowed_cpus() -> tuple[int, ...]:
    # Read once: make_session narrows the calling thread's own affinity afterwards.
    return tuple(sorted(os.sched_getaffinity(0)))


def physical_cores() -> list[list[int]]:
    """Logical CPUs this process may run on, grouped by physical core (first CPU of each core first)."""
    allowed = _allowed_cpus()
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = ("?", str(cpu))  # no topology info: count each CPU as a core
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


def thread_affinities(threads: int, cores: Sequence[Sequence[int]]) -> tuple[list[int], str]:
    """CPU for each of ``threads`` intra-op threads (caller first) and ORT's affinity string for the pool threads.

    ORT's ``session.intra_op_thread_affinities`` takes ``threads - 1`` entries (the calling
    thread is not one of them) separated by ``;``, with 1-based processor ids. Threads get
    distinct physical cores while there are enough; beyond that they share, round robin
    over the logical CPUs.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    order = [core[0] for core in cores] + [cpu for core in cores for cpu in core[1:]]
    cpus = [order[i % len(order)] for i in range(threads)]
    return cpus, ";".join(str(cpu + 1) for cpu in cpus[1:])


def session_options(
    threads: int | None = None,
    pin: bool = True,
    config: Mapping[str, str] | None = None,
    ops_library: str | None = None,
) -> ort.SessionOptions:
    """SessionOptions with the op library registered, ``threads`` intra-op threads (default: physical cores), pinned.

    ``config`` adds ORT session config entries (e.g. ``{"session.force_spinning_stop": "1"}``);
    ``ops_library`` registers another custom-op library in place of ours.
    """
    cores = physical_cores()
    n = len(cores) if threads is None else threads
    so = ort.SessionOptions()
    so.register_custom_ops_library(ops_library or library_path())
    so.intra_op_num_threads = n
    so.inter_op_num_threads = 1
    if pin and n > 1:
        _, affinities = thread_affinities(n, cores)
        so.add_session_config_entry("session.intra_op_thread_affinities", affinities)
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return so


def make_session(
    model: ModelSource,
    threads: int | None = None,
    pin: bool = True,
    config: Mapping[str, str] | None = None,
    backend: str = "native",
) -> ort.InferenceSession:
    """An InferenceSession for ``model`` (path, bytes or ModelProto) that can run CimInt4MatMul.

    ``threads`` intra-op threads (default: one per physical core). With ``pin``, each pool
    thread is pinned to its own physical core by ORT, and the calling thread, which ORT
    never pins but which also runs work, is pinned here to the first core. ``config``
    adds ORT session config entries. Without
    ``pin``, the calling thread is given back all CPUs of the process (pool threads
    inherit its affinity). ``backend="reference"`` runs CimInt4MatMul with the NumPy
    reference through onnxruntime-extensions instead of our library (see reference_backend).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    reference = backend == "reference"
    # Imported here: reference_backend reads the exporter's constants, and the exporter imports this package.
    from .reference_backend import extensions_library, reference_session

    so = session_options(threads, pin, config, ops_library=extensions_library() if reference else None)
    if pin:
        cpus, _ = thread_affinities(so.intra_op_num_threads, physical_cores())
        os.sched_setaffinity(0, {cpus[0]})
    else:
        os.sched_setaffinity(0, set(_allowed_cpus()))
    if reference:
        return reference_session(model, so)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif not isinstance(model, bytes):
        model = os.fspath(model)
    return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])
