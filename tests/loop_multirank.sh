#!/usr/bin/env bash
# Runs the multi-rank checks of tests/multirank.py (2 ranks, torchrun, gloo on CPU) N times in a row and stops at the
# first failure, to catch a failure that shows only now and then (an abort at process exit: "terminate called
# without an active exception", torchrun exit -6). Not part of CI: it takes minutes.
#
#   tests/loop_multirank.sh              # 20 rounds of every check
#   tests/loop_multirank.sh 50 sync_bytes
#   make test-multirank-loop
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
N=${1:-20}
shift || true
CHECKS=${*:-sync_bytes load offload_step save resume shared_dir}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
"$PY" -c "import sys; sys.path.insert(0, 'tests'); from conftest import make_tiny_model_dir as m; m('$WORK/model')" \
    > /dev/null 2>&1 || { echo "could not build the tiny model"; exit 1; }
for i in $(seq 1 "$N"); do
    for check in $CHECKS; do
        path="$WORK/model"
        if [ "$check" = resume ]; then path="$WORK/model/checkpoints/step_000001"; fi
        if [ "$check" = shared_dir ]; then path="$WORK/run$i"; fi
        out="$WORK/out_${check}_$i"
        mkdir -p "$out"
        "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 tests/multirank.py "$check" "$path" "$out" \
            > "$WORK/log" 2>&1
        rc=$?
        if [ $rc -ne 0 ] || grep -q "terminate called" "$WORK/log"; then
            echo "round $i, check $check: FAILED (exit $rc)"
            grep -m5 "terminate called\|Error\|exitcode" "$WORK/log"
            cp "$WORK/log" "multirank_failure.log" && echo "full log: multirank_failure.log"
            exit 1
        fi
    done
    echo "round $i/$N: ok ($CHECKS)"
done
