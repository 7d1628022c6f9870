"""`python -m bench.scanbench`, the command the docs name; the code is bench/loaders/scanbench.py."""
from bench.loaders.scanbench import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
