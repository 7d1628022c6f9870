"""The fork server of --data.worker_start forkserver ends with the process that started it, whatever else that
process forked (datamodules/processes/fork_server.py, `end_with_the_parent`; issue 54 items 12 and 13)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from tests.helpers.trees import make_tree

# Our loader under the fork server, then a native library's fork (no Python at-fork handler runs in its child, which
# keeps every descriptor of the script: the server's alive pipe too), its child outliving the script.
SCRIPT = """
import ctypes, os, sys, time
from multiprocessing import forkserver
from datamodules import ImageFolderDataModule

if __name__ == "__main__":
    dm = ImageFolderDataModule(data_dir=sys.argv[1], batch_size=4, image_size=16, num_workers=1,
                               worker_start="forkserver", persistent_workers=False)
    dm.setup("fit")
    next(iter(dm.train_dataloader()))
    child = ctypes.PyDLL(None).fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(forkserver._forkserver._forkserver_pid, child, flush=True)
"""


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_the_server_ends_with_the_script_though_a_native_fork_outlives_it(tmp_path):
    tree = make_tree(tmp_path / "tree", {"a": 4, "b": 4})
    (tmp_path / "script.py").write_text(SCRIPT)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: the forked child keeps both
        done = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tree)], stdout=stdout,
                              stderr=stderr, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                              check=False)
    assert done.returncode == 0, err.read_text()[-3000:]
    server, child = map(int, out.read_text().split())
    try:
        deadline = time.monotonic() + 60
        while running(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running(child), "the forked child should still hold the server's alive pipe"
        assert not running(server), f"the fork server {server} outlived its script (the alive pipe is still held)"
        assert "Traceback" not in err.read_text(), err.read_text()[-3000:]
    finally:
        for pid in (child, server):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
