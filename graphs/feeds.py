"""Random float32 feeds for a model's graph inputs."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto

# Symbolic dims named like a sequence get a short non-trivial length so causal masking
# is exercised; every other symbolic dim (batch, M, ...) defaults to 1.
SEQ_DIM_NAMES = frozenset({"seq", "seq_len", "sequence", "sequence_length"})
DEFAULT_SEQ = 8
DEFAULT_DIM = 1


def random_input(
    model: onnx.ModelProto,
    shape_overrides: Mapping[str, int] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Return standard-normal float32 feeds for every graph input, keyed by input name.

    Symbolic dims are looked up in `shape_overrides` by dim name (e.g. {"batch": 2,
    "seq": 5}); missing ones default to 8 for "seq"-like names and 1 otherwise.
    """
    overrides = dict(shape_overrides or {})
    rng = np.random.default_rng(seed)
    initializer_names = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializer_names:
            continue  # IR < 4 style: initializers listed as inputs are not fed
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type != TensorProto.FLOAT:
            raise ValueError(f"input {value.name!r} is not float32; random_input only makes float32 feeds")
        shape = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif dim.dim_param in overrides:
                shape.append(overrides[dim.dim_param])
            elif dim.dim_param in SEQ_DIM_NAMES:
                shape.append(DEFAULT_SEQ)
            else:
                shape.append(DEFAULT_DIM)
        feeds[value.name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds
