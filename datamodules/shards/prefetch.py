"""A chunk download that fails in a DataLoader worker reaches the user as one paragraph, not first as a traceback.

When a download fails, litdata 0.2.76's `PrepareChunksThread.run` (litdata/streaming/reader.py) does two
things: it stores the error where the reader's wait loop looks before every wait (`self._error`, read
through `prefetch_error` by `BaseItemLoader._raise_if_prefetch_crashed`, so the worker fails at once
instead of after MAX_WAIT_TIME), and it prints "[litdata] PrepareChunksThread CRASHED" plus the thread's
traceback to the worker's stderr (`_report_crash`). The stored error then reaches `ShardDataset.__next__`
in that worker, which raises it as errors.py's paragraph for `python main.py` to print (exit status 2).

LitData offers no hook for the report: the thread is made and started inside `BinaryReader.
setup_thread_and_download_chunk`, and the one part we supply, the downloader, cannot fail without
ending the thread (returning without the file leaves the reader waiting out MAX_WAIT_TIME, 120 s). So
`_report_crash` is wrapped: an error that errors.py names (the store unreachable or refusing, the
credentials refused, an object missing, a chunk of the wrong size, the cache disk full) is left to that
paragraph; any other error keeps LitData's report, traceback included, since it is a bug to look into.
The wrap checks that `run` still stores the error and calls `_report_crash`, and fails loudly if not.
"""
from __future__ import annotations

PINNED_LITDATA = "0.2.76"  # requirements.txt; the version whose reader.py this module was written against


def explained(error: BaseException) -> bool:
    """Whether errors.py (or the downloader's size check) names this failure in its own paragraph."""
    from datamodules.shards.downloader import ChunkSizeError
    from datamodules.shards.errors import explain

    return isinstance(error, ChunkSizeError) or explain(error, "") is not None


def quiet_explained_crashes() -> None:
    """Wrap litdata's PrepareChunksThread._report_crash in this process (idempotent; see the module doc)."""
    import litdata
    from litdata.streaming.reader import PrepareChunksThread

    report = PrepareChunksThread.__dict__.get("_report_crash")
    if getattr(report, "explained_errors_quiet", False):
        return
    uses = PrepareChunksThread.run.__code__.co_names
    if report is None or "_report_crash" not in uses or "_error" not in uses:
        from datamodules.errors import DataError

        raise DataError(
            f"litdata {litdata.__version__} is installed, but the streaming backend was written against litdata "
            f"{PINNED_LITDATA}, whose PrepareChunksThread.run stores a failed download and reports it through "
            f"_report_crash (litdata/streaming/reader.py); this one does not. Install the pinned version: "
            f"pip install litdata=={PINNED_LITDATA} (or pip install -r requirements.txt).")

    def _report_crash(self, exc: BaseException) -> None:
        if not explained(exc):
            report(self, exc)

    _report_crash.explained_errors_quiet = True
    PrepareChunksThread._report_crash = _report_crash
