"""The reference backend: CimInt4MatMul run by the NumPy reference inside ORT via onnxruntime-extensions."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.ops import ort_model, reference, reference_backend
from cim_int4.ops.reference_backend import (
    COMPUTE_CONFIG,
    REFERENCE_DOMAIN,
    REFERENCE_OP,
    ReferenceBackendUnavailable,
    reference_model,
)
from conftest import op_attributes, op_model, quantized
from test_op import _bad_attribute_cases

from cim_int4 import make_session
from cim_int4.contract import is_op_node

pytest.importorskip("onnxruntime_extensions")


def run(model: onnx.ModelProto | str | Path, a: np.ndarray, backend: str = "reference", **kwargs) -> np.ndarray:
    return make_session(model, threads=1, backend=backend, **kwargs).run(None, {"A0": a})[0]


# ---------------------------------------------------------------- the op is reference.emulate


@pytest.mark.parametrize("compute", reference.COMPUTE_MODES)
@pytest.mark.parametrize(
    ("k", "n", "group_size", "with_bias", "shape"),
    [
        (64, 8, 32, False, (3, 64)),
        (100, 7, 32, True, (2, 5, 100)),  # K not a multiple of the group, rank 3, bias
        (256, 33, 128, True, (1, 256)),
        (48, 5, 16, False, (48,)),  # rank 1
    ],
)
def test_reference_op_is_the_emulation(compute: str, k: int, n: int, group_size: int, with_bias: bool, shape) -> None:
    rng = np.random.default_rng(k + n)
    qw = quantized(k, n, group_size, seed=k)
    bias = rng.standard_normal(n, dtype=np.float32) if with_bias else None
    model = op_model(op_attributes(qw, bias, compute=compute), [None])
    a = rng.standard_normal(shape, dtype=np.float32)
    y = run(model, a)
    expected = reference.emulate(a, qw.packed, qw.scales, k, group_size, bias, compute)
    assert y.shape == (*shape[:-1], n) and y.tobytes() == expected.tobytes()


def test_compute_absent_means_fp32_and_modes_differ() -> None:
    qw = quantized(128, 16)
    a = np.random.default_rng(0).standard_normal((4, 128), dtype=np.float32)
    y = run(op_model(op_attributes(qw), [None]), a)
    fp32 = reference.emulate(a, qw.packed, qw.scales, 128, 32, compute="fp32")
    int8 = reference.emulate(a, qw.packed, qw.scales, 128, 32, compute="int8")
    assert y.tobytes() == fp32.tobytes() and not np.array_equal(fp32, int8)


@pytest.mark.parametrize(("node_mode", "override"), [("fp32", "int8"), ("int8", "fp32")])
def test_session_config_overrides_the_node_mode(node_mode: str, override: str) -> None:
    qw = quantized(128, 16)
    a = np.random.default_rng(1).standard_normal((4, 128), dtype=np.float32)
    model = op_model(op_attributes(qw, compute=node_mode), [None])
    y = run(model, a, config={COMPUTE_CONFIG: override})
    assert y.tobytes() == reference.emulate(a, qw.packed, qw.scales, 128, 32, compute=override).tobytes()


def test_bad_compute_override_is_refused_naming_the_entry() -> None:
    with pytest.raises(ValueError, match=f"'{COMPUTE_CONFIG}' must be one of .*, got 'int4'"):
        make_session(
            op_model(op_attributes(quantized(64, 4)), [None]), backend="reference", config={COMPUTE_CONFIG: "int4"}
        )


# ---------------------------------------------------------------- bad input: one-line errors, no abort


@pytest.mark.parametrize(("qw", "attribute", "overrides"), _bad_attribute_cases())
def test_bad_attribute_is_refused_naming_node_and_attribute(qw, attribute: str, overrides: dict) -> None:
    # The same cases the op library refuses; a Python op must never see them (raising there aborts).
    model = op_model(op_attributes(qw, **overrides), [["M", qw.k]])
    with pytest.raises(ValueError, match=f"node 'op0': attribute '{attribute}'") as info:
        make_session(model, threads=1, backend="reference")
    assert "\n" not in str(info.value)


def test_unknown_compute_attribute_is_refused() -> None:
    with pytest.raises(ValueError, match="node 'op0': attribute 'compute' is 'int4'"):
        make_session(op_model(op_attributes(quantized(64, 4), compute="int4"), [None]), backend="reference")


def test_wrong_last_dim_at_run_time_is_an_ort_error_and_session_survives() -> None:
    qw = quantized(100, 7)
    sess = make_session(op_model(op_attributes(qw), [["M", "K"]]), threads=1, backend="reference")
    with pytest.raises(Exception, match="op0"):
        sess.run(None, {"A0": np.ones((2, 99), dtype=np.float32)})
    a = np.random.default_rng(0).standard_normal((2, 100), dtype=np.float32)
    (y,) = sess.run(None, {"A0": a})
    assert y.tobytes() == reference.emulate(a, qw.packed, qw.scales, 100, 32).tobytes()


def test_empty_leading_dim_gives_empty_output() -> None:
    model = op_model(op_attributes(quantized(100, 7), np.ones(7, np.float32)), [["M", 100]])
    y = run(model, np.zeros((0, 100), dtype=np.float32))
    assert y.shape == (0, 7) and y.dtype == np.float32


def test_unreadable_model_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        make_session(b"\x08\xff\xff", backend="reference")
    with pytest.raises(Exception, match=str(tmp_path / "missing.onnx")):
        make_session(tmp_path / "missing.onnx", backend="reference")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        make_session(op_model(op_attributes(quantized(64, 4)), [None]), backend="numpy")


def test_missing_extra_gives_one_line_naming_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime_extensions", None)  # import now fails
    with pytest.raises(ReferenceBackendUnavailable) as info:
        make_session(op_model(op_attributes(quantized(64, 4)), [None]), backend="reference")
    message = str(info.value)
    assert "pip install cim-int4[reference]" in message and "\n" not in message


# ---------------------------------------------------------------- the rewritten model


def test_rewrite_keeps_everything_but_the_op() -> None:
    from cim_int4.graphs import mlp

    import cim_int4

    model = cim_int4.export_int4(mlp((64, 96, 48, 16), seed=4), quiet=True)
    before = model.SerializeToString()
    rewritten = reference_model(model)
    assert model.SerializeToString() == before
    ours = [n for n in rewritten.graph.node if n.op_type == REFERENCE_OP and n.domain == REFERENCE_DOMAIN]
    cims = [n for n in model.graph.node if is_op_node(n)]
    assert len(cims) == 3 and [(n.name, n.input[0], n.output) for n in ours] == [
        (n.name, n.input[0], n.output) for n in cims
    ]
    assert all(a.type != onnx.AttributeProto.TENSOR for n in ours for a in n.attribute)
    shape_checks = {n.input[1] for n in ours}
    others = [n for n in rewritten.graph.node if n not in ours and n.output[0] not in shape_checks]
    assert others == [n for n in model.graph.node if n not in cims]
    assert rewritten.graph.input == model.graph.input and rewritten.graph.output == model.graph.output


def test_external_data_model_runs(tmp_path: Path, monkeypatch) -> None:
    qw = quantized(256, 40)
    model = op_model(op_attributes(qw, np.ones(40, np.float32)), [None])
    path = tmp_path / "ext.onnx"
    onnx.save_model(
        onnx.ModelProto.FromString(model.SerializeToString()),  # save_model moves the tensors out of its argument
        path,
        save_as_external_data=True,
        location="ext.onnx.data",
        size_threshold=0,
        convert_attribute=True,
    )
    assert (tmp_path / "ext.onnx.data").stat().st_size > qw.packed.nbytes
    a = np.random.default_rng(2).standard_normal((3, 256), dtype=np.float32)
    expected = reference.emulate(a, qw.packed, qw.scales, 256, 32, np.ones(40, np.float32))
    assert run(path, a).tobytes() == expected.tobytes()
    # A rewritten model too large for one protobuf goes to ORT through a temporary file.
    monkeypatch.setattr(ort_model, "IN_MEMORY_LIMIT", 0)
    assert run(str(path), a).tobytes() == expected.tobytes()
    assert run(model.SerializeToString(), a).tobytes() == expected.tobytes()


# ---------------------------------------------------------------- one process, both backends


def test_both_backends_one_after_the_other() -> None:
    from onnxruntime_extensions._ocos import Opdef

    qw = quantized(128, 24)
    model = op_model(op_attributes(qw), [None])
    a = np.random.default_rng(3).standard_normal((2, 128), dtype=np.float32)
    results = [run(model, a, backend=b) for b in ("native", "reference", "native", "reference")]
    assert results[0].tobytes() == results[2].tobytes() and results[1].tobytes() == results[3].tobytes()
    assert (np.abs(results[0] - results[1]) <= 2 * reference.error_bound(a, qw.packed, qw.scales, 128, 32)).all()
    assert sum(op.op_type == REFERENCE_OP for op in Opdef._odlist.values()) == 1


def test_failure_inside_the_op_gives_nan_and_a_message_not_an_abort(monkeypatch, capsys) -> None:
    # onnxruntime-extensions aborts the process when a Python op raises; the op must not.
    def broken(*args, **attrs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(reference_backend, "run_node", broken)
    y = run(op_model(op_attributes(quantized(64, 4)), [None]), np.ones((2, 64), np.float32))
    assert y.shape == (2, 4) and np.isnan(y).all()
    assert "CimInt4MatMulReference node 'op0' failed: out of memory" in capsys.readouterr().err
