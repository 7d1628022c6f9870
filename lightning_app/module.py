"""ImageClassifier: the one LightningModule. A backbone from `models` (backbone.py), the family's optimiser
recipe with warm-up + cosine (optimization.py), MixUp/CutMix on the device batch (inputs.py)."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torchmetrics.classification import MulticlassAccuracy

from lightning_app import optimization, timm_weights
from lightning_app import weights as weights_lib
from lightning_app.backbone import body_modules, build_backbone, compile_static, head_classes
from lightning_app.callbacks.freeze import FreezeBackboneEpochs
from lightning_app.callbacks.hparams import HparamsWithMetric
from lightning_app.callbacks.norm_window import NormStatisticsPerEpoch
from lightning_app.callbacks.pictures import picture_callbacks
from lightning_app.callbacks.predictions import PredictionsCSV
from lightning_app.errors import UserError
from lightning_app.inputs import batch_mix, inference_settings
from lightning_app.log_steps import ShortEpochNote, logs_this_step
from lightning_app.settings import arch_problems
from models import own_kwargs
from models.recipes import Recipe

__all__ = ["ImageClassifier", "batch_mix", "compile_static", "inference_settings"]  # the names users import here


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
        optimizer: sgd or adamw. lr, weight_decay and optimizer left null (the default, here as in
            configs/default.yaml) take the arch family's recipe (models/recipes.py: SGD 0.1 for CNNs, AdamW
            5e-4 at 512 images for transformers, ...), said at the start of a fit: a module built in Python trains
            with what the CLI gives.
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
        lr: float | None = None,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float | None = None,
        optimizer: str | None = None,
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
        self.backbone = build_backbone(h, num_classes)
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

    # -- optimisation (lightning_app/optimization.py) ---------------------------------------
    @property
    def optim(self) -> tuple[str, float, float, Recipe | None]:
        """(optimizer, lr per 256 images, weight decay, the family recipe that filled what is unset, or None)."""
        return optimization.resolved(self.hparams)

    def recipe_line(self) -> str:
        """Each of optimizer, lr and weight decay with where it came from (optimization.recipe_line)."""
        return optimization.recipe_line(self.hparams, self.setting_sources)

    @property
    def scaled_lr(self) -> float:
        """lr per 256 images scaled to the global batch (times gradient accumulation)."""
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        return optimization.scaled_lr(self.hparams, accumulate)

    def configure_optimizers(self):
        return optimization.optimizer_and_schedule(self, self.scaled_lr)

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
        """What fine-tuning freezes: every module but the head (backbone.body_modules)."""
        return body_modules(self.backbone)

    def configure_callbacks(self) -> list[pl.Callback]:
        """What this model's settings ask for: fine-tuning, TensorBoard pictures, the HPARAMS tab, BatchNorm statistics
        that keep up with a short epoch (callbacks/norm_window.py); predictions.csv in predict only (Lightning sets
        trainer.state.fn before it asks: trainer/trainer.py, predict then _run)."""
        callbacks: list[pl.Callback] = []
        if self.hparams.get("freeze_backbone_epochs"):
            callbacks.append(FreezeBackboneEpochs(self.hparams.freeze_backbone_epochs))
        callbacks += picture_callbacks(self.hparams)
        if self._trainer is not None and self.trainer.state.fn == TrainerFn.PREDICTING:
            callbacks.append(PredictionsCSV())
        callbacks += [HparamsWithMetric(metric="val/acc1"), NormStatisticsPerEpoch(), ShortEpochNote()]
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
        return head_classes(self.backbone)
