"""Code widths per layer: the export's ``bits`` option and what a width costs in bits per weight.

``bits`` is one of:

* an int in ``contract.SUPPORTED_BITS`` (2, 3, 4, 5, 6, 8): every layer at that width;
* a mapping ``{node name or regular expression: bits}``: the first pattern (in order) equal to
  or fully matching a layer's name gives its width, the others get ``DEFAULT_BITS`` (4). A
  token embedding (CimInt4Gather) matches by its Gather's name or its table's name, and a
  tied LM head reads the table's codes, so it has the table's width;
* ``"auto"``: widths chosen per layer from measured sensitivity on the calibration inputs
  (``exporter.allocate``), under ``bits_budget`` (average bits per weight, scales included)
  or, without a budget, the fewest bytes that reach ``target_cosine``.

On the command line (``parse_bits``): ``--bits 3``, ``--bits auto`` or
``--bits 'PATTERN=8,PATTERN=3'``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..contract import DEFAULT_BITS, SUPPORTED_BITS, check_bits, groups_of, supers_of

AUTO = "auto"
CATCH_ALL = ".*"  # a bits pattern naming every layer no earlier pattern named ("others")
FP32_BITS = 32.0  # bits per weight of a layer left in float32
SCALE_BITS = {"float32": 32, "float16": 16, "int8": 8}  # int8 adds a float16 super-scale per SUPER_GROUPS groups

# The normalised option: an int, "auto", or ((pattern, bits), ...) in the order given.
Bits = int | str | tuple[tuple[str, int], ...]


def normalize_bits(bits: object) -> Bits:
    """The ``bits`` option checked and made immutable; ValueError says what was expected."""
    if isinstance(bits, str):
        if bits == AUTO:
            return AUTO
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, 'auto' or a mapping of node patterns, got {bits!r}")
    if isinstance(bits, bool):
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if isinstance(bits, int):
        return check_bits(bits)
    pairs = bits.items() if isinstance(bits, Mapping) else bits
    try:
        pairs = tuple((str(p), int(b)) for p, b in pairs)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"bits must be an int, 'auto' or a mapping {{node pattern: bits}}, got {bits!r}") from None
    for pattern, b in pairs:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"bits pattern {pattern!r} is not a valid regular expression: {e}") from None
        if b not in SUPPORTED_BITS:
            raise ValueError(f"bits for pattern {pattern!r} must be one of {SUPPORTED_BITS}, got {b!r}")
    return pairs


def parse_bits(text: str) -> Bits:
    """The ``--bits`` flag: ``3``, ``auto`` or ``PATTERN=B[,PATTERN=B...]``."""
    text = text.strip()
    if text == AUTO:
        return AUTO
    if text.lstrip("-").isdigit():
        return normalize_bits(int(text))
    pairs = []
    for item in text.split(","):
        pattern, sep, b = item.rpartition("=")
        if not sep or not pattern or not b.strip().isdigit():
            raise ValueError(f"--bits {text!r}: expected a width, 'auto' or PATTERN=BITS[,PATTERN=BITS...]")
        pairs.append((pattern.strip(), int(b)))
    return normalize_bits(pairs)


def width_of(bits: Bits, *names: str) -> int:
    """The width the option gives a layer known by ``names`` (node name, key, table name); "auto": DEFAULT_BITS."""
    if isinstance(bits, int):
        return bits
    if isinstance(bits, tuple):
        for pattern, b in bits:
            if any(name == pattern or re.fullmatch(pattern, name) for name in names if name):
                return b
    return DEFAULT_BITS


def bits_per_weight(k: int, n: int, group_size: int, bits: int | None, scale_dtype: str) -> float:
    """Bits per weight of a [K, N] layer stored ``bits`` wide (codes with K's padding, plus scales); None: FP32."""
    if bits is None:
        return FP32_BITS
    groups = groups_of(k, group_size)
    supers = supers_of(groups) * 16 if scale_dtype == "int8" else 0
    return (groups * group_size * bits + groups * SCALE_BITS[scale_dtype] + supers) / k


def describe(bits: Bits) -> str:
    """The option as the summary names it."""
    if isinstance(bits, tuple):
        others = DEFAULT_BITS
        if bits and bits[-1][0] == CATCH_ALL:  # a last catch-all is the others' width
            bits, others = bits[:-1], bits[-1][1]
        return ", ".join(f"{p}={b}" for p, b in bits) + f" (others {others})"
    return str(bits)
