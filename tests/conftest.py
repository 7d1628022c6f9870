"""Fixtures: small real datasets (JPEG files on disk) and real S3 endpoints. What tests share that is not a
fixture is in tests/helpers/."""
from __future__ import annotations

import os
import signal
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))
# the commands under test call `python`, `torchrun` and `tensorboard` by name, as a user with the venv active does
_VENV_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

# after the path set-up above: a clone's own packages, whatever the working directory
from datamodules.builtin.tree import generate  # noqa: E402
from tests.helpers.optional import DALI_MISSING, REQUIRE_DALI_ENV  # noqa: E402
from tests.helpers.s3 import S3Server  # noqa: E402
from tests.helpers.trees import jpeg, make_odd_tree, make_slow_tree  # noqa: E402

pytest_plugins = ["tests.helpers.failures_at_once"]  # each failure named as it happens, not only in the summary


def pytest_addoption(parser) -> None:
    parser.addoption("--share", default=None, metavar="K/N",
                     help="run the K-th of N parts of the selected tests (parts by a hash of each test's id; tests "
                          "marked every_ci always run): CI's rotation through the slow tests, .ci/run")


def pytest_collection_modifyitems(config, items) -> None:
    share = config.getoption("--share")
    if not share:
        return
    try:
        k, n = (int(x) for x in share.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--share takes K/N with 0 <= K < N, got {share!r}") from None
    keep, drop = [], []
    for item in items:
        picked = item.get_closest_marker("every_ci") or zlib.crc32(item.nodeid.encode()) % n == k
        (keep if picked else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_sessionstart(session) -> None:
    # A runner that starts the suite as a background job of a script (`cmd &`, job control off) starts it with
    # SIGINT ignored (POSIX), Python then installs no handler of its own, and an ignored disposition survives exec:
    # every tool a test starts would ignore the Ctrl-C that test_tools.py sends it. The tests stand in for a
    # terminal's foreground job, where SIGINT is Python's default.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if DALI_MISSING and os.environ.get(REQUIRE_DALI_ENV) == "1":
        pytest.exit(f"{REQUIRE_DALI_ENV}=1 and DALI's tests cannot run: they {DALI_MISSING}", returncode=1)


@pytest.fixture(autouse=True, scope="session")
def _isolated_index_cache(tmp_path_factory):
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _gpus_visible_again(monkeypatch):
    """An in-process CPU fit hides the GPUs from its process (lightning_app/devices.py, hide_gpus_from_a_cpu_run):
    the tests after it, in the same pytest process, see them again."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ["CUDA_VISIBLE_DEVICES"])
    else:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture(autouse=True)
def _stop_signals_as_they_were():
    """The stop signals' handlers after each test as before it: an in-process run that left one ignored would make
    every process a later test starts ignore it too (see pytest_sessionstart)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in before.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The built-in dataset, 'tiny' preset: 10 classes x (24 train, 8 val), 32 px JPEGs."""
    return generate(tmp_path_factory.mktemp("builtin") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="session")
def learnable_data(tmp_path_factory) -> Path:
    """Enough of the built-in dataset for a few-epoch fit to clearly beat chance."""
    return generate(
        tmp_path_factory.mktemp("builtin") / "learn", "small", train_per_class=120, val_per_class=30, progress=False
    )


@pytest.fixture
def odd_tree(tmp_path) -> Path:
    """Every unusual-but-valid case, plus the clutter a naive walk turns into samples or classes."""
    return make_odd_tree(tmp_path / "odd")


@pytest.fixture(scope="session")
def slow_tree(tmp_path_factory) -> Path:
    """200 noise PNGs of 320x240 (2 classes): slow enough to pack or downscale that a run can be killed midway."""
    return make_slow_tree(tmp_path_factory.mktemp("slow") / "tree")


@pytest.fixture
def imagenet_weights_in_cache(tmp_path, monkeypatch):
    """torch.hub's cache holding a file where ResNet50_Weights.IMAGENET1K_V2 lives (random values, real layout)."""
    from torchvision.models import resnet50 as tv_resnet50

    from lightning_app.weights import torchvision_cache_path

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached, _ = torchvision_cache_path("ResNet50_Weights.IMAGENET1K_V2")
    cached.parent.mkdir(parents=True)
    torch.save(tv_resnet50(weights=None).state_dict(), cached)
    return cached


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server for this test, the AWS_* variables pointing at it."""
    server = S3Server()
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_session():
    """One moto S3 server for the whole session, started when a test first asks for it."""
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def shared_s3(s3_session, monkeypatch):
    """The session's server, the AWS_* variables pointing at it for this test."""
    for k, v in s3_session.env.items():
        monkeypatch.setenv(k, v)
    return s3_session


@pytest.fixture(scope="session")
def photo_tree(tmp_path_factory) -> Path:
    """Smooth 200 x 150 JPEGs (a resize of random noise would hide a wrong box less well than a gradient)."""
    root = tmp_path_factory.mktemp("photos")
    yy, xx = np.mgrid[0:150, 0:200]
    for split in ("train", "val"):
        for c, name in enumerate(("a", "b")):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(12):
                arr = np.stack([(xx * (i + 1)) % 256, (yy * (c + 2)) % 256, (xx + yy + 7 * i) % 256], -1)
                (d / f"{i:02d}.jpg").write_bytes(jpeg(Image.fromarray(arr.astype(np.uint8)), quality=90))
    return root
