"""DataError: bad data or data settings, in one paragraph. A leaf: it imports nothing of ours."""
from __future__ import annotations


class DataError(ValueError):
    """Bad data or data settings; the message names the path and says how to fix it.

    Raised in a DataLoader worker, it is re-raised in the main process as DataError(text holding the
    worker's whole traceback) (torch/utils/data/_utils/__init__.py, ExceptionWrapper.reraise); that
    text is cut back to the original message, so a user reads one paragraph, not a worker's traceback.
    """

    def __init__(self, message: str = "", *args) -> None:
        if isinstance(message, str) and message.startswith("Caught DataError in DataLoader worker"):
            where = message.split("\n", 1)[0].removeprefix("Caught DataError ").rstrip(".")
            message = f"{message.rsplit('DataError: ', 1)[-1].strip()} (raised {where})"
        super().__init__(message, *args)
