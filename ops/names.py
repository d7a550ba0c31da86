"""The op's fixed names: the single source of truth, read by the exporter, the tests and CMake."""

OP_DOMAIN = "dbhoo.cim"
OP_TYPE = "CimInt4MatMul"
OP_VERSION = 1
