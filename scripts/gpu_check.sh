#!/usr/bin/env bash
# The GPU check of issue 32, one command on a lent GPU machine (set-up included).
#
#   bash scripts/gpu_check.sh fetch    # here, once: the cp312 wheels the GPU image lacks -> .gpu-wheels/
#   bash scripts/gpu_check.sh          # there, with .gpu-wheels carried: installs them, then
#                                      # the CUDA tests and benchmarks.split_cost on the GPU
#
# Results go to $OUT (the device tool's result folder) or /tmp/gpu-check. No network is
# needed on the GPU machine: pip installs from .gpu-wheels only.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels

if [[ "${1:-}" == "fetch" ]]; then
    PY=.venv/bin/python
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    specs=()
    while read -r name; do
        [[ -z "$name" || "$name" == \#* ]] && continue
        version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
        specs+=("$name==$version")
    done < scripts/gpu_wheels.txt
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any \
        -d "$WHEELS" "${specs[@]}"
    # py-spy: the split benchmark's CPU profile of the engine and the frontend (--profile)
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d "$WHEELS" py-spy
    du -sh "$WHEELS"
    exit 0
fi

OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
SITE=/tmp/tandem-gpu-site
start=$(date +%s)
python3 -m pip install -q --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl
export PATH="$SITE/bin:$PATH" PYTHONPATH="$SITE:$PWD" TANDEM_CACHE_DIR=/tmp/tandem-cache HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
echo "set-up: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"

export PYTHONUNBUFFERED=1

# GPU_CHECK_PARTS picks parts (default "decode split tests", in that order; "split-f32" adds
# the split in float32 (token parity with in-process), "sync" the in-process run without async
# scheduling, ~30 s each); SPLIT_MODES narrows the stack's modes, SPLIT_FRONTENDS is tandem
# serve --frontends.
PARTS=" ${GPU_CHECK_PARTS:-decode split tests} "

# Batch-1 decode of a Llama-3.2-1B shape (2.15 GB in bf16) against its weight-read roofline,
# without and with async scheduling, and the GPU time of each kernel of a step.
if [[ "$PARTS" == *" decode "* ]]; then
python3 -m benchmarks.gpu_decode --json "$OUT/decode.json" 2>&1 | grep -v '^\[engine' | tee "$OUT/decode.txt" || true
# The same with the opt-in kernels, untimed until this run: the Triton GEMV for the linears of
# 1-8 rows (kernels/triton_linear.py) and split-KV decode attention. Compare step_ms, and in
# the kernel tables gemv_kernel against nvjet and split_kv_* against paged_attention_kernel.
python3 -m benchmarks.gpu_decode --triton-gemv --triton-split-kv --json "$OUT/decode-new.json" 2>&1 \
    | grep -v '^\[engine' | tee "$OUT/decode-new.txt" || true
echo "after decode: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
fi

# The split at GPU speed: bench-135m's shape in bf16, 1,024 requests of 64-512 prompt ids and
# 128-256 output tokens, 4 client processes with 1,024 streams; in-process vs the stack, both
# with async scheduling (py-spy profiles of the DELTA run's engine and first frontend).
SPLIT=(--preset bench-135m --num-requests 1024 --concurrency 1024 --clients 4 --prompt-range 64,512
       --output-range 128,256)
ENGINE_ARGS="--device cuda --dtype bfloat16 --max-model-len 1024"
if [[ "$PARTS" == *" split "* ]]; then
python3 -m benchmarks.split_cost "${SPLIT[@]}" --modes "${SPLIT_MODES:-delta,final}" \
    --frontends "${SPLIT_FRONTENDS:-1}" --engine-args "$ENGINE_ARGS --async-scheduling" \
    --profile delta --profile-dir "$OUT" --json "$OUT/split.json" 2>&1 | grep -v '^\[engine' \
    | tee -a "$OUT/split.txt" || true
echo "after split: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
fi

# CUDA graphs, greedy parity on the GPU (the Triton kernels compiled, not interpreted; with
# and without async scheduling) and the fused kernels' numerics there. Their CPU cases run in CI.
if [[ "$PARTS" == *" tests "* ]]; then
python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py tests/test_engine_parity.py \
    tests/test_kernels.py tests/test_triton_linear.py \
    -k "test_cuda_graphs or (cuda and (test_engine_parity or silu or rotary_and_cache or split_kv or gemv))" \
    2>&1 | tail -5 | tee "$OUT/tests.txt"
echo "after tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
fi

# Opt-in (GPU_CHECK_PARTS=split-f32): the same split in float32, 256 requests, DELTA only. bf16
# runs of the stack gave other token ids than in-process from position 2-3 on (run 3); if the
# float32 digests match, that was bf16 batch-composition drift, not the split's doing.
if [[ "$PARTS" == *" split-f32 "* ]]; then
python3 -m benchmarks.split_cost "${SPLIT[@]}" --num-requests 256 --concurrency 256 --modes delta \
    --engine-args "--device cuda --dtype float32 --max-model-len 1024 --async-scheduling" 2>&1 \
    | grep -v '^\[engine' | tee -a "$OUT/split-f32.txt" || true
echo "after split-f32: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
fi

# The in-process run again without async scheduling: its gain on this workload.
if [[ "$PARTS" == *" sync "* ]]; then
python3 -m benchmarks.split_cost "${SPLIT[@]}" --no-stack --engine-args "$ENGINE_ARGS" 2>&1 \
    | grep -v '^\[engine' | tee -a "$OUT/split.txt" || true
fi
echo "total: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
