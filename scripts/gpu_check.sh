#!/usr/bin/env bash
# The GPU lane in one command (docs/gpu.md), on a machine with a CUDA GPU, CuPy and PyTorch CUDA:
#
#   bash scripts/gpu_check.sh [--dry-run] [OUT_DIR]       (default OUT_DIR: gpu_check_out)
#
# 1. what is here: GPU, CUDA, CuPy, the MPI library and whether it is CUDA-aware;
# 2. tests/test_device_arrays.py and tests/test_cuda_kernels.py on CuPy: every layer type forward and
#    backward, the CUDA kernels (pooling, batch norm, dropout) against the reference, and three
#    training steps of each model, on the GPU equal the same on the host (float64, 1e-10);
# 3. every partitioned layer against its unpartitioned oracle on the GPU (check-layer, float64,
#    1e-10), on 1, 2 and 4 ranks, device buffers staged through host memory and, where the MPI
#    is CUDA-aware, handed to it directly;
# 4. the layer benchmark: CuPy vs PyTorch CUDA/cuDNN, per shape (scripts/bench_layers.py --device cuda),
#    as a table and JSON, and where each conv row spends its time on the device schedule (--phases);
# 5. a CosmoFlow training step at 128^3 (the mlperf preset) on the GPU, 1 and 2 ranks, staged
#    and (CUDA-aware MPI only) direct;
# 6. training steps against PyTorch on the same GPU (scripts/bench_train.py --device cuda):
#    CosmoFlow at MLPerf's sizes and the U-Net at 128^3, 1 rank and 2 ranks vs DDP, full
#    float32, then TF32 on both sides;
# 7. where a CosmoFlow step's time goes on the GPU: every layer's forward and backward against
#    cuDNN's (scripts/profile_step.py --device cuda, MLPerf's sizes, full float32).
# Everything it prints is also written under OUT_DIR.  --dry-run prints the commands only.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,22p' "$0"; exit 0; fi
OUT=${1:-gpu_check_out}
MPIEXEC=(mpiexec --oversubscribe)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1

run() {                      # print, then run (unless --dry-run), teeing into OUT_DIR/log.txt
    echo "+ $*"
    if [ -z "$DRY" ]; then "$@" 2>&1 | tee -a "$OUT/log.txt"; fi
}

if [ -z "$DRY" ]; then
    # exit 3: CuPy cannot be imported; 4: it imports but sees no usable CUDA device
    status=0
    python -c "
import sys
try:
    import cupy
except Exception:
    sys.exit(3)
try:
    sys.exit(0 if cupy.is_available() else 4)
except Exception:
    sys.exit(4)" 2>/dev/null || status=$?
    if [ "$status" = 3 ]; then
        echo "gpu_check: CuPy is not installed here (or does not import): pip install -e" \
             "'.[gpu-cuda12]' or '.[gpu-cuda13]' for your CUDA driver (docs/gpu.md); nothing was run" >&2
        exit 2
    elif [ "$status" != 0 ]; then
        echo "gpu_check: CuPy is installed but finds no CUDA device here (no GPU, or no driver" \
             "it can use: see nvidia-smi); run this on a machine with a GPU; nothing was run" >&2
        exit 2
    fi
    mkdir -p "$OUT"              # only now: a machine without a GPU is left no empty folder
fi

echo "== 1. what is here"
run python -c "import cupy, torch; d = cupy.cuda.runtime.getDeviceProperties(0); \
print('GPU', d['name'].decode(), '| CUDA runtime', cupy.cuda.runtime.runtimeGetVersion(), \
'| CuPy', cupy.__version__, '| torch', torch.__version__, 'cuda', torch.cuda.is_available())"
run python -c "from mpi4py import MPI; from refimpl.parallel.buffers import mpi_cuda_support; \
print(MPI.Get_library_version().splitlines()[0]); print('CUDA-aware:', *mpi_cuda_support())"
AWARE=$(python -c "from refimpl.parallel.buffers import mpi_cuda_support; print(mpi_cuda_support()[0])" 2>/dev/null || echo unknown)
MODES=(0)
if [ "$AWARE" = "yes" ]; then MODES=(0 1); fi

echo "== 2. layers and models on the GPU equal the host"
run python -m pytest -q -p no:cacheprovider tests/test_device_arrays.py tests/test_cuda_kernels.py

echo "== 3. every partitioned layer on the GPU (float64, 1e-10)"
LAYERS=("conv3d --out-channels 5 --kernel 3,2,5 --stride 2,1,1 --padding 1,0,2 --dilation 1,2,1"
        "conv3d --out-channels 8 --kernel 3 --padding 1"
        "conv_transpose3d --out-channels 4 --kernel 3 --stride 2 --padding 1 --output-padding 1"
        "max_pool3d --kernel 3 --stride 2 --padding 1" "avg_pool3d --kernel 2" "batch_norm3d")
for mode in "${MODES[@]}"; do
    for layer in "${LAYERS[@]}"; do
        for grid in "1,1,1,1:1" "1,2,1,1:2" "2,1,2,1:4" "1,2,2,1:4"; do
            # shellcheck disable=SC2086
            run env REFIMPL_BACKEND=cupy REFIMPL_CUDA_AWARE="$mode" "${MPIEXEC[@]}" -n "${grid#*:}" \
                python -m refimpl check-layer $layer --input 2,8,12,10,9 --grid "${grid%:*}" --dtype float64
        done
    done
done

echo "== 4. layers: CuPy vs PyTorch CUDA/cuDNN"
run python scripts/bench_layers.py --device cuda --repeats 5 --tf32 off --phases --json "$OUT/bench_layers_cuda.json"
run python scripts/bench_layers.py --device cuda --repeats 3 --tf32 on --json "$OUT/bench_layers_cuda_tf32.json"

echo "== 5. CosmoFlow at 128^3 on the GPU"
for mode in "${MODES[@]}"; do
    for n in 1 2; do
        run env REFIMPL_CUDA_AWARE="$mode" "${MPIEXEC[@]}" -n "$n" python -m refimpl train --model cosmoflow \
            --preset mlperf --backend cupy --grid "1,$n,1,1" --steps 10 --global-batch 2 --no-plot \
            --out "$OUT/train_128_n${n}_aware${mode}" --overwrite
    done
done
echo "== 6. training steps: refimpl on CuPy vs PyTorch on the same GPU (full float32, then TF32 on both sides)"
for tf32 in off on; do          # bench_train's --device cuda sizes: MLPerf's CosmoFlow, the U-Net's default preset
    run python scripts/bench_train.py --device cuda --tf32 "$tf32" --models cosmoflow unet3d \
        --grids 1,1,1,1 2,1,1,1 --batch 4 --warmup 2 --steps 5 --json "$OUT/bench_train_cuda_tf32_${tf32}.json"
done
echo "== 7. per layer: refimpl on CuPy vs PyTorch on the same GPU (full float32)"
run python scripts/profile_step.py --device cuda --model cosmoflow --preset mlperf --batch 4 --repeats 2 \
    --json "$OUT/profile_cosmoflow_cuda.json"
echo "gpu_check: done; logs and JSON in $OUT"
