"""Drawing the TensorBoard pictures: host arrays in, uint8 HWC images (and Markdown) out.

Everything here runs on rank 0's one drawing thread (`Drawer`), never in the training loop, and
uses matplotlib's object-oriented API only (a `Figure` drawn by `FigureCanvasAgg`): pyplot's global
state is not thread-safe, the OO API with one figure per thread is (matplotlib keeps its font
objects per thread: matplotlib/font_manager.py, `_get_font` takes the thread id).

The confusion matrix costs the same at any class count:
- up to LABELLED_MAX classes, a labelled matplotlib figure of fixed size (counts in the cells up to
  COUNTS_MAX classes);
- above, a heatmap made with numpy: one square per (true, predicted) pair, coloured by the share of
  the true class predicted as that class (square root, so rare confusions show), at most
  HEATMAP_SIDE pixels a side (4 megapixels); with more classes than that, neighbouring classes
  are summed into blocks. torchmetrics' `plot_confusion_matrix` (torchmetrics/utilities/plot.py)
  instead writes a text label into every cell, and a 0.5 inch per class figure grows with the
  square of the class count: about a quarter of an hour and a 50,000 px canvas at 1000 classes.
The pairs confused most often go out as a Markdown table beside it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

LABELLED_MAX = 30
COUNTS_MAX = 15
HEATMAP_SIDE = 2000
MOST_CONFUSED = 20

log = logging.getLogger(__name__)


class Drawer:
    """One background thread that draws and writes pictures in order; `wait()` before the writer closes."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, job: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pictures")
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(_guarded, job))

    def wait(self) -> None:
        for future in self._pending:
            future.result()
        self._pending = []


def _guarded(job: Callable[[], None]) -> None:
    try:
        job()
    except Exception:  # a picture that fails must not end the run: say so and go on
        log.warning("a TensorBoard picture could not be drawn", exc_info=True)


def render(fig) -> np.ndarray:
    """A matplotlib Figure as a uint8 HWC RGB array (Agg, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def titled_grid(images: np.ndarray, titles: list[str], columns: int = 4) -> np.ndarray:
    """uint8 NCHW images, each with its title (TensorBoard images have no captions), as one picture."""
    from matplotlib.figure import Figure

    n = len(images)
    columns = max(1, min(columns, n))
    rows = (n + columns - 1) // columns
    fig = Figure(figsize=(2.2 * columns, 2.5 * rows), dpi=80)
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, title in zip(axes.flat, images, titles, strict=False):
        ax.imshow(np.transpose(image, (1, 2, 0)))
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return render(fig)


def confusion_picture(matrix: np.ndarray, names: list[str]) -> np.ndarray:
    """The confusion matrix (rows: true class, columns: predicted) as a uint8 HWC image."""
    if len(matrix) <= LABELLED_MAX:
        return labelled_matrix(matrix, names)
    return heatmap(matrix)


def labelled_matrix(matrix: np.ndarray, names: list[str]) -> np.ndarray:
    from matplotlib.figure import Figure

    n = len(matrix)
    side = min(12.0, 3.0 + 0.3 * n)
    fig = Figure(figsize=(side, side), dpi=80)
    ax = fig.add_subplot()
    ax.imshow(matrix, cmap="viridis")
    ax.set_xticks(range(n), [str(x) for x in names], rotation=90, fontsize=8)
    ax.set_yticks(range(n), [str(x) for x in names], fontsize=8)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    if n <= COUNTS_MAX:
        bright = matrix > matrix.max() / 2
        for (i, j), count in np.ndenumerate(matrix):
            ax.text(j, i, str(int(count)), ha="center", va="center", fontsize=7,
                    color="black" if bright[i, j] else "white")
    fig.tight_layout()
    return render(fig)


def heatmap(matrix: np.ndarray, side: int = HEATMAP_SIDE) -> np.ndarray:
    """Each square: the share of its row's (true class's) images predicted as its column, sqrt-scaled, viridis."""
    from matplotlib import colormaps

    counts = matrix.astype(np.float64)
    block = -(-len(counts) // side)  # classes per square: 1 unless there are more classes than pixels
    if block > 1:
        pad = -len(counts) % block
        counts = np.pad(counts, ((0, pad), (0, pad)))
        m = len(counts) // block
        counts = counts.reshape(m, block, m, block).sum(axis=(1, 3))
    rows = counts.sum(axis=1, keepdims=True)
    share = np.sqrt(np.divide(counts, rows, out=np.zeros_like(counts), where=rows > 0))
    lut = (colormaps["viridis"](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.uint8)
    image = lut[np.round(share * 255).astype(np.intp)]
    scale = max(1, side // len(counts))
    return np.repeat(np.repeat(image, scale, axis=0), scale, axis=1)


def most_confused(matrix: np.ndarray, names: list[str], k: int = MOST_CONFUSED) -> str:
    """The k (true, predicted) pairs counted most often off the diagonal, as a Markdown table."""
    off = matrix.astype(np.int64, copy=True)
    np.fill_diagonal(off, 0)
    flat = off.ravel()
    k = min(k, int(np.count_nonzero(flat)))
    if k == 0:
        return "No image was misclassified."
    top = np.argpartition(flat, -k)[-k:]
    top = top[np.argsort(-flat[top], kind="stable")]
    rows_total = matrix.sum(axis=1)
    lines = ["| true class | predicted as | images | share of the true class |", "|---|---|---|---|"]
    for index in top:
        t, p = divmod(int(index), len(matrix))
        lines.append(f"| {names[t]} | {names[p]} | {int(flat[index])} | {flat[index] / max(1, rows_total[t]):.1%} |")
    return "\n".join(lines)
