"""The op's fixed names: the single source of truth, read by the exporter, the tests and CMake."""

OP_DOMAIN = "dbhoo.cim"
OP_TYPE = "CimInt4MatMul"
OP_VERSION = 1
# The int4 row gather (token embeddings) in the same domain and version, reading the same codes/scales format.
GATHER_OP_TYPE = "CimInt4Gather"
# Session config entry that sets the compute mode ("fp32" | "int8") of every CimInt4MatMul in a session.
COMPUTE_CONFIG = "cim_int4.compute"
