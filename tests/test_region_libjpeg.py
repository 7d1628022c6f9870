"""The libjpeg-turbo route of region decode (datamodules/sample/region_libjpeg.py): built with the machine's C
compiler against Pillow's libjpeg, cached whole or not at all, refused where it would not be exact."""
from __future__ import annotations

import glob
import os
import stat
from pathlib import Path

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
