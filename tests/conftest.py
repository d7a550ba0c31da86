"""Shared helpers of the cim-int4 tests: one-node CimInt4MatMul models, kernel discovery, error bounds.

Also small graphs through the exporter, checked against their dequantized twin (``check``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import QuantizedWeight, quantize_weight
from cim_int4.exporter.gated import plain_nodes
from cim_int4.exporter.subgraph import all_graphs
from cim_int4.ops import reference
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import make_session
from cim_int4.contract import GATHER_OP_TYPE, OP_DOMAIN, OP_TYPE, OP_VERSION, scale_values

KERNEL_ENV = "CIM_INT4_KERNEL"
# Unit roundoff of float32 (round to nearest).
U32 = 2.0**-24

Dim = int | str

# The CPUs this process may use, read before any test narrows them.
INITIAL_CPUS = frozenset(os.sched_getaffinity(0))


def op_attributes(qw: QuantizedWeight, bias: np.ndarray | None = None, /, **overrides: object) -> dict[str, object]:
    """Node attributes of a CimInt4MatMul for ``qw`` (and a float32 ``bias``); ``overrides`` replace entries as given.

    An override of None drops the attribute; an ndarray becomes a tensor of its own dtype.
    ``bias`` is positional-only so that ``bias=...`` can override it with any dtype or shape.
    """
    attrs: dict[str, object] = {
        "K": qw.k,
        "N": qw.n,
        "group_size": qw.group_size,
        "packed": numpy_helper.from_array(qw.packed, "packed"),
        "scales": numpy_helper.from_array(qw.scales, "scales"),
    }
    if bias is not None:
        attrs["bias"] = numpy_helper.from_array(np.asarray(bias, dtype=np.float32), "bias")
    for name, value in overrides.items():
        if value is None:
            attrs.pop(name, None)
        elif isinstance(value, np.ndarray):
            attrs[name] = numpy_helper.from_array(value, name)
        else:
            attrs[name] = value
    return attrs


def op_model(attrs: dict[str, object], input_shapes: Sequence[Sequence[Dim] | None]) -> onnx.ModelProto:
    """A model with one CimInt4MatMul node per input shape, all sharing ``attrs``: inputs A0.., outputs Y0.."""
    nodes, inputs, outputs = [], [], []
    for i, shape in enumerate(input_shapes):
        nodes.append(helper.make_node(OP_TYPE, [f"A{i}"], [f"Y{i}"], name=f"op{i}", domain=OP_DOMAIN, **attrs))
        inputs.append(helper.make_tensor_value_info(f"A{i}", TensorProto.FLOAT, None if shape is None else list(shape)))
        # Output shape left unset: what the session reports comes from the op's shape inference.
        outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "cim_int4_op_test", inputs, outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)],
        ir_version=8,
    )


def random_weight(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    """A float32 [k, n] weight ~ N(0, 1) with one outlier input row, so group scales differ a lot."""
    w = rng.standard_normal((k, n), dtype=np.float32)
    w[rng.integers(k)] *= np.float32(10.0)
    return w


def quantized(k: int, n: int, group_size: int = 32, seed: int = 0) -> QuantizedWeight:
    """A random [k, n] weight in attribute form."""
    return quantize_weight(random_weight(np.random.default_rng(seed), k, n), group_size)


def op_bound(a: np.ndarray, qw: QuantizedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """Elementwise worst-case |y_fp32 - y_exact| of the op: Higham's dot-product bound plus the bias addition.

    With s the computed dot product, |s - s*| <= e (reference.error_bound); adding the bias
    rounds once more: |fl(s + b) - (s* + b)| <= e + u * (|s* + b| + e).
    """
    e = reference.error_bound(a, qw.packed, qw.scales, qw.k, qw.group_size)
    if bias is None:
        return e
    exact = reference.matmul(a, qw.packed, qw.scales, qw.k, qw.group_size, bias)
    return e + U32 * (np.abs(exact) + e)


def _kernel_probe_model() -> onnx.ModelProto:
    return op_model(op_attributes(quantized(16, 1, 16)), [[1, 16]])


@functools.lru_cache(maxsize=1)
def available_kernels() -> tuple[str, ...]:
    """Names of the kernel paths the op library runs on this CPU, read from its error for CIM_INT4_KERNEL=bogus."""
    old = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = "bogus"
    try:
        make_session(_kernel_probe_model(), threads=1)
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception classes
        message = str(e)
    else:
        raise AssertionError(f"{KERNEL_ENV}=bogus was accepted; the op must refuse unknown kernel names")
    finally:
        os.sched_setaffinity(0, INITIAL_CPUS)
        if old is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = old
    match = re.search(r"available: ([\w, ]+)", message)
    assert match, f"no 'available: ...' list in the error for {KERNEL_ENV}=bogus: {message}"
    names = tuple(name.strip() for name in match.group(1).split(",") if name.strip())
    assert "portable" in names, f"the portable kernel must always be available, got {names}"
    return names


@pytest.fixture(autouse=True, scope="session")
def _no_kernel_tuning(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Sessions made by the tests neither tune the kernels (time, and a transient stream twice
    # the last-level cache) nor read or write the user's profile; test_tune.py turns it back on.
    saved = {name: os.environ.get(name) for name in ("CIM_INT4_TUNE", "CIM_INT4_PROFILE")}
    os.environ["CIM_INT4_TUNE"] = "off"
    os.environ["CIM_INT4_PROFILE"] = str(tmp_path_factory.mktemp("profile") / "kernel-profile.json")
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _restore_affinity() -> Iterator[None]:
    # Tests may narrow the process's CPU mask (make_session no longer does); each starts with all of them.
    os.sched_setaffinity(0, INITIAL_CPUS)
    yield
    os.sched_setaffinity(0, INITIAL_CPUS)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def attribute_scales(attrs: dict[str, object]) -> np.ndarray:
    """The scale values of a node's attributes (as ``helper.get_attribute_value`` gives them): int8 scales
    times their super-scales (``contract.scale_values``), float ones as float32."""
    supers = numpy_helper.to_array(attrs["super_scales"]) if "super_scales" in attrs else None
    return scale_values(numpy_helper.to_array(attrs["scales"]), supers)


def dequantized_model(quantized: onnx.ModelProto) -> onnx.ModelProto:
    """``quantized`` with each CimInt4MatMul (any graph) as MatMul (+ Add) on its reference-dequantized weight.

    A CimInt4Gather becomes a Gather on its reference-dequantized table; codes and scales are
    read from attributes or, in the input form, from the main graph's initializers.
    """
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    tables = {t.name: t for t in out.graph.initializer}
    for graph in all_graphs(out.graph):
        nodes, inits = [], []
        for node in graph.node:
            if node.domain != OP_DOMAIN:
                nodes.append(node)
                continue
            a = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
            if node.op_type == GATHER_OP_TYPE:
                packed, scales = (numpy_helper.to_array(tables[node.input[i]]) for i in (0, 2))
                rows = packed.shape[0]
                if len(node.input) == 4:  # int8 scales and their super-scales
                    scales = scale_values(scales.reshape(rows, -1), numpy_helper.to_array(tables[node.input[3]]))
                table = reference.gather(packed, scales, np.arange(rows), a["K"], a["group_size"])
                inits.append(numpy_helper.from_array(table, f"{node.name}.dequantized"))
                nodes.append(helper.make_node("Gather", [f"{node.name}.dequantized", node.input[1]], [node.output[0]]))
                continue
            if len(node.input) >= 3:
                packed, scales = (numpy_helper.to_array(tables[node.input[i]]) for i in (1, 2))
                packed = packed.reshape(a["N"], -1)
                supers = numpy_helper.to_array(tables[node.input[3]]) if len(node.input) == 4 else None
            else:
                packed, scales = numpy_helper.to_array(a["packed"]), numpy_helper.to_array(a["scales"])
                supers = numpy_helper.to_array(a["super_scales"]) if "super_scales" in a else None
            scales = scale_values(scales.reshape(a["N"], -1), None if supers is None else supers.reshape(a["N"], -1))
            w = reference.dequantize(packed, scales, a["K"], a["group_size"])
            inits.append(numpy_helper.from_array(w.astype(np.float32), f"{node.name}.dequantized"))
            y = node.output[0] if "gated" not in a else f"{node.output[0]}.full"
            if "gated" in a:  # both halves as one product, then the gate in plain ONNX
                gate, consts = plain_nodes(y, node.output[0], a["N"] // 2, a["gated"].decode(), f"{node.name}.gate")
                nodes_after, inits_after = gate, consts
            else:
                nodes_after, inits_after = [], []
            if "bias" in a:
                inits.append(numpy_helper.from_array(numpy_helper.to_array(a["bias"]), f"{node.name}.bias_attr"))
                nodes.append(helper.make_node("MatMul", [node.input[0], f"{node.name}.dequantized"], [f"{y}.matmul"]))
                nodes.append(helper.make_node("Add", [f"{y}.matmul", f"{node.name}.bias_attr"], [y]))
            else:
                nodes.append(helper.make_node("MatMul", [node.input[0], f"{node.name}.dequantized"], [y]))
            nodes.extend(nodes_after)
            inits.extend(inits_after)
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(inits)
    keep = [o for o in out.opset_import if o.domain != OP_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(keep)
    return out


# ---------------------------------------------------------------- small graphs through the exporter


def model_of(nodes, inputs, outputs, inits=(), opset: int = 17, elem: int = TensorProto.FLOAT) -> onnx.ModelProto:  # noqa: ANN001
    """A model from nodes; ``inputs``/``outputs`` are (name, shape) pairs of type ``elem``."""
    graph = helper.make_graph(
        nodes,
        "pattern",
        [helper.make_tensor_value_info(n, elem, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, elem, s) for n, s in outputs],
        list(inits),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def w(seed: int, *shape: int, dtype=np.float32) -> np.ndarray:  # noqa: ANN001
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, name)


def check(model: onnx.ModelProto, q: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-4) -> None:
    """``q`` runs, equals its dequantized twin up to rounding, and is within INT4 error of ``model``."""
    names = [o.name for o in model.graph.output]
    got = make_session(q, threads=1).run(names, feeds)
    twin = ort.InferenceSession(dequantized_model(q).SerializeToString()).run(names, feeds)
    fp32 = ort.InferenceSession(model.SerializeToString()).run(names, feeds)
    for name, g, t, f in zip(names, got, twin, fp32, strict=True):
        assert g.shape == f.shape and g.dtype == f.dtype, name
        scale = float(np.abs(t.astype(np.float64)).max())
        np.testing.assert_allclose(g.astype(np.float64), t.astype(np.float64), rtol=rtol, atol=rtol * scale)
        rel = np.linalg.norm(g.astype(np.float64) - f) / np.linalg.norm(f.astype(np.float64))
        assert rel < 0.2, f"{name}: relative error {rel:.3f} vs FP32: the wrong weight was quantized"
