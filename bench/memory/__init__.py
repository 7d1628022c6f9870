"""`python -m bench memory`: the pinned, shared and host memory each rank and node of a config holds."""
