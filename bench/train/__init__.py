"""`python -m bench train`: strategies, precisions and speed flags as real fits, against a hand-written loop."""
