"""What `bench loaders` reports: its columns, the bottleneck it names, the Markdown table and the chart."""
from __future__ import annotations

from typing import Any

from bench.loaders import paired
from bench.report import markdown_table, repo_relative

NEAR = 0.8  # a rate at >= 80% of a ceiling is bound by it

COLUMNS = {
    "backend": "the DataModule whose train_dataloader() is timed (same tree, same batch, image size, workers)",
    "images/s cold | warm": "training images per second through the whole pipeline (read, decode, augment, "
                            "batch, copy to the device) as uint8 batches on the device; the model step's "
                            "normalisation there is timed on its own (notes); cold: the "
                            "backend's files evicted from the page cache first (method in the notes); warm: the "
                            "next epochs (--warm-epochs), files in RAM",
    "MB/s cold | warm": "megabytes (1e6) of encoded image bytes the backend reads per second (images/s x mean "
                        "stored size)",
    "% IO ceiling": "cold MB/s as a share of the cold raw read rate of the backend's own files",
    "% decode ceiling cold | warm": "images/s as a share of the FASTEST full-image decoder's decode-only rate on "
                                    "all cores for the same images (warm cache), so a faster decoder alone cannot "
                                    "raise it (CPU-decoding rows)",
    "% PIL ceiling cold | warm": "images/s as a share of PIL's decode-only rate on all cores for the original "
                                 "images (warm cache): what the template's targets are stated in",
    "bottleneck cold | warm": f"IO if MB/s >= {NEAR:.0%} of the IO ceiling; CPU decode if images/s >= {NEAR:.0%} "
                              "of the decode ceiling; GPU for GPU-decoding rows otherwise; else the work around "
                              "decoding (crop, resize, batching, transfer)",
}


def classify(images_s: float, mb_s: float, io_mb_s: float | None, decode_images_s: float | None,
             gpu_decode: bool = False, near: float = NEAR) -> tuple[str, float | None, float | None]:
    """Name the bottleneck of one row from its rates and the ceilings (None = does not apply).

    Returns (bottleneck, share of the IO ceiling, share of the decode ceiling).
    """
    io = mb_s / io_mb_s if io_mb_s else None
    dec = images_s / decode_images_s if (decode_images_s and not gpu_decode) else None
    bound = [(frac, name) for frac, name in ((io, "IO"), (dec, "CPU decode")) if frac is not None and frac >= near]
    if bound:
        return max(bound)[1], io, dec
    if gpu_decode:
        return "GPU", io, dec
    return "around decoding", io, dec


def fastest_decode(ceil: dict[str, Any], images: str) -> float | None:
    """The fastest full-image decoder's warm decode-only rate for an image set (None if not measured)."""
    rates = [v["warm"]["images_s"] for v in ceil["decode"].get(images, {}).values() if "warm" in v]
    return max(rates) if rates else None


def _pair(by_cache: dict[str, dict], key: str, spec: str = ",.0f", scale: float = 1.0) -> str:
    vals = [by_cache.get(c, {}).get(key) for c in ("cold", "warm")]
    return " | ".join("" if v is None else format(v * scale, spec) for v in vals)


def to_markdown(result: dict[str, Any]) -> str:
    """One line per backend, cold and warm side by side; then every ceiling, cold and warm."""
    headers = []
    for c in COLUMNS:
        headers += [c.replace("cold | warm", "cold"), c.replace("cold | warm", "warm")] if "cold | warm" in c else [c]
    table = []
    by_backend: dict[str, dict[str, dict]] = {}
    for r in result["rows"]:
        by_backend.setdefault(r["backend"], {})[r["cache"]] = r
    for backend, by_cache in by_backend.items():
        first = next(iter(by_cache.values()))
        if first["status"] != "ok":
            table.append([backend, f"{first['status']}: {first['reason']}"] + [""] * (len(headers) - 2))
            continue
        cells = [backend]
        cells += _pair(by_cache, "images_s").split(" | ")
        cells += _pair(by_cache, "mb_s", ",.1f").split(" | ")
        cells.append(_pair(by_cache, "io_frac", ".0f", 100).split(" | ")[0])
        cells += _pair(by_cache, "decode_frac", ".0f", 100).split(" | ")
        cells += _pair(by_cache, "pil_frac", ".0f", 100).split(" | ")
        cells += [by_cache.get(c, {}).get("bottleneck") or "" for c in ("cold", "warm")]
        table.append(cells)
    lines = [markdown_table(headers, table), ""]
    c = result["ceilings"]
    for key, v in c["io"].items():
        lines.append(f"- IO ceiling ({key} files): {v['mb_s']:,.1f} MB/s, {v['images_s']:,.0f} files/s ({v['how']})")
    for key, decoders in c["decode"].items():
        for decoder, by_cache in decoders.items():
            cold, warm = by_cache.get("cold"), by_cache.get("warm")
            lines.append(f"- Decode ceiling ({key} images, {decoder}): "
                         f"cold {cold['images_s'] if cold else float('nan'):,.0f} | "
                         f"warm {warm['images_s'] if warm else float('nan'):,.0f} images/s "
                         f"({(warm or cold)['how']}; cold: evicted first; median of the rounds, "
                         f"warm rounds {', '.join(f'{x:,.0f}' for x in (warm or cold).get('rounds_images_s', []))})")
    lines += paired.lines(result)
    if c.get("stages_us"):
        lines.append("- Stages of the sample path, one thread, original images, warm (microseconds per image): "
                     + "; ".join(f"{k} {v:,.0f}" for k, v in c["stages_us"].items()))
    if c.get("dali_stages"):
        lines.append("- DALI CPU train pipelines, all cores, warm (images/s): "
                     + "; ".join(f"{k} {v:,.0f}" for k, v in c["dali_stages"].items()))
    if c.get("normalize"):
        n = c["normalize"]
        lines.append(f"- Not in the rows: the model step's normalisation on the device (uint8 -> float, mean/std), "
                     f"{n['ms_per_batch']:.1f} ms per batch ({n['images_s']:,.0f} images/s, {n['threads']} threads); "
                     "on a GPU it runs there, on a CPU-only machine it is part of the model's compute")
    s = result["settings"]
    lines.append(f"- Cold cache by: {result['eviction']}")
    lines.append(f"- Dataset: {repo_relative(s['root'])} (train split); batch {s['batch_size']}, "
                 f"{s['num_workers']} workers, crop {s['image_size']} px, device {s['device']}; each row the median of "
                 f"{s.get('rounds', '1')} rounds, "
                 f"each round: one untimed epoch, a cold epoch, then warm = {s.get('warm_epochs', '1')} epochs; "
                 "the decode ceilings are timed in every round, beside the rows")
    notes = sorted({f"{r['backend']}: {r['note']}" for r in result["rows"] if r.get("note")})
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> dict[str, Any]:
    """Cold and warm bars per backend; the original images' decode-only ceilings (every decoder, cold and warm)
    as lines (the downscaled copy's much higher ones are in the table's notes, off this scale)."""
    labels = list(dict.fromkeys(r["backend"] for r in result["rows"]))
    series = {}
    for cache in ("cold", "warm"):
        by = {r["backend"]: r["images_s"] for r in result["rows"] if r["cache"] == cache}
        series[cache] = [by.get(b) for b in labels]
    lines = {}
    for decoder, by_cache in result["ceilings"]["decode"].get("original", {}).items():
        for cache in ("cold", "warm"):
            if cache in by_cache:
                lines[f"{decoder} decode-only ceiling, {cache}"] = by_cache[cache]["images_s"]
    return {"title": "Train pipeline throughput per backend (images/s)", "labels": labels, "series": series,
            "ylabel": "images/s (higher is better)", "lines": lines}
