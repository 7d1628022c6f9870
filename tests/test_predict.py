"""predict --data.predict_dir: every image under a folder, predictions.csv, class names from the checkpoint."""
from __future__ import annotations

import csv
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from datamodules.predict import PredictDataset
from lightning_app.callbacks.predictions import PredictionsCSV, columns
from lightning_app.cli import ClassifierCLI
from tests.helpers.cli import quick_args, run_main, train_checkpoint
from tests.helpers.gloo import gloo_group
from tests.helpers.optional import needs_gpus
from tests.helpers.processes import finish_all, free_port, in_processes, start_nodes

JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 64 + b"\xff\xd9"


def test_dataset_walks_recursively_and_lists_bad_files(tiny_data, tmp_path):
    root = tmp_path / "in"
    (root / "a" / "deeper").mkdir(parents=True)
    shutil.copy(tiny_data / "val" / "star" / "00000.jpg", root / "top.jpg")
    shutil.copy(tiny_data / "val" / "ring" / "00001.jpg", root / "a" / "deeper" / "x.JPG")
    (root / "a" / "empty.jpg").write_bytes(b"")
    (root / "a" / "text.jpg").write_text("not an image")
    (root / "cut.jpg").write_bytes((tiny_data / "val" / "star" / "00002.jpg").read_bytes()[:300])
    (root / "notes.txt").write_text("skip me")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.jpg").write_bytes(b"x")
    with pytest.warns(UserWarning, match=r"skipping 3 bad file\(s\).*a/empty\.jpg \(empty file"):
        ds = PredictDataset(root, image_size=32, crop_ratio=1.0)
    assert ds.paths == ["a/deeper/x.JPG", "top.jpg"]
    assert sorted(p for p, _ in ds.bad_files) == ["a/empty.jpg", "a/text.jpg", "cut.jpg"]
    image, index = ds[1]
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32) and index == 1


@pytest.mark.parametrize("workers", [0, "auto"])
def test_predict_only_datamodule_reads_no_training_tree(tiny_data, tmp_path, workers):
    from datamodules import ImageFolderDataModule

    dm = ImageFolderDataModule(data_dir=None, predict_dir=str(tiny_data / "val"), batch_size=16, num_workers=workers,
                               image_size=32, val_crop_ratio=1.0)
    assert dm.classes == [] and not hasattr(dm, "root")  # nothing discovered, nothing generated
    dm.setup("predict")
    images, indices = next(iter(dm.predict_dataloader()))
    assert images.dtype == torch.uint8 and indices.tolist() == list(range(16))


def test_merge_keeps_one_row_per_index(tmp_path):
    writer = PredictionsCSV()
    writer.out_dir = str(tmp_path)
    writer._dataset = list(range(5))
    k = 2

    def row(i: int) -> list:
        return [i, f"img{i}.jpg", "b", "0.9", "b", "0.9", "a", "0.1"]

    parts = {0: [row(0), row(2), row(4)], 1: [row(1), row(3), row(0)]}  # rank 1 padded with index 0 again
    for rank, rows in parts.items():
        with open(writer._part(rank, done=True), "w", newline="") as f:
            csv.writer(f).writerows(rows)
    out = writer.merge(world_size=2, expected=5)
    with open(out, newline="") as f:
        got = list(csv.reader(f))
    assert got[0] == columns(k) and [r[0] for r in got[1:]] == [f"img{i}.jpg" for i in range(5)]
    assert not list(tmp_path.glob(".predictions*"))


def _gather_rows(rank: int, store: str, batches: list[int]) -> list:
    """One of two gloo processes: `batches[rank]` batches of two rows each through a RowGather of every 2 batches;
    on rank 0, what its sink took, call by call."""
    from lightning_app.callbacks.prediction_rows import RowGather

    with gloo_group(store, rank, 2):
        taken = []
        gather = RowGather(2, lambda source, rows: taken.append((source, [r[0] for r in rows])))
        for b in range(batches[rank]):
            gather.add([[100 * rank + 2 * b, "x"], [100 * rank + 2 * b + 1, "x"]])
        gather.finish()
        return taken


def test_rows_reach_rank_0_every_few_batches_when_ranks_predict_unequal_shares(tmp_path):
    """Rank 1 predicts two batches fewer (one more than Lightning's unpadded sampler gives, to go one round
    further): its end rounds meet rank 0's last in-loop rounds, and every row arrives once, in order."""
    taken, nothing = in_processes(_gather_rows, 2, str(tmp_path / "store"), [5, 3], timeout=120)
    assert nothing == []
    assert taken == [(0, [0, 1, 2, 3]), (1, [100, 101, 102, 103]),  # the round at each one's 2nd batch
                     (0, [4, 5, 6, 7]),  # at rank 0's 4th: rank 1 has ended, its last batch comes in its end round
                     (1, [104, 105]),
                     (0, [8, 9])]  # rank 0's end round; rank 1 sends nothing in it


# -- the user's path: train, then predict on a flat folder, compare with validate ------------------

@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """(checkpoint, validate's val/acc1, flat folder) for conv11 trained 3 epochs on the tiny built-in data."""
    root = tmp_path_factory.mktemp("predict_run")
    trainer, model, dm, ckpt = train_checkpoint(tiny_data, root, epochs=3, batch=32)
    acc = trainer.validate(model, dm, verbose=False)[0]["val/acc1"]
    flat = root / "flat"
    flat.mkdir()
    for f in sorted((tiny_data / "val").rglob("*.jpg")):
        shutil.copy(f, flat / f"{f.parent.name}__{f.name}")
    (flat / "broken.jpg").write_text("not an image")
    return ckpt, float(acc), flat


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def predict_args(ckpt, flat, root) -> list[str]:
    return ["predict", "--ckpt_path", str(ckpt), "--data.predict_dir", str(flat), "--data.batch_size", "32",
            "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(root)]


@pytest.mark.slow
def test_predict_cli_matches_validate(trained, tmp_path):
    ckpt, val_acc, flat = trained
    proc = run_main(predict_args(ckpt, flat, tmp_path / "logs"))
    assert "broken.jpg" in proc.stderr + proc.stdout  # listed by name, and the run went on
    (out,) = (tmp_path / "logs").rglob("predictions.csv")
    rows = read_csv(out)
    assert list(rows[0]) == columns(5)
    assert len(rows) == 80 and len({r["path"] for r in rows}) == 80
    correct = sum(r["class"] == r["path"].rsplit("/", 1)[1].split("__")[0] for r in rows)
    assert abs(100 * correct / len(rows) - 100 * val_acc) <= 0.5, (correct, val_acc)
    first = rows[0]
    probs = [float(first[f"top{j}_prob"]) for j in range(1, 6)]
    assert probs == sorted(probs, reverse=True) and first["class"] == first["top1_class"]


@pytest.mark.slow
def test_predict_ddp_two_processes_every_row_once(trained, tmp_path):
    ckpt, _, flat = trained
    run_main(predict_args(ckpt, flat, tmp_path / "one"))
    two_ranks = run_main(predict_args(ckpt, flat, tmp_path / "two") + ["--trainer.devices", "2", "--trainer.strategy",
                                                                        "ddp"],
                         env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    (one,) = (tmp_path / "one").rglob("predictions.csv")
    (two,) = (tmp_path / "two").rglob("predictions.csv")
    single, ddp = read_csv(one), read_csv(two)
    assert [r["path"] for r in ddp] == [r["path"] for r in single] and len(ddp) == 80
    for a, b in zip(single, ddp, strict=False):
        assert a["class"] == b["class"] and abs(float(a["prob"]) - float(b["prob"])) < 1e-4
    assert not list((tmp_path / "two").rglob(".predictions.csv.rank*"))
    # one folder for both ranks: each writes its own part file, as before
    assert "is not shared by every rank" not in two_ranks.stdout + two_ranks.stderr


@pytest.mark.slow
def test_predict_on_two_nodes_with_node_local_run_folders_keeps_every_row(trained, tmp_path):
    """Two nodes (NODE_RANK 0 and 1, gloo), each in a working directory of its own, given the same relative
    --trainer.default_root_dir: the same folder name is a different folder on each node, as a node-local disk
    mounted at the same place on every node is. Rank 1's rows reach rank 0's file all the same."""
    ckpt, _, flat = trained
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    args = [*predict_args(ckpt, flat, "runs"), "--trainer.strategy", "ddp", "--trainer.devices", "1",
            "--trainer.num_nodes", "2"]
    codes, outs = finish_all(start_nodes(args, cwds=nodes), timeout=240)
    assert codes == [0, 0], "\n\n".join(out[-3000:] for out in outs)
    (out,) = (nodes[0] / "runs").rglob("predictions.csv")
    rows = read_csv(out)
    assert sorted(r["path"] for r in rows) == sorted(str(p) for p in flat.iterdir() if p.name != "broken.jpg")
    assert f"predict: {Path('runs') / out.parent.name} is not shared by every rank" in outs[0], outs[0][-3000:]
    assert not [p for node in nodes for p in node.rglob(".predictions.csv*")]  # no part file left on either node
    assert not list(nodes[1].iterdir())  # rank 1 wrote nothing on its own disk


@needs_gpus(1, "predict on CUDA")
def test_predict_on_a_gpu_writes_the_cpus_rows(trained, tmp_path):
    """The same checkpoint and folder on the GPU (16-mixed) and on the CPU: the same files, each with the same class
    wherever the CPU's top two are 0.05 apart or more, and probabilities within 0.02."""
    ckpt, _, flat = trained
    run_main(predict_args(ckpt, flat, tmp_path / "cpu"))
    run_main([*predict_args(ckpt, flat, tmp_path / "gpu"), "--trainer.accelerator", "gpu", "--trainer.devices", "1",
              "--trainer.precision", "16-mixed"])
    (on_cpu,) = (tmp_path / "cpu").rglob("predictions.csv")
    (on_gpu,) = (tmp_path / "gpu").rglob("predictions.csv")
    cpu_rows, gpu_rows = read_csv(on_cpu), read_csv(on_gpu)
    assert [r["path"] for r in gpu_rows] == [r["path"] for r in cpu_rows] and len(gpu_rows) == 80
    for a, b in zip(cpu_rows, gpu_rows, strict=True):
        assert abs(float(a["prob"]) - float(b["prob"])) < 0.02, (a, b)
        if float(a["top1_prob"]) - float(a["top2_prob"]) >= 0.05:
            assert a["class"] == b["class"], (a, b)


@pytest.mark.slow
def test_predict_names_a_bad_image_once(tiny_data, tmp_path):
    _, _, _, ckpt = train_checkpoint(tiny_data, tmp_path / "run", epochs=1, batch=40)
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "good.jpg").write_bytes((tiny_data / "val" / "star" / "00000.jpg").read_bytes())
    (photos / "broken.jpg").write_text("not an image")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ClassifierCLI(args=["predict", "--ckpt_path", str(ckpt), "--data.predict_dir", str(photos),
                            "--data.num_workers", "0", "--trainer.default_root_dir", str(tmp_path / "logs"),
                            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"])
    assert sum("broken.jpg" in str(w.message) for w in seen) == 1, [str(w.message) for w in seen]


@pytest.mark.slow
def test_failed_predict_leaves_no_folder_and_keeps_earlier_results(tiny_data, tmp_path):
    _, _, _, ckpt = train_checkpoint(tiny_data, tmp_path / "run", epochs=1, batch=40)
    logs = tmp_path / "logs"
    failed = run_main(predict_args(ckpt, tmp_path / "nowhere", logs), check=False)
    assert failed.returncode == 2 and "predict_dir" in failed.stderr and "Traceback" not in failed.stderr
    assert not list(logs.glob("predict_*"))
    run_main(predict_args(ckpt, tiny_data / "val" / "star", logs))
    assert (logs / "predict_0" / "predictions.csv").is_file()  # the name docs/after-training.md shows
    assert run_main(predict_args(ckpt, tmp_path / "nowhere", logs), check=False).returncode == 2
    assert sorted(p.name for p in logs.glob("predict_*")) == ["predict_0"]
    assert (logs / "predict_0" / "predictions.csv").is_file()


# -- predict without --data.predict_dir: the val split, only of the data the checkpoint trained on (issue 42) ------

@pytest.fixture(scope="module")
def cli_run(tiny_data, tmp_path_factory):
    """(runs root, checkpoint) of a 1-epoch CLI fit on the tiny data: its run.json names the data."""
    from lightning_app.cli import main

    root = tmp_path_factory.mktemp("predict_cli_run")
    main(["fit", *quick_args(tiny_data, root, epochs=1, batch=40), "--data.image_size", "16",
          "--trainer.num_sanity_val_steps", "0", "--model.pictures", "[]"])
    (ckpt,) = (root / "version_0" / "checkpoints").glob("last*.ckpt")
    return root, ckpt


def _predict(ckpt, root, data: list[str]) -> list[str]:
    return ["predict", "--ckpt_path", str(ckpt), "--data.num_workers", "0", "--data.image_size", "16",
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(root), "--model.arch_kwargs", "{width: 8}", *data]


@pytest.mark.parametrize("given", ["nothing", "other"])
def test_predict_of_other_data_than_the_checkpoints_is_one_paragraph(cli_run, tiny_data, tmp_path, capsys, given):
    """Checked before any data is read or generated (`--ckpt_path last` finds only a run trained on these data
    settings). No --data.data_dir means the built-in data."""
    from lightning_app.cli import main

    root, ckpt = cli_run
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)  # the same images elsewhere: another dataset as far as the run can tell
    with pytest.raises(SystemExit) as stopped:
        main(_predict(ckpt, root, ["--data.data_dir", str(other)] if given == "other" else []))
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "\n" not in err and "Traceback" not in err, err
    assert "--data.predict_dir" in err and str(tiny_data.resolve()) in err, err
    assert (str(other) if given == "other" else "the built-in data") in err, err
    assert not list(root.glob("version_0/predict_*"))


def test_predict_of_the_val_split_it_trained_on_writes_its_rows(cli_run, tiny_data):
    from lightning_app.cli import main

    root, ckpt = cli_run
    main(_predict(ckpt, root, ["--data.data_dir", str(tiny_data)]))
    (out,) = root.glob("version_0/predict_*/predictions.csv")
    rows = read_csv(out)
    assert len(rows) == sum(1 for _ in (tiny_data / "val").rglob("*.jpg"))


@pytest.mark.parametrize("subcommand", ["validate", "predict"])
def test_scoring_a_checkpoint_on_data_of_other_classes_is_one_paragraph(cli_run, tiny_data, tmp_path, capsys,
                                                                       subcommand):
    """A checkpoint without a run.json to compare: the class names inside it against the data's."""
    from lightning_app.cli import main

    _, ckpt = cli_run
    alone = tmp_path / "alone.ckpt"
    shutil.copy(ckpt, alone)  # outside its run: no run.json beside it
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    for split in ("train", "val"):
        first = min((other / split).iterdir())
        first.rename(first.with_name("zz_" + first.name))  # one class renamed: same count, other names
    args = [subcommand, "--ckpt_path", str(alone), *_predict(alone, tmp_path / "logs", [])[3:],
            "--data.data_dir", str(other)]
    with pytest.raises(SystemExit) as stopped:
        main(args)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "\n" not in err and "Traceback" not in err, err
    assert f"{subcommand}: the data's" in err and "--data.predict_dir" in err, err
    assert not list((tmp_path / "logs").rglob("predictions.csv"))


@pytest.mark.parametrize("fn, attached", [("fit", False), ("validate", False), ("predict", True)])
def test_predictions_csv_is_attached_to_predict_only(fn, attached):
    import pytorch_lightning as pl
    from pytorch_lightning.trainer.states import TrainerFn

    from lightning_app.module import ImageClassifier

    model = ImageClassifier(arch="conv11", num_classes=2, image_size=32, global_batch_size=4, arch_kwargs={"width": 4})
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    model.trainer = trainer
    trainer.state.fn = TrainerFn(fn)
    assert any(isinstance(c, PredictionsCSV) for c in model.configure_callbacks()) == attached
