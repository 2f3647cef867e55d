mkdir -p /tmp/res5; trap 'tar czf $OUT/res5.tgz -C /tmp res5' EXIT
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/site/torchtitan ] || pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_round5
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for r in 4 5; do
python3 scripts/bench_train.py --ngpu 1 --repeat 1 --steps 14 --warmup 6 --variants bf16+compile,float8_moe+compile --out /tmp/res5/r$r.json > /tmp/res5/r$r.txt 2>&1; tail -3 /tmp/res5/r$r.txt
done
