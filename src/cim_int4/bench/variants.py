"""How a workload's graph is run: FP32 ORT, ORT MatMulNBits, CimInt4MatMul per compute mode; their weight bytes."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import onnx
from onnx import TensorProto

from ..contract import COMPUTE_CONFIG, OP_DOMAIN, OP_TYPE
from ..exporter import export_with_summary
from .errors import BenchError

BLOCK_SIZE = 32


def _quiet_quantizer_logs() -> contextlib.AbstractContextManager:
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")

    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        level = logger.level
        logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.setLevel(level)

    return quiet()


def nbits_quantizer() -> type:
    """ORT's MatMulNBitsQuantizer class, or BenchError saying how to get it."""
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        hint = "pip install onnx-ir" if "onnx_ir" in str(missing) else f"({e})"
        raise BenchError(
            "the MatMulNBits baseline needs ORT's MatMulNBitsQuantizer, which imports the onnx-ir package "
            f"that the onnxruntime wheel does not declare: {hint}"
        ) from e
    finally:
        # The module calls logging.basicConfig(level=INFO) on import; keep the root logger as it was.
        root.setLevel(level)
        root.handlers[:] = handlers
    return MatMulNBitsQuantizer


def quantize_nbits(model: onnx.ModelProto, accuracy_level: int) -> onnx.ModelProto:
    """``model`` with its constant-weight MatMuls as ORT MatMulNBits (4 bits, block 32, symmetric)."""
    quantizer_class = nbits_quantizer()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantizer edits the model it is given
    with _quiet_quantizer_logs():
        quantizer = quantizer_class(
            copy, bits=4, block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=accuracy_level
        )
        quantizer.process()
    return quantizer.model.model


def quantize_cim_int4(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its constant-weight MatMuls as CimInt4MatMul (group 32)."""
    return export_with_summary(model, group_size=BLOCK_SIZE)[0]


def _unchanged(model: onnx.ModelProto) -> onnx.ModelProto:
    return model


@dataclass(frozen=True)
class Variant:
    """One way to run a workload's graph."""

    name: str
    description: str
    build: Callable[[onnx.ModelProto], onnx.ModelProto] = field(compare=False)
    # The MatMulNBits variant of the same accuracy (activation precision), for the "vs nbits" column.
    peer: str | None = None
    # Environment set while the variant's session is created (the op reads CIM_INT4_KERNEL then).
    env: tuple[tuple[str, str], ...] = ()
    # ORT session config entries of the variant's sessions (e.g. the compute mode).
    config: tuple[tuple[str, str], ...] = ()
    # Raises BenchError when something the variant needs is missing; run before any measuring.
    check: Callable[[], object] | None = field(default=None, compare=False)


BASELINE = "fp32"
BASELINES: tuple[Variant, ...] = (
    Variant(BASELINE, "FP32 MatMul in plain ORT", _unchanged),
    Variant(
        "nbits-acc0",
        "ORT MatMulNBits, 4 bits, block 32, symmetric, accuracy_level 0 (FP32 compute)",
        partial(quantize_nbits, accuracy_level=0),
        check=nbits_quantizer,
    ),
    Variant(
        "nbits-acc4",
        "ORT MatMulNBits, 4 bits, block 32, symmetric, accuracy_level 4 (int8 activations)",
        partial(quantize_nbits, accuracy_level=4),
        check=nbits_quantizer,
    ),
)
# COMPUTE_CONFIG chooses CimInt4MatMul's compute mode for every node of a session; a library
# that does not know it runs each node's own mode.
# CimInt4MatMul, one entry per compute mode, each beside the MatMulNBits of the same activation precision.
COMPUTE_MODES: tuple[Variant, ...] = (
    Variant(
        "cim-int4 fp32",
        "CimInt4MatMul, group 32, FP32 activations (session config cim_int4.compute=fp32), kernel by CPUID",
        quantize_cim_int4,
        peer="nbits-acc0",
        config=((COMPUTE_CONFIG, "fp32"),),
    ),
    Variant(
        "cim-int4 int8",
        "CimInt4MatMul, group 32, int8 activations (session config cim_int4.compute=int8), kernel by CPUID",
        quantize_cim_int4,
        peer="nbits-acc4",
        config=((COMPUTE_CONFIG, "int8"),),
    ),
)
VARIANTS: tuple[Variant, ...] = BASELINES + COMPUTE_MODES


def select_variants(names: Sequence[str] | None) -> tuple[Variant, ...]:
    """The variants named (all if None), always with fp32 first as the reference; ValueError for unknown names."""
    if not names:
        return VARIANTS
    known = {v.name: v for v in VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    wanted = [BASELINE, *(n for n in names if n != BASELINE)]
    return tuple(known[n] for n in dict.fromkeys(wanted))


def _tensor_bytes(t: TensorProto) -> int:
    count = int(np.prod(t.dims, dtype=np.int64))
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (count + 1) // 2
    return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def constant_bytes(model: onnx.ModelProto) -> int:
    """Bytes of every constant a forward pass reads: initializers and tensor attributes (packed weights, scales)."""
    total = sum(_tensor_bytes(t) for t in model.graph.initializer)
    for node in model.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                total += _tensor_bytes(a.t)
            elif a.type == onnx.AttributeProto.TENSORS:
                total += sum(_tensor_bytes(t) for t in a.tensors)
    return total


def int4_weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the codes, scales and super-scales of every CimInt4MatMul: what the memory ratio divides by."""
    return sum(
        _tensor_bytes(a.t)
        for node in model.graph.node
        if node.op_type == OP_TYPE and node.domain == OP_DOMAIN
        for a in node.attribute
        if a.name in ("packed", "scales", "super_scales")
    )


@contextlib.contextmanager
def _environment(overrides: Mapping[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
