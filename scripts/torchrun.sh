#!/bin/bash
# Several nodes with torchrun: run this on EVERY node with the same NNODES, MASTER_ADDR, MASTER_PORT and RDZV_ID
# (the c10d rendezvous numbers the nodes: no node rank). GPUS = GPUs per node = --trainer.devices.
#   NNODES=2 MASTER_ADDR=10.0.0.1 RDZV_ID=job42 scripts/torchrun.sh --config configs/ddp_amp.yaml
# A dead worker makes torchrun stop and restart the whole group, up to MAX_RESTARTS (default 3) times; the restarted
# group resumes its own run (the one whose run.json records RDZV_ID) from its newest checkpoint. The rendezvous is
# c10d, hosted at MASTER_ADDR:MASTER_PORT by the agent there, and outlives a worker's death (the static one, which
# --master_addr/--master_port select, cannot re-form the group). RDZV_ID names the job across restarts: the same on
# every node, a new one per job (default: SLURM's job id, else MASTER_ADDR-MASTER_PORT; torchrun's own default
# "none" is shared by every job).
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default the agent's one TCPStore serves the workers of every restart with
# no per-attempt prefix (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, next_rendezvous;
# torch/distributed/rendezvous.py, _create_c10d_store), so a restarted rank reads the dead attempt's peer addresses
# and fails to connect, or waits for peers that never come. With it set, each attempt's rank 0 hosts a fresh store
# on a new port (torch/distributed/elastic/rendezvous/api.py, RendezvousStoreInfo.build).
# Your arguments come FIRST and this script's --trainer.* flags LAST: jsonargparse applies them left
# to right, so a --config of yours (devices: auto) cannot override the node layout torchrun starts.
# The script sets only the layout (nodes, devices per node), never the strategy: a --trainer.strategy
# flag would replace your config's ClusterDDPStrategy block (timeout_s, gradient_as_bucket_view, ...) with
# defaults. With strategy auto, Lightning picks ddp for several devices or nodes.
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
NNODES=${NNODES:-1}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-fic-$MASTER_ADDR-$MASTER_PORT}}
GPUS=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
# NCCL's flight recorder (torch's ProcessGroupNCCL; its ring buffer of recent collectives is on by default,
# TORCH_NCCL_TRACE_BUFFER_SIZE 2000): on a collective timeout each rank writes it to TRACE<rank>, one folder per
# job, which `python -m torch.distributed.flight_recorder.fr_trace logs/nccl-trace/JOB` reads: which rank stopped
# at which collective.
TRACE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$PWD/logs/nccl-trace/$RDZV_ID/rank}
[ -n "${DRY_RUN:-}" ] || mkdir -p "$(dirname "$TRACE")"
NCCL_ENV=(env TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}" TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$TRACE"
          TORCH_FR_DUMP_TEMP_FILE="$TRACE")
CMD=("${NCCL_ENV[@]}" TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
     torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS"
     --max-restarts "$MAX_RESTARTS" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
     main.py fit "$@" --trainer.num_nodes "$NNODES" --trainer.devices "$GPUS")
if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
