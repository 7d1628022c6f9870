#!/bin/bash
# Several nodes with torchrun: run this on EVERY node with the same NNODES, MASTER_ADDR and MASTER_PORT
# and its own NODE_RANK (0 on the master). GPUS = GPUs per node = --trainer.devices.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/torchrun.sh --config configs/ddp_amp.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/torchrun.sh --config configs/ddp_amp.yaml
# Your arguments come FIRST and this script's --trainer.* flags LAST: jsonargparse applies them left
# to right, so a --config of yours (devices: auto) cannot override the node layout torchrun starts.
# The script sets only the layout (nodes, devices per node), never the strategy: a --trainer.strategy
# flag would replace your config's ClusterDDPStrategy block (timeout_s, gradient_as_bucket_view, ...) with
# defaults. With strategy auto, Lightning picks ddp for several devices or nodes.
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
CMD=(torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     main.py fit "$@" --trainer.num_nodes "$NNODES" --trainer.devices "$GPUS")
if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
