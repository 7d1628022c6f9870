"""User errors in one paragraph, and the library noise that says nothing to a user, silenced by exact message.

Raise `UserError` (or `datamodules.errors.DataError`) for anything the user can fix in a setting:
`python main.py` prints its message alone, once, from rank 0, and exits with status 2. There is no
traceback unless FIC_TRACEBACK=1.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator

EXIT_USER_ERROR = 2
TRACEBACK_ENV = "FIC_TRACEBACK"


class UserError(ValueError):
    """A bad setting or input; the message names the setting or file and says how to fix it."""


def _is_user_error(error: BaseException) -> bool:
    # Lightning's own configuration errors (a bad strategy/devices/precision combination) are
    # one clear sentence too: lightning_fabric/utilities/exceptions.py
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    from datamodules.errors import DataError

    return isinstance(error, (UserError, DataError, MisconfigurationException))


def find_user_error(error: BaseException) -> BaseException | None:
    """The user error behind `error`, if any.

    jsonargparse re-raises an exception from a class's __init__ as a ValueError ("Does not validate
    against any of the Union subtypes ...") chained `from` the original, and Lightning re-raises
    from its loops: walk __cause__ / __context__ to find it.
    """
    return next((e for e in chain(error) if _is_user_error(e)), None)


def chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error` and every exception behind it (__context__, __cause__), each once."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__context__, e.__cause__]


def paragraph(error: BaseException) -> str:
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    text = str(error).strip() or type(error).__name__
    if isinstance(error, MisconfigurationException) and not isinstance(error, UserError):
        # Lightning's wording names its own arguments; say which of ours set them
        text = (f"The trainer settings do not work together here: {text} Check --trainer.accelerator, "
                "--trainer.devices, --trainer.strategy, --trainer.num_nodes and --trainer.precision.")
    return text


def show_traceback() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


# Exact messages (regular expressions anchored at the start) of warnings that every run printed
# and that no user can act on. Each names the source it comes from.
KNOWN_NOISE_WARNINGS = (
    # torch/utils/_pytree.py: LeafSpec's @deprecated, triggered inside pytorch_lightning/utilities/_pytree.py
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # pytorch_lightning/utilities/model_summary/model_summary.py (ModelSummary.model_size)
    (r"Precision (bf16-mixed|16-mixed) is not supported by the model summary", UserWarning),
    # pytorch_lightning/callbacks/model_checkpoint.py (__warn_if_dir_not_empty): a resumed run's own folder
    (r"Checkpoint directory .* exists and is not empty\.", UserWarning),
    # pytorch_lightning/loops/fit_loop.py (setup_data): lightning_app/callbacks/short_epoch.py says it naming our flag
    (r"The number of training batches \(\d+\) is smaller than the logging interval", UserWarning),
    # torch/utils/data/dataloader.py (_check_worker_number_rationality); lightning_app.cli says it once,
    # naming --data.num_workers
    (r"This DataLoader will create \d+ worker processes in total\.", UserWarning),
    # pytorch_lightning/callbacks/weight_averaging.py (setup): our configure_model only compiles the
    # backbone (lightning_app/module.py); it never shards layers, which is what the warning is about
    (r"You're using the WeightAveraging callback with a model that overrides the configure_model", UserWarning),
    # pytorch_lightning/utilities/data.py (has_len): LitData shards its IterableDataset over the workers itself
    # (datamodules/shards/loader.py), so its __len__ is exact
    (r"Your `IterableDataset` has `__len__` defined\.", UserWarning),
    # pytorch_lightning/loops/prediction_loop.py (_get_batch_indices): a stream has no batch sampler; the
    # prediction writer takes each row's index from the batch (datamodules/shards/loader.py, PredictShardDataset)
    (r"Couldn't infer the batch indices fetched from your dataloader: `PredictShardLoader`", UserWarning),
)

# Log lines (python logging, not warnings), by the logger that writes them.
KNOWN_NOISE_LOGS: dict[str, tuple[re.Pattern, ...]] = {}
_LIGHTNING_TIP = (
    # pytorch_lightning/trainer/connectors/logger_connector/logger_connector.py (configure_logger), through
    # lightning_utilities' rank_zero `log`, which pytorch_lightning/utilities/rank_zero.py points at its own logger
    re.compile(r"💡 Tip: For seamless cloud logging and experiment tracking, try installing \[litlogger\]"),
)
KNOWN_NOISE_LOGS["pytorch_lightning.utilities.rank_zero"] = _LIGHTNING_TIP
KNOWN_NOISE_LOGS["lightning_fabric.utilities.rank_zero"] = _LIGHTNING_TIP
# litdata/streaming/dataset.py (__init__) advises against any max_cache_size under 25GB; the budgets here are
# split per split and checked against what the readers hold (datamodules/shards/datamodule.py, cache budgets)
KNOWN_NOISE_LOGS["litdata.streaming.dataset"] = (re.compile(r".*max_cache_size` is less than 25GB"),)


class _DropKnownNoise(logging.Filter):
    def __init__(self, patterns: tuple[re.Pattern, ...]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def silence_known_noise() -> None:
    """Silence exactly the messages above; every other warning and log line still shows."""
    for pattern, category in KNOWN_NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, patterns in KNOWN_NOISE_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
            logger.addFilter(_DropKnownNoise(patterns))
