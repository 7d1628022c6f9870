#!/bin/bash
# Two simulated hosts on this machine: network namespaces joined by a veth pair, the link shaped with tc,
# and a 2-node `python main.py fit` across them (needs root or CAP_NET_ADMIN; says so in one line otherwise).
#   scripts/netsim.sh run --rate 200mbit -- --config configs/ddp.yaml --config configs/comm/powersgd.yaml
#   scripts/netsim.sh up --rate 1gbit        # a pair for your own commands; scripts/netsim.sh down TAG removes it
#   scripts/netsim.sh down                   # pairs left by a run that was killed with SIGKILL
# `run` removes its namespaces on success, failure, Ctrl-C and SIGTERM, and exits with the nodes' status.
# DRY_RUN=1 (or --dry-run) prints each node's command instead. The code: netsim/.
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python}" -m netsim "$@"
