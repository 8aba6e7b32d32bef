"""The performance workloads and their one timing protocol: ``python -m bench.perf --list``."""
