#!/bin/bash
# K = 100, both servers per process, every resource's busy seconds: resnet18 on 4g, 4g+,
# wifi; mobilenetv3-small on 4g, wifi. Passes computed on the GPU (the time charged is
# the tables').
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=$PWD:/tmp/site
C=bench/results/2026-11-26-s18-gpu-costs
G="python3 bench/gpu_server.py --gpu-costs $C/costs-cuda.json --cpu-costs $C/costs-cpu-this-host.json --samples 500 --compute-on cuda --devices 100"
started=$(date +%s)
for job in "resnet18 4g" "resnet18 4g+" "resnet18 wifi" "mobilenetv3-small 4g" "mobilenetv3-small wifi"; do
  set -- $job
  log=$OUT/$1-${2/+/plus}.log
  (/usr/bin/time -v timeout ${LIMIT:-250} $G --model $1 --network $2 > $log 2>&1; echo "done after $(( $(date +%s) - started )) s" >> $log) &
done
wait
