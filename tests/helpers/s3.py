"""A real S3 endpoint for tests: moto's ThreadedMotoServer (moto[server]) in this process, in memory, any key
accepted.

Bound to 127.0.0.1 only (ThreadedMotoServer's default is 0.0.0.0), on a port the kernel picks, stopped after use.
The fixtures in tests/conftest.py wrap it: `s3` (a server of the test's own, for a test that stops it),
`s3_session` (one server for the whole session, started on first use) and `shared_s3` (that server, with
the AWS_* variables set for the test). Servers in one process share moto's in-memory store, so tests use
buckets of their own. `S3Server.env` is what the packer, training and the benchmark read: AWS_ENDPOINT_URL
and test credentials, with the user's own AWS config files masked.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.request
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


class S3Server:
    """stop() leaves nothing that answers, as a killed server process would: it shuts down the listening socket
    (a DataLoader worker forked while the server ran holds a copy of it, which would go on accepting connections
    that nobody serves: a client would wait for its timeout instead of being refused) and every connection the
    server accepted (a client's kept-alive connection would otherwise still be served)."""

    def __init__(self) -> None:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            pytest.skip("moto[server] not installed (pip install -r requirements-dev.txt)")
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request on the tests' stderr
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, self.port = self._moto.get_host_and_port()
        self.url = f"http://{host}:{self.port}"
        # werkzeug's server (ThreadedMotoServer has no public name for it): every connection it accepts is noted.
        # No client can connect before this: the port was not known until now.
        self._server, self._accepted, self._stopped = self._moto._server, weakref.WeakSet(), False
        accept = self._server.get_request

        def get_request():
            conn, addr = accept()
            self._accepted.add(conn)
            return conn, addr

        self._server.get_request = get_request

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
                    dest.put_object(Bucket=db, Key=key,
                                    Body=source.get_object(Bucket=sb, Key=obj["Key"])["Body"].read())
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
        if self._stopped:
            return
        self._stopped = True
        self._server.socket.shutdown(socket.SHUT_RDWR)  # refused from now on, wherever a copy of the socket is
        self._moto.stop()
        for conn in list(self._accepted):
            with contextlib.suppress(OSError):  # closed by its handler already
                conn.shutdown(socket.SHUT_RDWR)
