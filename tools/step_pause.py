"""How a decode step's time depends on what the caller did just before it: back to back, after a busy
or sleeping pause, or after reading a large buffer (a cold cache).

    python tools/step_pause.py SOURCE [--threads 2] [--rounds 3] [--pause-ms 3] [--evict-mib 300]

SOURCE is an ONNX causal LM or a genai folder (``cim_int4.perplexity.open_model``); its step (one
token after 32 cached ones) is bound once (``cim_int4.op_profile.bind_step``). Per round, each way
of waiting runs 40 steps, each step after its wait, and the round's median step time is printed
per way, with the CPU's model name. A step that is slower after a pause than back to back, and
slower still after the eviction, reads part of the model from a cache that a pause lets cool
(docs/real-llm.md, "What the genai loop adds at 2 threads").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cim_int4.bench.machine import cpu_model
from cim_int4.op_profile import bind_step
from cim_int4.perplexity import open_model

STEPS = 40
PAST = 32


def busy(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="ONNX causal LM or genai folder")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the ways of waiting (default 3)")
    parser.add_argument("--pause-ms", type=float, default=3.0, help="busy and sleeping pause (default 3 ms)")
    parser.add_argument("--evict-mib", type=int, default=300, help="buffer read before a cold step (default 300)")
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1 or args.pause_ms <= 0 or args.evict_mib < 1:
        parser.error("--threads, --rounds, --pause-ms and --evict-mib must be positive")
    model = open_model(args.source, threads=args.threads)
    binding = bind_step(model, PAST)
    buffer = np.ones(args.evict_mib * 2**20 // 8)
    pause = args.pause_ms / 1e3
    ways = {
        "back to back": lambda: None,
        f"busy {args.pause_ms:g} ms": lambda: busy(pause),
        f"sleep {args.pause_ms:g} ms": lambda: time.sleep(pause),
        f"read {args.evict_mib} MiB": buffer.sum,
    }
    for _ in range(20):
        model.session.run_with_iobinding(binding)
    medians: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, wait in ways.items():
            times = []
            for _ in range(STEPS):
                wait()
                start = time.perf_counter()
                model.session.run_with_iobinding(binding)
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times) * 1e3)
    print(f"{args.source}, {args.threads} thread(s), past {PAST}; CPU: {cpu_model()}")
    for name, values in medians.items():
        print(f"  {name:>14}: step ms per round {' '.join(f'{v:.3f}' for v in values)}")


if __name__ == "__main__":
    main()
