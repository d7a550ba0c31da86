"""Layer-by-layer comparison of an INT4 model against its FP32 original, both run in ONNX Runtime."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from .ops import OP_DOMAIN, OP_TYPE, make_session, session_options


@dataclass(frozen=True)
class TensorError:
    """How far one tensor of the INT4 model is from the same tensor of the FP32 model."""

    name: str
    rel_l2: float  # ||int4 - fp32|| / ||fp32||
    max_abs: float
    cosine: float

    def format(self) -> str:
        return f"{self.name:<40} rel L2 {self.rel_l2:9.3e}   max |diff| {self.max_abs:9.3e}   cosine {self.cosine:.6f}"


def compared_tensors(int4_model: onnx.ModelProto, extra: str | None = None) -> list[str]:
    """Outputs of every CimInt4MatMul node, tensors whose name fully matches ``extra``, and the graph outputs."""
    graph = int4_model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    names = []
    for n in graph.node:
        if n.op_type == OP_TYPE and n.domain == OP_DOMAIN:
            # The exporter's steps after the op (Cast back to fp16, Unsqueeze, bias Add) are named
            # "<op name>/...", and the last one writes the original node's output: compare that.
            out = n.output[0]
            while len(consumers.get(out, [])) == 1 and consumers[out][0].name.startswith(f"{n.name}/"):
                out = consumers[out][0].output[0]
            names.append(out)
    if extra:
        pattern = re.compile(extra)
        names += [o for n in int4_model.graph.node for o in n.output if pattern.fullmatch(o)]
    names += [o.name for o in int4_model.graph.output]
    return list(dict.fromkeys(names))


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> bytes:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    present = {o.name for o in m.graph.output}
    for name in names:
        if name not in present:
            m.graph.output.append(onnx.ValueInfoProto(name=name))  # ORT infers the type (fp16 or float)
    return m.SerializeToString()


def compare(
    fp32_model: onnx.ModelProto,
    int4_model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    threads: int | None = None,
    extra: str | None = None,
) -> list[TensorError]:
    """Run both models on ``feeds`` and return the error of each compared tensor (see compared_tensors)."""
    names = compared_tensors(int4_model, extra)
    produced = {o for n in fp32_model.graph.node for o in n.output} | {o.name for o in fp32_model.graph.output}
    missing = [n for n in names if n not in produced]
    if missing:
        raise ValueError(f"tensors {missing} of the INT4 model do not exist in the FP32 model")
    ref_sess = ort.InferenceSession(
        _with_outputs(fp32_model, names), sess_options=session_options(threads), providers=["CPUExecutionProvider"]
    )
    int4_sess = make_session(_with_outputs(int4_model, names), threads=threads)
    ref = ref_sess.run(names, feeds)
    got = int4_sess.run(names, feeds)
    errors = []
    for name, r, g in zip(names, ref, got, strict=True):
        r64, g64 = np.asarray(r, np.float64).ravel(), np.asarray(g, np.float64).ravel()
        norm = np.linalg.norm(r64)
        diff = np.linalg.norm(g64 - r64)
        denom = norm * np.linalg.norm(g64)
        errors.append(
            TensorError(
                name=name,
                rel_l2=float(diff / norm) if norm > 0 else float(diff),
                max_abs=float(np.max(np.abs(g64 - r64))) if r64.size else 0.0,
                cosine=float(r64 @ g64 / denom) if denom > 0 else 1.0,
            )
        )
    return errors
