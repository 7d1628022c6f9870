"""Where shards live and how to reach them: the S3 client settings, credentials, plain-HTTP endpoints.

One set of `storage_options` (boto3 client arguments: endpoint_url, region_name, aws_access_key_id,
aws_secret_access_key, aws_session_token, ...) serves the packer, training and the benchmark.
Anything not given is taken where boto3 takes it: the standard AWS environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,
AWS_PROFILE), ~/.aws, an instance role. So one `export AWS_ENDPOINT_URL=...` points every tool
at an on-premises store.

Two library defaults would turn an unreachable store into a hang, and are replaced here:
- litdata 0.2.76 builds its boto3 client with `retries={"max_attempts": 1000, "mode": "adaptive"}`
  (litdata/streaming/client.py, S3Client._create_client) and lets `storage_options` override it:
  `client_settings` passes a bounded retry config and timeouts.
- litdata downloads chunks through obstore (litdata/streaming/downloader.py, S3Downloader.download_file
  via _build_obstore_s3_store), with fixed client options (_OBSTORE_CLIENT_OPTIONS: a 200 s timeout,
  obstore's default of 10 retries over up to 3 minutes) and without `allow_http`, so obstore refuses an
  `http://` endpoint. `obstore_store` builds that store from the same boto3 client with `allow_http`
  exactly when the endpoint is plain HTTP, and with bounded retries and timeouts (downloader.py uses it).

Credentials are never written anywhere: `redact` (datamodules/credentials.py) replaces them in whatever is
saved or logged.
"""
from __future__ import annotations

import datetime as _dt
import os
from typing import Any
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
ATTEMPTS = 3  # boto3 attempts per request; obstore gets ATTEMPTS - 1 retries within RETRY_WINDOW
RETRY_WINDOW = _dt.timedelta(seconds=30)


def is_remote(url: str | os.PathLike | None) -> bool:
    return str(url or "").startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/a/b -> ("bucket", "a/b")."""
    parsed = urlparse(url)
    return parsed.netloc, parsed.path.strip("/")


def client_settings(storage_options: dict | None) -> dict:
    """boto3 client kwargs: the user's `storage_options` over bounded retries and timeouts.

    A `config` given as a mapping becomes a botocore Config (YAML cannot hold one).
    """
    from botocore.config import Config

    options = dict(storage_options or {})
    bounded = Config(retries={"max_attempts": ATTEMPTS, "mode": "standard"},
                     connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S)
    user = options.pop("config", None)
    if isinstance(user, dict):
        user = Config(**user)
    options["config"] = bounded.merge(user) if user is not None else bounded
    return options


def s3_client(storage_options: dict | None):
    """A boto3 S3 client with these options (AWS_* environment variables fill in the rest)."""
    import boto3

    return boto3.session.Session().client("s3", **client_settings(storage_options))


def endpoint_of(storage_options: dict | None) -> str:
    """The S3 endpoint in force: storage_options' endpoint_url, else what boto3 resolves (AWS_ENDPOINT_URL...)."""
    return s3_client(storage_options).meta.endpoint_url


def obstore_store(bucket: str, boto_client: Any, credentials: Any) -> Any:
    """litdata's _build_obstore_s3_store with the client options this module needs (see the module doc)."""
    from obstore.store import S3Store

    endpoint = boto_client.meta.endpoint_url
    config: dict[str, Any] = {}
    if boto_client.meta.region_name:
        config["region"] = boto_client.meta.region_name
    if endpoint:
        config["endpoint"] = endpoint
        if "amazonaws.com" not in endpoint:
            config["virtual_hosted_style_request"] = False  # path style, as S3-compatible stores expect
    client_options = {"timeout": f"{READ_TIMEOUT_S}s", "connect_timeout": f"{CONNECT_TIMEOUT_S}s",
                      "pool_max_idle_per_host": "32", "pool_idle_timeout": "90s",
                      "allow_http": str(endpoint or "").startswith("http://")}
    return S3Store(bucket, config=config, credential_provider=credentials, client_options=client_options,
                   retry_config={"max_retries": ATTEMPTS - 1, "retry_timeout": RETRY_WINDOW})
