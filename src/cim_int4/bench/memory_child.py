"""The child process of ``cim_int4.bench.memory``: load one model, run it once, print RSS figures as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from cim_int4.ops import make_session


def vm_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _child(model: str, feeds: str, config: str) -> dict:
    """Run in the fresh process: load ``model`` with session ``config`` (JSON), run it once on ``feeds``."""
    with np.load(feeds) as data:
        inputs = {name: data[name] for name in data.files}
    before = vm_status()["VmRSS"]
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        reset = True
    except OSError:
        reset = False
    session = make_session(model, threads=1, pin=False, config=json.loads(config))
    session.run(None, inputs)
    after = vm_status()
    return {"baseline": before, "rss": after["VmRSS"], "peak": after["VmHWM"], "reset": reset}


if __name__ == "__main__":
    print(json.dumps(_child(*sys.argv[1:4])))
