mkdir -p /tmp/res2; trap 'tar czf $OUT/res2.tgz -C /tmp res2' EXIT
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/probe ] || { pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1; python3 gpu/make_probe.py /tmp/probe; }
B="--ngpu 1 --repeat 1 --steps 14 --warmup 6"
for r in 2 3; do
python3 scripts/bench_train.py $B --variants bf16+compile,float8_moe+compile --out /tmp/res2/r$r.json > /tmp/res2/r$r.txt 2>&1; tail -3 /tmp/res2/r$r.txt
(cd /tmp/probe && FP8_MOE_DENSE_PROBE=1 PYTHONPATH=/tmp/site:/tmp/probe python3 scripts/bench_train.py $B --variants float8_moe+compile --out /tmp/res2/probe_r$r.json > /tmp/res2/probe_r$r.txt 2>&1; tail -1 /tmp/res2/probe_r$r.txt)
done
