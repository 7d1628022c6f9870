"""Processes for tests: a free port on 127.0.0.1, and a function run in a forked child."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_fork(fn, *args):
    """fn(*args) in a forked child, its result (or exception) brought back.

    For what starts obstore's tokio runtime (an S3 GET through obstore): started in the pytest process, it
    has crashed that process (SIGSEGV in tokio's io driver) once DataLoader workers were forked after it.
    LitData itself keeps obstore out of a process that forks workers (downloader.py, obstore_usable).
    """
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(1, mp_context=get_context("fork")) as pool:
        return pool.submit(fn, *args).result(timeout=120)
