#!/usr/bin/env bash
# Launch torchtitan's trainer with the float8_moe plugin, the way torchtitan's run_train.sh does.
#   NGPU=8 CONFIG_FILE=train_configs/llama4_grouped_shared_debug.toml ./scripts/run_train.sh --training.steps=50
# NGPU: processes (GPUs; on a machine without CUDA, CPU processes over gloo). LOG_RANK: ranks whose
# output is shown (comma separated). Extra arguments are torchtitan config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."

NGPU=${NGPU:-8}
CONFIG_FILE=${CONFIG_FILE:-train_configs/llama4_debug.toml}
LOG_RANK=${LOG_RANK:-0}
# The bundled corpus is read from disk; never reach for the Hugging Face hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # CPU run: one thread per process keeps NGPU processes from oversubscribing the cores.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan_fp8_moe.train --job.config_file "$CONFIG_FILE" "$@"
