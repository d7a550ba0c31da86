"""ONNX Runtime sessions with the op library loaded and intra-op threads pinned to cores."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import onnx
import onnxruntime as ort

from ..contract import COMPUTE_CONFIG, check_compute
from .library import library_path
from .ort_model import ort_source

ModelSource = str | os.PathLike | bytes | onnx.ModelProto
Pin = bool | Literal["run", "pool", "none"]

PIN_MODES = ("run", "pool", "none")
# Measured on a 4096x4096 chain at M=1 (docs/guide.md, make_session): pinning only ORT's pool threads
# was as fast or faster than also pinning the caller during each run, most of all on a busy machine.
DEFAULT_PIN = "pool"
BACKENDS = ("native", "reference")
def _allowed_cpus() -> tuple[int, ...]:
    # Read each time (no cache): a process that moved itself must not be pinned back.
    return tuple(sorted(os.sched_getaffinity(0)))


def physical_cores() -> list[list[int]]:
    """Logical CPUs this process may run on, grouped by physical core (first CPU of each core first)."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in _allowed_cpus():
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


def resolve_threads(threads: int | None, cores: Sequence[Sequence[int]], oversubscribe: bool = False) -> int:
    """Intra-op thread count: ``threads``, or one per physical core; more than the cores is capped with a warning.

    ``oversubscribe=True`` keeps a ``threads`` above the core count (threads then share cores).
    """
    if threads is None:
        return len(cores)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1 (or None for one per physical core), got {threads!r}")
    if threads > len(cores) and not oversubscribe:
        warnings.warn(
            f"cim-int4: threads={threads} exceeds the {len(cores)} physical core(s) this process may use; "
            f"using {len(cores)} (pass oversubscribe=True to keep {threads})",
            RuntimeWarning,
            stacklevel=3,
        )
        return len(cores)
    return threads


def _pin_mode(pin: Pin) -> str:
    if pin is True:
        return DEFAULT_PIN
    if pin is False:
        return "none"
    if pin not in PIN_MODES:
        raise ValueError(f"pin must be True, False or one of {PIN_MODES}, got {pin!r}")
    return pin


def session_options(
    threads: int | None = None,
    pin: Pin = True,
    config: Mapping[str, str] | None = None,
    ops_library: str | None = None,
    *,
    compute: str | None = None,
    oversubscribe: bool = False,
) -> ort.SessionOptions:
    """SessionOptions with the op library registered, ``threads`` intra-op threads (default: physical cores).

    Unless ``pin`` is False/"none", ORT pins each pool thread to its own core. ``config`` adds
    ORT session config entries (e.g. ``{"session.force_spinning_stop": "1"}``); ``ops_library``
    registers another custom-op library in place of ours; ``compute`` ("fp32" or "int8") sets
    the op library's ``cim_int4.compute`` entry.
    """
    mode = _pin_mode(pin)
    if compute is not None:
        check_compute(compute)
    cores = physical_cores()
    n = resolve_threads(threads, cores, oversubscribe)
    so = ort.SessionOptions()
    so.register_custom_ops_library(ops_library or library_path())
    so.intra_op_num_threads = n
    so.inter_op_num_threads = 1
    if mode != "none" and n > 1:
        _, affinities = thread_affinities(n, cores)
        so.add_session_config_entry("session.intra_op_thread_affinities", affinities)
    if compute is not None:
        so.add_session_config_entry(COMPUTE_CONFIG, compute)
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return so


class PinnedRunSession(ort.InferenceSession):
    """An InferenceSession whose ``run`` pins the calling thread to ``caller_cpu`` and restores its affinity after."""

    def __init__(self, *args: Any, caller_cpu: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.caller_cpu = caller_cpu

    def _pinned(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        # The caller runs a share of the work like a pool thread; pin it only while it does.
        before = os.sched_getaffinity(0)
        target = {self.caller_cpu} if self.caller_cpu in before else before
        if target != before:
            os.sched_setaffinity(0, target)
        try:
            return method(*args, **kwargs)
        finally:
            if target != before:
                os.sched_setaffinity(0, before)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._pinned(super().run, *args, **kwargs)

    def run_with_ort_values(self, *args: Any, **kwargs: Any) -> Any:
        return self._pinned(super().run_with_ort_values, *args, **kwargs)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        return self._pinned(super().run_with_iobinding, *args, **kwargs)


def make_session(
    model: ModelSource,
    threads: int | None = None,
    pin: Pin = True,
    config: Mapping[str, str] | None = None,
    backend: str = "native",
    *,
    compute: str | None = None,
    oversubscribe: bool = False,
) -> ort.InferenceSession:
    """An InferenceSession for ``model`` (path, bytes or ModelProto) that can run CimInt4MatMul.

    ``threads`` intra-op threads (default and cap: one per physical core of this process's
    CPU set; ``oversubscribe=True`` lifts the cap). ``pin``: "pool" (True, the default) pins
    ORT's pool threads to their own cores, the calling thread stays free; "run" also pins
    the calling thread to the first core while each run lasts; "none" (False) pins nothing. The
    calling thread's affinity is never changed after this returns. ``config`` adds ORT
    session config entries; ``compute`` ("fp32" or "int8") picks the op's compute mode.
    ``backend="reference"`` runs CimInt4MatMul with the NumPy reference through
    onnxruntime-extensions instead of our library (see reference_backend).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    reference = backend == "reference"
    # Imported here: the reference backend's module is only needed with backend="reference".
    from .reference_backend import extensions_library, reference_session

    library = extensions_library() if reference else None
    so = session_options(threads, pin, config, library, compute=compute, oversubscribe=oversubscribe)
    if reference:
        return reference_session(model, so)
    if isinstance(model, onnx.ModelProto):
        with ort_source(model) as source:
            return _session(source, so, pin)
    return _session(model if isinstance(model, bytes) else os.fspath(model), so, pin)


def _session(source: bytes | str, so: ort.SessionOptions, pin: Pin) -> ort.InferenceSession:
    providers = ["CPUExecutionProvider"]
    if _pin_mode(pin) == "run":
        cpus, _ = thread_affinities(so.intra_op_num_threads, physical_cores())
        return PinnedRunSession(source, sess_options=so, providers=providers, caller_cpu=cpus[0])
    return ort.InferenceSession(source, sess_options=so, providers=providers)
