"""`python -m datamodules.shards --dst s3://...` against a real S3 endpoint (moto's server on 127.0.0.1): a missing
bucket is made with --create-bucket or named with how to make it, and the packer's failures name the packer's own
flags and variables, never training's."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.cli import quick_args, run_main

pytestmark = pytest.mark.timeout(300)
TRAINING_FLAGS = re.compile(r"--data\.|--ckpt_path")


def _pack(src: Path, dst: str, *extra: str) -> subprocess.CompletedProcess:
    """The packer as a user runs it (the AWS_* variables of the fixture in force)."""
    return subprocess.run([sys.executable, "-m", "datamodules.shards", "--src", str(src), "--dst", dst, "--quiet",
                           "--chunk-mb", "0.05", *extra], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=240, check=False)


def _one_paragraph(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("python -m datamodules.shards: "), line
    assert not TRAINING_FLAGS.search(line), line
    return line


def _buckets(server) -> set[str]:
    return {b["Name"] for b in server.client().list_buckets()["Buckets"]}


def test_missing_bucket_says_how_to_make_it_and_makes_nothing(shared_s3, tiny_data):
    line = _one_paragraph(_pack(tiny_data, "s3://never-made/tiny"))
    assert "The bucket never-made of --dst s3://never-made/tiny does not exist" in line, line
    assert "--create-bucket" in line, line
    assert f"`aws s3 mb s3://never-made --endpoint-url {shared_s3.url}`" in line, line
    assert "never-made" not in _buckets(shared_s3)


@pytest.mark.slow
def test_create_bucket_makes_it_and_the_pack_trains(shared_s3, tiny_data, tmp_path):
    proc = _pack(tiny_data, "s3://made-by-packer/tiny", "--create-bucket")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"created the bucket s3://made-by-packer at {shared_s3.url}" in proc.stderr.splitlines(), proc.stderr
    assert "made-by-packer" in _buckets(shared_s3)
    again = _pack(tiny_data, "s3://made-by-packer/tiny", "--create-bucket")  # the bucket is there now: no line
    assert again.returncode == 0 and "created" not in again.stderr, again.stderr[-3000:]
    run_main(["fit", "--config", "configs/data/streaming.yaml",
              *quick_args("s3://made-by-packer/tiny", tmp_path / "logs"), "--data.cache_dir", str(tmp_path / "cache")])
    assert list((tmp_path / "logs").rglob("last.ckpt")), "the fit from the pack saved nothing"


def test_refused_credentials_name_the_packers_variables(shared_s3, tiny_data):
    shared_s3.bucket("locked")
    with shared_s3.auth_required():  # "test" is none of the server's own keys
        line = _one_paragraph(_pack(tiny_data, "s3://locked/tiny", "--create-bucket"))
    assert f"The object store at {shared_s3.url} refused the credentials for --dst s3://locked/tiny" in line, line
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
                 "--storage-options"):
        assert name in line, (name, line)


def test_unreachable_endpoint_names_the_packers_endpoint_settings(s3, tiny_data):
    s3.stop()  # nothing answers at AWS_ENDPOINT_URL now
    line = _one_paragraph(_pack(tiny_data, "s3://gone/tiny", "--create-bucket"))
    assert f"Cannot reach the object store at {s3.url} for --dst s3://gone/tiny" in line, line
    assert "AWS_ENDPOINT_URL" in line and "--storage-options" in line, line
    assert "rerun" not in line.lower(), line
