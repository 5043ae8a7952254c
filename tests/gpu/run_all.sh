#!/usr/bin/env bash
# The GPU check suite on every GPU of this machine (world 1, and world N when there are N > 1),
# then a summary of what it measured. Usage: tests/gpu/run_all.sh   (or: make test-gpu)
# Figures stay in $LOMO_GPU_RESULTS (default runs/gpu_checks): results_<world>.json, train_builtin.json,
# pytest.log. Budget: under 8 minutes on one GPU.
set -u
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
export LOMO_GPU_RESULTS=${LOMO_GPU_RESULTS:-runs/gpu_checks}
rm -rf "$LOMO_GPU_RESULTS"
mkdir -p "$LOMO_GPU_RESULTS"

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not found"
$PYTHON -c "import torch, deepspeed; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}, {torch.cuda.device_count()} GPU(s) visible')"

start=$(date +%s)
timeout 900 $PYTHON -m pytest -q -rA -s -p no:cacheprovider tests/gpu 2>&1 | tee "$LOMO_GPU_RESULTS/pytest.log"
status=${PIPESTATUS[0]}

echo
echo "== GPU check suite: $(( $(date +%s) - start )) s, pytest exit status $status"
$PYTHON tests/gpu/compare.py "$LOMO_GPU_RESULTS"
tail -n 1 "$LOMO_GPU_RESULTS/pytest.log"
exit "$status"
