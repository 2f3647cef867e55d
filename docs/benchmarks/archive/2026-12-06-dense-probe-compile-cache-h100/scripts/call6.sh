mkdir -p /tmp/res6; trap 'tar czf $OUT/res6.tgz -C /tmp res6' EXIT
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 scripts/bench_train.py --ngpu 1 --repeat 1 --steps 12 --warmup 6 --variants float8_moe+compile --out /tmp/res6/always.json -- --float8_moe.policy always > /tmp/res6/always.txt 2>&1; tail -1 /tmp/res6/always.txt
grep -c "policy always\|timed" /tmp/res6/always_float8_moe_compile.log
