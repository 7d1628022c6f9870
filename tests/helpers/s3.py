"""A real S3 endpoint for tests: `moto_server -H 127.0.0.1 -p PORT` (moto[server]), in memory, any key accepted.

Bound to loopback explicitly (its default is 0.0.0.0), on a free port, stopped after use.
The fixtures in tests/conftest.py wrap it: `s3` (a server of the test's own, for a test that stops it),
`s3_session` (one server for the whole session, started on first use) and `shared_s3` (that server, with
the AWS_* variables set for the test). Tests that share the server use buckets of their own. `S3Server.env`
is what the packer, training and the benchmark read: AWS_ENDPOINT_URL and test credentials, with the user's
own AWS config files masked.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.processes import free_port


class S3Server:
    def __init__(self, log: Path) -> None:
        exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        if not Path(exe).exists():
            pytest.skip("moto_server not installed (pip install -r requirements-dev.txt)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError(f"moto_server did not answer on {self.url}: {log.read_text()[-2000:]}")

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test-secret-42",
                "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def copy(self, src: str, dst: str, to: S3Server | None = None) -> str:
        """Copy every object under the s3:// URL `src` to `dst` (its bucket made if need be), on this server or `to`."""
        target = to or self
        (sb, sp), (db, dp) = (u[len("s3://"):].partition("/")[::2] for u in (src, dst))
        if db not in {b["Name"] for b in target.client().list_buckets()["Buckets"]}:
            target.bucket(db)
        source, dest = self.client(), target.client()
        for page in source.get_paginator("list_objects_v2").paginate(Bucket=sb, Prefix=sp + "/"):
            for obj in page.get("Contents", []):
                key = dp + obj["Key"][len(sp):]
                if target is self:
                    dest.copy_object(Bucket=db, Key=key, CopySource={"Bucket": sb, "Key": obj["Key"]})
                else:
                    dest.put_object(Bucket=db, Key=key, Body=source.get_object(Bucket=sb, Key=obj["Key"])["Body"].read())
        return dst

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="test",
                            aws_secret_access_key="test-secret-42")

    @contextmanager
    def auth_required(self) -> Iterator[None]:
        """Inside, only keys created through moto's IAM are accepted; after, any key again (moto's
        /moto-api/reset-auth sets how many requests may go unauthenticated: 0, then inf, its default)."""
        self._reset_auth(b"0")
        try:
            yield
        finally:
            self._reset_auth(b"inf")

    def _reset_auth(self, count: bytes) -> None:
        req = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=count, method="POST",
                                     headers={"Content-Type": "text/plain"})  # a form body would reach it empty
        urllib.request.urlopen(req, timeout=5).close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

