mkdir -p /tmp/res4; trap 'tar czf $OUT/res4.tgz -C /tmp res4' EXIT
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/site/torchtitan ] || pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
rm -rf /tmp/probe; python3 gpu/make_probe.py /tmp/probe
nvidia-smi --query-gpu=name,memory.total --format=csv
B="--ngpu 1 --repeat 1 --steps 14 --warmup 6 --variants float8_moe+compile"
for r in 1 2; do
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_main python3 scripts/bench_train.py $B --out /tmp/res4/main_r$r.json > /tmp/res4/main_r$r.txt 2>&1; tail -1 /tmp/res4/main_r$r.txt
  (cd /tmp/probe && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_probe FP8_MOE_DENSE_PROBE=1 PYTHONPATH=/tmp/site:/tmp/probe python3 scripts/bench_train.py $B --out /tmp/res4/probe_r$r.json > /tmp/res4/probe_r$r.txt 2>&1; tail -1 /tmp/res4/probe_r$r.txt; grep -c DENSE_PROBE /tmp/res4/probe_r${r}_float8_moe_compile.log)
done
