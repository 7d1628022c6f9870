"""The libjpeg-turbo route of region decode (datamodules/sample/region_libjpeg.py): built with the machine's C
compiler against Pillow's libjpeg, cached whole or not at all, refused where it would not be exact."""
from __future__ import annotations

import glob
import os
import shutil
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from datamodules.sample import region_libjpeg
from datamodules.sample.decode import decode
from tests.test_region_decode import photo

pytestmark = pytest.mark.skipif(region_libjpeg._compiler() is None or region_libjpeg.pillow_libjpeg() is None,
                                reason="no C compiler or no libjpeg of Pillow's here: the route cannot be built")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache: every `load` here builds unless the test has built before."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(region_libjpeg, "why_not", "")
    return tmp_path / "cache" / "fast-image-classifier" / "region-jpeg"


def compiler_script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_it_is_built_once_then_loaded_from_the_cache_without_a_compiler(cache, monkeypatch, tmp_path):
    decoder = region_libjpeg.load()
    assert decoder is not None, region_libjpeg.why_not
    built = sorted(os.listdir(cache))
    assert len(built) == 1 and built[0].startswith("region_libjpeg-")  # no temporary file left beside it
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))  # the compiler is not asked again
    data = bytearray(photo(40, 56, "RGB", 2))
    again = region_libjpeg.load()
    assert again is not None and torch.equal(again.decode(data, (3, 5, 30, 41)), decode(data)[:, 3:30, 5:41])


def test_a_build_that_fails_leaves_nothing_that_a_later_run_would_load(cache, monkeypatch, tmp_path):
    # a compiler that writes half a library to its -o path, then fails (as one killed mid-write would leave it)
    half = compiler_script(tmp_path / "half-cc", 'while [ "$1" != "-o" ]; do shift; done; echo half > "$2"; '
                                                 'echo "cc: error: out of disk" >&2; exit 1')
    monkeypatch.setenv("CC", half)
    assert region_libjpeg.load() is None
    assert "could not build region_libjpeg.c: cc: error: out of disk" in region_libjpeg.why_not
    assert not cache.exists() or os.listdir(cache) == []
    monkeypatch.delenv("CC")
    assert region_libjpeg.load() is not None  # the next run builds it whole


def test_without_a_compiler_load_says_so(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert region_libjpeg.load() is None
    assert region_libjpeg.why_not.startswith(f"{tmp_path / 'no-such-cc'} did not run")


def test_cc_may_hold_arguments(cache, monkeypatch):
    monkeypatch.setenv("CC", f"{region_libjpeg._compiler()[0]} -w")
    assert region_libjpeg.load() is not None, region_libjpeg.why_not


def test_two_threads_finding_an_empty_cache_both_get_the_decoder(cache):
    from concurrent.futures import ThreadPoolExecutor

    for _ in range(3):
        shutil.rmtree(cache, ignore_errors=True)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: region_libjpeg.load(), range(4)))
        assert all(d is not None for d in got), region_libjpeg.why_not
        assert len(os.listdir(cache)) == 1  # one library; every temporary file renamed or removed
        assert all(d.library._name.startswith(str(cache)) for d in got)  # none fell back to a private folder


def test_a_loader_worker_builds_nothing_it_loads_what_the_training_process_built(cache):
    assert region_libjpeg.load(build=False) is None
    assert region_libjpeg.why_not.startswith("no library built in ")
    assert not cache.exists()
    assert region_libjpeg.load() is not None
    assert region_libjpeg.load(build=False) is not None


def test_in_a_real_loader_worker_region_does_not_build(cache):
    """A torch DataLoader worker (forked) with nothing cached: it takes nvImageCodec or the whole decode, and the
    cache stays empty (the training process builds when it plans a train loader: datamodules/loaders.py)."""
    loader = torch.utils.data.DataLoader(_LooksForADecoder(), num_workers=1, multiprocessing_context="fork")
    (name,) = next(iter(loader))
    assert name in ("nvImageCodec", "none")
    assert not cache.exists() or os.listdir(cache) == []


class _LooksForADecoder(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> str:
        from datamodules.sample import region

        region._looked, region.decoder = False, None  # as a worker of a fork server or spawn starts
        return region.decoder.name if region.available() else "none"


def test_a_cache_folder_that_cannot_be_made_builds_into_a_private_folder(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    decoder = region_libjpeg.load()
    assert decoder is not None, region_libjpeg.why_not
    assert "fast-image-classifier-" in decoder.library._name  # tempfile.mkdtemp's, mode 0700


def test_a_cached_library_that_does_not_load_is_built_again(cache):
    name = region_libjpeg._cached_name(region_libjpeg.pillow_libjpeg())
    cache.mkdir(parents=True)
    (cache / name).write_bytes(b"half a library")
    assert region_libjpeg.load() is not None, region_libjpeg.why_not
    assert (cache / name).read_bytes()[:4] == b"\x7fELF" or sys.platform == "darwin"


def test_a_compiler_that_hangs_is_stopped_with_its_children(cache, monkeypatch, tmp_path):
    pids = tmp_path / "pids"
    hangs = compiler_script(tmp_path / "hangs-cc", f"sleep 600 & echo $! > {pids}; wait")
    monkeypatch.setenv("CC", hangs)
    monkeypatch.setattr(region_libjpeg, "BUILD_SECONDS", 1)
    assert region_libjpeg.load() is None
    assert region_libjpeg.why_not == f"{hangs} did not finish building region_libjpeg.c in 1 s"
    child = int(pids.read_text())
    with pytest.raises(ProcessLookupError):  # the compiler's own children went with it
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)
    assert not cache.exists() or os.listdir(cache) == []


def test_a_library_whose_pixels_differ_from_the_full_decode_is_not_used(cache, monkeypatch):
    decode = region_libjpeg.LibjpegRegion.decode
    monkeypatch.setattr(region_libjpeg.LibjpegRegion, "decode",  # as a libjpeg-turbo that rounds otherwise would
                        lambda self, data, box: decode(self, data, box).roll(1, -1))
    assert region_libjpeg.load() is None
    assert "does not give the full decode's pixels (4:2:0 box (0, 0, 36, 48))" in region_libjpeg.why_not


@pytest.mark.parametrize("subsampling", [0, 1, 2])
def test_nothing_outside_the_margins_is_written(cache, subsampling):
    decoder = region_libjpeg.load()
    data = bytearray(photo(64, 80, "RGB", subsampling, seed=subsampling))
    full = decode(data)
    guard, margin = 256, region_libjpeg.MARGIN
    for top, left, bottom, right in ((0, 0, 64, 80), (0, 17, 1, 80), (63, 33, 64, 50), (5, 31, 40, 48), (9, 1, 10, 79)):
        size = (bottom - top) * (right - left) * 3
        buffer = torch.full((guard + margin + size + margin + guard,), 0xA5, dtype=torch.uint8)
        status = decoder._decode(np.frombuffer(data, np.uint8).ctypes.data, len(data), top, left, bottom, right,
                                 buffer.data_ptr() + guard + margin, margin)
        assert status == 0
        assert bool((buffer[:guard] == 0xA5).all()) and bool((buffer[-guard:] == 0xA5).all())
        got = buffer[guard + margin:guard + margin + size].view(bottom - top, right - left, 3).permute(2, 0, 1)
        assert torch.equal(got, full[:, top:bottom, left:right]), (top, left, bottom, right)


def test_a_margin_too_small_for_the_columns_before_the_region_is_refused(cache):
    decoder = region_libjpeg.load()
    data = bytearray(photo(32, 64, "RGB", 2))  # 16-pixel MCUs: a region at column 31 (and its column of context
    # at 30) starts 15 columns after the MCU boundary at 16
    size = 4 * 10 * 3
    buffer = torch.zeros(64 + size + 64, dtype=torch.uint8)
    call = np.frombuffer(data, np.uint8).ctypes.data
    assert decoder._decode(call, len(data), 2, 31, 6, 41, buffer.data_ptr() + 64, 3 * 15 - 1) == 1
    assert decoder._decode(call, len(data), 2, 31, 6, 41, buffer.data_ptr() + 64, 3 * 15) == 0
    assert decoder._decode(call, len(data), 2, 31, 40, 41, buffer.data_ptr() + 64, 64) == 1  # rows past the image


def test_a_libjpeg_of_another_abi_is_refused_before_any_decode(cache, monkeypatch):
    """torchvision's libjpeg is ABI 80: its jpeg_CreateDecompress refuses a decompressor of the vendored ABI 62
    headers (a version and a struct size it does not know), so the library is not used."""
    other = sorted(glob.glob(os.path.join(os.path.dirname(torchvision.__file__) + ".libs", "libjpeg*.so.8*")))
    if not other:
        pytest.skip("this torchvision bundles no libjpeg.so.8")
    monkeypatch.setattr(region_libjpeg, "pillow_libjpeg", lambda: other[0])
    assert region_libjpeg.load() is None
    assert region_libjpeg.why_not == f"{other[0]} is not the libjpeg ABI 62 of third_party/libjpeg-turbo's headers"


def test_corrupt_data_in_the_region_is_refused_and_what_is_above_it_is_exact(cache):
    decoder = region_libjpeg.load()
    data = bytearray(photo(160, 96, "RGB", 2, seed=3))
    scan = data.index(b"\xff\xda")
    middle = scan + (len(data) - scan) // 2
    broken = data[:middle] + b"\xff\xd0" * 8 + data[middle:]  # restart markers where none belong: libjpeg warns
    assert decoder.decode(broken, (120, 0, 160, 96)) is None  # the rows past the damage: the full decode decides
    assert torch.equal(decoder.decode(broken, (0, 8, 16, 90)), decode(data)[:, 0:16, 8:90])


def test_threads_decode_side_by_side_with_the_same_pixels(cache):
    from concurrent.futures import ThreadPoolExecutor

    decoder = region_libjpeg.load()
    images = [bytearray(photo(80 + 8 * k, 120 - 4 * k, "RGB", k % 3, seed=k)) for k in range(8)]
    boxes = [(k, 2 * k + 1, 60 + k, 100 - 3 * k) for k in range(8)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: decoder.decode(images[k % 8], boxes[k % 8]), range(64)))
    for k, pixels in enumerate(got):
        t, c, b, r = boxes[k % 8]
        assert torch.equal(pixels, decode(images[k % 8])[:, t:b, c:r]), k



def test_a_truncated_file_is_refused_even_where_the_region_ends_before_the_cut(cache):
    """So a truncated file is named by the full decode whatever crop it draws, not only when the crop reaches the
    missing rows."""
    decoder = region_libjpeg.load()
    whole = bytearray(photo(200, 200, "RGB", 2))
    assert torch.equal(decoder.decode(whole, (0, 0, 8, 8)), decode(whole)[:, 0:8, 0:8])
    assert decoder.decode(whole[:len(whole) * 9 // 10], (0, 0, 8, 8)) is None


def _load_in_a_process(barrier) -> str:
    barrier.wait()  # both processes find the cache empty and build at once
    decoder = region_libjpeg.load()
    return decoder.library._name if decoder is not None else f"none: {region_libjpeg.why_not}"


@pytest.mark.slow
def test_two_processes_building_at_once_both_load_the_one_library(cache):
    """As two ranks of a fit planning their train loaders on a fresh machine: each builds under its own temporary
    name and renames it into place; both load the library from the cache, and nothing else is left there."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # fresh interpreters, as torchrun's ranks
    with context.Manager() as manager:
        barrier = manager.Barrier(2)
        with context.Pool(2) as pool:
            got = pool.map(_load_in_a_process, [barrier, barrier])
    assert all(path.startswith(str(cache)) for path in got), got
    assert len(os.listdir(cache)) == 1
