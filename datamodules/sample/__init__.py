"""The one sample path every PIL/libjpeg-turbo backend shares: bytes -> decode -> crop/flip -> uint8 batch.

images.py (check and PIL-decode bytes), decode.py (libjpeg-turbo for plain JPEG), crop.py (random
resized crop + flip, val resize + center crop), augment.py (per-sample policies), batches.py (the
batch a worker writes), dataset.py (SampleDataset: a backend's Source through those steps),
transforms.py (normalisation on the device).
"""
