"""A packed dataset's home: a local folder or an s3://bucket/prefix, with the few operations the packer
and the reader need (read, atomic write, upload a file, size, list, delete).

Local writes go to a temporary file beside the target, are fsynced and renamed into place; an S3
PUT appears whole or not at all. So a reader never sees half an object, and the packer's
completion marker, written last, is the one thing that says a pack is finished.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from datamodules.shards.s3_clients import is_remote, s3_client, split_url


class Store:
    """Objects under one root, named by relative keys ("train/index.json")."""

    url: str

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        raise NotImplementedError

    def write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def put_file(self, path: str | os.PathLike, key: str) -> None:
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        raise NotImplementedError

    def keys(self, prefix: str = "") -> list[str]:
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def where(self, key: str = "") -> str:
        return f"{self.url.rstrip('/')}/{key}" if key else self.url


def open_store(url: str | os.PathLike, storage_options: dict | None = None) -> Store:
    return S3Store(str(url), storage_options) if is_remote(url) else LocalStore(url)


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o644)  # mkstemp makes it 0600: a pack is read by other users too
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, path: str | os.PathLike, key: str) -> None:
        """Move a finished local file into place (it is fsynced first; same filesystem: a rename)."""
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
        shutil.move(str(path), tmp)
        os.replace(tmp, target)

    def size(self, key: str) -> int | None:
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError:
            return None

    def keys(self, prefix: str = "") -> list[str]:
        base = self.root / prefix
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            (self.root / key).unlink(missing_ok=True)


class S3Store(Store):
    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(self.url)
        self.client = s3_client(storage_options)
        self.endpoint = self.client.meta.endpoint_url

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def bucket_exists(self) -> bool:
        """False when the endpoint says the bucket is missing; refused credentials or no endpoint raise."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
                return False
            raise
        return True

    def create_bucket(self) -> None:
        """Make the bucket with this store's client: its endpoint, credentials and region."""
        region = self.client.meta.region_name
        # S3 rejects a LocationConstraint of us-east-1 and wants one for every other region
        if region in (None, "us-east-1"):
            self.client.create_bucket(Bucket=self.bucket)
        else:
            self.client.create_bucket(Bucket=self.bucket, CreateBucketConfiguration={"LocationConstraint": region})

    def read(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_file(self, path: str | os.PathLike, key: str) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key))
        os.remove(path)

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def keys(self, prefix: str = "") -> list[str]:
        out = []
        start = self._key(prefix)
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            out += [obj["Key"][len(self.prefix) + 1 if self.prefix else 0:] for obj in page.get("Contents", [])]
        return sorted(out)

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            if batch:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
