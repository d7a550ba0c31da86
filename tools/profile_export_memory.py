"""Where a calibrated export's peak RSS comes from: RSS sampled every 20 ms, attributed to the export's phases.

    python tools/profile_export_memory.py FP32_FOLDER OUT.onnx --tokens calib.npy --windows 2 --method gptq

Wraps the exporter's phase functions (probe, calibration pass, quantization, probe runs, rewrite,
the exported model's check, the write) and prints, per phase, the RSS at entry, the peak inside
it and at exit (split into anonymous memory and mapped file pages), then the whole run's peak
(getrusage) beside the FP32 weights' size.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import threading
import time
from pathlib import Path

import numpy as np


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    return _status("VmRSS")


class Sampler(threading.Thread):
    """Keeps the largest RSS seen since the last ``mark``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.02)

    def mark(self) -> int:
        peak, self.peak = self.peak, _rss()
        return peak


def _wrap(owner: object, name: str, label: str, sampler: Sampler, log: list) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def inner(*a, **k):  # noqa: ANN002, ANN003, ANN202
        before = _rss()
        sampler.mark()
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            log.append((label, before, sampler.mark(), _rss(), time.perf_counter() - t0))
            anon, file = _status("RssAnon"), _status("RssFile")
            mine = [row for row in log[:-1] if row[0] == label]
            if len(mine) < 2 or log[-1][2] > max(row[2] for row in mine):  # a phase called per layer: its new highs
                print(f"  {label:<28} entry {before / 2**20:7.0f} MiB  peak {log[-1][2] / 2**20:7.0f} MiB  "
                      f"exit {log[-1][3] / 2**20:7.0f} MiB (anon {anon / 2**20:.0f}, file {file / 2**20:.0f})  "
                      f"{log[-1][4]:6.1f} s", flush=True)  # fmt: skip

    setattr(owner, name, inner)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("out")
    p.add_argument("--tokens", required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--method", default="gptq")
    p.add_argument("--rule", default="mse")
    p.add_argument("--bos", type=int, default=None)
    p.add_argument("--act-order", action="store_true", help="GPTQ sweeps channels by decreasing H[k, k]")
    p.add_argument(
        "--options", default="{}", help='more export options as JSON, e.g. \'{"bits": "auto", "bits_budget": 3.0}\''
    )
    args = p.parse_args()

    import cim_int4.exporter.allocate as allocate
    import cim_int4.exporter.api as api
    import cim_int4.exporter.methods as methods
    import cim_int4.exporter.probe as probe
    import cim_int4.exporter.sensitivity as sensitivity
    import cim_int4.exporter.writer as writer
    from cim_int4.exporter import export_int4

    sampler = Sampler()
    sampler.start()
    log: list = []
    _wrap(probe.Probe, "__init__", "Probe (model + session)", sampler, log)
    _wrap(probe.Probe, "calibrate", "calibration pass", sampler, log)
    _wrap(probe.Probe, "cosines", "probe run (int4 weights)", sampler, log)
    _wrap(methods, "quantize_candidates", "quantize", sampler, log)
    _wrap(allocate, "relative_error", "bits auto: a width's error", sampler, log)
    _wrap(sensitivity, "rewrite_model", "rewrite", sampler, log)
    _wrap(sensitivity, "proto_session", "exported model's session", sampler, log)
    _wrap(api, "_commit", "write", sampler, log)
    _wrap(writer.OutputFiles, "commit", "write (streamed)", sampler, log)
    _wrap(probe.Probe, "reference", "FP32 reference run", sampler, log)
    _wrap(api, "read_model", "read", sampler, log)

    folder = Path(args.folder)
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    tokens = np.load(args.tokens)
    span = 512 - (args.bos is not None)
    kv = (1, config["num_key_value_heads"], 0, config["head_size"])
    feeds = []
    for i in range(args.windows):
        body = tokens[i * span : (i + 1) * span]
        ids = (body if args.bos is None else np.concatenate([[args.bos], body]))[None, :].astype(np.int64)
        feeds.append({"input_ids": ids, "attention_mask": np.ones_like(ids),
                      **{f"past_key_values.{j}.{kv_}": np.zeros(kv, np.float32)
                         for j in range(config["num_hidden_layers"]) for kv_ in ("key", "value")}})  # fmt: skip
    t0 = time.perf_counter()
    options = {"target_cosine": 0.0, "gptq_act_order": args.act_order, **json.loads(args.options)}
    export_int4(folder / config["filename"], args.out, method=args.method, scale_rule=args.rule, feeds=feeds,
                external_data=True, quiet=True, **options)  # fmt: skip
    seconds = time.perf_counter() - t0
    for label in dict.fromkeys(row[0] for row in log):
        mine = [row for row in log if row[0] == label]
        print(
            f"  {label:<28} {len(mine):5d} call(s), highest peak {max(r[2] for r in mine) / 2**20:7.0f} MiB, "
            f"{sum(r[4] for r in mine):7.1f} s in all",
            flush=True,
        )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = usage.ru_maxrss * 1024
    weights = (folder / (config["filename"] + ".data")).stat().st_size
    print(json.dumps({"method": args.method, "options": json.loads(args.options), "rule": args.rule,
                      "windows": args.windows, "seconds": seconds,
                      "cpu_seconds": usage.ru_utime + usage.ru_stime,
                      "peak_rss": peak, "fp32_bytes": weights, "peak_over_fp32": peak / weights}))  # fmt: skip


if __name__ == "__main__":
    main()
