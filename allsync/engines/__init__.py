"""Rollout engines, one interface: `generate(prompts, n, sampling) -> Rollout`, `load_adapter(tensors, version)`,
`release_memory()`.

    torch_engine.py   TorchEngine: the trainer's own model generates (the reference and the CPU default)
    vllm_engine.py    VLLMEngine: vLLM in the worker's process, the adapter handed over each step
    vllm_support.py   the engine arguments and memory share vLLM gets beside the trainer
"""
