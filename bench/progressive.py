"""`python -m bench.progressive`, the command the docs and tests name; the code is bench/train/progressive.py."""
from bench.train.progressive import build_parser, main, output_stem

__all__ = ["build_parser", "main", "output_stem"]

if __name__ == "__main__":
    main()
