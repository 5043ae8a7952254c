#!/usr/bin/env bash
# The GPU check suite on every GPU of this machine (world 1, and world N when there are N > 1),
# a summary of what it measured, then the GPU benchmark (benchmarks/bench_step.py --preset gpu
# --offload --fail-above-flag: LOMO against its floor, offload against none, failed above 1.10x the
# floor) on 1 GPU and on all of them. Usage: tests/gpu/run_all.sh   (or: make test-gpu)
# Figures stay in $LOMO_GPU_RESULTS (default runs/gpu_checks): results_<world>.json, train_builtin.json,
# pytest.log, bench_<world>.txt. Budget: about 15 minutes on one GPU (an estimate: never run). The exit
# status is the checks', else the benchmark's: one that fails to run, or that flags LOMO above 1.10x
# its floor, fails it.
set -u
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
export LOMO_GPU_RESULTS=${LOMO_GPU_RESULTS:-runs/gpu_checks}
rm -rf "$LOMO_GPU_RESULTS"
mkdir -p "$LOMO_GPU_RESULTS"

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not found"
$PYTHON -c "import torch, deepspeed; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}, {torch.cuda.device_count()} GPU(s) visible')"
n_gpus=$($PYTHON -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

start=$(date +%s)
timeout 2400 $PYTHON -m pytest -q -rA -s -p no:cacheprovider tests/gpu 2>&1 | tee "$LOMO_GPU_RESULTS/pytest.log"
status=${PIPESTATUS[0]}

echo
echo "== GPU check suite: $(( $(date +%s) - start )) s, pytest exit status $status"
$PYTHON tests/gpu/compare.py "$LOMO_GPU_RESULTS"
tail -n 1 "$LOMO_GPU_RESULTS/pytest.log"

if [ "$n_gpus" -lt 1 ]; then
    echo "== GPU benchmark: skipped (no GPU)"
    exit "$status"
fi
worlds="1"
[ "$n_gpus" -gt 1 ] && worlds="1 $n_gpus"
for world in $worlds; do
    echo
    echo "== GPU benchmark on $world GPU(s): benchmarks/bench_step.py --preset gpu --offload --fail-above-flag"
    bench_start=$(date +%s)
    timeout 600 $PYTHON -m torch.distributed.run --nproc_per_node "$world" -m benchmarks.bench_step \
        --preset gpu --offload --fail-above-flag > "$LOMO_GPU_RESULTS/bench_$world.txt" 2>&1
    bench_status=$?
    # The report (rank 0's), without the launch's log lines.
    sed -n '/-parameter LLaMA/,$p' "$LOMO_GPU_RESULTS/bench_$world.txt" | grep -v '^\[' || true
    echo "(benchmark: $(( $(date +%s) - bench_start )) s, exit status $bench_status; log: $LOMO_GPU_RESULTS/bench_$world.txt)"
    if grep -q "!!! LOMO ABOVE" "$LOMO_GPU_RESULTS/bench_$world.txt"; then
        echo "FAILED: LOMO above 1.10x its floor on $world GPU(s) (the benchmark's flag)"
    elif [ "$bench_status" -ne 0 ]; then
        tail -n 30 "$LOMO_GPU_RESULTS/bench_$world.txt"
    fi
    [ "$bench_status" -ne 0 ] && [ "$status" -eq 0 ] && status=$bench_status
done
echo
echo "== the benchmark's verdicts"
for world in $worlds; do
    echo "[$world GPU(s)]"
    grep -e "LOMO against its floor" -e "offload against none" -e "LOMO within" -e "!!! LOMO ABOVE" \
        "$LOMO_GPU_RESULTS/bench_$world.txt" || echo "no figures (see $LOMO_GPU_RESULTS/bench_$world.txt)"
done
exit "$status"
