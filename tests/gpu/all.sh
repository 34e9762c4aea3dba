#!/usr/bin/env bash
# Every GPU check in one command (the limits add up to 700 s: name fewer with ONLY to fit
# a shorter call), each under its own time limit, its output kept in OUTDIR (default
# reports/gpu): run from the repository root on a CUDA machine, offline. The most wanted first.
#
#   bash tests/gpu/all.sh [OUTDIR]
#   ONLY="tests seed" bash tests/gpu/all.sh [OUTDIR]    # only the steps named
#
# 1. install detaudit in place without fetching anything (else put the probes where an
#    installed package has them), 2. the scan's cost and whether the fused print agrees with
#    the torch form (tests/gpu/scan_cost.py), 3. the acceptance rows --verify-fix, throughput
#    and the seed scenario (tests/gpu/acceptance.py), 4. exec of a tutorial-style Mask R-CNN
#    script with 1,000 instances per image (tests/gpu/train_maskrcnn.py), 5. exec's overhead
#    on a GPU (tests/benchmark_exec.py), 6. the CUDA tests of the suite. A step that fails or runs out
#    of time is noted in steps.txt and the next one runs.
set -u
out=${1:-reports/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run it, its output to the screen and NAME.txt
    local name=$1 limit=$2
    shift 2
    [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || return 0
    echo "== $name (at most ${limit} s)"
    timeout "$limit" "$@" 2>&1 | grep -v '^USDT\|^ERROR:.*gpuGetDeviceCount' | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}" | tee -a "$out/steps.txt"
}

if ! $py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1; then
    echo "install failed (see install.txt): using the checkout with the probes linked in"
    [ -e detaudit/probes ] || ln -s ../probes detaudit/probes
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi -L | tee "$out/device.txt"
$py -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)" \
    | tee -a "$out/device.txt"
# Does a grad_fn's Python wrapper outlive its last Python reference? (The recorder holds them.)
$py -c "
import torch
w = torch.randn(4, 4, device='cuda', requires_grad=True)
f = torch.tanh(w * 2)
a = id(f.grad_fn)
others = [(w * i).grad_fn for i in range(100)]
print('grad_fn wrapper keeps its id:', id(f.grad_fn) == a, '; its id taken by another:',
      a in [id(o) for o in others])" | tee -a "$out/device.txt"
step scan_cost 110 $py tests/gpu/scan_cost.py
step verify_fix 130 $py tests/gpu/acceptance.py --out "$out/acceptance" --only verify throughput
step seed 100 $py tests/gpu/acceptance.py --out "$out/acceptance" --only seed
step exec_maskrcnn 80 $py -m detaudit exec --seed 0 --repeats 2 --max-steps 3 --overwrite \
    --out "$out/exec_maskrcnn" -- $py tests/gpu/train_maskrcnn.py --instances 1000
step exec_overhead 180 $py tests/benchmark_exec.py --device cuda --size 224 --batch-size 64 \
    --steps 300 --pairs 2 --inside-steps 30
step tests 70 $py -m pytest -q -p no:cacheprovider tests/test_fingerprint.py \
    tests/test_cuda_paths.py tests/test_recorder.py
step cuda_tests 30 $py -m pytest -q -p no:cacheprovider -m cuda tests/
