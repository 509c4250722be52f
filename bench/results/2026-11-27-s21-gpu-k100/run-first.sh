#!/bin/bash
# Issue 27's GPU check: resnet18, K devices, GPU server vs CPU server in virtual time,
# every pass computed on $WHERE; and the CUDA paths' tests. Writes logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
WHERE=${WHERE:-cuda}; K=${K:-100}; LIMIT=${LIMIT:-400}
${PIP:-python3 -m pip} install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=$PWD:/tmp/site
C=bench/results/2026-11-26-s18-gpu-costs
G="python3 bench/gpu_server.py --gpu-costs $C/costs-cuda.json --cpu-costs $C/costs-cpu-this-host.json --model resnet18 --samples 500 --compute-on $WHERE --devices $K"
T="/usr/bin/time -v timeout $LIMIT"
started=$(date +%s)
($T $G --network 4g --servers gpu > $OUT/k$K-4g-gpu.log 2>&1; echo "done after $(( $(date +%s) - started )) s" >> $OUT/k$K-4g-gpu.log) &
($T $G --network 4g --servers cpu > $OUT/k$K-4g-cpu.log 2>&1; echo "done after $(( $(date +%s) - started )) s" >> $OUT/k$K-4g-cpu.log) &
($T $G --network wifi > $OUT/k$K-wifi.log 2>&1; echo "done after $(( $(date +%s) - started )) s" >> $OUT/k$K-wifi.log) &
runs=$(jobs -p)
{ nvidia-smi -L; nproc; free -g | head -2
  python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o filterwarnings= -W default \
      tests/runtime/test_runtime_compute.py tests/test_gpu_processes.py
  echo "tests done after $(( $(date +%s) - started )) s"
  while for r in $runs; do kill -0 $r 2>/dev/null && break; false; done; do echo "$(( $(date +%s) - started )) s: $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader) $(free -g | sed -n 2p)"; sleep 15; done
} > $OUT/tests.log 2>&1 &
wait
