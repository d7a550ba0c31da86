"""exporter/tune/scales.py: trained scales bring an export closer to FP32, in the format the op already runs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportError, export_int4
from cim_int4.exporter.api import export_with_summary
from cim_int4.exporter.tune.scales import TuneOptions, _kl, _log_softmax, tune_scales
from cim_int4.graphs import mlp
from cim_int4.graphs.genai_like import genai_feeds, genai_like
from cim_int4.ops.ort_model import proto_session
from cim_int4.ops.session import session_options
from onnx import numpy_helper

from cim_int4.contract import GATHER, MATMUL_SHARED, Int4Node, is_op_node


def _teacher(model: onnx.ModelProto):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(["logits"], feeds)[0]


def _codes(model: onnx.ModelProto) -> list[bytes]:
    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if is_op_node(node) and len(node.input) == 1:
            out.append(Int4Node.from_node(node).packed.tobytes())
        elif is_op_node(node, GATHER):
            out.append(numpy_helper.to_array(inits[node.input[0]]).tobytes())
    return out


def _held_kl(model: onnx.ModelProto, teacher, windows) -> float:
    session = proto_session(model, session_options(pin=False))
    names = {i.name for i in session.get_inputs()}
    kls = [_kl(session.run(["logits"], {k: v for k, v in w.items() if k in names})[0].astype(np.float64),
               _log_softmax(teacher(w).astype(np.float64)))[0] for w in windows]  # fmt: skip
    return float(np.mean(kls))


@pytest.mark.parametrize(("scale_dtype", "gemma"), [("int8", False), ("float16", False), ("int8", True)])
def test_trained_scales_bring_a_3_bit_export_closer_to_fp32(scale_dtype, gemma):
    fp32 = genai_like(gemma=gemma)
    exported = export_int4(fp32, bits=3, group_size=16, scale_dtype=scale_dtype, quiet=True)
    assert any(is_op_node(n, MATMUL_SHARED) for n in exported.graph.node), "the tied table should stay tied"
    gated = [n for n in exported.graph.node if is_op_node(n) and any(a.name == "gated" for a in n.attribute)]
    assert gated, "the gated MLPs should be fused (their gate runs in the twin as plain ONNX)"
    teacher = _teacher(fp32)
    windows = [genai_feeds(seq=48, seed=s) for s in range(16)]
    unseen = [genai_feeds(seq=48, seed=100 + s) for s in range(4)]
    codes, size = _codes(exported), exported.ByteSize()
    before = _held_kl(exported, teacher, unseen)

    result = tune_scales(exported, windows, teacher, TuneOptions(epochs=4, lr=5e-3, held_out=2))

    after = _held_kl(exported, teacher, unseen)  # through the op library, on windows it never saw
    # A random decoder on random tokens gains far less than a real LLM (13% here, 41% on SmolLM2's prototype)
    assert result.kl_after < 0.95 * result.kl_before
    assert after < 0.95 * before
    assert _codes(exported) == codes  # only scales move
    assert abs(exported.ByteSize() - size) <= 16  # same bytes (protobuf varints aside)
    for node in exported.graph.node:
        if is_op_node(node) and len(node.input) == 1:
            n = Int4Node.from_node(node)
            assert (n.super_scales is not None) == (scale_dtype == "int8")


def test_too_few_windows_is_a_one_line_error():
    exported = export_int4(genai_like(), bits=4, group_size=16, quiet=True)
    with pytest.raises(ValueError, match="more than 1 calibration windows, got 1"):
        tune_scales(exported, [genai_feeds()], _teacher(genai_like()))


def test_tune_epochs_export_option_trains_the_scales():
    """export_int4(tune_epochs=...): the same codes as the plain export, scales closer to FP32 on unseen windows."""
    fp32 = genai_like()
    windows = [genai_feeds(seq=48, seed=s) for s in range(16)]
    unseen = [genai_feeds(seq=48, seed=100 + s) for s in range(4)]
    plain = export_int4(fp32, bits=3, group_size=16, quiet=True)
    tuned, summary = export_with_summary(fp32, bits=3, group_size=16, tune_feeds=iter(windows), tune_epochs=4,
                                         tune_lr=5e-3)  # fmt: skip
    teacher = _teacher(fp32)
    assert _codes(tuned) == _codes(plain)
    assert _held_kl(tuned, teacher, unseen) < 0.95 * _held_kl(plain, teacher, unseen)
    t = summary.tuning
    assert (t.epochs, t.batches, t.held_out) == (4, 16, 1) and t.kl_after < 0.95 * t.kl_before
    assert "scales tuned:" in summary.format() and "1 held-out window(s)" in summary.format()


def test_tune_epochs_from_the_command_line(tmp_path, capsys):
    """An .npz of 16 rows is 16 windows (one held out); float16 scales, so the KL moves by more than re-rounding."""
    from test_cli import run_cli

    src, npz, out = tmp_path / "m.onnx", tmp_path / "rows.npz", tmp_path / "out.onnx"
    onnx.save(genai_like(), src)
    rows = [genai_feeds(seq=32, seed=s) for s in range(16)]
    np.savez(npz, **{k: np.concatenate([r[k] for r in rows]) for k in rows[0]})
    argv = ["export", str(src), "-o", str(out), "--bits", "3", "--group-size", "16", "--scale-dtype", "float16"]
    code, stdout, _ = run_cli([*argv, "--tune-feeds", str(npz), "--tune-epochs", "4", "--tune-lr", "5e-3"], capsys)
    assert code == 0 and out.exists()
    line = next(x for x in stdout.splitlines() if "scales tuned:" in x)
    assert "4 epoch(s) over 15 window(s)" in line and "1 held-out window(s)" in line
    before, after = (float(v) for v in line.split(" -> ")[0].split()[-1:] + line.split(" -> ")[1].split()[:1])
    assert after < 0.97 * before


def test_tune_epochs_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="tune_epochs needs calibration inputs"):
        export_int4(genai_like(), tune_epochs=1, quiet=True)
    with pytest.raises(ValueError, match="tune_epochs must be a non-negative integer"):
        export_int4(genai_like(), tune_epochs=-1, feeds=genai_feeds(), quiet=True)
    with pytest.raises(ValueError, match="tune_lr must be a positive finite number"):
        export_int4(genai_like(), tune_epochs=1, tune_lr=float("nan"), feeds=genai_feeds(), quiet=True)
    padded = genai_feeds()
    padded["attention_mask"][0, :3] = 0
    with pytest.raises(ExportError, match=r"^tune_epochs: window 0: attention_mask has zeros"):
        export_int4(genai_like(), bits=3, tune_epochs=1, tune_feeds=[padded, genai_feeds()], quiet=True)
    with pytest.raises(ExportError, match=r"^tune_epochs: window 1: attention_mask has zeros"):
        export_int4(genai_like(), bits=3, tune_epochs=1, tune_feeds=[genai_feeds(), padded], quiet=True)
    with pytest.raises(ValueError, match="tune_epochs must be a non-negative integer, got True"):
        export_int4(genai_like(), tune_epochs=True, feeds=genai_feeds(), quiet=True)
    with pytest.raises(ValueError, match="tune_feeds is only read by scale tuning"):
        export_int4(genai_like(), tune_feeds=genai_feeds(), quiet=True)
    int4 = export_int4(genai_like(), quiet=True)
    with pytest.raises(ExportError, match=r"^tune_epochs: the model already has \d+ INT4 node"):
        export_int4(int4, tune_epochs=1, tune_feeds=[genai_feeds(), genai_feeds(seed=2)], quiet=True)
    x = np.zeros((2, 256), np.float32)
    out = tmp_path / "never.onnx"
    # An op tuning does not run: named before the export starts, and nothing written
    with pytest.raises(ExportError, match=r"^tune_epochs: node '\S+': op (Gemm|Relu)\b.* not one scale"):
        export_int4(mlp(), out, tune_epochs=1, tune_feeds=[{"x": x}, {"x": x}], quiet=True)
    assert not out.exists()
