#!/usr/bin/env bash
# One machine, N workers: the 4-GPU workstation launcher.
#
#   launch/single_node.sh parallel=fsdp model=gpt2            # one worker per visible GPU
#   NPROC=2 launch/single_node.sh parallel=ddp                 # or as many as you say (CPU: gloo)
#
# Every argument is a Hydra override passed to train.py unchanged. NPROC defaults to the number of visible GPUs,
# or 1 without GPUs.
#
# Peer-to-peer between consumer PCIe cards (RTX 40-series) is decided by train.py itself, from the devices, in
# every launch path (llmtrain/process/runtime.py). NCCL_IB_DISABLE=1 skips InfiniBand probing on a workstation.
# OMP_NUM_THREADS caps CPU threads per worker so N workers do not oversubscribe the cores.
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the caching allocator grow segments instead of splitting
# fixed blocks: less fragmentation, which is what runs out first on 16 GB cards.
# In a container, NCCL's shared-memory transport (used when P2P is off) needs a large /dev/shm: start it with
# `docker run --shm-size=16g` (or --ipc=host); the default 64 MB makes NCCL fail or fall back to sockets.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"

exec torchrun --standalone --nproc_per_node="$NPROC" train.py "$@"
