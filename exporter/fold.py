"""Constant weights behind producer ops: a tensor name resolved to its value, across subgraph scopes.

A weight is folded when it is an initializer or a ``Constant`` node, possibly behind a chain of
Transpose, Identity, Cast, Reshape, Squeeze and Unsqueeze, in the node's graph or any graph
enclosing it (If/Loop/Scan bodies read outer-scope names). Anything else gets a reason that
tells a computed operand (activation x activation) from a constant behind an op we do not fold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

DEFAULT_DOMAINS = ("", "ai.onnx")
FOLDABLE = frozenset({"Transpose", "Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze"})
# Ops without inputs that still produce a new value on every run.
_RANDOM = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
COMPUTED = "both operands are computed (activation x activation)"


class NotFoldable(Exception):
    """A weight that is not a foldable constant; the message says why."""


@dataclass
class Folded:
    """A constant's value, its ONNX element type, and the tensor names it was read through."""

    value: np.ndarray
    elem_type: int
    names: list[str] = field(default_factory=list)


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    if len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value":
        return attr.t
    if attr.name in ("value_float", "value_floats", "value_int", "value_ints"):
        value = helper.get_attribute_value(attr)
        dtype = np.float32 if attr.name.startswith("value_float") else np.int64
        return numpy_helper.from_array(np.asarray(value, dtype=dtype))
    return None  # sparse or string constants are not weights


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class Scope:
    """The names one graph defines (initializers, inputs, node outputs), with its enclosing graph's scope."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        parent: Scope | None = None,
        fold_inputs: bool = True,
        load: Callable[[onnx.TensorProto], np.ndarray] | None = None,
    ) -> None:
        self.graph = graph
        self.parent = parent
        # How an initializer's values are read: a caller holding a model without its external data passes its own.
        self.load = load or (parent.load if parent is not None else numpy_helper.to_array)
        self.initializers = {t.name: t for t in graph.initializer}
        self.inputs = {i.name for i in graph.input}
        self.producers = {o: n for n in graph.node for o in n.output if o}
        # Only the main graph's initializers can be listed as (overridable) inputs; a subgraph's
        # inputs are fed by its parent node and shadow any initializer of the same name.
        self.overridable = (self.inputs & self.initializers.keys()) if parent is None else set()
        self.fold_inputs = fold_inputs
        self._constant = self._constant_names()

    def owner(self, name: str) -> Scope | None:
        """The innermost scope that defines ``name``, or None."""
        scope: Scope | None = self
        while scope is not None:
            if name in scope.inputs or name in scope.initializers or name in scope.producers:
                return scope
            scope = scope.parent
        return None

    def is_constant(self, name: str) -> bool:
        """True if ``name`` is fixed at export time (possibly behind ops we do not fold)."""
        owner = self.owner(name)
        return owner is not None and name in owner._constant

    def _initializer_is_constant(self, name: str) -> bool:
        if name in self.overridable:
            return self.fold_inputs
        return name in self.initializers and name not in self.inputs

    def _constant_names(self) -> set[str]:
        """Names whose value is fixed at export time (one pass in topological order, no recursion)."""
        constant = {name for name in self.initializers if self._initializer_is_constant(name)}

        def is_constant(name: str) -> bool:
            if name in constant:
                return True
            if name in self.inputs or name in self.initializers or name in self.producers:
                return False
            owner = self.parent.owner(name) if self.parent is not None else None
            return owner is not None and name in owner._constant

        for node in self.graph.node:
            if node.op_type in _RANDOM:
                continue
            inputs = [i for i in node.input if i]
            if (node.op_type == "Constant" and not inputs) or (inputs and all(is_constant(i) for i in inputs)):
                constant.update(o for o in node.output if o)
        return constant

    def resolve(self, name: str, role: str = "weight") -> Folded:
        """The value of ``name`` if it is a foldable constant; NotFoldable with the reason otherwise."""
        owner = self.owner(name)
        if owner is None:
            raise NotFoldable(f"{role} {name!r} is not defined in this graph or an enclosing one")
        return owner._resolve_local(name, role)

    def _resolve_local(self, name: str, role: str) -> Folded:
        if name in self.initializers and name not in (self.inputs - self.overridable):
            if name in self.overridable and not self.fold_inputs:
                raise NotFoldable(f"{role} {name!r} is an initializer also listed as a graph input (overridable)")
            tensor = self.initializers[name]
            return Folded(self.load(tensor), tensor.data_type, [name])
        node = self.producers.get(name)
        if node is None and self.parent is None and name in self.inputs:
            raise NotFoldable(f"{role} {name!r} is a graph input (fed at run time)")
        if node is None:
            raise NotFoldable(COMPUTED)  # a subgraph input: loop state, scan slice, ...
        foldable = node.domain in DEFAULT_DOMAINS and node.op_type in FOLDABLE
        if not foldable and name not in self._constant:
            raise NotFoldable(COMPUTED)
        if node.domain in DEFAULT_DOMAINS and node.op_type == "Constant":
            tensor = _constant_value(node)
            if tensor is None:
                raise NotFoldable(f"{role} {name!r} is a Constant we do not read ({node.name!r})")
            return Folded(numpy_helper.to_array(tensor), tensor.data_type, [name])
        if not foldable:
            raise NotFoldable(
                f"{role} {name!r} is constant, but behind an op we do not fold ({node.op_type} {node.name!r})"
            )
        # Walk to the source first, so its reason (computed, overridable, ...) is the one reported.
        source = self.resolve(node.input[0], role)
        try:
            value, elem_type = _apply(node, source, self)
        except NotFoldable:
            raise
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise NotFoldable(f"{role} {name!r}: cannot fold {node.op_type} {node.name!r} ({e})") from e
        return Folded(value, elem_type, [*source.names, name])


def _int_input(node: onnx.NodeProto, index: int, scope: Scope) -> list[int] | None:
    if len(node.input) <= index or not node.input[index]:
        return None
    return [int(v) for v in scope.resolve(node.input[index], f"{node.op_type} input").value.reshape(-1)]


def _apply(node: onnx.NodeProto, source: Folded, scope: Scope) -> tuple[np.ndarray, int]:
    """One foldable op applied in NumPy, following the ONNX definition of each."""
    x, elem_type = source.value, source.elem_type
    op = node.op_type
    if op == "Identity":
        return x, elem_type
    if op == "Transpose":
        perm = _attr(node, "perm")
        return np.transpose(x, None if perm is None else list(perm)), elem_type
    if op == "Cast":
        to = int(_attr(node, "to"))
        return x.astype(helper.tensor_dtype_to_np_dtype(to)), to
    if op == "Reshape":
        shape = _int_input(node, 1, scope) or []
        if not _attr(node, "allowzero", 0):
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return x.reshape(shape), elem_type
    axes = _attr(node, "axes")
    axes = list(axes) if axes is not None else _int_input(node, 1, scope)
    if op == "Squeeze":
        if axes is None:
            return np.squeeze(x), elem_type
        return np.squeeze(x, axis=tuple(a % x.ndim for a in axes)), elem_type
    # Unsqueeze: axes index the output, whose rank is the input's plus len(axes).
    rank = x.ndim + len(axes or [])
    for axis in sorted(a % rank for a in axes or []):
        x = np.expand_dims(x, axis)
    return x, elem_type
