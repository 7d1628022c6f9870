"""The training core's rooms (lightning_app/callbacks, strategies, runs): what moved still resolves, what a config
names is checked by the class it resolves to, not by the string that names it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_app.cli import ClassifierCLI, main
from lightning_app.strategies import ClusterDDPStrategy
from tests.helpers.imports import circles, import_graph

RESIZING_NOW = "lightning_app.callbacks.progressive_resizing.ProgressiveResizing"
RESIZING_BEFORE = "lightning_app.schedules.ProgressiveResizing"


class CheckedDDP(ClusterDDPStrategy):
    """A user's own subclass: its class path names neither our module nor our class."""


def _args(data: Path, root: Path, epochs: int) -> list[str]:
    return ["--data.data_dir", str(data), "--data.batch_size", "40", "--data.num_workers", "0",
            "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(root),
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--model.arch_kwargs", "{width: 8}", "--model.pictures", "[]"]


def test_a_run_json_naming_a_moved_callback_is_resumed_by_last(tiny_data, tmp_path):
    resizing = ["--trainer.callbacks+=" + RESIZING_NOW, "--trainer.callbacks.start_size=24",
                "--trainer.callbacks.end_size=32", "--trainer.callbacks.end_epoch=2"]
    first = ClassifierCLI(args=["fit", *_args(tiny_data, tmp_path, 1), *resizing])
    assert first.trainer.current_epoch == 1
    run_json = tmp_path / "version_0" / "run.json"
    record = json.loads(run_json.read_text())
    assert [c["class_path"] for c in record["training"]["trainer"]["callbacks"]] == [RESIZING_NOW]
    # a run made before the move names the callback by its old module
    run_json.write_text(run_json.read_text().replace(RESIZING_NOW, RESIZING_BEFORE))

    again = ClassifierCLI(args=["fit", *_args(tiny_data, tmp_path, 1), *resizing, "--ckpt_path", "last"])
    assert Path(again.trainer.log_dir) == tmp_path / "version_0"  # resumed that run: no setting changed
    assert not (tmp_path / "version_1").exists()
    assert again.trainer.ckpt_path == str((tmp_path / "version_0" / "checkpoints" / "last.ckpt").resolve())


@pytest.mark.parametrize("class_path", ["lightning_app.strategies.ClusterDDPStrategy",  # the package's re-export
                                        "tests.test_training_core.CheckedDDP"])           # a subclass
def test_the_strategy_check_runs_on_the_resolved_class(class_path, tiny_data, tmp_path, capsys):
    config = tmp_path / "ddp.yaml"
    config.write_text(f"trainer:\n  strategy:\n    class_path: {class_path}\n    init_args:\n      timeout_s: -5\n")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(config), *_args(tiny_data, tmp_path, 1)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    # our paragraph, not jsonargparse's "Does not validate against any of the Union subtypes"
    assert "timeout_s must be > 0 seconds, got -5" in err
    assert "Union" not in err


def test_help_says_whose_ddp_the_name_means(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--help"])
    assert stopped.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "`ddp` is lightning_app.strategies.ddp.ClusterDDPStrategy" in text
    assert "Lightning's plain DDP: class_path pytorch_lightning.strategies.DDPStrategy" in text


REPO = Path(__file__).resolve().parents[1]
OURS = ("models", "datamodules", "lightning_app", "netsim", "bench", "tests")
# docs/design.md, "The folders and what each may import"
NEVER = {"models": {"datamodules", "lightning_app", "netsim", "bench", "tests"},
         "datamodules": {"models", "lightning_app", "netsim", "bench", "tests"},
         "lightning_app": {"netsim", "bench", "tests"},
         "netsim": {"models", "datamodules", "lightning_app", "bench", "tests", "torch"},
         "bench": {"tests"}}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in a file, at any depth."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
    return found


def test_each_folder_imports_only_what_the_design_page_allows():
    broken = []
    for folder, never in NEVER.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            for module, _ in _imports(path):
                if module.split(".")[0] in never:
                    broken.append(f"{path.relative_to(REPO)} imports {module}")
    assert not broken, "\n".join(broken)


def test_no_package_of_ours_imports_in_a_circle():
    """A deferred import counts too: it hides a circle, it does not break it (datamodules.index -> packing -> tool
    -> index was one, until DataError and file_lock moved to leaf modules)."""
    assert circles(import_graph(("datamodules", "lightning_app", "models", "bench", "netsim"))) == []


def test_no_private_name_crosses_a_file_of_ours():
    crossing = []
    for folder in ("lightning_app", "datamodules", "models", "bench", "netsim"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for module, names in _imports(path):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if module.split(".")[0] in OURS and private:
                    crossing.append(f"{path.relative_to(REPO)}: from {module} import {', '.join(private)}")
    assert not crossing, "\n".join(crossing)


@pytest.mark.slow  # real training: 45 steps, minutes on a loaded 2-core VM
def test_the_plain_loop_twin_of_a_step_still_trains(tiny_data):
    """bench/train/plain_loop.py is a fit's step in one file (docs/design.md, "One step in one page"): the template's
    Index, dataset and worker-built batches, then a plain loop. Its mean loss falls over a tiny run."""
    from bench.train.plain_loop import plain_loop

    spec = {"seed": 0, "root": str(tiny_data), "batch_size": 16, "num_workers": 0, "image_size": 32,
            "min_scale": 0.35, "val_crop_ratio": 1.0, "arch": "conv11", "width": 8, "lr": 1.6, "weight_decay": 5e-4,
            "momentum": 0.9, "nesterov": True, "epochs": 3, "warmup_epochs": 0.0, "precision": "32-true",
            "benchmark": False, "label_smoothing": 0.1}
    epochs = plain_loop(spec)["epochs"]
    losses = [epoch["loss"] for epoch in epochs]
    assert [epoch["images"] for epoch in epochs] == [240] * 3  # 10 classes x 24 train images, whole batches of 16
    assert losses[-1] < losses[0] - 0.05, losses  # 2.41 -> 2.29 (seed 0); without the optimizer step it stays
