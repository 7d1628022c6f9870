"""The benchmark tool: both subcommands end to end on tiny data, the bottleneck rule, --help."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.__main__ import main
from bench.loaders.backends import BACKENDS
from bench.loaders.report import classify
from bench.train.rows import RowSpec, row_specs, skip_reason
from datamodules.builtin.tree import generate
from datamodules.sample import region
from netsim import link as netlink
from tests.helpers import REPO
from tests.helpers.imports import circles, import_graph
from tests.helpers.optional import needs_dali


@pytest.fixture(scope="module")
def photo_data(tmp_path_factory) -> Path:
    """ImageNet-like files (varied ~470x390 JPEGs), 2 per class: 20 train images."""
    return generate(tmp_path_factory.mktemp("bench") / "img", "imagenet", train_per_class=2, val_per_class=1,
                    progress=False)


def _outputs(out: Path, kind: str) -> tuple[str, dict]:
    md = list(out.glob(f"*.{kind}.md"))
    assert len(md) == 1, md
    stem = md[0].name[: -len(f".{kind}.md")]
    png = out / f"{stem}.{kind}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / f"{stem}.md").read_text()
    assert "CPU:" in summary and "Libraries:" in summary and f"## {kind}" in summary
    return md[0].read_text(), json.loads((out / f"{stem}.{kind}.json").read_text())


# ------------------------------------------------------------------------------ bottleneck rule

def test_classify_io_bound_when_near_read_ceiling():
    assert classify(images_s=500, mb_s=45, io_mb_s=50, decode_images_s=2000)[0] == "IO"


def test_classify_decode_bound_when_near_decode_ceiling():
    name, io, dec = classify(images_s=900, mb_s=80, io_mb_s=1000, decode_images_s=1000)
    assert name == "CPU decode" and io == pytest.approx(0.08) and dec == pytest.approx(0.9)


def test_classify_picks_the_closer_ceiling_when_both_are_near():
    assert classify(images_s=950, mb_s=85, io_mb_s=100, decode_images_s=1000)[0] == "CPU decode"
    assert classify(images_s=850, mb_s=99, io_mb_s=100, decode_images_s=1000)[0] == "IO"


def test_classify_overhead_when_far_from_both_and_gpu_for_gpu_decoding():
    assert classify(images_s=300, mb_s=27, io_mb_s=500, decode_images_s=1000)[0] == "around decoding"
    # warm rows have no IO ceiling; GPU-decoding rows have no CPU decode ceiling
    assert classify(images_s=300, mb_s=27, io_mb_s=None, decode_images_s=None)[0] == "around decoding"
    assert classify(images_s=3000, mb_s=270, io_mb_s=1000, decode_images_s=1000, gpu_decode=True) == ("GPU", 0.27, None)
    assert classify(images_s=3000, mb_s=950, io_mb_s=1000, decode_images_s=1000, gpu_decode=True)[0] == "IO"


# ------------------------------------------------------------------------------ --help

def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _unexplained(md: str, help_text: str) -> list[str]:
    """The columns of the first table in `md` that `--help` does not explain
    ("x cold" and "x warm": "x cold | warm")."""
    header = next(line for line in md.splitlines() if line.startswith("| "))
    columns = [c.strip() for c in header.strip().strip("|").split(" | ")]
    return [c for c in columns
            if f"{c}:" not in help_text and f"{re.sub(r' (cold|warm)$', '', c)} cold | warm:" not in help_text]


def test_help_explains_every_column_of_the_train_table(capsys):
    from bench.train.report import to_markdown

    settings = {"arch": "conv11", "width": 8, "image_size": 32, "batch_size": 8, "epochs": 1, "num_workers": 0,
                "root": "/data"}
    md = to_markdown({"rows": [_row("baseline", 0.1)], "overhead": None, "settings": settings})
    assert _unexplained(md, _help("train", capsys)) == []
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "loaders" in capsys.readouterr().out


def test_unknown_backend_is_a_clear_error(capsys, tmp_path, photo_data):
    assert main(["loaders", "--data-dir", str(photo_data), "--backends", "nfs", "--out", str(tmp_path)]) == 2
    assert "unknown ['nfs']" in capsys.readouterr().err


def test_unknown_row_and_no_config_are_clear_errors(capsys, tmp_path):
    """Every suite reports what it cannot run as asked by one mechanism (BenchError): a line, an exit status."""
    assert main(["train", "--rows", "baseline,nope", "--out", str(tmp_path)]) == 2
    assert "--rows: unknown ['nope']" in capsys.readouterr().err
    assert main(["memory", "--out", str(tmp_path)]) == 1
    assert "bench memory: give --config FILE" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------------------ the suites' table

def test_every_suite_has_the_four_entry_points():
    from bench.__main__ import SUITES

    assert list(SUITES) == ["loaders", "train", "gpu", "memory", "nodes"]  # the order --help lists them in
    for name, suite in SUITES.items():
        assert all(callable(getattr(suite, f, None)) for f in ("add_parser", "run", "to_markdown", "chart")), name


def test_bench_modules_import_no_circle_and_no_private_name():
    graph = import_graph(("bench",))
    private = sorted(f"{m} imports {t}" for m, ts in graph.items() for t in ts
                     if t.split(".")[0] in ("bench", "datamodules", "lightning_app") and ":_" in t)
    assert private == []
    assert circles(graph) == []


# ------------------------------------------------------------------------------ end to end

def test_loaders_end_to_end(tmp_path, photo_data, capsys):
    out = tmp_path / "out"
    rc = main(["loaders", "--data-dir", str(photo_data), "--backends", "imagefolder,imagefolder-whole,dali-gpu",
               "--batch-size", "4",
               "--num-workers", "0", "--work-dir", str(tmp_path / "work"), "--out", str(out),
               "--note", "test run"])
    assert rc == 0
    md, data = _outputs(out, "loaders")
    assert {"rows", "ceilings", "eviction", "settings", "machine", "note"} <= set(data)
    rows = {(r["backend"], r["cache"]): r for r in data["rows"]}
    assert len({r["backend"] for r in data["rows"]}) == len(BACKENDS)  # every backend is a row
    for cache in ("cold", "warm"):
        r = rows[("ImageFolder", cache)]
        assert r["status"] == "ok" and r["images"] == (20 if cache == "cold" else 40)  # 5 batches of 4; warm: 2 epochs
        assert r["images_s"] > 0 and r["mb_s"] > 0
        assert r["bottleneck"] in ("IO", "CPU decode", "around decoding")
        assert r["decode_frac"] > 0 and r["pil_frac"] >= r["decode_frac"]  # the fastest decoder's ceiling
    # the row beside it decodes every image whole (region decode: datamodules/sample/region.py)
    assert rows[("ImageFolder, whole decode", "warm")]["status"] == "ok"
    assert "whole decode (region decode off)" in rows[("ImageFolder, whole decode", "warm")]["note"]
    on = f"region decode ({region.decoder.name})" if region.available() else "no region decoder here"
    assert on in rows[("ImageFolder", "warm")]["note"]
    by_region, whole = rows[("ImageFolder", "warm")]["extra"]["region_whole"]
    assert (by_region > 0 and whole == 0) if region.available() else by_region == 0
    assert rows[("ImageFolder, whole decode", "warm")]["extra"]["region_whole"][0] == 0
    assert rows[("ImageFolder", "cold")]["io_frac"] > 0
    assert rows[("ImageFolder", "warm")]["io_frac"] is None
    assert data["ceilings"]["io"]["tree"]["mb_s"] > 0 and all(
        data["ceilings"]["decode"]["original"][d][c]["images_s"] > 0
        for d in ("pil", "torchvision") for c in ("cold", "warm"))
    assert data["eviction"].startswith(("posix_fadvise", "drop_caches"))
    skipped = [r for r in data["rows"] if r["status"] == "skipped"]
    assert skipped and all(r["reason"] for r in skipped)
    assert any(r["reason"] == "not selected (--backends)" for r in skipped)
    gpu_row = rows[("DALI GPU (mixed)", "cold")]
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in gpu_row["reason"]
    else:  # decoded on the GPU: timed, and never called CPU-decode-bound
        assert gpu_row["status"] == "ok" and gpu_row["images_s"] > 0, gpu_row
        assert gpu_row["bottleneck"] in ("GPU", "IO"), gpu_row
    assert _unexplained(md, _help("loaders", capsys)) == []  # every column of the table a run writes
    assert "| ImageFolder | " in md and "Decode ceiling" in md and "**test run**" in md
    # each round's ratio of the region row to its whole-decode twin and to PIL's ceiling (no workers: no CPU time)
    paired = {(p["row"], p["against"]): p for p in data["paired"]}
    assert set(paired) == {("ImageFolder", "ImageFolder, whole decode"), ("ImageFolder", "PIL decode-only ceiling")}
    assert all(p["wall"] > 0 and len(p["wall_rounds"]) == 3 and p["cpu"] is None for p in paired.values())
    assert "ImageFolder / ImageFolder, whole decode: images/s" in md


def test_process_cpu_reads_the_cpu_seconds_of_a_running_process():
    from bench.loaders.cpu_time import CpuClock, process_cpu

    # 0.6 s burnt, 0.5 asked: /proc counts whole clock ticks, and a loaded machine's tick sampling runs short of the
    # process's own clock by a tick or two
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\nprint(1, flush=True)\n" \
           "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()  # it has burnt 0.6 s of CPU, and sleeps
        assert 0.5 <= process_cpu([proc.pid]) < 10
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        assert process_cpu([proc.pid, gone.pid]) == process_cpu([proc.pid])  # a process gone counts 0
    finally:
        proc.kill()
        proc.wait()
    assert CpuClock(None).seconds() is None and CpuClock([]).seconds() >= 0


@pytest.mark.slow
def test_train_end_to_end(tmp_path, tiny_data):
    out = tmp_path / "out"
    rc = main(["train", "--data-dir", str(tiny_data), "--rows", "baseline,plain-pytorch", "--epochs", "1",
               "--batch-size", "48", "--num-workers", "0", "--width", "8", "--overhead-pairs", "2", "--out", str(out)])
    assert rc == 0
    md, data = _outputs(out, "train")
    assert {"rows", "overhead", "settings", "machine"} <= set(data)
    rows = data["rows"]
    assert rows[0]["row"] == "baseline" and rows[0]["status"] == "ok", rows[0]
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert rows[0]["devices"] == 1 and len(rows[0]["epoch_seconds"]) == 1
    plain = rows[1]
    assert plain["strategy"] == "plain" and plain["status"] == "ok", plain
    pairs = data["overhead"]["pairs"]
    assert len(pairs) == 2 and pairs[0] == {"lightning_img_s": rows[0]["images_s"], "plain_img_s": plain["images_s"]}
    assert data["overhead"]["ratio"] in [pytest.approx(q["lightning_img_s"] / q["plain_img_s"]) for q in pairs]
    assert len(rows) == len(row_specs(torch.cuda.is_available()))  # nothing hidden
    for r in rows[2:]:
        assert r["status"] == "skipped" and r["reason"], r
    assert "Template overhead" in md and "| baseline |" in md


@pytest.mark.slow
def test_train_says_every_few_seconds_which_row_and_step_it_is_at(tmp_path, tiny_data):
    """FIC_PROGRESS_EVERY_S sets how often (default 15 s); written to a file, only these lines, no redrawn bar."""
    proc = subprocess.run([sys.executable, "-m", "bench", "train", "--data-dir", str(tiny_data), "--rows",
                           "baseline,plain-pytorch", "--epochs", "2", "--batch-size", "8", "--num-workers", "0",
                           "--width", "8", "--overhead-pairs", "1", "--out", str(tmp_path / "out")],
                          cwd=REPO, env={**os.environ, "FIC_PROGRESS_EVERY_S": "0.1"}, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = len(row_specs(torch.cuda.is_available()))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bench train: row ")]
    assert any(line.startswith(f"bench train: row 1/{rows} baseline: ") for line in lines), proc.stderr[-3000:]
    assert any(line.startswith(f"bench train: row 2/{rows} plain-pytorch (hand-written loop): ") for line in lines)
    assert any(re.match(rf"bench train: row 1/{rows} baseline: epoch [12]/2, step \d+/30 \(\d+ s in this row\)$",
                        line) for line in lines), lines[-20:]
    assert "\r" not in proc.stderr


def test_memory_says_which_cpus_it_sizes_for_and_no_lightning_warning(tmp_path):
    from datamodules.budget.cpus import cpu_share

    def stderr(*extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "bench", "memory", "--config", "configs/default.yaml", "--ranks",
                               "2", "--out", str(tmp_path / "out"), *extra], cwd=REPO, capture_output=True, text=True,
                              timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "LightningCLI's args parameter" not in proc.stderr, proc.stderr
        return proc.stderr

    here = cpu_share(1).cpus
    said = [line for line in stderr().splitlines() if "sized for this machine's CPUs" in line]
    line = (f"bench memory: sized for this machine's CPUs ({here}: {max(1, here // 2)} per rank of 2); for another "
            "machine pass --cpus-per-rank (its CPUs / --ranks).")
    assert said == [line], said
    assert "sized for this machine" not in stderr("--cpus-per-rank", "4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only skip reasons")
def test_rows_that_cannot_run_on_cpu_say_why():
    assert "CUDA" in skip_reason(RowSpec("cudnn.benchmark", benchmark=True))
    assert "bf16" in skip_reason(RowSpec("16-mixed", precision="16-mixed"))
    assert "GPU" in skip_reason(RowSpec("dp", strategy="dp"))
    assert skip_reason(RowSpec("baseline")) is None
    assert skip_reason(RowSpec("bf16-mixed", precision="bf16-mixed")) is None
    names = [r.name for r in row_specs(False)]
    assert names[0] == "baseline" and names[1].startswith("plain-pytorch")


# ------------------------------------------------------------------------------ GPU readiness

def _row(name: str, wait: float | None) -> dict:
    return {"row": name, "strategy": "single", "precision": "32-true", "benchmark": False, "status": "ok",
            "devices": 1, "seconds": 1.0, "images_s": 100.0, "speedup": 1.0, "data_wait_frac": wait}


def test_train_table_flags_input_bound_rows():
    from bench.train.report import to_markdown
    from bench.train.rows import INPUT_BOUND_FRAC

    rows = [_row("baseline", 0.05), _row("16-mixed", INPUT_BOUND_FRAC), _row("compile", 0.29), _row("bf16", None)]
    settings = {"arch": "resnet50", "width": 32, "image_size": 96, "batch_size": 256, "epochs": 3,
                "num_workers": 16, "root": "/data"}
    md = to_markdown({"rows": rows, "overhead": None, "settings": settings})
    lines = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "30% input-bound" in lines["16-mixed"]
    assert "input-bound" not in lines["baseline"] and "input-bound" not in lines["compile"]
    assert "**Input-bound** (data wait >= 30%): 16-mixed." in md


def test_train_workload_is_gpu_sized_on_cuda_and_flags_win():
    import argparse

    from bench.train.rows import apply_workload
    from datamodules.builtin.draw import CLASSES, PRESETS

    unset = dict.fromkeys(["builtin", "train_per_class", "arch", "width", "image_size", "batch_size", "num_workers"])
    args = argparse.Namespace(**unset)
    assert apply_workload(args, cuda=True) == "cuda"
    # what docs/benchmarks.md promises: ResNet-50 on the 96 px built-in set, 23 steps of 256 an epoch, and
    # every CPU this process may use decoding (at most 16)
    assert (args.arch, args.image_size, args.batch_size) == ("resnet50", 96, 256)
    assert PRESETS[args.builtin].size == 96 and len(CLASSES) * args.train_per_class // args.batch_size == 23
    assert args.num_workers == min(16, len(os.sched_getaffinity(0)))
    args = argparse.Namespace(**unset)
    assert apply_workload(args, cuda=False) == "cpu"
    assert (args.arch, args.image_size) == ("conv11", 32)  # on a CPU, the 11-conv net at 32 px
    flags = {"builtin": "tiny", "train_per_class": 5, "arch": "vgg11", "width": 8, "image_size": 48,
             "batch_size": 64, "num_workers": 3}
    for cuda in (True, False):  # every flag given is kept as given
        args = argparse.Namespace(**flags)
        apply_workload(args, cuda=cuda)
        assert vars(args) == flags


@needs_dali
def test_dali_loader_built_before_the_clock_and_not_rebuilt_with_max_batches(tmp_path, photo_data):
    from bench.loaders.backends import FACTORIES
    from bench.loaders.prepared import Settings
    from bench.loaders.timing import prepare, time_epoch

    s = Settings(root=photo_data, work=tmp_path, batch_size=4, num_workers=1, image_size=32, max_batches=2)
    p = FACTORIES["dali-cpu"](s)
    loader = p.datamodule.train_dataloader()
    assert len(loader) == 2  # an epoch of exactly --max-batches batches
    prepare(loader)
    assert loader._it is not None  # built (threads started) before any epoch is timed
    for _ in range(3):
        images, _, _ = time_epoch(p.datamodule, loader, torch.device("cpu"), s.max_batches, "dali")
        assert images == 8
    assert loader.rebuilds == 0


# ------------------------------------------------------------------------------ bench nodes (no namespaces needed)

def _nodes_result(none_step: float, psgd_step: float, local_step: float = 2.0) -> dict:
    from bench.nodes.steps import Row

    rows = []
    for hook, step, sent in (("no compression", none_step, 94.0), ("PowerSGD rank 2", psgd_step, 0.9)):
        r = Row("200mbit", hook, step_s=step, images_s=256 / step, sent_mb_per_step=sent, vs_none=step / none_step,
                comm_share=1 - local_step / step)
        rows.append(r.__dict__)
    local = Row("none", "no all-reduce", step_s=local_step, images_s=128.0).__dict__
    return {"rows": rows, "local": local, "settings": {"rates": ["200mbit"], "hooks": ["no compression",
            "PowerSGD rank 2"], "arch": "resnet50", "image_size": 32, "batch_size": 256, "precision": "32-true",
            "steps": 10, "warmup": 3, "data_dir": "data/builtin/small"}}


def test_nodes_verdict_names_the_bound_and_what_powersgd_does():
    from bench.nodes.report import chart, to_markdown, verdicts

    assert verdicts(_nodes_result(6.0, 2.4)) == [
        ("200mbit: bandwidth-bound: all-reduce is 67% of the step; PowerSGD rank 2 cuts the step by 60% "
         "(6.00 s -> 2.40 s)")]
    assert verdicts(_nodes_result(2.5, 2.6)) == [
        ("200mbit: compute-bound: all-reduce is 20% of the step; PowerSGD rank 2 makes the step 4% slower "
        "(2.50 s -> 2.60 s)")]
    md = to_markdown(_nodes_result(6.0, 2.4))
    assert "| 200mbit | PowerSGD rank 2 | 2.40 | 0.40x | 107 | 17% | 0.9 |" in md
    assert chart(_nodes_result(6.0, 2.4))["series"] == {"link 200mbit": [6.0, 2.4]}


def test_nodes_hooks_and_step_marks_are_read_as_written():
    from bench.nodes.steps import parse_hooks, read_marks

    assert [h.label for h in parse_hooks("none,fp16,powersgd:4")] == ["no compression", "fp16 compression",
                                                                        "PowerSGD rank 4"]
    for bad in ("int8", "powersgd", "fp16:2"):
        with pytest.raises(ValueError, match="--hooks"):
            parse_hooks(bad)
    # (seconds, tx bytes, rx bytes): the start, then the end of each step; the first 2 steps are warm-up
    marks = [[0.0, 0, 0], [5.0, 100e6, 0], [7.0, 200e6, 0], [9.5, 300e6, 0], [12.5, 500e6, 0]]
    times, sent = read_marks(marks, warmup=2)
    assert times == [2.5, 3.0] and sent == pytest.approx(150.0)


def test_nodes_accuracy_result_is_shown_by_the_same_entry_points():
    from bench.nodes import chart, to_markdown

    settings = {"hooks": ["no compression", "PowerSGD rank 2"], "seeds": [1, 2], "rate": "unshaped", "epochs": 15,
                "config": "configs/ddp_amp.yaml", "data_dir": "data/builtin/small", "batch_size": None}
    best = {("no compression", 1): 0.50, ("no compression", 2): 0.52, ("PowerSGD rank 2", 1): 0.45,
            ("PowerSGD rank 2", 2): 0.47}
    runs = [{"hook": h, "seed": s, "seconds": 10.0, "exit": [0, 0], "best_acc1": acc, "final_acc1": acc}
            for (h, s), acc in best.items()]
    result = {"kind": "nodes-accuracy", "runs": runs, "settings": settings}
    assert "| PowerSGD rank 2 | 0.4500 (0.4500) | 0.4700 (0.4700) | 0.4600 | -5.0 | 10 |" in to_markdown(result)
    assert chart(result)["series"] == {"seed 1": [0.50, 0.45], "seed 2": [0.52, 0.47]}


def test_help_explains_every_column_of_the_nodes_table(capsys):
    from bench.nodes.report import to_markdown

    assert _unexplained(to_markdown(_nodes_result(6.0, 2.4)), _help("nodes", capsys)) == []


@pytest.mark.slow
@pytest.mark.skipif(netlink.unavailable() is not None, reason=f"netsim: {netlink.unavailable()}")
def test_nodes_accuracy_says_every_few_seconds_which_run_and_step_it_is_at(tmp_path, tiny_data):
    proc = subprocess.run([sys.executable, "-m", "bench", "nodes", "--accuracy", "--hooks", "none", "--seeds", "1",
                           "--epochs", "2", "--data-dir", str(tiny_data), "--config", "configs/ddp.yaml",
                           "--batch-size", "40", "--out", str(tmp_path / "out")],
                          cwd=REPO, env={**os.environ, "FIC_PROGRESS_EVERY_S": "0.5"}, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bench nodes --accuracy: row 1/1 ")]
    assert any(re.match(r"bench nodes --accuracy: row 1/1 no compression, seed 1: epoch [12]/2, step \d+/\d+ ",
                        line) for line in lines), proc.stderr[-3000:]


def test_the_one_thread_stages_time_each_region_decoder_on_the_files_that_take_it(tmp_path):
    from PIL import Image

    from bench.loaders.ceilings import stage_times
    from datamodules.sample import region_libjpeg, region_nvimgcodec
    from tests.helpers.trees import jpeg

    rgb = Image.new("RGB", (96, 80), (30, 140, 200))
    paths = []
    for name, data in (("a.jpg", jpeg(rgb)), ("b.jpg", jpeg(rgb.convert("L"))), ("c.jpg", jpeg(rgb, progressive=True))):
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    stages = stage_times(paths, image_size=32, min_scale=0.08, repeats=1)
    names = [d.name for d in (region_libjpeg.load(), region_nvimgcodec.load()) if d is not None]
    region_stages = [k for k in stages if k.startswith("decode: region")]
    assert region_stages == [f"decode: region ({n}; 2 of the files)" for n in names]  # not the progressive one
    assert all(stages[k] > 0 for k in region_stages)
