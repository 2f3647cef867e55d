mkdir -p /tmp/res3; trap 'tar czf $OUT/res3.tgz -C /tmp res3' EXIT
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee /tmp/res3/gpu.txt
extra=""; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && extra="--training.local_batch_size=3"
timeout 170 python3 scripts/bench_train.py --ngpu 1 --variants bf16,float8_moe --repeat 1 --steps 14 --warmup 6 --out /tmp/res3/eager.json $extra > /tmp/res3/eager.txt 2>&1; cat /tmp/res3/eager.txt | tail -4
