#!/usr/bin/env bash
# Fine-tune across several machines. HOSTFILE lists one machine per line with its GPU count
# (DeepSpeed's format, see launch/hostfile.example); run this on the first machine, which must
# reach the others by passwordless ssh and share the repository path and the model weights.
#   launch/multi_node.sh launch/hostfile ds_configs/llama65b.json [train.py flags...]
# lomo_ds takes each rank's shard index from its place in the data-parallel group, never from
# LOCAL_RANK, so shards are right on any number of nodes.
set -euo pipefail
HOSTFILE=${1:?usage: $0 HOSTFILE CONFIG [train.py flags...]}
CONFIG=${2:?usage: $0 HOSTFILE CONFIG [train.py flags...]}
shift 2
cd "$(dirname "$0")/.."
[ -f "$HOSTFILE" ] || { echo "$HOSTFILE: hostfile not found (see launch/hostfile.example)" >&2; exit 2; }
python3 launch/train.py --config "$CONFIG" --dry-run "$@" >/dev/null
MASTER_ADDR=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$HOSTFILE")}
exec deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
    launch/train.py --config "$CONFIG" "$@"
