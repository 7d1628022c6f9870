"""`python -m bench loaders`: every data backend's train pipeline timed, cold and warm, against the machine's ceilings."""
