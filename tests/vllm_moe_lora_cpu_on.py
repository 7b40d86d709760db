"""For run.imports in tests: switches on the vLLM CPU MoE-LoRA harness (tests/vllm_moe_lora_cpu.py) in every process
of a run, before any vLLM import (the config is parsed, and this imported, first)."""

from tests.vllm_moe_lora_cpu import activate

activate()
