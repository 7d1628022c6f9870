"""The LMDB backend: format.py (the file layout), pack.py (`python -m datamodules.lmdb`), reader.py, datamodule.py."""
