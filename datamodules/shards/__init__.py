"""Streaming from LitData shards in a folder or object storage: layout.py (what a pack holds), pack.py
(`python -m datamodules.shards`), store.py (a folder or s3://bucket/prefix), storage.py (S3 settings,
credentials, plain-HTTP endpoints), errors.py (one paragraph per failure), datamodule.py
(StreamingDataModule), loader.py (the batches, the stateful loader)."""
