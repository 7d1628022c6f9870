"""scripts/gpu_check.py's parts without a GPU: which parts a --parts word selects, an unknown word refused in one
paragraph before anything runs, the GPU decode's part within its 5 minutes, and a bench part stopped at its time
limit keeping the rows it saved; EMA's row judged on its host syncs."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from tests.helpers import REPO


def _check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_unknown_parts_word_stops_it_naming_the_word_and_the_parts(tmp_path):
    out = tmp_path / "out"
    refused = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out), "--parts", "decode,flagz"],
                             cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "no part is called 'flagz'" in refused.stderr and "'decode'" not in refused.stderr
    assert "decode, dp, ema, engines, flags, gpu" in refused.stderr  # the parts there are
    assert "Traceback" not in refused.stderr and not out.exists()  # nothing ran, nothing written


def test_the_decode_word_selects_the_gpu_decodes_part_within_five_minutes():
    check = _check()
    decode = check.selected({"decode"})
    assert [p.name for p in decode] == ["gpu mutants", "bench gpu engines,trace,ema,trainer"]
    assert sum(p.seconds for p in decode) <= 300
    assert decode[1].argv[-4:] == ["--synthetic", "ceiling", "--data-rows", "decode"]
    # a word of its own reruns one piece; the pieces the decode part runs are not run twice by default
    assert [p.name for p in check.selected({"trace"})] == ["bench gpu trace"]
    assert [p.name for p in check.selected({"mutants"})] == ["gpu mutants"]
    default = [p.name for p in check.selected(None)]
    assert default[:2] == [p.name for p in decode] and "bench gpu trace" not in default
    assert set(check.WORDS) == {w for p in check.PARTS for w in p.words} and all(check.selected({w})
                                                                                  for w in check.WORDS)


def test_every_bench_part_names_groups_and_flags_bench_gpu_takes():
    from bench.__main__ import build_parser
    from bench.gpu.command import GROUPS

    check = _check()
    for part in check.PARTS:
        if part.argv[:2] == ["-m", "bench"]:
            args = build_parser().parse_args(part.argv[2:])
            assert set(args.groups.split(",")) <= set(GROUPS), part


def test_a_bench_part_stopped_at_its_limit_keeps_the_rows_it_saved(tmp_path):
    check = _check()
    folder = tmp_path / "bench" / "engines-trace-ema-trainer"
    folder.mkdir(parents=True)
    row = {"group": "trace", "name": "VERDICT", "status": "ok", "figure": "the engines", "verdict": "..."}
    (folder / "gpu-check.gpu.partial.json").write_text(json.dumps({"checks": [row], "partial": True}))
    assert check.bench_rows(folder) == [row]
    assert [c["name"] for c in check.bench_checks(tmp_path)] == ["VERDICT"]
    final = {**row, "figure": "allocations"}
    (folder / "gpu-check.gpu.json").write_text(json.dumps({"checks": [final]}))  # the finished run's, when there
    assert check.bench_rows(folder) == [final]
    assert check.bench_rows(tmp_path / "bench" / "none") is None


def test_emas_row_fails_when_the_callback_adds_a_host_sync():
    from bench.gpu.ema import judge

    assert judge(0.0, 0.0) == ("ok", "EMA adds no host sync")
    assert judge(1 / 30, 1 / 30)[0] == "ok"  # the step's own sync, in both
    assert judge(0.0, 2.0) == ("FAIL", "EMA adds 2 host syncs a step")
    assert judge(1 / 30, 2 / 30)[0] == "FAIL"  # one sync in the 30 steps of the window is one too many
