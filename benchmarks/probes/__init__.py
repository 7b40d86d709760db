"""Probes: extensions a benchmark loads through `run.imports` to test one hypothesis, not settings of the toolkit."""
