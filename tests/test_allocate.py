"""bits="auto": widths per layer from measured sensitivity, under a byte budget or for a target cosine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import export_with_summary
from cim_int4.exporter.allocate import _hull, anchor_width, spearman, steps_in_order, within_budget
from cim_int4.graphs import random_input
from cim_int4.ops.reference import dequantize

from cim_int4.contract import GATHER, MATMUL_SHARED, is_op_node
from cim_int4.metrics import row_cosines

MODELS = Path(__file__).parent / "models"
ZOO = Path(__file__).parent / "zoo"


def _twin_outputs(model: onnx.ModelProto, quantized: onnx.ModelProto, feeds: dict) -> tuple[list, list]:
    """FP32 outputs and those of ``quantized`` with every attribute-form node's weight dequantized back to FP32."""
    from cim_int4.exporter.tune.twin import twin

    def run(m: onnx.ModelProto) -> list:
        s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return s.run([o.name for o in m.graph.output], feeds)

    copy = onnx.ModelProto()
    copy.CopyFrom(quantized)
    return run(model), run(twin(copy))


def test_hull_keeps_only_points_that_pay() -> None:
    # (bytes, damage, width): 3 lies above the segment 2 -> 4, 5 gains nothing over 4
    points = [(2.0, 1.0, 2), (3.0, 0.9, 3), (4.0, 0.2, 4), (5.0, 0.2, 5), (32.0, 0.0, None)]
    assert [p[2] for p in _hull(points)] == [2, 4, None]


def test_budget_allocation_spends_bytes_where_they_save_most() -> None:
    costs = [{2: 2.0, 4: 4.0, None: 32.0}, {2: 2.0, 4: 4.0, None: 32.0}]
    damages = [{2: 1.0, 4: 0.1, None: 0.0}, {2: 0.05, 4: 0.01, None: 0.0}]
    start, steps = steps_in_order(costs, damages)
    assert start == [2, 2]
    assert within_budget(start, steps, costs, damages, 6.0) == [4, 2]  # the sensitive layer first
    assert within_budget(start, steps, costs, damages, 8.0) == [4, 4]
    assert within_budget(start, steps, costs, damages, 4.0) == [2, 2]
    with pytest.raises(ValueError, match="below the cheapest"):
        within_budget(start, steps, costs, damages, 3.0)


def test_the_proxy_is_anchored_at_the_widest_width_under_the_budget() -> None:
    budgets = (None, 1.5, 2.0, 2.9, 3.0, 3.9, 4.5, 5.5, 7.9, 12.0)
    assert [anchor_width(b) for b in budgets] == [4, 2, 2, 2, 3, 3, 4, 5, 6, 8]


def test_spearman() -> None:
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


@pytest.fixture(scope="module")
def llama() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    with np.load(MODELS / "llama.npz") as data:
        feeds = {k: data[k] for k in data.files}
    return onnx.load(MODELS / "llama.onnx"), feeds


@pytest.mark.parametrize("budget", [3.0, 4.5])
def test_budget_is_met_and_beats_the_uniform_width_of_the_same_bytes(llama, budget: float) -> None:
    model, feeds = llama
    # embedding FP32: the probe measures MatMuls only, so its cosine is then the export's
    common = {"scale_dtype": "float16", "scale_rule": "signed", "keep_embedding": True}
    out, summary = export_with_summary(model, feeds=feeds, bits="auto", bits_budget=budget, **common)
    allocation = summary.allocation
    assert allocation is not None and allocation.bits_per_weight <= budget + 1e-9
    assert allocation.bits_per_weight > budget - 0.5  # the budget is spent, not left idle
    assert len({layer.bits for layer in allocation.layers}) > 1  # a mix, not one width
    text = summary.format()
    assert f"budget {budget} bits per weight" in text and "-bit" in text
    # Uniform at the width of about the same bytes (fp16 scales: b + 0.5 bits per weight).
    uniform, _ = export_with_summary(model, bits=int(budget - 0.5), **common)
    ref, auto_out = _twin_outputs(model, out, feeds)
    _, uni_out = _twin_outputs(model, uniform, feeds)
    assert np.mean(row_cosines(ref, auto_out)) > np.mean(row_cosines(ref, uni_out))
    # Under a budget no probe run of the chosen widths (the export's memory peak): the exported model's
    # check measures them, with the op (within 1e-4 of the dequantized twin here).
    assert allocation.cosine_probe is None and "chosen widths" not in text
    assert allocation.cosine_exported is not None and f"exported model: cosine {allocation.cosine_exported:.6f}" in text
    assert np.min(row_cosines(ref, auto_out)) == pytest.approx(allocation.cosine_exported, abs=1e-4)


def test_target_cosine_is_reached_with_fewer_bytes_than_keeping_layers_fp32(llama) -> None:
    model, feeds = llama
    common = {"scale_rule": "signed", "keep_embedding": True}  # the analysis sees the MatMuls only
    out, summary = export_with_summary(model, feeds=feeds, bits="auto", target_cosine=0.995, **common)
    allocation = summary.allocation
    ref, got = _twin_outputs(model, out, feeds)
    assert np.min(row_cosines(ref, got)) >= 0.995
    assert allocation.cosine_probe >= 0.995
    # the same target by keeping whole layers FP32 (every other layer 4-bit) writes a bigger model
    fp32_mixed, _ = export_with_summary(model, feeds=feeds, target_cosine=0.995, **common)
    assert out.ByteSize() < fp32_mixed.ByteSize()


def test_proxy_and_exact_sensitivities_are_both_reported(llama) -> None:
    model, feeds = llama
    for mode in ("exact", "proxy"):
        _, summary = export_with_summary(
            model, feeds=feeds, bits="auto", bits_budget=4.0, bits_sensitivity=mode, scale_rule="signed"
        )
        allocation = summary.allocation
        assert allocation.sensitivity == mode and -1.0 <= allocation.rank_correlation <= 1.0
        assert allocation.anchor == 4 and "exact damage at 4 bits" in summary.format()
        layer = allocation.layers[0]
        assert set(layer.damage) == {2, 3, 4, 5, 6, 8} and set(layer.proxy) == {2, 3, 4, 5, 6, 8}
        # more bits, less weight error, for every layer (the proxy is monotone in width)
        assert all(all(x.proxy[a] > x.proxy[b] for a, b in [(2, 3), (3, 4), (4, 5), (5, 6), (6, 8)])
                   for x in allocation.layers)  # fmt: skip


def test_under_a_budget_of_three_the_proxy_measures_3_bits_exactly(llama) -> None:
    model, feeds = llama
    found = {}
    for mode in ("exact", "proxy"):
        _, summary = export_with_summary(
            model, feeds=feeds, bits="auto", bits_budget=3.0, bits_sensitivity=mode, scale_rule="signed"
        )
        found[mode] = summary.allocation
    proxy, exact = found["proxy"], found["exact"]
    assert proxy.anchor == 3 and "exact damage at 3 bits" in proxy.format()
    # the anchor's damage is the measured one; the others are carried from it by the weight error
    assert [x.damage[3] for x in proxy.layers] == [x.damage[3] for x in exact.layers]
    assert [x.damage[4] for x in proxy.layers] != [x.damage[4] for x in exact.layers]


def test_auto_rule_under_a_budget_reports_its_choice(llama) -> None:
    model, feeds = llama
    _, summary = export_with_summary(model, feeds=feeds, bits="auto", bits_budget=4.0, bits_sensitivity="proxy")
    allocation = summary.allocation
    choice = allocation.rule_choice
    assert choice is not None and set(choice.cosine) == {"balanced", "signed", "mse"}
    assert choice.default == "balanced" and allocation.scale_rule == choice.chosen
    assert f"scale rule auto: {choice.chosen} (mean cosine, every layer at 4 bits" in summary.format()


def test_a_tied_head_and_its_table_share_one_width() -> None:
    model = onnx.load(ZOO / "qwen2_tied_dynamo.onnx")
    feeds = random_input(model, {}, seed=0)
    out, summary = export_with_summary(model, feeds=feeds, bits="auto", bits_budget=6.0, scale_rule="signed")
    heads = [n for n in out.graph.node if is_op_node(n, MATMUL_SHARED) and len(n.input) > 1]
    gathers = [n for n in out.graph.node if is_op_node(n, GATHER)]
    assert heads and gathers
    width = {a.name: a.i for a in gathers[0].attribute}.get("bits", 4)
    assert all({a.name: a.i for a in h.attribute}.get("bits", 4) == width for h in heads)
    head = next(
        x
        for x in summary.allocation.layers
        if x.bits is not None and x.weights == max(y.weights for y in summary.allocation.layers)
    )
    assert head.bits == width
    inits = {t.name: t for t in out.graph.initializer}
    packed = onnx.numpy_helper.to_array(inits[gathers[0].input[0]])
    scales, supers = (onnx.numpy_helper.to_array(inits[name]) for name in gathers[0].input[2:4])
    k = {a.name: a.i for a in gathers[0].attribute}["K"]
    assert np.isfinite(dequantize(packed, scales, k, 32, width, supers)).all()


def test_gptq_allocates_widths_with_its_own_codes_and_beats_rounding_at_the_budget(llama) -> None:
    """bits="auto" with method gptq: every width measured and written by GPTQ; the same bytes keep more accuracy."""
    import re

    model, feeds = llama
    common = {"feeds": feeds, "bits": "auto", "bits_budget": 3.0, "scale_rule": "signed", "keep_embedding": True}
    out, summary = export_with_summary(model, method="gptq", **common)
    allocation = summary.allocation
    assert allocation.method == "gptq" and "method gptq" in summary.format()
    assert allocation.bits_per_weight <= 3.0 + 1e-9
    widths = {x.name: x.bits for x in allocation.layers}
    assert None not in widths.values() and len(set(widths.values())) > 1
    # The nodes hold what a fixed-width GPTQ export of the same widths writes.
    fixed, _ = export_with_summary(
        model, feeds=feeds, method="gptq", scale_rule="signed", keep_embedding=True,
        bits={re.escape(name): b for name, b in widths.items()},
    )  # fmt: skip
    got = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    for t in fixed.graph.initializer:
        np.testing.assert_array_equal(got[t.name], onnx.numpy_helper.to_array(t), err_msg=t.name)
    assert [n.attribute for n in out.graph.node] == [n.attribute for n in fixed.graph.node]
    rtn, _ = export_with_summary(model, **common)
    ref, gptq_out = _twin_outputs(model, out, feeds)
    _, rtn_out = _twin_outputs(model, rtn, feeds)
    assert np.mean(row_cosines(ref, gptq_out)) > np.mean(row_cosines(ref, rtn_out))


def test_auto_without_feeds_is_a_one_line_error(llama) -> None:
    model, _ = llama
    with pytest.raises(ValueError, match="bits='auto' needs calibration inputs"):
        export_with_summary(model, bits="auto")


def _genai_decoder(name: str) -> tuple[Path, onnx.ModelProto, dict[str, np.ndarray]]:
    """The decoder of tests/genai/NAME: its file, the model, feeds of 8 tokens and an empty past."""
    import json

    folder = Path(__file__).parent / "genai" / name
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    model = onnx.load(folder / config["filename"])
    ids = np.arange(1, 9, dtype=np.int64)[None, :]
    kv = np.zeros((1, config["num_key_value_heads"], 0, config["head_size"]), np.float32)
    feeds = {i.name: ids if i.name == "input_ids" else np.ones_like(ids) if i.name == "attention_mask" else
             np.arange(8, dtype=np.int64)[None, :] if i.name == "position_ids" else kv
             for i in model.graph.input}  # fmt: skip
    return folder / config["filename"], model, feeds


def test_an_llm_is_scored_on_its_logits_alone() -> None:
    """A decoder's KV-cache outputs outnumber its logits and never see the LM head: damages use the logits."""
    from cim_int4.exporter import ExportOptions
    from cim_int4.exporter.probe import Probe

    _, model, feeds = _genai_decoder("llama-fp32")
    probe = Probe(model, ExportOptions(), [feeds])
    assert "logits" in probe.outputs and len(probe.outputs) > 1
    head = next(i for i, c in enumerate(probe.candidates) if c.w.shape[1] == probe.reference(0)[0].shape[-1])
    from cim_int4.exporter.quantize import quantize_weight

    weights = {probe.candidates[head].key: quantize_weight(probe.candidates[head].w, 32, "signed", 2)}
    every = probe.cosines([head], weights)
    logits = probe.cosines([head], weights, scored=[probe.outputs.index("logits")])
    assert len(logits) == 1 and len(every) == len(probe.outputs)
    assert logits[0] < 1.0 and np.mean(1 - every) < 1 - logits[0]  # the head's error, diluted by the KV outputs
    _, summary = export_with_summary(model, feeds=feeds, bits="auto", bits_budget=5.0, scale_rule="signed")
    assert summary.allocation.bits_per_weight <= 5.0
    assert summary.allocation.damage == "KL of the logits" and "(KL of the logits)" in summary.format()


def test_damage_on_logits_is_their_kl(monkeypatch) -> None:
    """With logits, a layer's damage is the mean KL of the next-token distributions (what perplexity pays)."""
    import cim_int4.exporter.allocate as allocate

    from cim_int4.metrics import row_kl

    _, model, feeds = _genai_decoder("llama-fp32")
    measures = []
    real = allocate.Probe.compared

    def compared(self, layers, weights, measure, parts=None, scored=None):
        measures.append(measure)
        return real(self, layers, weights, measure, parts, scored)

    monkeypatch.setattr(allocate.Probe, "compared", compared)
    _, summary = export_with_summary(
        model, feeds=feeds, bits="auto", bits_budget=5.0, scale_rule="signed", bits_sensitivity="exact"
    )
    assert measures.count(row_kl) == len(summary.allocation.layers) * len(allocate.WIDTHS)


def test_a_head_tied_through_a_transpose_gives_its_width_to_the_table() -> None:
    """The genai builder stores a tied head once, [K, N], and the Gather reads it through a Transpose."""
    _, model, feeds = _genai_decoder("llama-tied-fp32")
    out, summary = export_with_summary(model, feeds=feeds, bits="auto", bits_budget=7.0, scale_rule="signed")
    gathers = [n for n in out.graph.node if is_op_node(n, GATHER)]
    heads = [n for n in out.graph.node if is_op_node(n, MATMUL_SHARED) and len(n.input) > 1]
    assert gathers and heads, summary.format()
    head = max((x for x in summary.allocation.layers if x.bits is not None), key=lambda x: x.weights)
    assert {a.name: a.i for a in gathers[0].attribute}.get("bits", 4) == head.bits
    assert all({a.name: a.i for a in h.attribute}.get("bits", 4) == head.bits for h in heads)


@pytest.mark.parametrize(("method", "mapped"), [("rtn", False), ("gptq", False), ("gptq", True)])
def test_auto_from_a_file_is_the_export_from_memory(tmp_path: Path, method: str, mapped: bool, monkeypatch) -> None:
    """From a file, bits="auto" reads each weight once into the probe and streams the output: the same export.

    ``mapped``: the probe's FP32 weights mapped from a temporary file, dropped before runs with many
    layers dequantized (as a real LLM's are).
    """
    import cim_int4.exporter.probe as probe
    from cim_int4.exporter import ExportOptions, export_int4
    from onnx import numpy_helper

    evicted = []
    if mapped:
        monkeypatch.setattr(probe, "MAP_WEIGHTS_BYTES", 0)
        real = probe.WeightFile.evict
        monkeypatch.setattr(probe.WeightFile, "evict", lambda self: (evicted.append(1), real(self)))
    path, model, feeds = _genai_decoder("llama-tied-fp32")
    options = {"feeds": feeds, "bits": "auto", "bits_budget": 4.5, "scale_rule": "signed", "method": method}
    assert not ExportOptions(**options).whole_model
    export_int4(path, tmp_path / "auto.onnx", quiet=True, external_data=True, **options)
    mem, _ = export_with_summary(model, **options)
    streamed = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "auto.onnx").graph.initializer}
    assert streamed.keys() == {t.name for t in mem.graph.initializer}
    for t in mem.graph.initializer:
        np.testing.assert_array_equal(streamed[t.name], numpy_helper.to_array(t), err_msg=t.name)
    assert bool(evicted) == mapped


def test_gptq_statistics_spilled_to_disk_give_the_same_export(llama, monkeypatch) -> None:
    """Past SPILL_BYTES the X^T X of every input wait in a temporary folder: the export is unchanged."""
    import cim_int4.exporter.calibration as calibration

    model, feeds = llama
    options = {"feeds": feeds, "bits": "auto", "bits_budget": 3.5, "method": "gptq", "keep_embedding": True}
    kept, _ = export_with_summary(model, **options)
    made = []
    real = calibration.SpilledStats

    def spy(stats):  # noqa: ANN001, ANN202
        made.append(real(stats))
        return made[-1]

    monkeypatch.setattr(calibration, "SPILL_BYTES", 0)
    monkeypatch.setattr(calibration, "SpilledStats", spy)
    spilled, _ = export_with_summary(model, **options)
    assert made and len(made[0]) > 1
    got = {t.name: onnx.numpy_helper.to_array(t) for t in spilled.graph.initializer}
    for t in kept.graph.initializer:
        np.testing.assert_array_equal(got[t.name], onnx.numpy_helper.to_array(t), err_msg=t.name)
    assert [n.attribute for n in spilled.graph.node] == [n.attribute for n in kept.graph.node]


def test_spilled_stats_read_back_what_was_kept() -> None:
    from cim_int4.exporter.calibration import SpilledStats, Stats, spilled

    rng = np.random.default_rng(0)
    stats = {f"x{i}": Stats(rng.standard_normal((k, k)).astype(np.float32), rng.random(k), rows=7 * k)
             for i, k in enumerate((3, 8))}  # fmt: skip
    assert spilled(stats) is stats  # small: stays in memory
    disk = spilled(stats, threshold=0)
    assert isinstance(disk, SpilledStats) and list(disk) == list(stats) and len(disk) == 2
    for name, s in stats.items():
        back = disk[name]
        np.testing.assert_array_equal(back.xtx, s.xtx)
        np.testing.assert_array_equal(back.abs_sum, s.abs_sum)
        assert back.rows == s.rows and back.xtx.dtype == np.float32
    folder = Path(disk._folder.name)
    assert folder.is_dir()
    del disk
    assert not folder.exists()  # removed with the object


def test_weight_file_maps_the_arrays_back_read_only() -> None:
    from cim_int4.exporter.weightfile import map_weights

    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 5), (1, 1), (700, 9), (0, 4))]
    file = map_weights(arrays)
    assert file is not None and file.nbytes % 4096 == 0
    for a, m in zip(arrays, file.arrays, strict=True):
        assert m.shape == a.shape and m.dtype == np.float32 and not m.flags.writeable
        np.testing.assert_array_equal(m, a)
    file.evict()  # pages leave the process, the values do not
    for a, m in zip(arrays, file.arrays, strict=True):
        np.testing.assert_array_equal(m, a)
