mkdir -p /tmp/res; trap 'tar czf $OUT/res.tgz -C /tmp res; cp /tmp/trace_*.json.gz $OUT/ 2>/dev/null' EXIT
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
python3 gpu/make_probe.py /tmp/probe
B="--ngpu 1 --repeat 1"
P="--profiling.enable_profiling --profiling.profile_freq=10 --profiling.profiler_active=2"
for v in bf16+compile float8_moe+compile; do
  python3 scripts/bench_train.py $B --variants $v --steps 11 --warmup 6 --out /tmp/res/prof_$v.json -- $P > /tmp/res/prof_$v.txt 2>&1; tail -2 /tmp/res/prof_$v.txt
  t=$(find outputs/bench_train/$v -name rank0_trace.json | head -1); echo "$v trace: $t"; gzip -c "$t" > /tmp/trace_${v%%+*}.json.gz
done
ls -la /tmp/trace_*
S="--steps 14 --warmup 6"
python3 scripts/bench_train.py $B $S --variants bf16+compile,float8_moe+compile --out /tmp/res/r1.json > /tmp/res/r1.txt 2>&1; tail -4 /tmp/res/r1.txt
(cd /tmp/probe && FP8_MOE_DENSE_PROBE=1 PYTHONPATH=/tmp/site:/tmp/probe python3 scripts/bench_train.py $B $S --variants float8_moe+compile --out /tmp/res/probe_r1.json > /tmp/res/probe_r1.txt 2>&1; tail -2 /tmp/res/probe_r1.txt)
