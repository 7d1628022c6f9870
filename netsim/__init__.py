"""Two simulated hosts on one machine (network namespaces, a shaped veth link) and a 2-node fit across them.

`scripts/netsim.sh up|down|run` is the command line (python -m netsim); link.py makes and
shapes the pair, nodes.py runs the two node processes.
"""
