"""ImageClassifier: the one LightningModule. A backbone from `models`, SGD, warm-up + cosine."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torchmetrics.classification import MulticlassAccuracy
from torchvision.transforms import v2

from datamodules.sample.transforms import IMAGENET_MEAN, IMAGENET_STD
from lightning_app import timm_weights
from lightning_app import weights as weights_lib
from lightning_app.callbacks.freeze import FreezeBackboneEpochs
from lightning_app.callbacks.hparams import HparamsWithMetric
from lightning_app.callbacks.norm_window import NormStatisticsPerEpoch
from lightning_app.callbacks.pictures import picture_callbacks
from lightning_app.callbacks.predictions import PredictionsCSV
from lightning_app.errors import UserError
from lightning_app.log_steps import logs_this_step
from lightning_app.lr_schedule import total_steps, warmup_cosine
from lightning_app.settings import arch_problems
from models import create_model, own_kwargs
from models.recipes import Recipe, batch_scale, recipe

MIN_PATCH_GRID = 4  # patches a side below which a ViT is said to see too few tokens (a 224-px ViT sees 14x14)
OPTIMIZER_NAMES = {"sgd": "SGD", "adamw": "AdamW"}  # as their papers and torch.optim spell them


class ImageClassifier(pl.LightningModule):
    """Image classification with any registered backbone.

    Args:
        arch: backbone name in the `models` registry: ours (conv11, resnet50, vgg11, vgg16, with small-image stems)
            or any torchvision classification builder by its name (models/torchvision_zoo.py): resnet18/34/101/152,
            resnext, wide_resnet, regnet, efficientnet(_v2), mobilenet_v2/v3, mnasnet, shufflenet_v2, convnext,
            densenet, squeezenet, alexnet, googlenet, inception_v3, vgg*_bn, swin(_v2), vit (224 px only), maxvit_t
            (224, 448... px); or any timm model as timm/NAME (models/timm_zoo.py; `pip install timm`; names from
            timm.list_models(), e.g. timm/resnet10t, timm/mobilenetv3_small_050, timm/convnext_atto,
            timm/vit_tiny_patch16_224: ViTs, Swin and other fixed-size models are built for the train size).
            Its last layer is built for num_classes; an unknown name gets the closest ones.
        num_classes: linked from the data; never set by hand.
        image_size: linked from the data (small inputs change ResNet's stem).
        global_batch_size: linked from data.batch_size (the global batch).
        arch_kwargs: extra backbone arguments, e.g. {width: 64} for conv11.
        lr: learning rate per 256 images; the optimiser uses lr * global batch / 256.
        momentum, nesterov: SGD's. weight_decay: either optimiser's (none on norms and biases).
        optimizer: sgd or adamw. lr, weight_decay and optimizer left null take the arch family's recipe
            (models/recipes.py: SGD 0.1 for CNNs, AdamW 2.5e-4 for transformers and ConvNeXt, ...), said at the
            start of a fit; configs/default.yaml leaves them null.
        warmup_epochs: linear warm-up from ~0 to the scaled rate, then cosine decay to 0.
        label_smoothing: cross-entropy label smoothing.
        channels_last: NHWC memory format for the model and inputs (faster convs with AMP on tensor cores).
        compile: torch.compile the backbone (state-dict keys stay the same).
        matmul_precision: float32 matmul precision, "highest" (true fp32), "high" (TF32 on Ampere+)
            or "medium" (bf16); null leaves torch's setting alone. Applied in every process.
        weights: start training from these weights: a checkpoint of ours, a state_dict file or a
            torchvision weights name (ResNet50_Weights.IMAGENET1K_V2) in torch.hub's cache; for a timm arch,
            `timm` (its default pretrained weights), `timm/NAME.TAG` or a .safetensors/.pth file, loaded by timm
            from the Hugging Face cache (lightning_app/timm_weights.py). The head is
            replaced when the class count differs. Loaded when fit, validate, test or predict starts, unless
            --ckpt_path is given; validate, test and predict need weights for every layer, the head included.
        freeze_backbone_epochs: train only the head for this many epochs first (BatchNorm statistics frozen too).
        backbone_lr_scale: the backbone's learning rate as a fraction of the head's (e.g. 0.1 when fine-tuning).
        pictures: TensorBoard images (lightning_app.callbacks.pictures): confusion_matrix, mistakes, train_batch;
            [] for none.
        mixup_alpha, cutmix_alpha: Beta(alpha, alpha) of MixUp / CutMix on the device batch
            (torchvision v2.MixUp / v2.CutMix; 0 = off). Soft targets go to the loss; train/acc1
            is measured against each mixed sample's dominant label.
        mix_switch_prob: when both are on, the probability that a batch gets CutMix rather than MixUp.
        test_time_flip: validate, test and predict on the average of the logits of each image
            and its horizontal mirror (FFCV's test-time augmentation).
    """

    # What trainer.callback_metrics holds at the end of every validation epoch of a fit: the metrics a sweep may
    # take as its objective (lightning_app/sweep/space.py, check_objective). train/acc1 and train/lr are logged on
    # the logging steps only.
    EPOCH_METRICS = ("val/acc1", "val/acc5", "val/loss", "train/loss")

    def __init__(
        self,
        arch: str = "conv11",
        num_classes: int = 10,
        image_size: int = 224,
        global_batch_size: int = 256,
        arch_kwargs: dict | None = None,
        lr: float | None = 0.1,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float | None = 5e-5,
        optimizer: str | None = "sgd",
        warmup_epochs: float = 1.0,
        label_smoothing: float = 0.1,
        channels_last: bool = False,
        compile: bool = False,
        matmul_precision: str | None = None,
        weights: str | None = None,
        freeze_backbone_epochs: int = 0,
        backbone_lr_scale: float = 1.0,
        pictures: list[str] = ["confusion_matrix", "mistakes", "train_batch"],  # noqa: B006 (jsonargparse default)
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mix_switch_prob: float = 0.5,
        test_time_flip: bool = False,
    ) -> None:
        super().__init__()
        if matmul_precision not in (None, "highest", "high", "medium"):
            raise UserError(f"model.matmul_precision must be highest, high, medium or null, got {matmul_precision!r}.")
        if freeze_backbone_epochs < 0 or not 0 < backbone_lr_scale:
            raise UserError("model.freeze_backbone_epochs must be >= 0 and model.backbone_lr_scale > 0.")
        self.save_hyperparameters()
        self.class_names: list[str] = []  # set from the data (fit) or the checkpoint (predict)
        # where optimizer, lr and weight_decay came from when set ('the command line', a config file): the CLI's
        self.setting_sources: dict[str, str] = {}
        self.inference_settings: dict = {}  # val size and normalisation: for export, kept in checkpoints
        # num_classes 0: predicting from a folder without the training tree; the checkpoint's count wins.
        self._build_backbone(num_classes if num_classes > 1 else 2)  # placeholder until the checkpoint loads

    def _build_backbone(self, num_classes: int) -> None:
        h = self.hparams
        self.backbone = create_model(h.arch, num_classes=num_classes, image_size=h.image_size,
                                     **own_kwargs(h.arch, h.arch_kwargs))
        grid = getattr(getattr(self.backbone, "patch_embed", None), "grid_size", None)  # timm's ViTs and kin
        if grid and min(grid) < MIN_PATCH_GRID:
            patch = h.image_size // grid[0]
            rank_zero_warn(f"--model.arch {h.arch} at --data.image_size {h.image_size} cuts each image into "
                           f"{grid[0]}x{grid[1]} patches of {patch} px: {grid[0] * grid[1]} tokens, too few for its "
                           "attention to learn from. Pass --model.arch_kwargs '{patch_size: 4}' (for this arch: "
                           f"{{{h.arch}: {{patch_size: 4}}}}) or a larger --data.image_size.")
        if h.channels_last:
            self.backbone = self.backbone.to(memory_format=torch.channels_last)
        top5 = min(5, num_classes)
        # validate_args=False: the check may count distinct values with torch.unique, a host sync per update
        # (torchmetrics/functional/classification/stat_scores.py, _multiclass_stat_scores_tensor_validation; in
        # the installed version only for integer predictions, not for our logits). The labels are ours.
        self.train_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro", validate_args=False)
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro", validate_args=False)
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro", validate_args=False)
        self.batch_mix = batch_mix(num_classes, h.mixup_alpha, h.cutmix_alpha, h.mix_switch_prob)

    def configure_model(self) -> None:
        if self.hparams.get("matmul_precision"):
            torch.set_float32_matmul_precision(self.hparams.matmul_precision)
        if self.hparams.compile and not getattr(self, "_compiled", False):
            if self._trainer is not None:
                from lightning_app.strategies import check_compile

                check_compile(self._trainer.strategy)  # dp: refused; ddp: warned (why: lightning_app/strategies/ddp.py)
            compile_static(self.backbone, self._trainer)
            self._compiled = True

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        # The dp strategy puts a DataParallel view of the backbone here (outside state_dict).
        backbone = self.__dict__.get("data_parallel_backbone") or self.backbone
        return backbone(images)

    # -- steps ----------------------------------------------------------------------------
    def eval_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Logits for validate, test and predict: with test_time_flip, averaged with the mirror image's."""
        logits = self(images)
        if self.hparams.get("test_time_flip"):
            logits = (logits + self(images.flip(-1))) / 2
        return logits

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        if self.batch_mix is not None:
            images, labels = self.batch_mix(images, labels)  # labels become soft targets (N, classes)
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        # Not prog_bar: Lightning converts every progress-bar value with .item() after every batch
        # (trainer/connectors/logger_connector/result.py, _ResultCollection.metrics), a host sync per step.
        self.log("train/loss", loss)
        if logs_this_step(self.trainer):
            # only on the steps that are logged: the accuracy and a Python float (which Lightning copies to the
            # device, LightningModule.__to_tensor: a host-device sync) cost a sync each
            self.train_acc1(logits, labels.argmax(-1) if labels.ndim == 2 else labels)
            self.log("train/acc1", self.train_acc1, on_step=True, on_epoch=False)  # tag train/acc1 (docs/design.md)
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self.eval_logits(images)
        loss = F.cross_entropy(logits, labels)
        self.val_acc1(logits, labels)
        self.val_acc5(logits, labels)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/acc1", self.val_acc1, prog_bar=True)
        self.log("val/acc5", self.val_acc5)
        return logits  # for the pictures callback (confusion matrix, mistakes); Lightning keeps no outputs

    def test_step(self, batch, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)  # returns None: no pictures from test

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        """Class probabilities (float32). A `--data.predict_dir` batch is (images, dataset indices); the
        DataModule's on_after_batch_transfer has normalised the images, as for validation."""
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.eval_logits(images).float().softmax(dim=-1)

    # -- optimisation ---------------------------------------------------------------------
    @property
    def optim(self) -> tuple[str, float, float, Recipe | None]:
        """(optimizer, lr per 256 images, weight decay, the family recipe that filled what is unset, or None)."""
        h = self.hparams
        family = recipe(h.arch)
        unset = h.get("optimizer") is None or h.lr is None or h.weight_decay is None
        return (h.get("optimizer") or family.optimizer, family.lr if h.lr is None else h.lr,
                family.weight_decay if h.weight_decay is None else h.weight_decay, family if unset else None)

    def recipe_line(self) -> str:
        """`--model.arch A: SGD, lr ... from the recipe (its source); weight decay ... from best.yaml`: each value with
        where it came from (the recipe where the config leaves it null, else `setting_sources`, which the CLI fills
        with the config file or the command line that set it)."""
        h = self.hparams
        name, lr, weight_decay, family = self.optim
        rate = family.said if h.lr is None and name == family.optimizer else f"lr {lr:g} per 256 images"
        by_source: dict[str, list[str]] = {}
        for key, words in (("optimizer", OPTIMIZER_NAMES.get(name, name)), ("lr", rate),
                           ("weight_decay", f"weight decay {weight_decay:g}")):
            where = (f"the recipe ({family.source}: models/recipes.py)" if h.get(key) is None
                     else self.setting_sources.get(key, "the config"))
            by_source.setdefault(where, []).append(words)
        said = "; ".join(f"{', '.join(words)} from {where}" for where, words in by_source.items())
        return (f"--model.arch {h.arch}: {said}. --model.optimizer, --model.lr and --model.weight_decay set "
                "what the recipe gives.")

    @property
    def scaled_lr(self) -> float:
        """lr per 256 images scaled to the global batch: linearly for SGD, by the square root for AdamW
        (models/recipes.py, batch_scale)."""
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        name, lr = self.optim[:2]
        return lr * batch_scale(name, self.hparams.global_batch_size * accumulate)

    def param_groups(self) -> list[dict]:
        """SGD groups: head first (its rate is the logged one), then the backbone at lr * backbone_lr_scale;
        no weight decay on norms and biases. Parameters frozen for the first epochs are included
        (they get no gradient, so SGD skips them) so the LR schedule covers them once trainable."""
        heads = tuple(n + "." for n in weights_lib.head_names(self.backbone))
        groups = []
        for in_head in (True, False):
            scale = 1.0 if in_head else self.hparams.get("backbone_lr_scale", 1.0)
            decay, no_decay = [], []
            for name, p in self.backbone.named_parameters():
                if name.startswith(heads) == in_head:
                    (no_decay if p.ndim <= 1 else decay).append(p)
            for params, wd in ((decay, self.optim[2]), (no_decay, 0.0)):
                if params:
                    groups.append({"params": params, "weight_decay": wd, "lr": self.scaled_lr * scale})
        others = [p for n, p in self.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
        if others:
            groups.append({"params": others, "weight_decay": 0.0, "lr": self.scaled_lr})
        return groups

    def configure_optimizers(self):
        name, _, _, family = self.optim
        if family is not None:
            rank_zero_info(self.recipe_line())
        if name == "adamw":
            optimizer = torch.optim.AdamW(self.param_groups(), lr=self.scaled_lr, fused=self.fused_step())
        else:
            optimizer = torch.optim.SGD(
                self.param_groups(),
                lr=self.scaled_lr,
                momentum=self.hparams.momentum,
                nesterov=self.hparams.nesterov,
                fused=self.fused_step(),
            )
        total = total_steps(self.trainer)  # not estimated_stepping_batches: lightning_app/lr_schedule.py says why
        epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        warmup = min(total - 1, int(self.hparams.warmup_epochs * total / epochs))
        self.warmup_steps = warmup  # PowerSGD never starts before it (ClusterDDPStrategy.powersgd_start_iter)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def fused_step(self) -> bool:
        """SGD's fused kernel on CUDA: one kernel per step, and under 16-mixed no host sync; gradient clipping
        keeps the plain kernel (docs/design.md, "No host sync per step")."""
        trainer = self._trainer
        clipping = trainer is not None and bool(trainer.gradient_clip_val)
        return self.device.type == "cuda" and not clipping

    # -- starting weights, fine-tuning, class names in the checkpoint -----------------------
    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if datamodule is not None and getattr(datamodule, "image_size", None):
            # the parse-time check again, for a model built in Python rather than by the CLI (a ViT at 32 px)
            # (callbacks' setup ran first: a ProgressiveResizing schedule's sizes are known)
            sizes = {"image_size": datamodule.image_size, "val_image_size": getattr(datamodule, "val_image_size", None),
                     "scheduled_train_sizes": list(getattr(datamodule, "scheduled_train_sizes", None) or [])}
            found = arch_problems(dict(self.hparams), sizes)
            if found:
                raise UserError("; ".join(found) + ".")
        if datamodule is not None and getattr(datamodule, "classes", None) and not self.class_names:
            self.class_names = list(datamodule.classes)
            self.inference_settings = inference_settings(datamodule)
        if self.hparams.get("weights") and self.trainer.ckpt_path is None:
            report = self.load_weights(self.hparams.weights)
            if stage != "fit" and report.untrained():
                # validate/test/predict with layers at their random init would report noise
                raise UserError(f"{stage} with --model.weights {self.hparams.weights}: {report.untrained()} of this "
                                "model would keep its random initialisation. Pass weights trained on these classes, "
                                "e.g. --ckpt_path of a fine-tuned run.")

    def load_weights(self, source: str) -> weights_lib.LoadReport:
        h = self.hparams
        if timm_weights.applies(h.arch, source):  # timm's names, timm weight files: timm's own loader
            report = timm_weights.load(self.backbone, source, h.arch, h.image_size, own_kwargs(h.arch, h.arch_kwargs))
        else:
            report = weights_lib.load_weights(self.backbone, source)
        rank_zero_info(str(report))
        return report

    def backbone_body_modules(self) -> list[torch.nn.Module]:
        """What fine-tuning freezes, for any arch: every module holding parameters (or a leaf) except the head that
        weights_lib.head_names finds (the last nn.Linear; a timm model's own classifier, two for distilled ones) and
        their children. Modules holding parameters of their own besides children count too (ViT's class_token and
        pos_embedding, swin's position-bias tables)."""
        heads = weights_lib.head_names(self.backbone)
        return [m for n, m in self.backbone.named_modules() if (m._parameters or not list(m.children()))
                and n not in heads and not n.startswith(tuple(h + "." for h in heads))]

    def configure_callbacks(self) -> list[pl.Callback]:
        """What this model's settings ask for: fine-tuning, TensorBoard pictures, predictions.csv, the HPARAMS tab, and
        BatchNorm statistics that keep up with a short epoch (callbacks/norm_window.py)."""
        callbacks: list[pl.Callback] = []
        if self.hparams.get("freeze_backbone_epochs"):
            callbacks.append(FreezeBackboneEpochs(self.hparams.freeze_backbone_epochs))
        callbacks += picture_callbacks(self.hparams)
        callbacks += [PredictionsCSV(), HparamsWithMetric(metric="val/acc1"), NormStatisticsPerEpoch()]
        return callbacks

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["class_names"] = list(self.class_names)
        checkpoint["inference"] = dict(self.inference_settings)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        names = checkpoint.get("class_names") or []
        n = int(checkpoint.get("hyper_parameters", {}).get("num_classes", 0) or len(names))
        if n and n != self.backbone_num_classes():
            # Predicting from a folder: the data knew no classes, the checkpoint does.
            self._build_backbone(n)
            self.hparams.num_classes = n
            if getattr(self, "_compiled", False):
                self._compiled = False
                self.configure_model()
        if names:
            if self.class_names and self.class_names != list(names):
                self._refuse_other_classes(list(names))
                rank_zero_warn(f"the data's classes {self.class_names[:5]}... differ from the checkpoint's "
                               f"{list(names)[:5]}...: the checkpoint's names are used.")
            self.class_names = list(names)
        self.inference_settings = dict(checkpoint.get("inference") or self.inference_settings)

    def _refuse_other_classes(self, names: list[str]) -> None:
        """validate, test and predict of a split score the checkpoint against the data's labels: with other class
        names those scores mean nothing. (A folder to predict, --data.predict_dir, has no classes of its own.)"""
        stage = getattr(getattr(self._trainer, "state", None), "fn", None)
        if stage is None or stage.value not in ("validate", "test", "predict"):
            return
        if stage.value == "predict" and getattr(getattr(self._trainer, "datamodule", None), "predict_dir", None):
            return
        theirs = set(names)
        missing = [c for c in self.class_names if c not in theirs]
        raise UserError(f"{stage.value}: the data's {len(self.class_names)} classes differ from the "
                        f"{len(names)} the checkpoint was trained on (the data's {missing[:3] or self.class_names[:3]} "
                        f"against the checkpoint's {names[:3]}...), so its scores against these labels would mean "
                        f"nothing. Give the data it was trained on (--data.data_dir), or predict a folder of images "
                        f"with --data.predict_dir, which the checkpoint's names label.")

    def backbone_num_classes(self) -> int:
        head = dict(self.backbone.named_modules())[weights_lib.head_name(self.backbone)]
        # squeezenet's head (and some of timm's) is a Conv2d; timm's NormLinear and kin have out_features too
        return head.out_features if hasattr(head, "out_features") else head.out_channels


def inference_settings(datamodule) -> dict:
    """What export needs to feed the model as validation did: input size, resize, mean/std (0..1 units)."""
    size = getattr(datamodule, "val_image_size", None)
    if not size:
        return {}
    ratio = float(getattr(datamodule, "val_crop_ratio", 1.0) or 1.0)
    return {"image_size": int(size), "resize": round(size / ratio), "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD)}
def compile_static(backbone: torch.nn.Module, trainer: pl.Trainer | None) -> None:
    """torch.compile the backbone in place (checkpoint keys do not gain "_orig_mod.") with static shapes: one graph
    per input shape (each train size, the val size and its last partial batch, in train and eval mode), the
    recompile limit raised to hold them, every recompile logged by rank 0 (docs/design.md, "compile")."""
    import torch._dynamo

    sizes = getattr(getattr(trainer, "datamodule", None), "scheduled_train_sizes", None) or [None]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * (len(sizes) + 2) + 4)
    if trainer is None or trainer.global_rank == 0:
        torch._logging.set_logs(recompiles=True)
    backbone.compile(dynamic=False)


def batch_mix(num_classes: int, mixup_alpha: float, cutmix_alpha: float,
              switch_prob: float = 0.5) -> v2.Transform | None:
    """MixUp, CutMix, or a random choice between them per batch (as torchvision's reference recipe); None when off."""
    if mixup_alpha < 0 or cutmix_alpha < 0 or not 0 <= switch_prob <= 1:
        raise UserError(f"model.mixup_alpha and model.cutmix_alpha must be >= 0 and model.mix_switch_prob in [0, 1], "
                         f"got {mixup_alpha}, {cutmix_alpha}, {switch_prob}.")
    mixes = []
    if mixup_alpha > 0:
        mixes.append((v2.MixUp(alpha=mixup_alpha, num_classes=num_classes), 1 - switch_prob))
    if cutmix_alpha > 0:
        mixes.append((v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes), switch_prob))
    if len(mixes) < 2:
        return mixes[0][0] if mixes else None
    return v2.RandomChoice([m for m, _ in mixes], p=[p for _, p in mixes])
