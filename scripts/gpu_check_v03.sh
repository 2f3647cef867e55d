#!/usr/bin/env bash
# torchtitan 0.3 on a GPU machine whose own torch is older than the 2.13 it is released with
# (an H200 machine with torch 2.11, Python 3.12): installs the wheels in .whl03/ into /tmp/site03,
# says whether torchtitan 0.3 imports, and if it does, trains the DeepSeek-V3 and Qwen3-MoE
# debug models on 1 GPU, float8_moe and bf16 in turn, printing each run's losses and tokens/s.
#   scripts/gpu_check_v03.sh [STEPS]     (default 20 steps a run)
# .whl03/ holds what torchtitan 0.3.0 needs beyond the machine's torch, triton and numpy (6 MB),
# downloaded on a machine with an index for each NAME==VER below with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl03 NAME==VER
# torchtitan==0.3.0 torchao==0.18.0 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0
# typeguard==4.6.1 shtab==1.13.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
# spmd_types==0.2.3 torch_checkpointing==0.1.1
# Seen on a CPU machine with torch 2.11.0 (2026-12-03): torchtitan 0.3.0 does not import
# ("cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'", from
# torchtitan/distributed/full_dtensor.py); this script says whether the GPU machine agrees.
set -uo pipefail
cd "$(dirname "$0")/.."

STEPS=${1:-20}
SITE=/tmp/site03
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl03/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

echo "== does torchtitan 0.3 import with this machine's torch?"
if ! python3 - <<'EOF'; then
import torch, torchtitan, torchao
print(f"torch {torch.__version__}, torchtitan {torchtitan.__version__}, torchao {torchao.__version__}")
import torchtitan.train  # the trainer, every model registry and torchtitan's own fp8 converters
import torchtitan_fp8_moe.torchtitan_v03.config_registry  # noqa: F401
print(f"torchtitan 0.3 imports with torch {torch.__version__}: yes")
EOF
    echo "torchtitan 0.3 does not import with this machine's torch (traceback above)"
    exit 2
fi

# The debug entries of torchtitan_fp8_moe/torchtitan_v03/config_registry.py at torchtitan's own
# debug batch (8 x 2048 tokens); float8_moe converts with policy "always".
run() {
    local entry=$1
    echo "== $entry"
    timeout 150 python3 -m torch.distributed.run --nproc_per_node=1 --rdzv_backend c10d \
        --rdzv_endpoint=localhost:0 -m torchtitan_fp8_moe.torchtitan_v03.train \
        --module torchtitan_fp8_moe.torchtitan_v03.config_registry --config "$entry" \
        --training.steps "$STEPS" --training.local_batch_size 8 --training.seq_len 2048 \
        --metrics.disable_color_printing --debug.seed 0 --dump_folder "/tmp/gpu_check_v03/$entry" \
        >"/tmp/gpu_check_v03_$entry.log" 2>&1
    local rc=$?
    grep -E "float8_moe: converted|step: *[0-9]+ " "/tmp/gpu_check_v03_$entry.log" |
        sed -E 's/.*(float8_moe: converted[^;]*).*/\1/; s/.*(step:.*)/\1/'
    if [ "$rc" -ne 0 ]; then
        echo "$entry failed (exit $rc); the log's last lines:"
        tail -30 "/tmp/gpu_check_v03_$entry.log"
    fi
}
mkdir -p /tmp/gpu_check_v03
for entry in deepseek_v3_debugmodel_float8_moe deepseek_v3_debugmodel \
    qwen3_moe_debug_float8_moe qwen3_moe_debug; do
    run "$entry"
done
# Mean tokens/s over each run's steps after the 3rd (compilation and warm-up before).
python3 - <<'EOF'
import glob, re
for path in sorted(glob.glob("/tmp/gpu_check_v03_*.log")):
    tps = [(int(s), float(t)) for s, t in re.findall(r"step: *(\d+) .*?tps: *([\d,]+)", open(path).read().replace(",", ""))]
    warm = [t for s, t in tps if s > 3]
    name = path.removeprefix("/tmp/gpu_check_v03_").removesuffix(".log")
    print(f"{name}: {len(tps)} steps, mean tokens/s after step 3: {sum(warm) / len(warm):.0f}" if warm else f"{name}: no steps")
EOF
