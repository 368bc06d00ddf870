#!/usr/bin/env bash
# Issue 44's rows in one lease, from the repository root on a CUDA machine: ResNet-50 224
# fp32 against torch.compile (default and reduce-overhead), GPT-2 small against
# reduce-overhead, then a kernel profile of functacc's ResNet-50 step (where its time goes).
# JSON, logs and the profile land under $OUT; BUDGET (seconds) bounds the whole run.
#
#   OUT=out/gpu BUDGET=540 bash benchmarks/gpu/rows.sh
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/functacc-inductor}
end=$((SECONDS + ${BUDGET:-540}))

bench() {
    local name=$1
    shift
    timeout $((end - SECONDS)) python3 -m functacc bench "$@" --device cuda --no-progress \
        --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | tail -8
}
bench resnet50-fp32 --model resnet50 --image-size 224 --batch-size 64 --steps 10 --rounds 3 \
    --warmup 2 --competitors eager,torch.compile,torch.compile:reduce-overhead,functacc
bench gpt2-small --model gpt2-small --steps 10 --rounds 2 --warmup 1 \
    --competitors torch.compile:reduce-overhead,functacc
timeout $((end - SECONDS)) python3 benchmarks/gpu/profile_step.py --model resnet50 \
    --image-size 224 --batch-size 64 >"$OUT/profile-resnet50.txt" 2>&1
tail -30 "$OUT/profile-resnet50.txt"
