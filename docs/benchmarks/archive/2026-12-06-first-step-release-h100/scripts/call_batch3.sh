mkdir -p /tmp/res; trap 'tar czf $OUT/res.tgz -C /tmp res' EXIT
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider > /tmp/res/test_cuda.txt 2>&1; tail -3 /tmp/res/test_cuda.txt
B="--ngpu 1 --repeat 1 --steps 12 --warmup 5 --training.local_batch_size=3"
rounds() { for r in 1 2; do
  PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_train.py $B --variants bf16,float8_moe --out /tmp/res/new_r$r.json > /tmp/res/new_r$r.txt 2>&1; tail -3 /tmp/res/new_r$r.txt
  (cd gpu/base && PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_train.py $B --variants float8_moe --out /tmp/res/base_r$r.json > /tmp/res/base_r$r.txt 2>&1; tail -2 /tmp/res/base_r$r.txt)
  (cd gpu/base && EXP_RELEASE=1 PYTHONPATH=$PWD/../release_site:/tmp/site:$PWD python3 scripts/bench_train.py $B --variants bf16 --out /tmp/res/bf16rel_r$r.json > /tmp/res/bf16rel_r$r.txt 2>&1; tail -2 /tmp/res/bf16rel_r$r.txt; grep -c EXP_RELEASE /tmp/res/bf16rel_r${r}_bf16.log)
  grep -h "released\|step: " /tmp/res/new_r${r}_float8_moe.log /tmp/res/base_r${r}_float8_moe.log /tmp/res/bf16rel_r${r}_bf16.log /tmp/res/new_r${r}_bf16.log | cut -c1-130 | grep "released\|step:  [1234] \|step: 12"
done; }
export -f rounds; export B
timeout 330 bash -c rounds
