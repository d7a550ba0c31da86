"""One decode step of several causal LMs under plain ORT, interleaved: per-model medians and paired ratios.

    python tools/step_ab.py [--threads 1 2] [--rounds 30] [--past 32] LABEL=SOURCE ...

SOURCE is an ONNX causal LM or a genai folder (``cim_int4.perplexity.open_model``). Each model's
step (one token after ``past`` cached tokens) is bound once with IOBinding, as a C++ caller runs
it, the KV cache in one buffer with the present outputs where genai shares them
(``cim_int4.op_profile.bind_step``), so no numpy copies are timed. Per round each model runs a
block of 10 steps (the block's median kept), after a 20 ms pause so the previous session's pool
threads stop spinning: sessions alternated step by step steal each other's second core on a 2-vCPU
guest. Reports each model's median over rounds and the median over rounds of the first model's
block time over this one's (a speed ratio; the figure to trust on a shared host), with the CPU's
model name. No profiler: it adds several microseconds per node (``cim_int4.op_profile``). The
LABEL=SOURCE words may come before or after the options.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from cim_int4.bench.machine import cpu_model
from cim_int4.op_profile import bind_step, interleaved_blocks
from cim_int4.perplexity import PerplexityError, open_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="LABEL=SOURCE; the first is the ratios' base")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--past", type=int, default=32)
    # LABEL=SOURCE words first, wherever they were given: --threads takes every word after it.
    words = sys.argv[1:]
    models = [w for w in words if "=" in w and not w.startswith("-")]
    args = parser.parse_args(models + [w for w in words if w not in models])
    if bad := [m for m in args.models if "=" not in m or m.startswith("=") or m.endswith("=")]:
        parser.error(f"expected LABEL=SOURCE, got {bad[0]!r}")
    if args.rounds < 1 or args.past < 0 or min(args.threads) < 1:
        parser.error("need --rounds >= 1, --past >= 0 and --threads >= 1")
    labels, sources = zip(*(m.split("=", 1) for m in args.models), strict=True)
    for threads in args.threads:
        try:
            models = [open_model(s, threads=threads) for s in sources]
        except PerplexityError as e:
            parser.exit(2, f"step_ab: {e}\n")
        bindings = [bind_step(model, args.past) for model in models]
        times = interleaved_blocks([(m.session, b) for m, b in zip(models, bindings, strict=True)], args.rounds)
        for label, t in zip(labels, times, strict=True):
            ratio = statistics.median(a / b for a, b in zip(times[0], t, strict=True))
            print(f"{threads} thread(s)  {label:<16} {statistics.median(t) * 1e3:7.2f} ms per step  "
                  f"{ratio:.3f}x as fast as {labels[0]}")  # fmt: skip
        del models, bindings
    print(f"CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
