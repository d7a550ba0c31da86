"""cim-int4 op-profile: one decode step's kernel time per op type and role, from ORT's profiler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from cim_int4.cli import main
from cim_int4.genai import prepare
from cim_int4.genai_bench import decoder_file
from cim_int4.op_profile import BETWEEN, EMBEDDING, LM_HEAD, bind_step, breakdown, node_roles
from cim_int4.perplexity import PerplexityError, open_model

FIXTURES = Path(__file__).parent / "genai"  # made by tests/genai/make_models.py
FP32 = FIXTURES / "llama-fp32"


def test_the_head_is_the_weight_op_that_makes_the_logits_and_the_table_gather_is_the_embedding() -> None:
    graph = onnx.load(decoder_file(FP32)).graph
    roles = node_roles(decoder_file(FP32))
    (head,) = [n for n, r in roles.items() if r == LM_HEAD]
    (embedding,) = [n for n, r in roles.items() if r == EMBEDDING]
    producer = {o: n for n in graph.node for o in n.output}
    assert producer["logits"].name == head
    assert {n.name: n.op_type for n in graph.node}[embedding] == "Gather"


def test_a_decode_step_after_a_cached_prefix_feeds_consistent_shapes() -> None:
    """feeds_for(ids, past): mask past + len(ids) long, positions from past, caches of past tokens."""
    model = open_model(FP32)
    feeds = model.feeds_for(np.array([5], dtype=np.int64), 7)
    assert feeds["attention_mask"].shape == (1, 8)
    if "position_ids" in feeds:
        assert feeds["position_ids"].tolist() == [[7]]
    past = [v for k, v in feeds.items() if k.startswith("past")]
    assert past and all(v.shape[2] == 7 for v in past)
    logits = model.session.run(["logits"], feeds)[0]
    assert logits.shape[:2] == (1, 1) and np.isfinite(logits).all()


def test_a_step_is_bound_as_genai_runs_it_the_present_written_into_the_past_buffer() -> None:
    """past_present_share_buffer: one buffer per layer's key / value, the new token written in place."""
    model = open_model(FP32)
    assert sorted(model.shared_kv.items()) == sorted(
        (f"present.{i}.{kind}", f"past_key_values.{i}.{kind}") for i in range(2) for kind in ("key", "value")
    )
    past = 7
    binding = bind_step(model, past)
    model.session.run_with_iobinding(binding)
    names = [o.name for o in model.session.get_outputs()]
    shared = binding.get_outputs()[names.index("logits")].numpy()
    fed = model.session.run(["logits"], model.feeds_for(np.array([1], dtype=np.int64), past))[0]
    np.testing.assert_allclose(shared, fed, rtol=1e-5, atol=1e-5)
    for buffer in binding.kv_buffers.values():
        assert buffer.shape[2] == past + 1
        assert not buffer[:, :, :past].any() and buffer[:, :, past].any()  # the step's key / value, in place


def test_a_decoder_without_its_genai_config_is_fed_its_cache_and_gives_the_same_logits(tmp_path: Path) -> None:
    alone = tmp_path / "decoder.onnx"
    decoder = onnx.load(decoder_file(FP32))
    for inp in decoder.graph.input:  # the heads and head size genai_config.json gave, now static
        if inp.name.startswith("past_key_values"):
            dims = inp.type.tensor_type.shape.dim
            dims[1].dim_value, dims[3].dim_value = 2, 16
    onnx.save(decoder, alone)
    model = open_model(alone)
    assert model.shared_kv == {}
    binding = bind_step(model, 7)
    model.session.run_with_iobinding(binding)
    assert not hasattr(binding, "kv_buffers")
    logits = binding.get_outputs()[[o.name for o in model.session.get_outputs()].index("logits")].numpy()
    shared = open_model(FP32)
    reference = shared.session.run(["logits"], shared.feeds_for(np.array([1], dtype=np.int64), 7))[0]
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)


def test_fp32_and_cim_int4_decoders_are_broken_down_by_role(tmp_path: Path) -> None:
    fp32 = breakdown(FP32, past=16, steps=3, threads=1)
    assert fp32.nodes[LM_HEAD] == 1 and fp32.nodes[EMBEDDING] == 1 and fp32.nodes["MatMul"] > 0
    assert all(us >= 0 for us in fp32.rows.values()) and fp32.rows[LM_HEAD] > 0
    assert fp32.step_us > 0 and BETWEEN in fp32.rows
    assert fp32.unprofiled_step_us > 0 and fp32.shared_kv
    # Every row but the time between nodes also less the profiler's measured cost of each of its nodes.
    assert set(fp32.rows_less_profiler) == set(fp32.rows) - {BETWEEN}
    for row, less in fp32.rows_less_profiler.items():
        assert less == pytest.approx(max(0.0, fp32.rows[row] - fp32.nodes[row] * fp32.node_cost_us))
    cim = breakdown(prepare(FP32, tmp_path / "cim", quiet=True), past=16, steps=3, threads=1)
    # every layer MatMul converted (the head aside), each of the 2 layers' gate and up as one gated node
    assert cim.nodes["CimInt4MatMul"] == fp32.nodes["MatMul"] - 2
    assert cim.nodes[LM_HEAD] == 1 and cim.nodes[EMBEDDING] == 1
    assert "MatMul" not in cim.nodes
    assert "CimInt4MatMul" in cim.format() and LM_HEAD in cim.format()


@pytest.mark.parametrize(("cost", "kept"), [(0.0, True), (1e9, False)])
def test_rows_less_the_profiler_take_out_its_cost_per_node(cost: float, kept: bool, monkeypatch) -> None:
    import cim_int4.op_profile as op_profile

    monkeypatch.setattr(op_profile, "profiler_node_cost", lambda threads, prefix: cost)
    report = breakdown(FP32, past=4, steps=2, threads=1)
    assert report.node_cost_us == cost
    for row, less in report.rows_less_profiler.items():
        assert less == (report.rows[row] if kept else 0.0)


def test_cli_writes_json_and_never_overwrites_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ops.json"
    assert main(["op-profile", str(FP32), "--past", "4", "--steps", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["past"] == 4 and row["steps"] == 2 and row["rows"][LM_HEAD] > 0
    assert row["step_us"] > 0 and row["unprofiled_step_us"] > 0 and LM_HEAD in row["rows_less_profiler"]
    before = out.read_text()
    assert main(["op-profile", str(FP32), "--steps", "2", "--json", str(out)]) == 1
    assert "exists" in capsys.readouterr().err and out.read_text() == before


def test_a_cache_longer_than_the_context_is_a_one_line_error() -> None:
    with pytest.raises(PerplexityError, match="context"):
        breakdown(FP32, past=10_000, steps=1)
    with pytest.raises(PerplexityError, match="steps"):
        breakdown(FP32, steps=0)
