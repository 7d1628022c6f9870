"""The NVIDIA DALI backend: datamodule.py, loader.py (threads, memory, epochs), pipelines.py, augment.py."""
