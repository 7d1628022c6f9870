"""`python -m bench nodes`: DDP comm hooks on two simulated hosts (step times, or --accuracy)."""
