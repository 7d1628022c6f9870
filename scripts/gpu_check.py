"""The offline GPU check's runner (scripts/gpu_check.sh makes its venv, then runs this in it).

Prints the versions, stops with exit status 2 when there is no usable CUDA device, else runs the parts (PARTS:
the GPU decode's part first, then `pytest -m gpu` and `python -m bench gpu` group by group), each under its own
timeout and all within DEADLINE_S of the start, and writes OUT/gpu-check.md and OUT/gpu-check.json naming the GPU
and the date. `--parts` takes words of WORDS only: an unknown one stops it with exit status 2, naming it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEADLINE_S = 560  # the whole check; a 10-minute device call keeps 40 s of slack
# (part, command after `python`, its own timeout in seconds), in order; the bench groups of bench/gpu/command.py.
# Limits from the first run on an H200 (bench/results/gpu-check-h200.md): startup (torch, CUDA, cuDNN) alone takes
# 10-15 s, compiling ResNet-50 about 40 s.
PYTEST_GPU = ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--timeout", "150",
              "-rfEs", "--tb=short"]


class Part(NamedTuple):
    """A part: its command after `python`, its own time limit (s), the --parts words that select it, and whether a
    run without --parts runs it (a part another covers does not)."""

    name: str
    argv: list[str]
    seconds: float
    words: frozenset[str]
    default: bool = True


def bench(groups: str, seconds: float, words: set[str] | None = None, extra: tuple[str, ...] = (),
          default: bool = True) -> Part:
    return Part(f"bench gpu {groups}", ["-m", "bench", "gpu", "--groups", groups, *extra], seconds,
                frozenset(words or set(groups.split(","))), default)


# The GPU decode's next run (issue 51), `--parts decode`, at most 300 s: the CUDA tests with their defects put back
# (all at once, about 40 s), then one bench call in the order of what matters most (bench/gpu/command.py): the
# hardware JPEG engines and the decode alone, the trace with its VERDICT and A/B rows (the blocking-sync arm in a
# process of its own), EMA's host syncs, and last the trainer rows, ImageFolder and LMDB with `cpu` and `gpu`,
# without and with compile (without compile, `cpu` also with region decode off: issue 55's rows). A bench call
# saves its rows as it goes: one stopped at its limit keeps what it measured.
DECODE = [Part("gpu mutants", ["scripts/gpu_mutants.py"], 50, frozenset({"mutants", "decode"})),
          bench("engines,trace,ema,trainer", 250, {"decode"}, ("--synthetic", "ceiling", "--data-rows", "decode"))]
# Then the rest; limits from the first run on an H200 (bench/results/gpu-check-h200.md): startup (torch, CUDA, cuDNN)
# alone takes 10-15 s, compiling ResNet-50 about 40 s. The whole `pytest -m gpu` takes about 120 s on an H200.
PARTS = [*DECODE, Part("pytest -m gpu", PYTEST_GPU, 180, frozenset({"gpu"})),
         bench("ceiling", 60), bench("trainer", 300, extra=("--synthetic", "ceiling")),
         # the template's multi-process paths on one GPU (issue 41): sweep trials sharing it, predict on it
         Part("pytest -m gpu clusters", [*PYTEST_GPU, "tests/test_sweep.py", "tests/test_predict.py"], 150,
              frozenset({"clusters"})),
         bench("input", 180), bench("backends", 110), bench("precision", 45), bench("flags", 120), bench("dali", 30),
         bench("dp,ddp", 40), bench("powersgd", 60),
         # alone, for a rerun: the decode part runs them
         bench("engines", 60, default=False), bench("trace", 120, default=False), bench("ema", 60, default=False)]
WORDS = sorted({word for part in PARTS for word in part.words})
# One built-in tree for every data part: 16,000 ImageNet-sized JPEGs, 62 batches of 256 an epoch, so no timed window
# crosses an epoch (the input group's longest: whole rounds of 14 workers, 28 + 28 batches at --steps 20; the
# trainer's data rows: 25 + 30; the backend rows: 10 + 30). Made once, by the first data part, in about 45 s.
TRAIN_PER_CLASS = "1600"
INPUT_SIZE = ["--steps", "20"]


def selected(wanted: set[str] | None) -> list[Part]:
    """The parts `--parts` selects, in PARTS order: those with one of its words; without it, the default ones."""
    return [part for part in PARTS if (wanted & part.words if wanted is not None else part.default)]


def versions() -> dict:
    import pytorch_lightning
    import torch

    from lightning_app.devices import nvidia_driver

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "driver": nvidia_driver(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None, "nccl": nccl,
            "lightning": pytorch_lightning.__version__, "python": sys.version.split()[0], "usable": cuda}


def run_part(name: str, argv: list[str], timeout: float, out: Path) -> dict:
    """One part in its own process group, stopped at its timeout; its output kept in OUT/logs/."""
    log = out / "logs" / (name.replace(" ", "_").replace("-", "") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    if timeout < 5:
        return {"part": name, "status": "skipped", "seconds": 0.0, "summary": "no time left before the deadline"}
    print(f"gpu_check: {name}: started, at most {timeout:.0f} s (log: {log.relative_to(out)})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
    seconds = time.perf_counter() - t0
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    last = lines[-1][:200] if lines else ""
    if code is None:
        status, summary = "FAIL", f"timed out after {timeout:.0f} s; {last}"
    elif name.startswith("pytest") and code == 5:
        status, summary = "skipped", "no test is marked gpu"
    else:
        status, summary = ("ok" if code == 0 else "FAIL"), last
    print(f"gpu_check: {name}: {status} in {seconds:.0f} s ({summary})", flush=True)
    return {"part": name, "status": status, "seconds": round(seconds, 1), "exit": code, "summary": summary,
            "log": str(log.relative_to(out))}


def bench_rows(folder: Path) -> list[dict] | None:
    """The rows a bench part wrote in `folder`: its result, else the rows it saved before it was stopped (bench gpu
    saves them as it goes); None when it wrote neither."""
    for name in ("gpu-check.gpu.json", "gpu-check.gpu.partial.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())["checks"]
    return None


def bench_checks(out: Path) -> list[dict]:
    """Every row the bench parts wrote, from each group's JSON (a group's rows are the ones it selected)."""
    rows = []
    for folder in sorted(p for p in (out / "bench").glob("*") if p.is_dir()):
        group = folder.name
        for check in bench_rows(folder) or []:
            if check["verdict"] != "not selected (--groups)":
                rows.append({**check, "bench_group": group})
    return rows


def write_report(out: Path, result: dict) -> None:
    v = result["versions"]
    gpu = ", ".join(v["gpus"]) or "no usable CUDA device"
    lines = [f"# GPU check, {result['date']}", "",
             f"- GPU: {gpu}; driver {v['driver']}",
             (f"- torch {v['torch']} (CUDA {v['cuda']}, cuDNN {v['cudnn']}, NCCL {v['nccl']}), Lightning "
              f"{v['lightning']}, Python {v['python']}"),
             f"- Verdict: {result['verdict']}", ""]
    if result["parts"]:
        lines += ["| part | status | seconds | summary |", "|---|---|---|---|"]
        lines += [f"| {p['part']} | {p['status']} | {p['seconds']:.0f} | {p['summary']} |" for p in result["parts"]]
        lines.append("")
    if result["checks"]:
        lines += ["| group | path | status | figure | verdict or reason |", "|---|---|---|---|---|"]
        lines += [f"| {c['group']} | {c['name']} | {c['status']} | {c['figure']} | {c['verdict']} |"
                  for c in result["checks"]]
    (out / "gpu-check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    print(f"\nwrote {out / 'gpu-check.md'}, {out / 'gpu-check.json'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default=None, help=f"comma list of parts to run, by their words ({', '.join(WORDS)}; "
                    "decode: the GPU decode's part): a rerun of the ones that failed; default every part but the ones "
                    "alone for a rerun (engines, trace, ema: the decode part runs them)")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S, help=f"the whole check (default {DEADLINE_S})")
    ap.add_argument("--rehearse-on-cpu", action="store_true", help="without CUDA, run every part anyway at a tiny "
                    "size (bench gpu --allow-cpu): a test of this runner, never a result")
    args = ap.parse_args()
    wanted = {word.strip() for word in args.parts.split(",") if word.strip()} if args.parts else None
    unknown = sorted((wanted or set()) - set(WORDS))
    if unknown:
        print(f"gpu_check: --parts {args.parts}: no part is called {', '.join(repr(w) for w in unknown)}. The parts "
              f"are {', '.join(WORDS)} (`decode`: the GPU decode's part, every piece of it).", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)  # run on its own (a rerun), not only from gpu_check.sh
    # the deadline counts from gpu_check.sh's start (its venv and wheel install included)
    start = time.monotonic() - max(0.0, time.time() - float(os.environ.get("GPU_CHECK_STARTED", time.time())))
    print("gpu_check: reading the versions (torch, CUDA, Lightning, the NVIDIA driver): up to a minute on a small "
          "machine", flush=True)
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "versions": versions(),
              "parts": [], "checks": []}
    v = result["versions"]
    print(f"gpu_check: GPU {', '.join(v['gpus']) or 'none usable'}; driver {v['driver']}; torch {v['torch']}; "
          f"CUDA {v['cuda']}; cuDNN {v['cudnn']}; NCCL {v['nccl']}; Lightning {v['lightning']}", flush=True)
    if not v["usable"] and not args.rehearse_on_cpu:
        result["verdict"] = (
            f"no usable CUDA device: torch {v['torch']} (built for CUDA {v['cuda']}) sees none"
            + (f", while the NVIDIA driver {v['driver']} is here: install a torch built for this driver" if v["driver"]
               else " and no NVIDIA driver answers: this machine has no GPU")
            + ". Nothing was checked.")
        write_report(out, result)
        return 2
    precision = []  # the ceiling's faster AMP, passed to the later groups (bench gpu --precision)
    for name, argv, own, _, _ in selected(wanted):
        folder = None
        if name.startswith("bench"):
            group = name.split()[-1]
            folder = out / "bench" / group.replace(",", "-")
            data = ["--train-per-class", TRAIN_PER_CLASS, *(INPUT_SIZE if group == "input" else [])]
            size = ([*data, *precision] if v["usable"] else  # else --rehearse-on-cpu
                    ["--allow-cpu", "--builtin", "tiny", "--train-per-class", "16", "--arch", "conv11",
                     "--image-size", "32", "--batch-size", "8", "--steps", "2", "--warmup", "1",
                     "--backends", "imagefolder"])
            argv = [*argv, "--out", str(folder), "--machine", "gpu-check", *size]
        left = args.deadline_s - (time.monotonic() - start)
        part = run_part(name, argv, min(own, left), out)
        written = bench_rows(folder) if folder is not None else None
        if written is not None:
            rows = [c for c in written if c["verdict"] != "not selected (--groups)"]
            stopped = "" if (folder / "gpu-check.gpu.json").is_file() else "; stopped: the rows measured before"
            part["summary"] = ", ".join(f"{sum(c['status'] == s for c in rows)} {s}"
                                        for s in ("ok", "FAIL", "skipped")) + stopped
            measured = [c["extra"].get("precision") for c in rows if c["group"] == "compute ceiling" and c.get("extra")]
            if measured and measured[0] in ("16-mixed", "bf16-mixed"):
                precision = ["--precision", measured[0]]
            elif name.endswith("trainer") and not precision and part["status"] == "ok":
                precision = ["--precision", "16-mixed"]  # the trainer rows' (bench/gpu/trainer.py): later rows compare
        result["parts"].append(part)
    result["checks"] = bench_checks(out)
    failed = [p["part"] for p in result["parts"] if p["status"] == "FAIL"]
    failed += [f"{c['group']}: {c['name']}" for c in result["checks"] if c["status"] == "FAIL"]
    ran = [c for c in result["checks"] if c["status"] == "ok"]
    if wanted is not None:
        result["parts_selected"] = sorted(wanted)
    # a rerun of the tests alone (--parts gpu) has no rows: its tests are what was checked
    tested = [p for p in result["parts"]
              if p["part"].startswith("pytest") and p["status"] == "ok" and " passed" in p["summary"]]
    nothing = not ran and (any(p["part"].startswith("bench") for p in result["parts"]) or not tested)
    if args.rehearse_on_cpu and not v["usable"]:
        result["rehearsal"] = True
        result["verdict"] = (f"rehearsal on a CPU, not a check: {len(result['parts'])} parts ran at a tiny size, "
                             f"{len(ran)} rows; " + (f"FAILED: {', '.join(failed)}" if failed else "the runner works")
                             + ". No figure here is a GPU's.")
    elif failed:
        result["verdict"] = f"FAILED: {', '.join(failed)}"
    elif nothing:
        result["verdict"] = "every row was skipped: nothing was checked"
    elif ran:
        result["verdict"] = f"passed: {len(ran)} rows ran, {len(result['checks']) - len(ran)} skipped with their reason"
    else:
        result["verdict"] = f"passed: pytest -m gpu, {tested[0]['summary']}"
    write_report(out, result)
    return 1 if failed or nothing else 0


if __name__ == "__main__":
    sys.exit(main())
