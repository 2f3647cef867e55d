mkdir -p /tmp/res3; trap 'tar czf $OUT/res3.tgz -C /tmp res3; cp /tmp/trace3_*.json.gz $OUT/ 2>/dev/null' EXIT
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/probe ] || { pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1; python3 gpu/make_probe.py /tmp/probe; }
nvidia-smi --query-gpu=name,memory.total --format=csv
P="--profiling.enable_profiling --profiling.profile_freq=10 --profiling.profiler_active=2"
B="--ngpu 1 --repeat 1 --steps 11 --warmup 6 --variants float8_moe+compile"
(cd /tmp/probe && FP8_MOE_DENSE_PROBE=1 PYTHONPATH=/tmp/site:/tmp/probe python3 scripts/bench_train.py $B --out /tmp/res3/prof_probe.json -- $P > /tmp/res3/prof_probe.txt 2>&1; tail -1 /tmp/res3/prof_probe.txt
t=$(find outputs/bench_train/float8_moe+compile -name rank0_trace.json | head -1); echo "trace $t"; gzip -c "$t" > /tmp/trace3_probe.json.gz)
python3 scripts/bench_train.py $B --out /tmp/res3/prof_main.json -- $P > /tmp/res3/prof_main.txt 2>&1; tail -1 /tmp/res3/prof_main.txt
t=$(find outputs/bench_train/float8_moe+compile -name rank0_trace.json | head -1); echo "trace $t"; gzip -c "$t" > /tmp/trace3_main.json.gz
