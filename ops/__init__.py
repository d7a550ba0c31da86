"""The op library (path, sessions) and the NumPy reference of CimInt4MatMul."""

from ..contract import OP_DOMAIN, OP_TYPE, OP_VERSION
from .library import library_path
from .session import make_session, physical_cores, session_options, thread_affinities

__all__ = [
    "OP_DOMAIN",
    "OP_TYPE",
    "OP_VERSION",
    "library_path",
    "make_session",
    "physical_cores",
    "session_options",
    "thread_affinities",
]
