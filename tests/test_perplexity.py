"""cim-int4 perplexity: same figures as a plain ORT loop, KL 0 against itself, one-line errors; windows scored once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cim_int4.cli import main
from cim_int4.perplexity import PerplexityError, perplexity, windows

FIXTURES = Path(__file__).parent / "genai"  # made by tests/genai/make_models.py
FP32, INT4 = FIXTURES / "llama-fp32", FIXTURES / "llama-int4"
WINDOW = 48

TEXT = (
    "The licence grants each person who receives a copy the right to run, study, share and change the "
    "program, on the condition that every copy they pass on carries the same freedoms. A distributor "
    "must offer the corresponding source code, keep the notices intact, and may charge for the service "
    "of making a copy but not for the permission itself. "
) * 6


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def og():
    return pytest.importorskip("onnxruntime_genai")


def plain_loop_perplexity(folder: Path, text: str, window: int, og) -> tuple[float, int]:
    """Perplexity the straightforward way: genai's tokenizer, plain ORT, non-overlapping windows, tokens 1..W-1."""
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    ids = [int(t) for t in og.Tokenizer(og.Config(str(folder))).encode(text)]
    bos = config["bos_token_id"]
    lead = [bos] if ids and ids[0] == bos else []
    ids = ids[len(lead) :]
    span = window - len(lead)
    dec = config["decoder"]
    sess = ort.InferenceSession(str(folder / dec["filename"]), providers=["CPUExecutionProvider"])
    past = {
        i.name: np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
        for i in sess.get_inputs()
        if i.name.startswith("past_key_values")
    }
    nll, count = 0.0, 0
    for start in range(0, len(ids) - span + 1, span):
        w = np.array(lead + ids[start : start + span], dtype=np.int64)[None]
        logits = sess.run(["logits"], {"input_ids": w, "attention_mask": np.ones_like(w), **past})[0][0]
        x = logits.astype(np.float64)
        logp = x - x.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= logp[np.arange(window - 1), w[0, 1:]].sum()
        count += window - 1
    return math.exp(nll / count), count


def test_fp32_perplexity_matches_a_plain_ort_loop(text_file: Path, og) -> None:
    expected, count = plain_loop_perplexity(FP32, TEXT, WINDOW, og)
    report = perplexity(FP32, text=text_file, window=WINDOW, progress=False)
    row = report.rows[0]
    assert row["tokens"] == count
    assert report.settings["windows"] >= 3
    assert row["perplexity"] == pytest.approx(expected, rel=1e-6)


def test_a_model_against_itself_has_kl_zero_and_agreement_one(text_file: Path, og) -> None:
    report = perplexity(FP32, [FP32, INT4], text=text_file, window=WINDOW, progress=False)
    ref, same, int4 = report.rows
    assert same["kl"] == 0.0 and same["top1_agreement"] == 1.0
    assert same["perplexity"] == ref["perplexity"] and same["gap"] == 0.0
    # The int4 model is a different model: its KL is positive and its perplexity differs.
    assert int4["kl"] > 0.0 and int4["perplexity"] != ref["perplexity"]
    assert 0.0 < int4["top1_agreement"] <= 1.0
    assert int4["tokens"] == ref["tokens"]


def test_onnx_file_with_tokenizer_folder_and_cim_int4_model(text_file: Path, og, tmp_path: Path) -> None:
    from cim_int4.genai import prepare
    from cim_int4.genai_bench import with_accuracy_level

    cim = prepare(INT4, tmp_path / "cim", compute="fp32", quiet=True)  # CimInt4MatMul nodes: our library needed
    report = perplexity(FP32 / "model.onnx", [cim], text=text_file, window=WINDOW, tokenizer=FP32, progress=False)
    acc0 = with_accuracy_level(INT4, tmp_path / "acc0", 0)  # float activations, like compute fp32
    nbits = perplexity(FP32, [acc0], text=text_file, window=WINDOW, progress=False)
    # The converted model computes the same dequantized weights as MatMulNBits: nearly the same figures.
    assert report.rows[1]["perplexity"] == pytest.approx(nbits.rows[1]["perplexity"], rel=1e-3)
    assert report.rows[0]["perplexity"] == pytest.approx(nbits.rows[0]["perplexity"], rel=1e-9)


def test_windows_score_each_text_position_once() -> None:
    tokens = list(range(100, 200))
    for stride, score_from, bos in [(None, 1, None), (10, 1, None), (7, 1, 5), (None, 8, None), (None, 8, 5)]:
        wins = windows(tokens, 16, stride, bos, score_from)
        scored = [int(t) for w in wins for t in w.ids[w.first :]]
        assert len(scored) == len(set(scored)), (stride, score_from, bos)
        assert all(len(w.ids) == 16 for w in wins)
        assert all(w.first >= score_from for w in wins)
        if bos is not None:
            assert all(w.ids[0] == bos for w in wins)
    # Overlapping windows (stride 10 < 15 text tokens) score every token after the first window's first.
    wins = windows(tokens, 16, 10, None, 1)
    assert sorted(int(t) for w in wins for t in w.ids[w.first :]) == tokens[1 : 10 * (len(wins) - 1) + 16]


def test_windows_too_few_tokens() -> None:
    with pytest.raises(PerplexityError, match="too few for one window"):
        windows([1, 2, 3], 16)


def _one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("cim-int4: error: "), err
    return err


def test_errors_are_one_line(text_file: Path, tmp_path: Path, capsys, og) -> None:
    fp32 = str(FP32)
    err = _one_line_error(["perplexity", fp32, "--text", str(tmp_path / "missing.txt")], capsys)
    assert "missing.txt" in err
    err = _one_line_error(["perplexity", fp32, str(tmp_path / "nope.onnx"), "--text", str(text_file)], capsys)
    assert "nope.onnx" in err
    # The tiny model's context is 256 tokens.
    err = _one_line_error(["perplexity", fp32, "--text", str(text_file), "--window", "300"], capsys)
    assert "context length 256" in err
    err = _one_line_error(["perplexity", fp32, "--text", str(text_file), "--window", "4000"], capsys)
    assert "too few" in err
    err = _one_line_error(["perplexity", str(FP32 / "model.onnx"), "--text", str(text_file)], capsys)
    assert "--tokenizer" in err
    # A model without a logits output.
    model = onnx.load(str(FP32 / "model.onnx"))
    for out in model.graph.output:
        if out.name == "logits":
            out.name = "scores"
    for node in model.graph.node:
        node.output[:] = ["scores" if o == "logits" else o for o in node.output]
    bad = tmp_path / "nologits.onnx"
    onnx.save(model, str(bad), save_as_external_data=True, location="nologits.onnx.data")
    err = _one_line_error(["perplexity", fp32, str(bad), "--text", str(text_file), "--window", str(WINDOW)], capsys)
    assert "no 'logits' output" in err


def test_cli_table_and_json(text_file: Path, tmp_path: Path, capsys, og) -> None:
    out = tmp_path / "ppl.json"
    argv = ["perplexity", str(FP32), str(INT4), "--text", str(text_file), "--window", str(WINDOW), "-q"]
    assert main([*argv, "--json", str(out), "--max-tokens", "200"]) == 0
    table = capsys.readouterr().out
    assert str(INT4) in table and "perplexity" in table
    data = json.loads(out.read_text())
    assert [m["model"] for m in data["models"]] == [str(FP32), str(INT4)]
    assert data["settings"]["text_tokens"] == 200
    assert data["models"][0]["tokens"] == data["settings"]["scored_tokens"]


def test_bos_starts_every_window(text_file: Path, og) -> None:
    plain = perplexity(FP32, text=text_file, window=WINDOW, progress=False)
    with_bos = perplexity(FP32, text=text_file, window=WINDOW, bos=1, progress=False)
    assert plain.settings["bos"] is None and with_bos.settings["bos"] == 1
    assert with_bos.settings["stride"] == WINDOW - 1  # one text token fewer per window
    # Every text token of a window is scored after the BOS, so no window loses its first token.
    assert with_bos.rows[0]["tokens"] == with_bos.settings["windows"] * (WINDOW - 1)
    assert with_bos.rows[0]["perplexity"] != plain.rows[0]["perplexity"]
    with pytest.raises(PerplexityError, match="bos must be"):
        perplexity(FP32, text=text_file, window=WINDOW, bos=-1, progress=False)
