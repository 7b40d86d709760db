"""Benchmarks (run as modules: `python -m benchmarks.moe_lora`)."""
