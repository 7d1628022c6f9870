"""A forked child never finalises the parent's objects: the garbage collector is frozen across fork.

DataLoader workers are forked. A DALI pipeline owns native threads (its executor and thread pool);
dropped by the parent, it can sit in a reference cycle until the parent's next collection. A child
forked meanwhile inherits that garbage but not the threads, and the first collection in the child
runs the pipeline's finaliser: `Pipeline.Shutdown` -> `Executor2::Shutdown` -> `std::thread::join`
on a thread that does not exist there, and the worker dies of SIGSEGV ("DataLoader worker ... is
killed by signal: Segmentation fault"; nvidia/dali/libdali.so, seen in a core dump of the worker).
Any native object that owns threads (or locks held by them) has the same hazard.

So, around every fork (`os.register_at_fork`, which covers multiprocessing's fork start method):
the parent calls `gc.freeze()` just before it, which moves every object it tracks into the
permanent generation, and `gc.unfreeze()` just after, so its own collector sees them again. The
child keeps them frozen: its collector only ever looks at objects the child made, and the parent's
garbage is finalised in the parent, where its threads are. Freezing and unfreezing move list heads
(O(1)); Python's gc documentation recommends the same freeze before fork for copy-on-write memory.
"""
from __future__ import annotations

import gc
import os

_installed = False


def install() -> None:
    """Freeze the collector across every fork of this process (idempotent)."""
    global _installed
    if _installed or not hasattr(os, "register_at_fork"):
        return
    # A process that froze objects itself finds them unfrozen after a fork: still correct, only less
    # memory shared with later children.
    os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)
    _installed = True
