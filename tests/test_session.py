"""Session helpers: thread-to-core pinning plan, model sources, library lookup, thread-count invariance."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.ops import physical_cores, session_options, thread_affinities
from cim_int4.ops.library import LIBRARY_ENV
from cim_int4.ops.session import PIN_MODES
from conftest import op_attributes, op_model, quantized

from cim_int4 import library_path, make_session
from cim_int4.contract import COMPUTE_CONFIG

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


# ---------------------------------------------------------------- affinity side effects, thread count


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (its own CPU mask and ORT state); fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")

MODEL_CODE = """
    import os, threading, warnings
    import numpy as np
    from cim_int4 import make_session
    from cim_int4.ops import physical_cores
    from conftest import op_attributes, op_model, quantized
    model = op_model(op_attributes(quantized(64, 4)), [["M", 64]])
    a = np.ones((2, 64), dtype=np.float32)
"""


@pytest.fixture
def tests_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))


@needs_two_cpus
@pytest.mark.parametrize("pin", [True, "pool", "run", False])
def test_make_session_leaves_the_calling_thread_free(pin: object, tests_on_path: None) -> None:
    # Before: make_session pinned the caller, every thread it started later, and the pool threads of
    # any later plain ORT session to the first CPU for good.
    run_python(
        MODEL_CODE
        + f"""
    allowed = os.sched_getaffinity(0)
    sess = make_session(model, threads=2, pin={pin!r})
    sess.run(None, {{"A0": a}})
    assert os.sched_getaffinity(0) == allowed, os.sched_getaffinity(0)
    seen = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    t.start(); t.join()
    assert seen == [allowed], seen
    """
    )


@needs_two_cpus
def test_a_process_that_moved_is_not_pinned_back(tests_on_path: None) -> None:
    run_python(
        MODEL_CODE
        + """
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    make_session(model, threads=1)
    os.sched_setaffinity(0, {last})
    assert physical_cores() == [[last]]
    sess = make_session(model, threads=1, pin="run")
    assert os.sched_getaffinity(0) == {last}
    sess.run(None, {"A0": a})
    assert os.sched_getaffinity(0) == {last}
    """
    )


@needs_two_cpus
def test_threads_above_the_cores_of_a_restricted_mask_warn_and_cap(tests_on_path: None) -> None:
    # Before: under a mask of one CPU, threads=2 put the caller and the pool thread on the same CPU, silently.
    proc = run_python(
        MODEL_CODE
        + """
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = make_session(model, threads=2)
    assert sess.get_session_options().intra_op_num_threads == 1
    assert [str(w.message) for w in caught if "exceeds the 1 physical core" in str(w.message)], caught
    sess = make_session(model, threads=2, oversubscribe=True)
    assert sess.get_session_options().intra_op_num_threads == 2
    print(sess.run(None, {"A0": a})[0].shape)
    """
    )
    assert proc.stdout.strip() == "(2, 4)"


@pytest.mark.parametrize("threads", [0, -1])
@pytest.mark.parametrize("pin", [True, False])
def test_threads_below_one_is_a_value_error_naming_it(threads: int, pin: bool) -> None:
    model = op_model(op_attributes(quantized(64, 4)), [["M", 64]])
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        make_session(model, threads=threads, pin=pin)
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        session_options(threads=threads, pin=pin)


def test_bad_pin_and_compute_are_value_errors() -> None:
    with pytest.raises(ValueError, match="pin must be"):
        session_options(pin="always")
    with pytest.raises(ValueError, match="compute must be"):
        session_options(compute="fp16")


@pytest.mark.parametrize("compute", ["fp32", "int8"])
def test_compute_sets_the_session_config_entry(compute: str) -> None:
    assert session_options(compute=compute).get_session_config_entry(COMPUTE_CONFIG) == compute
    with pytest.raises(Exception, match=COMPUTE_CONFIG):  # ORT: unknown key
        session_options().get_session_config_entry(COMPUTE_CONFIG)


def test_pin_modes_compute_the_same() -> None:
    model = op_model(op_attributes(quantized(256, 64)), [["M", 256]])
    a = np.random.default_rng(2).standard_normal((5, 256), dtype=np.float32)
    outputs = [make_session(model, threads=2, pin=p, oversubscribe=True).run(None, {"A0": a})[0] for p in PIN_MODES]
    assert outputs[0].tobytes() == outputs[1].tobytes() == outputs[2].tobytes()


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
    y2 = make_session(model, threads=2, oversubscribe=True).run(None, {"A0": a})[0]
    y2_unpinned = make_session(model, threads=2, pin=False, oversubscribe=True).run(None, {"A0": a})[0]
    assert y1.tobytes() == y2.tobytes() == y2_unpinned.tobytes()
