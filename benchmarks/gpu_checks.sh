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
part pytest_latent 100 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short -m "slow or not slow" tests/moe_lora/test_latent_attention.py
part pytest_experts 60 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short -m "slow or not slow" tests/quant/test_fused_experts.py
part pytest_graphs 90 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short -m "slow or not slow" tests/allsync/engines/test_decode_graphs.py
part pytest_fp8_gemm 40 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short -m "slow or not slow" tests/allsync/engines/test_fp8_linears.py \
    tests/benchmarks/test_fp8_linear.py
# rollout.fp8_linear_kernel scaled_mm in the graphed step (the plan assumes its copies' measured cost gone until this runs)
part fp8_gemm 80 python3 -m benchmarks.engine_decode --plans nf4 --rows 32,256 --contexts 1024,20480 --steps 6 \
    --modes graphed --kv-cache fp8 --attention triton --fp8-linear-kernel dequantize,scaled_mm \
    --json "$OUT/engine_decode_h200_fp8_gemm.json"
part blocks 80 python3 -m benchmarks.engine_decode --plans nf4 --rows 32,256 --contexts 1024,20480 --steps 6 \
    --modes graphed --kv-cache auto,fp8 --attention triton --attention-blocks 64x32x8,64x32x4,128x16x8 \
    --json "$OUT/engine_decode_h200_blocks_2.json"
# 256 rows: 8 an expert; 2048 rows: 64 an expert, what each held expert gets at 671B's EP 16 with 128 slots
part expert_blocks 70 python3 -m benchmarks.engine_decode --plans nf4 --rows 256,2048 --contexts 1024 --steps 6 \
    --modes graphed --kv-cache fp8 --expert-kernel dequantize,triton \
    --expert-blocks 64x64x4x3x16,64x128x4x3x16,128x128x8x3x16,64x64x4x3x64,64x128x4x3x64 \
    --json "$OUT/engine_decode_h200_expert_blocks.json"
# at most 8 files come back from $OUT: every part's log in one file, beside the JSONs
for f in "$OUT"/*.txt; do echo "== $(basename "$f")"; cat "$f"; done > "$OUT/logs.log"
rm -f "$OUT"/*.txt
tail -n 60 "$OUT/logs.log"
