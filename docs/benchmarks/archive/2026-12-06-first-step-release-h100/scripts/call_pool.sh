mkdir -p /tmp/res2; trap 'tar czf $OUT/res2.tgz -C /tmp res2' EXIT
B="--ngpu 1 --repeat 1 --steps 12 --warmup 5"
for r in 1 2; do
  (cd gpu/base && PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_train.py $B --variants float8_moe --out /tmp/res2/base_r$r.json > /tmp/res2/base_r$r.txt 2>&1; tail -1 /tmp/res2/base_r$r.txt)
  (cd gpu/pool && FP8_MOE_CAST_POOL=1 PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_train.py $B --variants float8_moe --out /tmp/res2/pool_r$r.json > /tmp/res2/pool_r$r.txt 2>&1; tail -1 /tmp/res2/pool_r$r.txt)
  grep -h "retries\|OutOfMemory" /tmp/res2/*_r${r}_*.log | head -3
done
