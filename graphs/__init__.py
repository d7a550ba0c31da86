"""Builders of the FP32 ONNX graphs used by the demo, tests and benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import onnx

from ._common import IR_VERSION, OPSET
from .feeds import guess_vocabulary, load_feeds, model_feeds, random_input
from .llama import LlamaConfig, llama_decoder
from .simple import matmul_chain, mlp, single_matmul

# Default builds by short name; entries are factories so importing builds nothing.
BUILDERS: dict[str, Callable[[], onnx.ModelProto]] = {
    "matmul": partial(single_matmul, 4096, 4096),
    "chain": partial(matmul_chain, 4, 1024),
    "mlp": mlp,
    "llama": llama_decoder,
}

__all__ = [
    "BUILDERS",
    "IR_VERSION",
    "OPSET",
    "LlamaConfig",
    "llama_decoder",
    "matmul_chain",
    "mlp",
    "guess_vocabulary",
    "load_feeds",
    "model_feeds",
    "random_input",
    "single_matmul",
]
