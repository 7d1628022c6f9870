"""What went wrong with a shard store, in one paragraph that says what to do (a DataError, exit status 2).

`explain(error, where)` reads an exception from boto3, obstore (in litdata's download thread, wrapped
in litdata's RuntimeError), the file system, or a DataLoader whose worker died, and names the case:
the endpoint unreachable or refusing, credentials refused, the bucket or prefix missing or not a
pack, a chunk corrupt or truncated, the cache disk full, a worker killed. Errors it does not
recognise are returned as None and travel on unchanged.

The packer and training share these cases but not their flags: `side="packer"` words each paragraph with the
packer's own (`--dst`, `--storage-options`, `--create-bucket`, the AWS_* variables boto3 reads), `side="training"`
(the default) with training's (`--data.data_dir`, `--data.storage_options`, `--data.cache_dir`).
"""
from __future__ import annotations

import errno
import re
import tempfile
from typing import Literal

from datamodules.errors import DataError

PACK_HINT = "python -m datamodules.shards --src ROOT --dst {url}"
ENV_HINT = ("Set the endpoint and credentials with --data.storage_options "
            "'{endpoint_url: ..., region_name: ...}' or the standard variables AWS_ENDPOINT_URL, "
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials).")
# botocore reads these (botocore/configprovider.py); the packer passes --storage-options over them
PACKER_ENV_HINT = ("The packer takes the endpoint from AWS_ENDPOINT_URL, the keys from AWS_ACCESS_KEY_ID and "
                   "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials), the region from "
                   "AWS_DEFAULT_REGION, or boto3 client arguments from --storage-options "
                   "'{\"endpoint_url\": ...}'.")
Side = Literal["training", "packer"]

_UNREACHABLE = re.compile(
    r"EndpointConnectionError|Could not connect to the endpoint|Connection refused|ConnectTimeout|"
    r"ConnectionClosedError|ReadTimeout|timed out|tcp connect error|error sending request|dns error|"
    r"Name or service not known|Connection reset|connection closed|Max retries exceeded", re.IGNORECASE)
_CREDENTIALS = re.compile(
    r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|ExpiredToken|InvalidToken|Forbidden|"
    r"Unauthenticated|PermissionDenied|NoCredentialsError|Unable to locate credentials|\b403\b", re.IGNORECASE)
_NO_BUCKET = re.compile(r"NoSuchBucket|specified bucket does not exist", re.IGNORECASE)
_NOT_FOUND = re.compile(r"NoSuchKey|NotFoundError|Object at location .* not found|\b404\b", re.IGNORECASE)
_NO_SPACE = re.compile(r"No space left on device|Errno 28|ENOSPC", re.IGNORECASE)
# torch/utils/data/dataloader.py (_try_get_data) and torch/utils/data/_utils/signal_handling.py
_WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) (?:exited unexpectedly|is killed by signal: "
                          r"[^.\n]*)", re.IGNORECASE)


def _text(error: BaseException) -> str:
    parts, seen, e = [], set(), error
    while e is not None and id(e) not in seen:  # the exception and what it was raised from
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost exception (obstore's messages go on with a multi-line debug dump)."""
    e, seen = error, set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}"[:300] if lines else type(e).__name__


def _is_enospc(error: BaseException) -> bool:
    e, seen = error, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    return bool(_NO_SPACE.search(_text(error)))


def _kind(error: BaseException, text: str) -> str | None:
    """Which known failure `error` is, in the order both sides check it; each side words its own paragraph."""
    if _is_enospc(error):
        return "disk full"
    for kind, pattern in (("credentials", _CREDENTIALS), ("no bucket", _NO_BUCKET), ("unreachable", _UNREACHABLE),
                          ("not found", _NOT_FOUND)):
        if pattern.search(text):
            return kind
    return None


def explain(error: BaseException, url: str, endpoint: str | None = None, cache_dir: str | None = None,
            side: Side = "training") -> str | None:
    """One paragraph for a known failure reading the pack at `url` (or, side="packer", writing it), else None."""
    if side == "packer":
        return _explain_packing(error, url, endpoint)
    text = _text(error)
    at = f" at {endpoint}" if endpoint else ""
    first = _root_cause(error)
    died = _WORKER_DIED.search(text)
    if died:
        return worker_died(url, died.group(0))
    kind = _kind(error, text)
    if kind == "disk full":
        where = cache_dir or "the chunk cache (--data.cache_dir)"
        return (f"The disk holding {where} is full while streaming {url}. Point --data.cache_dir at a disk with "
                "room, or lower --data.max_cache_size to what that disk can hold (at least a few chunks per "
                "worker); then resume with --ckpt_path last.")
    if kind == "credentials":
        return (f"The object store{at} refused the credentials for {url} ({first}). Check the access key, "
                f"secret and session token in use, and that they may read this bucket. {ENV_HINT}")
    if kind == "no bucket":
        return missing_bucket(url, endpoint, side="training")
    if kind == "unreachable":
        return (f"Cannot reach the object store{at} for {url}: the endpoint is unreachable or refused the "
                f"connection ({first}). Check the endpoint URL (AWS_ENDPOINT_URL or --data.storage_options "
                "endpoint_url), that the server is running and reachable from this machine; then rerun (a fit "
                "resumes with --ckpt_path last).")
    if kind == "not found":
        return (f"An object of the pack {url} is missing ({first}): the pack was changed or deleted while it "
                f"was read, or is incomplete. Pack it again: {PACK_HINT.format(url=url)}")
    return None


def _explain_packing(error: BaseException, url: str, endpoint: str | None) -> str | None:
    text = _text(error)
    at = f" at {endpoint}" if endpoint else ""
    first = _root_cause(error)
    kind = _kind(error, text)
    if kind == "disk full":
        return (f"The disk is full while packing to {url} ({first}). A local --dst is built in a folder beside it; "
                f"for an s3:// --dst each chunk is staged in the temporary folder first ({tempfile.gettempdir()}, "
                "set by TMPDIR). Free space there or set TMPDIR to a disk with room; the chunks packed so far are "
                "kept and reused.")
    if kind == "credentials":
        return (f"The object store{at} refused the credentials for --dst {url} ({first}). Check the keys in "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), and that they may list and "
                f"write this bucket (and create it, for --create-bucket). {PACKER_ENV_HINT}")
    if kind == "no bucket":
        return missing_bucket(url, endpoint)
    if kind == "unreachable":
        return (f"Cannot reach the object store{at} for --dst {url}: the endpoint is unreachable or refused the "
                f"connection ({first}). Check the endpoint (AWS_ENDPOINT_URL, or endpoint_url in "
                "--storage-options) and that its server is running and reachable from this machine; the chunks "
                "packed so far are kept and reused.")
    if kind == "not found":
        return (f"An object under --dst {url} disappeared while packing ({first}): something else writes or "
                "deletes under that prefix. Give this pack a --dst of its own.")
    return None


def missing_bucket(url: str, endpoint: str | None, side: Side = "packer") -> str:
    """The paragraph for an s3:// URL whose bucket does not exist at `endpoint`."""
    at = f" at {endpoint}" if endpoint else ""
    if side == "training":
        return (f"The bucket of {url} does not exist{at}. Check --data.data_dir and the endpoint, or pack the "
                f"data there first: {PACK_HINT.format(url=url)}. {ENV_HINT}")
    bucket = url[len("s3://"):].split("/", 1)[0]
    mb = f"aws s3 mb s3://{bucket}" + (f" --endpoint-url {endpoint}" if endpoint else "")
    return (f"The bucket {bucket} of --dst {url} does not exist{at}. The packer creates it when given "
            f"--create-bucket (with the same endpoint and credentials), or create it yourself: `{mb}`. Or check "
            "--dst and AWS_ENDPOINT_URL, if this is not the store you meant.")


def worker_died(url: str, detail: str) -> str:
    return (f"A data-loading worker process died while streaming {url} ({detail}). A worker killed by the kernel "
            "usually means the machine ran out of memory: check `dmesg` or the job's memory limit, then lower "
            "--data.num_workers or --data.batch_size, and resume with --ckpt_path last.")


def as_data_error(error: BaseException, url: str, **context) -> BaseException:
    """A DataError with `explain`'s paragraph, or `error` itself when it is not a known case."""
    if isinstance(error, DataError):
        return error
    message = explain(error, url, **context)
    return DataError(message) if message else error


def corrupt_chunk(url: str, chunk: str, detail: str) -> DataError:
    return DataError(f"Chunk {chunk} of the pack {url} is corrupt or truncated ({detail}). Pack the data again "
                     f"({PACK_HINT.format(url=url)}), or delete the chunk cache (--data.cache_dir) if only the "
                     "cached copy is damaged.")
