"""exporter.io: the hand-written protobuf reader and writer, external-data spans, output-path checks."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import writer as exporter_writer
from cim_int4.exporter.io import ModelFileError, external_span, read_model
from cim_int4.exporter.writer import TensorStore
from cim_int4.graphs import mlp


def test_write_model_gives_the_bytes_of_serialize_to_string() -> None:
    # The exporter writes a one-file output node by node, not as one serialized copy of the model.
    from cim_int4.graphs import LlamaConfig, llama_decoder

    model = llama_decoder(LlamaConfig(hidden=64, intermediate=128, layers=1, heads=2))
    model.doc_string = "model doc"
    model.graph.doc_string = "graph doc"
    model.metadata_props.add(key="k", value="v")
    model.graph.value_info.add(name="extra")
    buf = io.BytesIO()
    exporter_writer.write_model(buf, model)
    assert buf.getvalue() == model.SerializeToString()



def test_read_model_leaves_external_weights_in_their_file_until_asked(tmp_path: Path) -> None:
    model = mlp()
    expected = onnx.numpy_helper.to_array(model.graph.initializer[0])
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="m.data", size_threshold=0)
    lazy, files = read_model(path)
    assert files[0] == str(path.resolve()) and str((tmp_path / "m.data").resolve()) in files
    tensor = lazy.graph.initializer[0]
    assert tensor.data_location == onnx.TensorProto.EXTERNAL and not tensor.raw_data
    location, offset, length = external_span(tensor)
    assert Path(location).name == "m.data" and offset >= 0 and length == np.prod(tensor.dims) * 4
    np.testing.assert_array_equal(TensorStore().read(tensor), expected)


def test_inline_model_reads_back_as_onnx_reads_it(tmp_path: Path) -> None:
    model = mlp()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    lazy, files = read_model(path)
    TensorStore().inline(lazy)
    assert lazy.SerializeToString() == onnx.load(path).SerializeToString() and len(files) == 1


@pytest.mark.parametrize(("content", "message"), [(b"", "empty file"), (b"not a model", "not a readable ONNX model")])
def test_unreadable_files_are_one_line_errors_naming_them(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=message) as info:
        read_model(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_output_that_is_an_input_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    with pytest.raises(ModelFileError):
        exporter_writer.check_output(path, tmp_path / "m.onnx.data", [str(path.resolve())])
