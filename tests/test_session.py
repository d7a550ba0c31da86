"""Session helpers: thread-to-core pinning plan, model sources, library lookup, thread-count invariance."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.ops import physical_cores, session_options, thread_affinities
from cim_int4.ops.library import LIBRARY_ENV
from conftest import op_attributes, op_model, quantized

from cim_int4 import library_path, make_session

# ---------------------------------------------------------------- thread_affinities


def test_two_threads_on_two_cores() -> None:
    # Caller on CPU 0; the one pool thread on CPU 1, which ORT spells 1-based: "2".
    assert thread_affinities(2, [[0], [1]]) == ([0, 1], "2")


def test_one_thread_has_no_pool_threads() -> None:
    assert thread_affinities(1, [[0], [1]]) == ([0], "")


def test_more_threads_than_cores_wrap_around() -> None:
    assert thread_affinities(4, [[0], [1]]) == ([0, 1, 0, 1], "2;1;2")


def test_distinct_physical_cores_before_hyperthread_siblings() -> None:
    # Two cores with SMT siblings (0, 2) and (1, 3): first one CPU per core, then siblings.
    assert thread_affinities(3, [[0, 2], [1, 3]]) == ([0, 1, 2], "2;3")
    assert thread_affinities(5, [[0, 2], [1, 3]]) == ([0, 1, 2, 3, 0], "2;3;4;1")


@pytest.mark.parametrize("threads", [0, -1])
def test_threads_below_one_raise(threads: int) -> None:
    with pytest.raises(ValueError, match="threads must be >= 1"):
        thread_affinities(threads, [[0], [1]])


def test_physical_cores_cover_the_allowed_cpus() -> None:
    cores = physical_cores()
    cpus = [cpu for core in cores for cpu in core]
    assert sorted(cpus) == sorted(os.sched_getaffinity(0)) and len(set(cpus)) == len(cpus)


def test_session_options() -> None:
    so = session_options(threads=2)
    assert so.intra_op_num_threads == 2 and so.inter_op_num_threads == 1
    assert session_options().intra_op_num_threads == len(physical_cores())


def test_make_session_pins_the_calling_thread_or_frees_it() -> None:
    model = op_model(op_attributes(quantized(64, 4)), [["M", 64]])
    allowed = os.sched_getaffinity(0)
    make_session(model, threads=2)
    cpus, _ = thread_affinities(2, physical_cores())
    assert os.sched_getaffinity(0) == {cpus[0]}
    make_session(model, threads=2, pin=False)
    assert os.sched_getaffinity(0) == allowed


# ---------------------------------------------------------------- model sources


def test_make_session_accepts_path_bytes_and_proto(tmp_path: Path) -> None:
    model = op_model(op_attributes(quantized(100, 9)), [["M", 100]])
    path = tmp_path / "op.onnx"
    onnx.save(model, path)
    a = np.random.default_rng(0).standard_normal((3, 100), dtype=np.float32)
    outputs = [
        make_session(source, threads=1).run(None, {"A0": a})[0]
        for source in (model, model.SerializeToString(), path, str(path))
    ]
    assert outputs[0].shape == (3, 9) and np.abs(outputs[0]).max() > 0
    for y in outputs[1:]:
        assert y.tobytes() == outputs[0].tobytes()


# ---------------------------------------------------------------- library lookup


def test_library_path_from_env_must_exist(tmp_path: Path, monkeypatch) -> None:
    missing = tmp_path / "no" / "libcim_int4_ops.so"
    monkeypatch.setenv(LIBRARY_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        library_path()
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        make_session(op_model(op_attributes(quantized(32, 2)), [[1, 32]]), threads=1)


def test_library_path_from_env_is_used(monkeypatch) -> None:
    real = library_path()
    assert Path(real).is_file()
    monkeypatch.setenv(LIBRARY_ENV, real)
    assert library_path() == real


# ---------------------------------------------------------------- threads


def test_two_threads_equal_one_thread() -> None:
    # Enough output channels (N = 300) for several tasks on the pool, M = 17 rows.
    model = op_model(op_attributes(quantized(1000, 300, 64)), [["M", 1000]])
    a = np.random.default_rng(3).standard_normal((17, 1000), dtype=np.float32)
    y1 = make_session(model, threads=1).run(None, {"A0": a})[0]
    y2 = make_session(model, threads=2).run(None, {"A0": a})[0]
    y2_unpinned = make_session(model, threads=2, pin=False).run(None, {"A0": a})[0]
    assert y1.tobytes() == y2.tobytes() == y2_unpinned.tobytes()
