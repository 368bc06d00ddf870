#!/usr/bin/env bash
# On a CUDA machine, from the repository root: versions, the CUDA tests, then the rest of the
# suite, each log under $OUT (default out/gpu). BUDGET (seconds, default 560) bounds the whole
# run: the CUDA tests come first, so they always finish; the rest of the suite gets what is
# left, and its log names every test it ran (pytest -v), so a cut run still says which passed.
#
#   OUT=out/gpu BUDGET=560 bash benchmarks/gpu/check.sh
#   ONLY="tests/test_data.py tests/test_accelerate.py" DIST=load bash benchmarks/gpu/check.sh
#   PYTHONPATH=out/gpu-deps DIST=load ONLY=tests bash benchmarks/gpu/check.sh  # one pass
#   BENCH="wgan-gp distill" bash benchmarks/gpu/check.sh   # these bench rows after the CUDA
#                    tests, before the suite: eager, torch.compile and functacc.jit, JSON each
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
# stream_failures.py (beside this script) writes each traceback to $OUT/failures.log at once.
# Not nproc: it reports OMP_NUM_THREADS where that is set (below).
workers=$(($(python3 -c "import os; print(len(os.sched_getaffinity(0)))") - 2))
export OUT PYTHONPATH=$PWD:$PWD/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Two OpenMP threads per process: 14 pytest workers each using every core oversubscribed the
# 16 cores so badly that CPU tests of 30 s here ran past 240 s there.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/functacc-inductor}
end=$((SECONDS + ${BUDGET:-560}))

nvidia-smi -L
# The third parties the tests trace too: the GPU image's timm differed from ours (2026-11-27).
python3 -c 'import sys, torch, triton, timm, transformers; print(sys.version.split()[0], "torch",
torch.__version__, "triton", triton.__version__, "timm", timm.__version__, "transformers",
transformers.__version__, torch.cuda.get_device_name())'

if [ -z "${ONLY:-}" ]; then
    timeout $((end - SECONDS)) python3 -m pytest -q -rfEs -n 12 -p no:cacheprovider \
        tests/test_cuda.py tests/test_cudagraph.py 2>&1 | tee "$OUT/cuda.log" | tail -25
    rest=(--ignore tests/test_cuda.py --ignore tests/test_cudagraph.py)
fi
for model in ${BENCH:-}; do
    timeout $((end - SECONDS)) python3 -m functacc bench --model "$model" --device cuda \
        --competitors eager,torch.compile,functacc --steps "${BENCH_STEPS:-50}" --rounds 2 \
        --warmup 3 --no-progress --json "$OUT/gpu-$model.json" 2>&1 | tee "$OUT/bench-$model.log" |
        tail -15
done
if [ -n "${ONLY:-}" ]; then
    read -r -a rest <<<"$ONLY"
fi
timeout $((end - SECONDS)) python3 -m pytest -v -n "$workers" --dist "${DIST:-loadfile}" --tb=short -rfE \
    -p no:cacheprovider -p stream_failures --timeout "${TEST_TIMEOUT:-400}" "${rest[@]}" >"$OUT/suite.log" 2>&1
echo "suite rc $?"
grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/suite.log" | tail -40
echo "tests passed: $(grep -c ' PASSED ' "$OUT/suite.log")," \
    "failed: $(grep -c ' FAILED ' "$OUT/suite.log"), errors: $(grep -c ' ERROR ' "$OUT/suite.log")"
