"""The CPUs a serving replica pins itself to, claimed so that two replicas on one machine never share one.

Ray reserves ``num_cpus`` for a replica but does not say which CPUs, and every replica's
process may run on all of them (``os.sched_getaffinity``). So each replica claims CPUs of
that set with an exclusive ``flock`` on one lock file per CPU: the kernel drops the locks
when the process ends (also when it is killed), so a replacement replica gets them back.
Replicas then pin every thread of their process (ORT's pool threads, created later,
inherit it). Without enough free CPUs the replica runs unpinned.
"""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..ops.session import physical_cores

LOCK_DIR_ENV = "CIM_INT4_CPU_LOCKS"
# A replica replacing a killed one may start while the old process is still exiting.
CLAIM_WAIT_S = 3.0


def lock_dir() -> Path:
    """Folder of the per-CPU lock files: $CIM_INT4_CPU_LOCKS, or cim-int4-cpus in the temp folder."""
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "cim-int4-cpus")


@dataclass
class CpuClaim:
    """CPUs held by this process until ``release`` (or its end)."""

    cpus: tuple[int, ...]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        """Give the CPUs back."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def claim_order(cores: Sequence[Sequence[int]]) -> list[int]:
    """CPUs in the order they are claimed: one per physical core first, then their siblings."""
    return [core[0] for core in cores] + [cpu for core in cores for cpu in core[1:]]


def _try_claim(count: int, order: Sequence[int], folder: Path) -> CpuClaim | None:
    claim = CpuClaim(())
    cpus = []
    for cpu in order:
        fd = os.open(folder / f"cpu{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        claim._fds.append(fd)
        cpus.append(cpu)
        if len(cpus) == count:
            claim.cpus = tuple(sorted(cpus))
            return claim
    claim.release()
    return None


def claim_cpus(count: int, wait_s: float = CLAIM_WAIT_S, folder: Path | None = None) -> CpuClaim | None:
    """Claim ``count`` CPUs of this process's CPU set that no other claimant holds; None if too few are free."""
    folder = lock_dir() if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    order = claim_order(physical_cores())
    if count > len(order):
        return None
    deadline = time.monotonic() + wait_s
    while True:
        claim = _try_claim(count, order, folder)
        if claim is not None or time.monotonic() >= deadline:
            return claim
        # Two replicas that each hold part of what they need both let go; a random pause breaks the tie.
        time.sleep(random.uniform(0.05, 0.2))


def pin_process(cpus: Sequence[int]) -> None:
    """Restrict every thread of this process (and so the threads they start later) to ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """CPU set of each thread of process ``pid`` (from /proc), by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = set(os.sched_getaffinity(int(tid)))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return out
