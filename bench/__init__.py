"""The benchmarks of mergekit-bmm: the merging benchmark on real models and the perf scripts."""
