"""The contract of the op library's nodes: the one home of every name, rule and format they share.

Everything that writes or reads a ``CimInt4MatMul`` node (the exporter, the MatMulNBits
converter, the reference backend, validation, the tests) takes its names, checks and node
layout from here, and the C++ library gets the same constants from a header CMake generates
from this file at build time (``ops/cpp/CMakeLists.txt``: it reads the ``NAME = value`` lines
below, so keep them literal, one per line). This module imports nothing else of the package.

The node (docs/contract.md has the full table, pinned to ``ATTRIBUTES`` by a test):

* ``K``, ``N`` (int >= 1) and ``group_size`` (one of ``SUPPORTED_GROUP_SIZES``; absent = 32):
  ``y[..., N] = a[..., K] @ W[K, N]`` with ``groups = ceil(K / group_size)`` scale groups along K.
* ``bits`` (optional int, one of ``SUPPORTED_BITS``; absent = 4): the code width b.
* ``grid`` (optional string, one of ``GRIDS``; absent = ``"uniform"``): what a code stands for. ``uniform``:
  code c is ``q = c - 2^(b-1)``; ``normal`` (widths ``GRID_BITS`` only): ``q = NORMAL_LEVELS_<b>[c]``, a
  fixed non-uniform set of integers near a Gaussian's Lloyd-Max levels (``levels`` gives either).
* ``packed`` uint8 ``[N, groups * group_size * b / 8]``: row n holds channel n along K as one
  little-endian bit stream, element k in bits ``k*b .. k*b + b-1`` (least significant bit first),
  stored as the code ``q + 2^(b-1)`` (0 .. 2^b - 1); padding codes beyond K are ``2^(b-1)``
  (q = 0). For b = 4 that is two codes per byte, **even k in the low nibble**. ``pack`` /
  ``unpack`` are this byte order.
* ``scales`` float32, float16 or int8 ``[N, groups]``; any finite scale whose ``2^(b-1) * |scale|`` is
  finite in float32. int8 scales q come with ``super_scales`` float16 ``[N, ceil(groups / SUPER_GROUPS)]``:
  the scale of group g is ``float32(q) * float32(super_scales[n, g // SUPER_GROUPS]) / 128`` (exact in
  float32; ``int8_scales`` makes both from float scales, ``scale_values`` reads them back).
* ``bias`` (optional) float32 ``[N]``, finite.
* ``compute`` (optional string, one of ``COMPUTE_MODES``; absent = ``"fp32"``); a session's
  config entry ``COMPUTE_CONFIG`` overrides it for every node.
* ``gated`` (optional string, one of ``GATED_ACTIVATIONS``): a gated MLP's two projections in one
  node. ``N`` is even and counts both: channels ``[0, N/2)`` are the gate, ``[N/2, N)`` the up
  projection (codes, scales and bias in that order), and the node outputs ``N/2`` channels,
  ``y = act(a @ W[:, :N/2]) * (a @ W[:, N/2:])`` (act by ``GATED_FORMULAS``).

Dequantized, ``W[k, n] = scale(n, k // group_size) * q(code(n, k))``, q by the grid (``c - 2^(b-1)``), the scale
``float32(scales[n, g])`` (float32 or float16) or the int8 product above.

In Python a node's ``scales`` are always the values (float32 or float16 arrays; float32 for int8
scales, with ``super_scales`` set): the int8 form is how ``to_node`` writes them and
``from_node`` reads them, so code that computes with ``scales`` never sees the codes.

How to grow it (each is rows/fields here, then the code that uses them):

* **A second op with the same codes/scales layout**: add its name (``*_OP_TYPE = "..."``,
  which CMake's header generator must also list) and an ``OpSpec`` row with its inputs and the
  subset of ``ATTRIBUTES`` it takes (plus any new ``Attribute`` rows). ``CimInt4Gather``
  (``GATHER``) and the tied-head form of the MatMul (``MATMUL_SHARED``) read the codes and
  scales as initializer inputs: ``SharedInt4Node`` writes them; ``Int4Node`` writes and
  ``Int4Node.from_node`` checks the attribute form (``OPS``).
* **A bit width**: add it to ``SUPPORTED_BITS``; ``pack``/``unpack`` and the shapes in
  ``Int4Node`` follow ``bits`` (the bit stream above holds any width up to 8).
* **A grid** (what codes stand for): add its name to ``GRIDS`` and its levels per width
  (``<NAME>_LEVELS_<b>``, integers ascending within +-2^b, read by CMake) to ``levels``; the op's
  level tables (kernel.h's ``CodeLevels``, ``make_levels`` in repack.cpp) cover widths up to 3.
* **A scale dtype**: add it to ``SCALE_DTYPES`` (the ``scales`` row lists them); one that needs a
  second tensor (int8: ``super_scales``) encodes in ``Int4Node.attributes`` and decodes in
  ``from_node``, so that ``scales`` stay values everywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

# --- names (read by CMake: keep each a literal on its own line) -------------------------------
OP_DOMAIN = "dbhoo.cim"
OP_TYPE = "CimInt4MatMul"
OP_VERSION = 1
# The domain version a model declares when a node has a non-uniform ``grid``: a library from before grids
# (versions 1..1) then refuses the model instead of reading its codes as uniform; ours runs 1..GRID_OP_VERSION.
GRID_OP_VERSION = 2
# The int4 row gather (token embeddings, docs/embeddings.md): same domain and version, same codes/scales.
GATHER_OP_TYPE = "CimInt4Gather"
# Session config entry that sets the compute mode of every node of a session.
COMPUTE_CONFIG = "cim_int4.compute"
COMPUTE_MODES = ("fp32", "int8")
DEFAULT_COMPUTE = "fp32"
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 32
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
DEFAULT_BITS = 4
SCALE_DTYPES = ("float32", "float16", "int8")
# What a code stands for (attribute ``grid``): ``uniform`` q = code - 2^(b-1); ``normal`` q = NORMAL_LEVELS_<b>[code],
# integers near the Lloyd-Max levels of a Gaussian (3 bits: +-0.245, 0.756, 1.344, 2.152 times 3.72), for
# rotated weights (docs/widths.md); levels within +-2^b, so int8 mode's u8 codes q + max stay under 2^(b+1).
GRIDS = ("uniform", "normal")
DEFAULT_GRID = "uniform"
GRID_BITS = (2, 3)
NORMAL_LEVELS_2 = (-3, -1, 1, 3)
NORMAL_LEVELS_3 = (-8, -5, -3, -1, 1, 3, 5, 8)
# int8 scales: each group's scale is int8 q times the float16 super-scale d of its super-block of
# SUPER_GROUPS groups (attribute ``super_scales``) over INT8_SCALE_ONE: float32(q) * (float32(d) / 128),
# exact in float32 (a power of two, and an int8 times a float16).
SUPER_GROUPS = 8
INT8_SCALE_ONE = 128
# Activations of a gated node (attribute ``gated``): y = act(A @ W_gate) * (A @ W_up), see GATED_FORMULAS.
GATED_ACTIVATIONS = ("silu", "gelu_tanh")
# Each is act(g) = g / (1 + exp(-t(g))) with this t (gelu_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))).
GATED_FORMULAS = {"silu": "t = g", "gelu_tanh": "t = 2 sqrt(2/pi) (g + 0.044715 g^3)"}

# --- attribute names (read by CMake: keep each a literal on its own line) -----------------------
ATTR_K = "K"
ATTR_N = "N"
ATTR_GROUP_SIZE = "group_size"
ATTR_BITS = "bits"
ATTR_PACKED = "packed"
ATTR_SCALES = "scales"
ATTR_SUPER_SCALES = "super_scales"
ATTR_BIAS = "bias"
ATTR_COMPUTE = "compute"
ATTR_GATED = "gated"
ATTR_GRID = "grid"


def check_compute(compute: str, what: str = "compute") -> str:
    """``compute`` if it is one of COMPUTE_MODES, else ValueError naming ``what``."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"{what} must be one of {COMPUTE_MODES}, got {compute!r}")
    return compute


def check_group_size(group_size: int) -> int:
    """``group_size`` if the op accepts it, else ValueError."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}")
    return group_size


def groups_of(k: int, group_size: int) -> int:
    """Scale groups along K: ``ceil(K / group_size)``."""
    return -(-k // group_size)


def check_bits(bits: int) -> int:
    """``bits`` if the op accepts that code width, else ValueError."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def check_grid(grid: str, bits: int = DEFAULT_BITS) -> str:
    """``grid`` if codes of ``bits`` bits may stand for it (GRIDS; ``normal`` at GRID_BITS only), else ValueError."""
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    if grid != "uniform" and bits not in GRID_BITS:
        raise ValueError(f"grid {grid!r} is for bits {GRID_BITS}, got bits={bits}")
    return grid


def grid_of(grid: str, bits: int) -> str:
    """The grid a layer of ``bits`` bits gets when an export asks for ``grid``: it if the width has it, else uniform."""
    return grid if grid == "uniform" or bits in GRID_BITS else "uniform"


_NORMAL_LEVELS = {2: NORMAL_LEVELS_2, 3: NORMAL_LEVELS_3}


def levels(bits: int = DEFAULT_BITS, grid: str = DEFAULT_GRID) -> np.ndarray:
    """int16 [2^bits]: the q each code stands for (sorted ascending; uniform: ``code - 2^(bits-1)``)."""
    check_grid(grid, check_bits(bits))
    if grid == "normal":
        return np.array(_NORMAL_LEVELS[bits], dtype=np.int16)
    return np.arange(1 << bits, dtype=np.int16) - code_offset(bits)


def max_level(bits: int = DEFAULT_BITS, grid: str = DEFAULT_GRID) -> int:
    """The largest ``|q|`` of a grid (``2^(bits-1)`` uniform): the op needs ``max_level * |scale|`` finite."""
    return int(np.abs(levels(bits, grid)).max())


def round_to_grid(x: np.ndarray, bits: int = DEFAULT_BITS, grid: str = DEFAULT_GRID) -> np.ndarray:
    """The q nearest each ``x`` (in steps of the scale), as float32: uniform ``clip(rint(x))`` (half to even),
    otherwise the nearest level (a tie goes to the level nearer zero)."""
    if grid == "uniform":
        return np.clip(np.rint(x), *q_range(bits)).astype(np.float32, copy=False)
    lv = levels(bits, grid).astype(np.float32)
    mid = (lv[1:] + lv[:-1]) / 2
    x = np.asarray(x, dtype=np.float32)
    # searchsorted puts x == mid on the left level; flip the sign test for positive mids so ties go inward.
    idx = np.where(x >= 0, np.searchsorted(mid, x, side="left"), np.searchsorted(mid, x, side="right"))
    return lv[idx]


def code_offset(bits: int = DEFAULT_BITS) -> int:
    """The stored code of q = 0: ``2^(bits-1)`` (8 for 4 bits)."""
    return 1 << (bits - 1)


def q_range(bits: int = DEFAULT_BITS) -> tuple[int, int]:
    """The smallest and largest q of a width: ``-2^(bits-1)`` and ``2^(bits-1) - 1``."""
    return -code_offset(bits), code_offset(bits) - 1


def supers_of(groups: int) -> int:
    """Super-blocks of int8 scales along a row of ``groups`` groups: ``ceil(groups / SUPER_GROUPS)``."""
    return -(-groups // SUPER_GROUPS)


_FLOAT16_MAX = 65504.0


def int8_steps(super_scales: np.ndarray, groups: int) -> np.ndarray:
    """float32 [N, groups]: each group's super-scale / INT8_SCALE_ONE (exact: a power of two), the value of q = 1."""
    d = np.asarray(super_scales, dtype=np.float16).astype(np.float32) / np.float32(INT8_SCALE_ONE)
    return np.repeat(d, SUPER_GROUPS, axis=1)[:, :groups]


def scale_values(scales: np.ndarray, super_scales: np.ndarray | None = None) -> np.ndarray:
    """The scales the op computes with, float32 [N, groups]: ``scales``, or int8 ``scales`` times super-scales / 128."""
    if super_scales is None:
        return np.asarray(scales).astype(np.float32)
    q = np.asarray(scales)
    return q.astype(np.float32) * int8_steps(super_scales, q.shape[1])


def encode_int8_scales(values: np.ndarray, super_scales: np.ndarray, what: str = "scales") -> np.ndarray:
    """The int8 scales whose ``scale_values`` with ``super_scales`` are ``values``; else ValueError naming ``what``."""
    values = np.asarray(values, dtype=np.float32)
    step = int8_steps(super_scales, values.shape[1])
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.rint(values / np.where(step != 0, step, 1)), 0)
    if np.any(np.abs(q) > 127) or not np.array_equal(scale_values(q, super_scales), values):
        raise ValueError(f"{what}: scales are not int8 multiples of their super_scales / {INT8_SCALE_ONE}")
    return q.astype(np.int8)


def int8_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """int8 ``q`` [N, groups] and float16 super-scales [N, supers] nearest ``scales``; None if float16 cannot hold one
    (beyond 65504, or so small that float16 moves it by more than 2^-9 of itself).

    Each super-scale is its super-block's largest ``|scale|`` times 128/127 in float16, so the
    largest q is about 127; ``scale_values(q, d)`` are the scales the op computes with.
    """
    s = np.asarray(scales, dtype=np.float32)
    n, groups = s.shape
    supers = supers_of(groups)
    padded = np.zeros((n, supers * SUPER_GROUPS), dtype=np.float32)
    padded[:, :groups] = np.abs(s)
    top = padded.reshape(n, supers, SUPER_GROUPS).max(axis=2).astype(np.float64) * (INT8_SCALE_ONE / 127.0)
    if np.any(top > _FLOAT16_MAX):
        return None
    d = top.astype(np.float16)
    # float16 must hold each super-scale to 2^-9 of itself: subnormal ones (below ~6e-5) round
    # coarser, and under ~3e-8 they vanish with their whole run of groups.
    nonzero = top > 0
    if np.any(np.abs(d[nonzero].astype(np.float64) - top[nonzero]) > top[nonzero] * 2.0**-9):
        return None
    return int8_multiple(s, int8_steps(d, groups)), d


def int8_multiple(scales: np.ndarray, step: np.ndarray) -> np.ndarray:
    """int8 ``q`` nearest ``scales / step``, within +-127; a nonzero scale never gets 0 (that would zero its group,
    while the smallest step rounds each weight to the nearest of 0 and +-step: never farther from it)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(scales / np.where(step > 0, step, 1)), 0)
    q = np.where((q == 0) & (scales != 0) & (step > 0), np.sign(scales), q)
    return np.clip(q, -127, 127).astype(np.int8)


def row_bytes(codes: int, bits: int = DEFAULT_BITS) -> int:
    """Bytes of ``codes`` codes of ``bits`` bits (``codes * bits`` must be a multiple of 8)."""
    if codes * bits % 8:
        raise ValueError(f"{codes} codes of {bits} bits do not fill whole bytes")
    return codes * bits // 8


def pack_codes(codes: np.ndarray, bits: int = DEFAULT_BITS) -> np.ndarray:
    """Pack ``codes`` [N, K_padded] (0 .. 2^bits - 1), each row a little-endian bit stream: uint8 [N, K_padded*b/8]."""
    check_bits(bits)
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"codes must be [N, K_padded], got shape {codes.shape}")
    n, k = codes.shape
    nbytes = row_bytes(k, bits)
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes must lie in 0..{(1 << bits) - 1}")
    if bits == 8:
        return codes.astype(np.uint8)
    if bits == 4:  # the common case, without the 64-bit detour
        c = codes.astype(np.uint8)
        return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
    # Eight codes fill exactly `bits` bytes: build each run of eight as one 64-bit word.
    runs = -(-k // 8)
    padded = np.zeros((n, runs * 8), dtype=np.uint64)
    padded[:, :k] = codes
    words = np.zeros((n, runs), dtype=np.uint64)
    for j in range(8):
        words |= padded[:, j::8] << np.uint64(bits * j)
    out = words.astype("<u8").view(np.uint8).reshape(n, runs, 8)[:, :, :bits].reshape(n, runs * bits)
    return np.ascontiguousarray(out[:, :nbytes])


def unpack_codes(packed: np.ndarray, bits: int = DEFAULT_BITS) -> np.ndarray:
    """Codes of ``packed`` uint8 [N, B] (each row a little-endian bit stream) as uint8 [N, B*8/bits]."""
    check_bits(bits)
    packed = np.asarray(packed, dtype=np.uint8)
    n, nbytes = packed.shape
    count = nbytes * 8 // bits
    if bits == 8:
        return packed.copy()
    if bits == 4:
        return np.stack([packed & 0x0F, packed >> 4], axis=2).reshape(n, -1)
    runs = -(-nbytes // bits)
    raw = np.zeros((n, runs, 8), dtype=np.uint8)
    flat = np.zeros((n, runs * bits), dtype=np.uint8)
    flat[:, :nbytes] = packed
    raw[:, :, :bits] = flat.reshape(n, runs, bits)
    words = raw.reshape(n, runs * 8).view("<u8").reshape(n, runs)
    mask = np.uint64((1 << bits) - 1)
    codes = np.stack([(words >> np.uint64(bits * j)) & mask for j in range(8)], axis=2).reshape(n, runs * 8)
    return codes[:, :count].astype(np.uint8)


def pack(q: np.ndarray, bits: int = DEFAULT_BITS, grid: str = DEFAULT_GRID, pad_from: int | None = None) -> np.ndarray:
    """Pack signed ``q`` [N, K_padded] (levels of ``grid``: ``q_range(bits)`` uniform) as their codes in the contract's
    bit order; columns from ``pad_from`` on (the padding past K) are written as the padding code ``2^(bits-1)``."""
    check_grid(grid, check_bits(bits))
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] * bits % 8:
        raise ValueError(f"q must be [N, K_padded] with K_padded*{bits} a multiple of 8, got shape {q.shape}")
    live = q[:, :pad_from]  # the padding's q (if pad_from is given) are not read
    if grid == "uniform":
        lo, hi = q_range(bits)
        if live.size and (live.min() < lo or live.max() > hi):
            raise ValueError(f"q values must lie in {lo}..{hi}")
        codes = np.clip(q.astype(np.int16), lo, hi) + code_offset(bits)
    else:
        lv = levels(bits, grid)
        codes = np.searchsorted(lv, q).clip(0, len(lv) - 1)
        if live.size and not np.array_equal(lv[codes[:, :pad_from]], live):
            raise ValueError(f"q values must be levels of grid {grid!r}: {lv.tolist()}")
    if pad_from is not None:
        codes[:, pad_from:] = code_offset(bits)
    return pack_codes(codes, bits)


def unpack(packed: np.ndarray, bits: int = DEFAULT_BITS, grid: str = DEFAULT_GRID) -> np.ndarray:
    """Signed ``q`` of ``packed`` uint8 [N, B] (the levels its codes stand for under ``grid``) as int8 [N, B*8/bits]."""
    return levels(bits, grid)[unpack_codes(packed, bits)].astype(np.int8)


# --- the node's attributes ---------------------------------------------------------------------
@dataclass(frozen=True)
class Attribute:
    """One attribute of a node: name, ONNX kind, tensor dtypes (if a tensor), shape, whether required, default."""

    name: str
    kind: str  # "int" | "string" | "tensor"
    dtypes: tuple[str, ...] = ()
    shape: str = ""
    required: bool = True
    default: int | str | None = None
    meaning: str = ""


ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(ATTR_K, "int", meaning="input features (A's last dimension), >= 1"),
    Attribute(ATTR_N, "int", meaning="output features, >= 1"),
    Attribute(
        ATTR_GROUP_SIZE,
        "int",
        required=False,
        default=DEFAULT_GROUP_SIZE,
        meaning=f"K elements per scale, one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}",
    ),
    Attribute(
        ATTR_BITS,
        "int",
        required=False,
        default=DEFAULT_BITS,
        meaning=f"code width b, one of {', '.join(map(str, SUPPORTED_BITS))}",
    ),
    Attribute(
        ATTR_GRID,
        "string",
        required=False,
        default=DEFAULT_GRID,
        meaning=f"what a code stands for, one of {', '.join(GRIDS)}: uniform q = code - 2^(b-1); normal (b = "
        f"{' or '.join(map(str, GRID_BITS))}) q = the code's level, 2 bits {list(NORMAL_LEVELS_2)}, 3 bits "
        f"{list(NORMAL_LEVELS_3)}",
    ),
    Attribute(
        ATTR_PACKED, "tensor", ("uint8",), "[N, groups * group_size * b / 8]",
        meaning="codes (uniform grid: q + 2^(b-1)), each row a little-endian bit stream",
    ),
    Attribute(ATTR_SCALES, "tensor", SCALE_DTYPES, "[N, groups]", meaning="one scale per output channel and group"),
    Attribute(
        ATTR_SUPER_SCALES, "tensor", ("float16",), "[N, ceil(groups / 8)]", required=False,
        meaning="with int8 scales only: scale = q * super_scales[n, g // 8] / 128",
    ),
    Attribute(ATTR_BIAS, "tensor", ("float32",), "[N]", required=False, meaning="added to every output row"),
    Attribute(
        ATTR_COMPUTE,
        "string",
        required=False,
        default=DEFAULT_COMPUTE,
        meaning=f"compute mode, one of {', '.join(COMPUTE_MODES)}",
    ),
    Attribute(
        ATTR_GATED,
        "string",
        required=False,
        meaning=f"gated MLP, one of {', '.join(GATED_ACTIVATIONS)}: N even, channels [0, N/2) the gate, "
        "[N/2, N) the up projection; output N/2 channels act(gate) * up",
    ),
)


@dataclass(frozen=True)
class OpSpec:
    """One op of the library: its type, inputs and outputs, and the attributes it takes (by name)."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]
    # Inputs that may follow ``inputs`` (int8 scales' super-scales of the input form).
    optional_inputs: tuple[str, ...] = ()

    def attribute(self, name: str) -> Attribute:
        """The ATTRIBUTES row ``name`` of this op."""
        return next(a for a in ATTRIBUTES if a.name == name and name in self.attributes)


MATMUL = OpSpec(
    OP_TYPE, ("A",), ("Y",),
    (ATTR_K, ATTR_N, ATTR_GROUP_SIZE, ATTR_BITS, ATTR_GRID, ATTR_PACKED, ATTR_SCALES, ATTR_SUPER_SCALES, ATTR_BIAS,
     ATTR_COMPUTE, ATTR_GATED),
)
OPS: Mapping[str, OpSpec] = {MATMUL.op_type: MATMUL}
# The same codes and scales read as constant-initializer inputs instead of attributes, so that an
# embedding table (CimInt4Gather) and the LM head tied to it hold one copy (docs/embeddings.md).
MATMUL_SHARED = OpSpec(
    OP_TYPE, ("A", ATTR_PACKED, ATTR_SCALES), ("Y",),
    (ATTR_K, ATTR_N, ATTR_GROUP_SIZE, ATTR_BITS, ATTR_GRID, ATTR_BIAS, ATTR_COMPUTE), (ATTR_SUPER_SCALES,),
)
GATHER = OpSpec(
    GATHER_OP_TYPE, (ATTR_PACKED, "indices", ATTR_SCALES), ("Y",), (ATTR_K, ATTR_GROUP_SIZE, ATTR_BITS, ATTR_GRID),
    (ATTR_SUPER_SCALES,),
)


def is_op_node(node: onnx.NodeProto, op: OpSpec = MATMUL) -> bool:
    """Whether ``node`` is an ``op`` node of the library's domain."""
    return node.op_type == op.op_type and node.domain == OP_DOMAIN


# --- one node ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Node:
    """One node's contract values: ``to_node()`` writes the node, ``from_node()`` reads and checks one.

    ``compute=None`` writes no ``compute`` attribute (the op then computes in ``"fp32"``), ``bits=4`` no
    ``bits`` attribute (4 is its default) and the uniform ``grid`` no ``grid``; ``from_node`` fills in the
    defaults, so a read node always has ``group_size``, ``bits``, ``grid`` and ``compute``. ``gated`` (an activation of
    GATED_ACTIVATIONS, else None): ``n`` counts both halves, the node outputs ``outputs_n``.
    ``super_scales`` (float16, else None): the node stores its ``scales`` (then float32 values of
    ``scale_values``) as int8 with these super-scales.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    k: int
    n: int
    group_size: int
    packed: np.ndarray = field(repr=False)
    scales: np.ndarray = field(repr=False)
    bias: np.ndarray | None = field(default=None, repr=False)
    compute: str | None = DEFAULT_COMPUTE
    op: OpSpec = MATMUL
    bits: int = DEFAULT_BITS
    gated: str | None = None
    super_scales: np.ndarray | None = field(default=None, repr=False)
    grid: str = DEFAULT_GRID

    @property
    def groups(self) -> int:
        """Scale groups along K."""
        return groups_of(self.k, self.group_size)

    @property
    def outputs_n(self) -> int:
        """Channels of the output: ``n``, or ``n / 2`` for a gated node."""
        return self.n // 2 if self.gated else self.n

    @property
    def stored_scales(self) -> np.ndarray:
        """``scales`` as the node stores them: as they are, or int8 (ValueError if the values are not those codes)."""
        if self.super_scales is None:
            return self.scales
        return encode_int8_scales(self.scales, self.super_scales, f"{self.op.op_type} node '{self.name}'")

    @property
    def nbytes(self) -> int:
        """Bytes of the node's codes, stored scales and bias (what it streams per token)."""
        scales = self.scales.size if self.super_scales is not None else self.scales.nbytes
        extra = sum(a.nbytes for a in (self.super_scales, self.bias) if a is not None)
        return self.packed.nbytes + scales + extra

    def attributes(self) -> dict[str, object]:
        """The node's attributes as ``helper.make_node`` keywords (tensors as TensorProtos named as the attribute)."""
        values = {ATTR_K: self.k, ATTR_N: self.n, ATTR_GROUP_SIZE: self.group_size, ATTR_BITS: _bits_value(self.bits),
                  ATTR_GRID: _grid_value(self.grid, self.bits), ATTR_PACKED: self.packed,
                  ATTR_SCALES: self.stored_scales, ATTR_SUPER_SCALES: self.super_scales, ATTR_BIAS: self.bias,
                  ATTR_COMPUTE: self.compute, ATTR_GATED: self.gated}
        return _attributes(self.op, values)

    def to_node(self) -> onnx.NodeProto:
        """The ONNX node (domain OP_DOMAIN)."""
        return _make_node(self.op, self.name, self.inputs, self.outputs, self.attributes())

    @classmethod
    def from_node(cls, node: onnx.NodeProto, op: OpSpec | None = None) -> Int4Node:
        """Read and check a node as the op library does; ValueError names the node and the attribute."""
        op = op or OPS.get(node.op_type, MATMUL)
        where = f"{op.op_type} node '{node.name}': "
        if len(node.input) != len(op.inputs) or len(node.output) != len(op.outputs):
            raise ValueError(
                f"{where}has {len(node.input)} inputs and {len(node.output)} outputs, "
                f"expected {len(op.inputs)} and {len(op.outputs)}"
            )
        values = _attribute_values(node, where)
        k = _int(values, op.attribute(ATTR_K), where)
        n = _int(values, op.attribute(ATTR_N), where)
        group_size = _int(values, op.attribute(ATTR_GROUP_SIZE), where)
        bits = _int(values, op.attribute(ATTR_BITS), where)
        for name, value in ((ATTR_K, k), (ATTR_N, n)):
            if value < 1:
                raise ValueError(f"{where}attribute '{name}' is {value}, expected >= 1")
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"{where}attribute 'group_size' is {group_size}, expected one of {SUPPORTED_GROUP_SIZES}")
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"{where}attribute 'bits' is {bits}, expected one of {SUPPORTED_BITS}")
        grid = _grid(values, op, bits, where)
        compute = values.get(ATTR_COMPUTE, DEFAULT_COMPUTE.encode())
        compute = compute.decode() if isinstance(compute, bytes) else compute
        if compute not in COMPUTE_MODES:
            raise ValueError(f"{where}attribute 'compute' is {compute!r}, expected one of {COMPUTE_MODES}")
        gated = values.get(ATTR_GATED)
        gated = gated.decode() if isinstance(gated, bytes) else gated
        if gated is not None and (ATTR_GATED not in op.attributes or gated not in GATED_ACTIVATIONS):
            raise ValueError(f"{where}attribute 'gated' is {gated!r}, expected one of {GATED_ACTIVATIONS}")
        if gated is not None and n % 2:
            raise ValueError(f"{where}attribute 'N' is {n}, expected an even N with 'gated' (gate, then up channels)")
        groups = groups_of(k, group_size)
        packed = _tensor(values, op.attribute(ATTR_PACKED), where, (n, row_bytes(groups * group_size, bits)))
        scales = _tensor(values, op.attribute(ATTR_SCALES), where, (n, groups))
        super_scales = None
        if scales.dtype == np.int8 or ATTR_SUPER_SCALES in values:
            if scales.dtype != np.int8 or ATTR_SUPER_SCALES not in op.attributes:
                raise ValueError(
                    f"{where}attribute 'super_scales' is for int8 'scales' only, got {scales.dtype} scales"
                )
            super_scales = _tensor(values, op.attribute(ATTR_SUPER_SCALES), where, (n, supers_of(groups)))
            if not np.all(np.isfinite(super_scales)):
                row, col = np.argwhere(~np.isfinite(super_scales))[0]
                raise ValueError(f"{where}attribute 'super_scales': [{row}, {col}] is not finite")
            scales = scale_values(scales, super_scales)
        bias = _tensor(values, op.attribute(ATTR_BIAS), where, (n,)) if ATTR_BIAS in values else None
        offset = code_offset(bits)
        padding = unpack_codes(packed, bits)[:, k:]
        if np.any(padding != offset):
            row, col = np.argwhere(padding != offset)[0]
            raise ValueError(f"{where}attribute 'packed': padding code at row {row}, k={k + col} is not {offset}")
        top = max_level(bits, grid)
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite(np.float32(top) * np.abs(scales.astype(np.float32)))
        if np.any(bad):
            row, col = np.argwhere(bad)[0]
            raise ValueError(f"{where}attribute 'scales': [{row}, {col}] is not finite with {top}*|scale| finite")
        if bias is not None and not np.all(np.isfinite(bias)):
            raise ValueError(f"{where}attribute 'bias': index {np.argwhere(~np.isfinite(bias))[0][0]} is not finite")
        return cls(
            node.name, tuple(node.input), tuple(node.output), k, n, group_size, packed, scales, bias, compute, op,
            bits, gated, super_scales, grid,
        )


@dataclass(frozen=True)
class SharedInt4Node:
    """A node that reads its codes and scales as initializer inputs (named in ``inputs``): ``to_node()`` writes it.

    ``op`` is MATMUL_SHARED (inputs: activations, packed, scales) or GATHER (inputs: packed,
    indices, scales), each with int8 scales' ``super_scales`` as a fourth input; ``n``, ``bias``
    and ``compute`` belong to the MatMul only (``compute=None`` writes no attribute). The tensors'
    layout is the attribute form's (``Int4Node``; int8 scales stored as int8).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    k: int
    group_size: int
    op: OpSpec
    n: int | None = None
    bias: np.ndarray | None = field(default=None, repr=False)
    compute: str | None = None
    bits: int = DEFAULT_BITS
    grid: str = DEFAULT_GRID

    def to_node(self) -> onnx.NodeProto:
        """The ONNX node (domain OP_DOMAIN)."""
        if not len(self.op.inputs) <= len(self.inputs) <= len(self.op.inputs) + len(self.op.optional_inputs):
            expected = self.op.inputs + tuple(f"[{name}]" for name in self.op.optional_inputs)
            raise ValueError(f"{self.op.op_type} node '{self.name}' takes inputs {expected}, got {self.inputs}")
        values = {ATTR_K: self.k, ATTR_N: self.n, ATTR_GROUP_SIZE: self.group_size, ATTR_BITS: _bits_value(self.bits),
                  ATTR_GRID: _grid_value(self.grid, self.bits), ATTR_BIAS: self.bias, ATTR_COMPUTE: self.compute}
        return _make_node(self.op, self.name, self.inputs, self.outputs, _attributes(self.op, values))


def _bits_value(bits: int) -> int | None:
    """The ``bits`` attribute to write: none for the default width, so int4 nodes stay as they always were."""
    return None if check_bits(bits) == DEFAULT_BITS else bits


def _grid_value(grid: str, bits: int) -> str | None:
    """The ``grid`` attribute to write: none for the uniform grid, so nodes without a grid stay as they always were."""
    return None if check_grid(grid, bits) == DEFAULT_GRID else grid


def _grid(values: dict[str, object], op: OpSpec, bits: int, where: str) -> str:
    grid = values.get(ATTR_GRID, DEFAULT_GRID.encode())
    grid = grid.decode() if isinstance(grid, bytes) else grid
    if ATTR_GRID not in op.attributes:
        raise ValueError(f"{where}attribute 'grid' is {grid!r}, which {op.op_type} does not take")
    try:
        return check_grid(grid, bits)
    except ValueError as e:
        raise ValueError(f"{where}attribute 'grid': {e}") from None


def _attributes(op: OpSpec, values: Mapping[str, object]) -> dict[str, object]:
    """The ``values`` that ``op`` takes and that are set, as ``helper.make_node`` keywords (arrays as TensorProtos)."""
    return {
        name: numpy_helper.from_array(np.ascontiguousarray(value), name) if isinstance(value, np.ndarray) else value
        for name, value in values.items()
        if name in op.attributes and value is not None
    }


def _make_node(
    op: OpSpec, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], attrs: Mapping[str, object]
) -> onnx.NodeProto:
    return helper.make_node(op.op_type, list(inputs), list(outputs), name=name, domain=OP_DOMAIN, **attrs)


def _attribute_values(node: onnx.NodeProto, where: str) -> dict[str, object]:
    values: dict[str, object] = {}
    for attr in node.attribute:
        try:
            values[attr.name] = helper.get_attribute_value(attr)
        except Exception as e:  # noqa: BLE001 - onnx raises several types for unreadable attributes
            raise ValueError(f"{where}attribute '{attr.name}' cannot be read ({e})") from None
    return values


def _int(values: dict[str, object], spec: Attribute, where: str) -> int:
    value = values.get(spec.name, spec.default)
    if value is None or not isinstance(value, int):
        raise ValueError(f"{where}attribute '{spec.name}' is missing or not an int")
    return value


def _tensor(values: dict[str, object], spec: Attribute, where: str, shape: tuple[int, ...]) -> np.ndarray:
    expected = f"{' or '.join(spec.dtypes)} tensor {list(shape)}"
    value = values.get(spec.name)
    if not isinstance(value, onnx.TensorProto):
        raise ValueError(f"{where}attribute '{spec.name}' is missing or not a tensor (expected {expected})")
    try:
        array = numpy_helper.to_array(value)
    except Exception as e:  # noqa: BLE001 - e.g. external data that was not loaded
        raise ValueError(f"{where}attribute '{spec.name}' cannot be read ({e})") from None
    if array.dtype.name not in spec.dtypes:
        raise ValueError(f"{where}attribute '{spec.name}' has element type {array.dtype}, expected {expected}")
    if array.shape != shape:
        raise ValueError(f"{where}attribute '{spec.name}' has shape {list(array.shape)}, expected {expected}")
    return array
