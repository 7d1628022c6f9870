"""What went wrong with a shard store, in one paragraph that says what to do (a DataError, exit status 2).

`explain(error, where)` reads an exception from boto3, obstore (in litdata's download thread, wrapped
in litdata's RuntimeError), the file system, or a DataLoader whose worker died, and names the case:
the endpoint unreachable or refusing, credentials refused, the bucket or prefix missing or not a
pack, a chunk corrupt or truncated, the cache disk full, a worker killed. Errors it does not
recognise are returned as None and travel on unchanged.
"""
from __future__ import annotations

import errno
import re

from datamodules.index import DataError

PACK_HINT = "python -m datamodules.shards --src ROOT --dst {url}"
ENV_HINT = ("Set the endpoint and credentials with --data.storage_options "
            "'{endpoint_url: ..., region_name: ...}' or the standard variables AWS_ENDPOINT_URL, "
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials).")

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


def explain(error: BaseException, url: str, endpoint: str | None = None, cache_dir: str | None = None) -> str | None:
    """One paragraph for a known failure reading the pack at `url`, else None."""
    text = _text(error)
    at = f" at {endpoint}" if endpoint else ""
    first = _root_cause(error)
    died = _WORKER_DIED.search(text)
    if died:
        return worker_died(url, died.group(0))
    if _is_enospc(error):
        where = cache_dir or "the chunk cache (--data.cache_dir)"
        return (f"The disk holding {where} is full while streaming {url}. Point --data.cache_dir at a disk with "
                "room, or lower --data.max_cache_size to what that disk can hold (at least a few chunks per "
                "worker); then resume with --ckpt_path last.")
    if _CREDENTIALS.search(text):
        return (f"The object store{at} refused the credentials for {url} ({first}). Check the access key, "
                f"secret and session token in use, and that they may read this bucket. {ENV_HINT}")
    if _NO_BUCKET.search(text):
        return (f"The bucket of {url} does not exist{at}. Check --data.data_dir and the endpoint, or pack the "
                f"data there first: {PACK_HINT.format(url=url)}. {ENV_HINT}")
    if _UNREACHABLE.search(text):
        return (f"Cannot reach the object store{at} for {url}: the endpoint is unreachable or refused the "
                f"connection ({first}). Check the endpoint URL (AWS_ENDPOINT_URL or --data.storage_options "
                "endpoint_url), that the server is running and reachable from this machine; then rerun (a fit "
                "resumes with --ckpt_path last).")
    if _NOT_FOUND.search(text):
        return (f"An object of the pack {url} is missing ({first}): the pack was changed or deleted while it "
                f"was read, or is incomplete. Pack it again: {PACK_HINT.format(url=url)}")
    return None


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
