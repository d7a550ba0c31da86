"""``cim-int4 tune``: time the kernel variants on this CPU, print the table, save the choice to the profile."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .ops import tuning


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tune`` command's options."""
    p.add_argument(
        "--kernel", default="auto", help="ISA path to tune (default: auto, the one sessions use; see CIM_INT4_KERNEL)"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=0.8,
        help="time budget of the timing rounds (default 0.8; up to twice it while a choice is open)",
    )
    p.add_argument("--no-save", action="store_true", help="print the table only; leave the profile as it is")
    p.add_argument("--json", metavar="FILE", help="also write the full report as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    """Runs the tuner and prints its table; returns the exit code."""
    if not args.seconds > 0 or args.seconds > 60:
        raise ValueError(f"tune: --seconds must be in (0, 60], got {args.seconds}")
    if args.json and Path(args.json).exists():
        raise ValueError(f"tune: --json {args.json} exists; not overwriting it")
    report = tuning.tune(args.kernel, seconds=args.seconds, save=not args.no_save)
    print(tuning.format_report(report))
    if args.json:
        with open(args.json, "x") as f:  # never overwrite a user's file
            json.dump(report, f, indent=1)
    return 0
