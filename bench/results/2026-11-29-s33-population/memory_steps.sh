#!/bin/bash
# RSS of 10,300 devices (2 a round, then 100 a round) at each step of session 33, one
# process per run, each from a worktree of that commit. Hold /tmp/bench.lock around it.
#   flock /tmp/bench.lock bash bench/results/2026-11-29-s33-population/memory_steps.sh
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
for rev in e6f3370 9b3e6d1 b3acc38 3f33cce 646bda1 dadbb29; do
    tree=/tmp/steps-$rev
    git -C "$repo" worktree add -q --detach "$tree" "$rev"
    for d in 2 100; do
        echo "== $rev, 10300 devices, $d a round; $(cat /proc/loadavg)"
        (cd /tmp && PYTHONPATH="$tree" "$repo/.venv/bin/python" "$here/probes.py" rounds 10300 "$d" 2>&1 | grep "^K=")
    done
    git -C "$repo" worktree remove --force "$tree"
done
