#!/usr/bin/env bash
# Fine-tune on one machine with 1-8 GPUs (or CPU ranks).
#   launch/single_node.sh 8 ds_configs/llama65b.json [train.py flags...]
#   launch/single_node.sh 1 ds_configs/llama7b.json --set lomo.lr=0.03
set -euo pipefail
NGPUS=${1:?usage: $0 NGPUS CONFIG [train.py flags...]}
CONFIG=${2:?usage: $0 NGPUS CONFIG [train.py flags...]}
shift 2
cd "$(dirname "$0")/.."
# Fail on a bad config here, in one process, before N ranks start and allocate anything.
python3 launch/train.py --config "$CONFIG" --dry-run "$@" >/dev/null
exec deepspeed --num_gpus "$NGPUS" launch/train.py --config "$CONFIG" "$@"
