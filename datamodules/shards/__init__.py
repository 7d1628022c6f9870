"""Streaming from LitData shards in a folder or object storage: layout.py (what a pack holds), pack.py
(`python -m datamodules.shards`), pack_store.py (a pack's objects in a folder or under s3://bucket/prefix),
s3_clients.py (S3 settings, credentials, plain-HTTP endpoints), errors.py (one paragraph per failure),
datamodule.py (StreamingDataModule), loader.py (the batches, the stateful loader)."""
