#!/usr/bin/env bash
# Launch torchtitan's trainer with the float8_moe plugin, the way torchtitan's run_train.sh does.
#   NGPU=8 CONFIG_FILE=train_configs/llama4_grouped_shared_debug.toml ./scripts/run_train.sh --training.steps=50
# NGPU: processes on this node (GPUs; on a machine without CUDA, CPU processes over gloo).
# LOG_RANK: LOCAL ranks whose output is shown, comma separated, applied on every node (default
# 0: the first process of each node; with NNODES set, lines are prefixed with the global rank).
# Extra arguments are torchtitan config overrides.
#
# Multi-node: run this script once on every node with the same NNODES, MASTER_ADDR, MASTER_PORT
# and RDZV_ID (scripts/multinode_train.slurm does it for SLURM):
#   NNODES: number of nodes. Unset: one node, as above.
#   NODE_RANK: this node's index, 0..NNODES-1. Node 0 hosts the rendezvous store at
#     MASTER_ADDR:MASTER_PORT. Global ranks are assigned by the rendezvous, so node N does not
#     necessarily hold ranks N*NGPU..; the log lines' "[rankR]:" prefixes say which it holds.
#   MASTER_ADDR: address of node 0, reachable from every node (required).
#   MASTER_PORT: free port on node 0 for the rendezvous (default 29500).
#   RDZV_ID: rendezvous id, the same on every node (default: $SLURM_JOB_ID, else a constant).
#   LOCAL_ADDR: address the other nodes reach this node at (default: its FQDN).
set -euo pipefail
cd "$(dirname "$0")/.."

NGPU=${NGPU:-8}
CONFIG_FILE=${CONFIG_FILE:-train_configs/llama4_debug.toml}
LOG_RANK=${LOG_RANK:-0}
# Checked before anything slow, so a misconfigured node fails at once.
if [[ -z "${NNODES:-}" ]]; then
    # One node: a private rendezvous on a free local port.
    launch=(--nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0")
else
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        echo "run_train.sh: NNODES=$NNODES is set but MASTER_ADDR is not;" \
            "set MASTER_ADDR to the address of node 0 on every node" >&2
        exit 2
    fi
    if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
        echo "run_train.sh: NNODES must be a positive integer, not '$NNODES'" >&2
        exit 2
    fi
    if ! [[ "${NODE_RANK:-}" =~ ^(0|[1-9][0-9]*)$ ]] || ((NODE_RANK >= NNODES)); then
        echo "run_train.sh: with NNODES=$NNODES, NODE_RANK must be set to 0..$((NNODES - 1))" \
            "(0 on the node at MASTER_ADDR), not '${NODE_RANK:-}'" >&2
        exit 2
    fi
    # torchrun ignores --node_rank under c10d (ranks come from the rendezvous), so NODE_RANK
    # says instead which node hosts the rendezvous store. Left to torchrun, a node guesses it
    # from MASTER_ADDR matching one of its addresses, which misses an address of a secondary
    # NIC (what `hostname --ip-address` may give) and leaves no node hosting it.
    is_host=0
    if ((NODE_RANK == 0)); then
        is_host=1
    fi
    launch=(--nnodes="$NNODES" --nproc_per_node="$NGPU"
        --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
        --rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-torchtitan_fp8_moe}}" --rdzv_conf="is_host=$is_host")
    # Every node's local rank 0 would print "[rank0]:"; prefix lines with the global rank
    # instead, so the merged output of all nodes (one SLURM log) says which rank wrote what.
    # shellcheck disable=SC2016 # ${rank} is torchrun's placeholder, not a shell variable
    prefix='[rank${rank}]:'
    export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-$prefix}
    if [[ -n "${LOCAL_ADDR:-}" ]]; then
        launch+=(--local_addr="$LOCAL_ADDR")
    fi
fi

# The bundled corpus is read from disk; never reach for the Hugging Face hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# As torchtitan's run_train.sh: the CUDA allocator grows segments instead of caching blocks of
# every size, so steps whose temporaries differ in size (fp8 casts) fragment less. A setting of
# the user's, under either name, is left as it is.
if [[ -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then
    export PYTORCH_ALLOC_CONF=expandable_segments:True
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # CPU run: one thread per process keeps NGPU processes from oversubscribing the cores.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

exec torchrun "${launch[@]}" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan_fp8_moe.train --job.config_file "$CONFIG_FILE" "$@"
