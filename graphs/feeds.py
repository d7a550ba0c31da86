"""Feeds for a model's graph inputs: generated from the input specs, or read from an .npz file.

Generated values, per input element type:

* float (float32/16/64, bfloat16 as float32 is not fed): standard normal;
* int64/int32 (and other integers): uniform in ``int_range`` (``[low, high)``) when given,
  else in ``[0, vocab)`` where ``vocab`` is the row count of a constant table that a
  ``Gather`` looks up with this input (an embedding), else, for a name containing
  "mask", all ones, else ``[0, DEFAULT_INT_HIGH)``;
* bool: True.

Symbolic dims are looked up by name in ``shape_overrides`` (``--dim name=value``); missing
ones get DEFAULT_SEQ for sequence-like names and DEFAULT_DIM for every other named dim.
Dims with neither a value nor a name get DEFAULT_UNNAMED_DIM.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

# Symbolic dims named like a sequence get a short non-trivial length so causal masking
# is exercised; every other named symbolic dim (batch, M, ...) defaults to 1.
SEQ_DIM_NAMES = frozenset({"seq", "seq_len", "sequence", "sequence_length"})
DEFAULT_SEQ = 8
DEFAULT_DIM = 1
# A dim without a name says nothing about its role; a length above 1 keeps reductions and
# broadcasts along it from being trivially exact.
DEFAULT_UNNAMED_DIM = 4
# Integer inputs with no Gather to guess a vocabulary from (ids, positions) draw from [0, 16).
DEFAULT_INT_HIGH = 16
# Ops that keep the values of an integer input, followed when looking for the Gather that reads it.
_VALUE_PRESERVING = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"})


def _dim_values(value: onnx.ValueInfoProto, overrides: Mapping[str, int]) -> list[int]:
    shape = []
    for dim in value.type.tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        elif dim.dim_param in overrides:
            shape.append(overrides[dim.dim_param])
        elif dim.dim_param in SEQ_DIM_NAMES:
            shape.append(DEFAULT_SEQ)
        elif dim.dim_param:
            shape.append(DEFAULT_DIM)
        else:
            shape.append(DEFAULT_UNNAMED_DIM)
    return shape


def guess_vocabulary(model: onnx.ModelProto, name: str) -> int | None:
    """Rows of the constant table a Gather looks up with input ``name`` (through Cast/Reshape/...), or None."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            shapes[node.output[0]] = list(node.attribute[0].t.dims)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    frontier, seen = [name], {name}
    while frontier:
        tensor = frontier.pop()
        for node in consumers.get(tensor, []):
            if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == tensor:
                dims = shapes.get(node.input[0])
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if dims and -len(dims) <= axis < len(dims):
                    return int(dims[axis])
            elif node.op_type in _VALUE_PRESERVING and node.input[0] == tensor:
                for out in node.output:
                    if out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return None


def random_input(
    model: onnx.ModelProto,
    shape_overrides: Mapping[str, int] | None = None,
    seed: int = 0,
    int_range: tuple[int, int] | None = None,
    names: Collection[str] | None = None,
) -> dict[str, np.ndarray]:
    """Feeds for every graph input (or those in ``names``), keyed by input name, generated as the module doc says.

    ``shape_overrides`` gives symbolic dims by name (e.g. {"batch": 2, "seq": 5});
    ``int_range`` (low, high exclusive) overrides the range of every integer input.
    """
    overrides = dict(shape_overrides or {})
    if int_range is not None and not int_range[0] < int_range[1]:
        raise ValueError(f"int_range must be LOW:HIGH with LOW < HIGH, got {int_range[0]}:{int_range[1]}")
    rng = np.random.default_rng(seed)
    initializer_names = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializer_names or (names is not None and value.name not in names):
            continue  # IR < 4 style: initializers listed as inputs are not fed
        elem = value.type.tensor_type.elem_type
        if not value.type.HasField("tensor_type") or elem == TensorProto.UNDEFINED:
            raise ValueError(f"input {value.name!r} is not a tensor of known type; pass its value in the feeds")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        shape = _dim_values(value, overrides)
        if dtype == np.bool_:
            feeds[value.name] = np.ones(shape, dtype=np.bool_)
        elif np.issubdtype(dtype, np.integer):
            low, high = int_range or (0, guess_vocabulary(model, value.name) or DEFAULT_INT_HIGH)
            if int_range is None and "mask" in value.name.lower() and guess_vocabulary(model, value.name) is None:
                low, high = 1, 2
            feeds[value.name] = rng.integers(low, high, size=shape).astype(dtype)
        elif np.issubdtype(dtype, np.floating) and elem != TensorProto.BFLOAT16:
            feeds[value.name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        else:
            raise ValueError(
                f"input {value.name!r} has element type {TensorProto.DataType.Name(elem)}, which cannot be generated; "
                "pass its value in the feeds (.npz)"
            )
    return feeds


def load_feeds(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Arrays of an ``.npz`` file, keyed by input name, with an error that names the file."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read feeds ({e}); expected an .npz of arrays named like the inputs") from e


def model_feeds(
    model: onnx.ModelProto,
    given: Mapping[str, np.ndarray] | None = None,
    shape_overrides: Mapping[str, int] | None = None,
    seed: int = 0,
    int_range: tuple[int, int] | None = None,
) -> dict[str, np.ndarray]:
    """``given`` feeds checked against the graph inputs (name, element type, rank), the missing ones generated."""
    given = dict(given or {})
    initializer_names = {t.name for t in model.graph.initializer}
    inputs = {v.name: v for v in model.graph.input if v.name not in initializer_names}
    unknown = sorted(set(given) - set(inputs))
    if unknown:
        raise ValueError(f"feeds {unknown} are not inputs of the model (its inputs: {sorted(inputs)})")
    for name, array in given.items():
        tensor_type = inputs[name].type.tensor_type
        want = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        array = np.asarray(array)
        if array.dtype != want:
            raise ValueError(f"feed {name!r} is {array.dtype}, the model's input is {want}")
        if tensor_type.HasField("shape") and array.ndim != len(tensor_type.shape.dim):
            raise ValueError(f"feed {name!r} has rank {array.ndim}, the model's input has {len(tensor_type.shape.dim)}")
    missing = [name for name in inputs if name not in given]
    generated = random_input(model, shape_overrides, seed=seed, int_range=int_range, names=missing)
    return {name: given[name] if name in given else generated[name] for name in inputs}
