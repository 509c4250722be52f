#!/bin/bash
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=$PWD:/tmp/site
C=bench/results/2026-11-26-s18-gpu-costs
G="python3 bench/gpu_server.py --gpu-costs $C/costs-cuda.json --cpu-costs $C/costs-cpu-this-host.json --samples 500 --compute-on cuda --devices 100 --model resnet18 --network 4g+"
started=$(date +%s)
for s in cpu gpu; do
  (/usr/bin/time -v timeout 250 $G --servers $s > $OUT/k100-resnet18-4gplus-$s.log 2>&1; echo "done after $(( $(date +%s) - started )) s" >> $OUT/k100-resnet18-4gplus-$s.log) &
done
{ timeout 200 python3 -m pytest -q -s -p no:cacheprovider -o filterwarnings= -W default \
      tests/test_gpu_processes.py
  echo "tests done after $(( $(date +%s) - started )) s"
} > $OUT/tests.log 2>&1 &
wait
