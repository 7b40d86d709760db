#!/bin/bash
# The checks waiting for the next lent GPU (BENCHMARKS.md, "GPU checks"), as one device call from the repository root:
#   run(command="bash benchmarks/gpu_checks.sh", carry=[".whl"], timeout_s=540)
# Each part is bounded by `timeout`, so that one hang leaves the others' output; logs and JSONs go to $OUT.
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/pip.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD
part() {  # part NAME SECONDS COMMAND...: the command's output in $OUT/NAME.txt, its exit status last
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
    echo "rc $?" >> "$OUT/$name.txt"
}
# a file a part: a file whose time runs out still leaves the others' failures printed
part pytest_latent 100 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/moe_lora/test_latent_attention.py
part pytest_experts 60 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/quant/test_fused_experts.py
part pytest_graphs 110 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/allsync/engines/test_decode_graphs.py
part profile_experts 70 python3 -m benchmarks.decode_profile --cases 32x1024 --expert-kernel triton \
    --json "$OUT/decode_profile_nf4_expert_kernel.json"
part blocks 90 python3 -m benchmarks.engine_decode --plans nf4 --rows 32,256 --contexts 1024,20480 --steps 6 \
    --modes graphed --kv-cache auto,fp8 --attention triton --attention-blocks 64x32x8,64x32x4,128x16x8 \
    --json "$OUT/engine_decode_h200_blocks_2.json"
part expert_blocks 80 python3 -m benchmarks.engine_decode --plans nf4 --rows 32,256 --contexts 1024 --steps 6 \
    --modes graphed --kv-cache fp8 --expert-kernel triton \
    --expert-blocks 64x64x4x3,64x128x4x3,128x128x8x3,64x256x8x2,32x256x4x3 --json "$OUT/engine_decode_h200_expert_blocks.json"
# at most 8 files come back from $OUT: every part's log in one file, beside the JSONs
for f in "$OUT"/*.txt; do echo "== $(basename "$f")"; cat "$f"; done > "$OUT/logs.log"
rm -f "$OUT"/*.txt
tail -n 60 "$OUT/logs.log"
