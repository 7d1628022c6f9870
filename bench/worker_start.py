"""What a loader worker costs under each start method (--data.worker_start, datamodules/processes/start.py).

    python -m bench.worker_start [--samples 1281167] [--workers 2] [--data DIR]

Per case, in a fresh process each (the fork server starts once per process): the time from `iter(loader)` to
the first batch, and from the start of the data's setup (where the datamodules start the fork server) to it; again
for a second iter() (workers not persistent: the server runs already); and each worker's memory at its first batch
(/proc/PID/smaps_rollup: Rss, and Private = what the worker alone holds; a forked worker's Rss counts pages it
shares with the training process or the server). Cases: the built-in quickstart data through
ImageFolderDataModule, and a synthetic ImageNet-sized Index (1,281,167 samples, 1,000 classes, ImageNet's path
pattern) in a dataset that reads no file, holding the Index as ImageFolder's dataset does ("index") or a list of
(path, label) tuples ("tuples"). Also the bytes that dataset sends a forkserver or spawned worker (the Index's
arrays go as shared memory), and the Index's plain pickle (the arrays' bytes). Every row of one run shares the
machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_samples(n: int, classes: int = 1000) -> list[tuple[str, int]]:
    """ImageNet's pattern: train/<wnid>/<wnid>_<id>.JPEG, ids sparse and sorted within a class as listed
    (ImageNet's run to ~50,000 with gaps), wnids 8 random digits."""
    import random

    rng = random.Random(0)
    per = -(-n // classes)
    wnids = sorted(rng.sample(range(10**7, 10**8), classes))
    return [(f"train/n{w:08d}/n{w:08d}_{k}.JPEG", c) for c, w in enumerate(wnids)
            for k in sorted(rng.sample(range(1, 50_000), per))][:n]


class TupleIndexDataset:
    """The Index as it was: a list of (relative path, label) tuples, pickled as such."""

    def __init__(self, root: str, samples: list[tuple[str, int]]) -> None:
        self.root, self.samples = root, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> int:
        return len(os.path.join(self.root, self.samples[i][0])) + self.samples[i][1]


class IndexDataset:
    """What ImageFolder's SampleDataset holds, less the crop: the Index's paths (`FileSource`) and the labels as an
    int64 tensor (no file read)."""

    def __init__(self, index) -> None:
        import torch

        from datamodules.sample.dataset import FileSource

        self.files = FileSource(index, "")
        self.labels = torch.as_tensor(index.labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> int:
        return len(self.files.paths[i]) + int(self.labels[i])


def memory(pid: int) -> dict[str, float]:
    got = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                got[key] = int(value.split()[0]) / 1024
    return {"rss_mib": got["Rss"], "pss_mib": got["Pss"], "private_mib": got["Private_Clean"] + got["Private_Dirty"]}


def one_case(case: str, method: str, workers: int, samples: int, data: str | None) -> dict:
    """In this process: make the loader, time iter() to the first batch, read the workers' memory."""
    import torch
    from torch.utils.data import DataLoader

    from datamodules.processes.start import worker_context

    t_setup = time.perf_counter()
    if case == "quickstart":
        from datamodules import ImageFolderDataModule

        dm = ImageFolderDataModule(data_dir=data, batch_size=64, num_workers=workers, image_size=64,
                                   worker_start=method, persistent_workers=False)
        dm.setup("fit")
        loader = dm.train_dataloader()
    else:
        from datamodules.index import Index

        pairs = synthetic_samples(samples)
        dataset = TupleIndexDataset("/data/imagenet", pairs) if case == "tuples" else \
            IndexDataset(Index("/data/imagenet", "train", [f"n{c:08d}" for c in range(1000)], pairs))
        del pairs
        loader = DataLoader(dataset, batch_size=64, num_workers=workers, shuffle=True,
                            multiprocessing_context=worker_context(method))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - t0
    from_setup = time.perf_counter() - t_setup
    workers_of = getattr(batches, "_workers", None) or loader._iterator._workers  # a plain DataLoader's, ours
    mem = [memory(w.pid) for w in workers_of]
    del batches, workers_of
    t0 = time.perf_counter()  # a second epoch's workers (persistent_workers off): the fork server runs already
    next(iter(loader))
    again = time.perf_counter() - t0
    row = {"case": case, "method": method, "workers": workers, "first_batch_s": round(first, 2),
           "setup_to_first_batch_s": round(from_setup, 2),
           "again_first_batch_s": round(again, 2),
           "worker_rss_mib": round(sum(m["rss_mib"] for m in mem) / len(mem), 1),
           "worker_private_mib": round(sum(m["private_mib"] for m in mem) / len(mem), 1),
           "trainer_rss_mib": round(memory(os.getpid())["rss_mib"], 1)}
    return row


def pickled_sizes(samples: int) -> dict:
    from datamodules.index import Index

    pairs = synthetic_samples(samples)
    t0 = time.perf_counter()
    index = Index("/data/imagenet", "train", [f"n{c:08d}" for c in range(1000)], pairs)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    sent = ForkingPickler.dumps(IndexDataset(index))  # what a forkserver or spawned worker receives
    dumped = time.perf_counter() - t0
    t0 = time.perf_counter()
    pickle.loads(sent)
    loaded = time.perf_counter() - t0
    plain = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)  # to a file: the arrays' bytes
    t0 = time.perf_counter()
    tuples = pickle.dumps(pairs, protocol=pickle.HIGHEST_PROTOCOL)
    tuples_dumped = time.perf_counter() - t0
    t0 = time.perf_counter()
    pickle.loads(tuples)
    tuples_loaded = time.perf_counter() - t0
    in_memory = index.names.nbytes + index.name_ends.nbytes + index.label_array.nbytes
    return {"samples": samples, "dataset_sent_kib": round(len(sent) / 2**10, 1),
            "index_plain_pickle_mib": round(len(plain) / 2**20, 1),
            "index_arrays_mib": round(in_memory / 2**20, 1), "index_build_s": round(built, 2),
            "dataset_sent_dumps_s": round(dumped, 2), "dataset_sent_loads_s": round(loaded, 2),
            "tuples_pickled_mib": round(len(tuples) / 2**20, 1), "tuples_dumps_s": round(tuples_dumped, 2),
            "tuples_loads_s": round(tuples_loaded, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_start", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1_281_167)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", default=None, help="an ImageFolder tree (default: the built-in small preset)")
    parser.add_argument("--methods", default="fork,forkserver,spawn")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_case(args.one[0], args.one[1], args.workers, args.samples, args.data)))
        return 0
    if args.data is None:
        from datamodules.base import BUILTIN_ROOT
        from datamodules.builtin.tree import ensure_builtin

        args.data = str(ensure_builtin("small", root=BUILTIN_ROOT))
    print(json.dumps(pickled_sizes(args.samples)), flush=True)
    env = {**os.environ, "PYTHONPATH": REPO}
    for case in ("quickstart", "index", "tuples"):
        for method in args.methods.split(","):
            out = subprocess.run([sys.executable, "-m", "bench.worker_start", "--one", case, method, "--workers",
                                  str(args.workers), "--samples", str(args.samples), "--data", args.data],
                                 check=False, cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=600)
            rows = [line for line in out.stdout.splitlines() if line.startswith("{")]
            print(rows[-1] if rows and out.returncode == 0 else
                  json.dumps({"case": case, "method": method, "error": out.stderr[-800:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
