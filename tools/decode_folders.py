"""genai greedy decode tokens/s of several model folders, interleaved, with per-round ratios to the first.

    python tools/decode_folders.py [--threads 1 2] [--rounds 5] [--steps 32] LABEL=FOLDER ... [--json OUT]

Per thread count every folder is loaded, warmed up once, then decoded ``rounds`` times in turn
(a 16-token prompt, ``steps`` new tokens, KV cache of 512). Reports tokens/s medians and minima of
the time, and the median over rounds of each folder's speed over the first folder's in the same
round (the figure to trust on a shared host), with the CPU's model name.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from cim_int4.bench.machine import cpu_model
from cim_int4.genai_bench import greedy, load

KV_CAPACITY = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="LABEL=FOLDER; the first is the ratios' base")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()
    folders = dict(item.split("=", 1) for item in args.folders)
    vocab = json.loads((Path(next(iter(folders.values()))) / "genai_config.json").read_text())["model"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(3, min(vocab, 30000), 16).tolist()
    report: dict = {"cpu": cpu_model(), "steps": args.steps, "rounds": args.rounds, "threads": {}}
    base = next(iter(folders))
    for t in args.threads:
        models = {label: load(path, t) for label, path in folders.items()}
        for model in models.values():
            greedy(model, prompt, args.steps, KV_CAPACITY)
        times: dict[str, list[float]] = {label: [] for label in models}
        for _ in range(args.rounds):
            for label, model in models.items():
                times[label].append(greedy(model, prompt, args.steps, KV_CAPACITY).decode_s)
        rows = {}
        for label, v in times.items():
            ratios = [b / x for b, x in zip(times[base], v, strict=True)]
            rows[label] = {
                "tokens_per_s": (args.steps - 1) / statistics.median(v),
                "tokens_per_s_best": (args.steps - 1) / min(v),
                "ratio_to_first": statistics.median(ratios),
            }
            print(f"{t} thread(s)  {label:<24} {rows[label]['tokens_per_s']:7.1f} tok/s "
                  f"(best {rows[label]['tokens_per_s_best']:7.1f})  x{rows[label]['ratio_to_first']:.3f} {base}",
                  flush=True)  # fmt: skip
        report["threads"][str(t)] = rows
        del models
    print(f"CPU: {report['cpu']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
