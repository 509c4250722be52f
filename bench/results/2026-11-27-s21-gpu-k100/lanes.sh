#!/bin/bash
# Server lanes through the runtime on a GPU: real processes, the server on
# ${WHERE:-cuda}, K device processes on the CPU, PiPar resnet18 P1 N2, server_lanes 1..8.
set -u
export PYTHONUNBUFFERED=1
WHERE=${WHERE:-cuda}; K=${K:-8}; S=${S:-4000}; LANES=${LANES:-"1 2 4 8"}; LIMIT=${LIMIT:-70}
${PIP:-python3 -m pip} install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/lanes-out}; mkdir -p $OUT
n=0
for L in $LANES; do
  n=$((n + 1))
  d=$(mktemp -d /tmp/lanes-$L-XXXX)
  python3 -c "
from aiopipe import RunConfig
print(RunConfig(mode='pipar', model='resnet18', devices=$K, samples_per_device=$S,
                batch_size=100, epochs=2, split_point=1, parallel_batches=2,
                test_samples=100, network='lan', server_lanes=$L).to_toml())" > $d/run.toml
  port=$((8700 + n))
  started=$(date +%s.%N)
  timeout $LIMIT python3 -m aiopipe.server --config $d/run.toml --port $port --out-dir $d/out \
      --torch-device $WHERE > $d/server.log 2>&1 &
  server=$!
  for i in $(seq 100); do grep -q "waiting for" $d/server.log && break; sleep 0.2; done
  devices=""
  for k in $(seq 0 $((K - 1))); do
    timeout $LIMIT python3 -m aiopipe.device --server ws://127.0.0.1:$port/ws --device-id $k \
        --torch-device cpu > $d/device$k.log 2>&1 &
    devices="$devices $!"
  done
  wait $server; rc=$?
  wait $devices
  python3 -c "
import json, sys
rows = [json.loads(l) for l in open('$d/out/metrics.jsonl')]
for r in rows:
    print(f\"server {sys.argv[1]} lanes $L: epoch {r['epoch']} {r['time_s']:.2f} s, server busy \"
          f\"{r['busy_s']['server']:.2f} s, device busy {r['busy_s']['device']:.2f} s, up \"
          f\"{r['busy_s']['uplink']:.2f} s, loss {r['loss']:.3f}\")
" $WHERE 2>&1 | tee -a $OUT/lanes.log || { echo "lanes $L: server exit $rc"; tail -20 $d/server.log; } | tee -a $OUT/lanes.log
  echo "lanes $L: wall $(python3 -c "import time; print(round(time.time() - $started, 1))") s" | tee -a $OUT/lanes.log
done
