#!/usr/bin/env bash
# The CUDA and NCCL checks on a GPU machine, in one run: tests/test_cuda.py (CUDA tensors on
# simulated ranks; real NCCL processes, one per GPU, under "nccl" and "cpu:gloo,cuda:nccl"),
# then 2 gloo processes on one GPU's CUDA tensors, then one GPU's VAE figures at a larger
# size (`benchmarks.vae --device cuda`: the one-device call and diffusers' tiling).
#
#   scripts/gpu_check.sh [OUT_DIR]      logs go to OUT_DIR (default: a temp dir)
#   HALOSHARD_CPU4=1 scripts/gpu_check.sh [OUT_DIR]
#       instead: the P = 4 training steps on that machine's CPU cores, one core a rank (gloo;
#       `benchmarks.vae --floor --floor-plus`, HunyuanVideo at 48 px and Mochi at 32 px, about
#       6 minutes): the compute target at P = 4 without the 4-processes-on-2-cores contention
#       of the CI machine (benchmarks/README.md, "P = 4 training on 2 cores"); first, three
#       runs of `benchmarks.matrix`'s tiny row (2 ranks, about 10 s each): a halo layer's
#       fixed cost per step with a free core for every rank's main and gloo threads
#
# Uses the machine's own python3 and torch (PYTHON= to pick another); diffusers and what it
# needs beyond that image can come as wheels in .whl/ (installed to a temp target first).
# HALOSHARD_ALLOW_TORCH=2.11 lowers the import-time floor for a machine whose only torch is
# older than the supported range (eager paths only: torch.compile is not run here).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"

{ nvidia-smi -L; "$python" -c "import sys, torch; print(sys.version.split()[0], torch.__version__,
'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
} 2>&1 | tee "$out/machine.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/haloshard-site .whl/*.whl && export PYTHONPATH=/tmp/haloshard-site
fi
if [[ -n "${HALOSHARD_ALLOW_TORCH:-}" ]]; then
    sed -i "s/^SUPPORTED_TORCH = ((2, [0-9]*)/SUPPORTED_TORCH = ((${HALOSHARD_ALLOW_TORCH/./, })/" \
        src/haloshard/_compat.py
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}

if [[ -n "${HALOSHARD_CPU4:-}" ]]; then
    nproc | tee -a "$out/machine.txt"
    status=0
    for run in 1 2 3; do
        timeout 90 "$python" -m benchmarks.matrix --iters 15 --only "conv1d C8 T64" 2>&1 \
            | grep -v "^USDT" | tee -a "$out/tiny_row.log" || status=1
    done
    export MALLOC_MMAP_THRESHOLD_=65536
    for model in "hunyuan 48" "mochi 32"; do
        set -- $model
        timeout 280 "$python" -m benchmarks.vae --models "$1" --modes train --ranks 4 --dims 2 \
            --latent-frames 16 --size "$2" --warmup 1 --ref-warmup 0 --floor --floor-plus \
            --out "$out/cpu4_$1.json" 2>&1 | tee "$out/cpu4_$1.log" || status=1
    done
    exit $status
fi

status=0
timeout 300 "$python" -m pytest -q -p no:cacheprovider -rs -s tests/test_cuda.py 2>&1 \
    | tee "$out/test_cuda.log" || status=1
HALOSHARD_TEST_WORLD=2 HALOSHARD_TEST_BACKENDS=gloo timeout 120 "$python" -m pytest -q \
    -p no:cacheprovider -s tests/test_cuda.py -k real_ranks 2>&1 | tee "$out/gloo_cuda.log"
timeout 240 "$python" -m benchmarks.vae --device cuda --models hunyuan ltx --modes decode \
    encode --ranks 1 --latent-frames 8 --size 512 --approx --out "$out/vae_cuda.json" 2>&1 \
    | tee "$out/vae_cuda.log"
exit $status
