"""Hyperparameter sweeps with Optuna: `python -m lightning_app.sweep` (docs/training.md, "Sweeps").

space.py (the space file) -> storage.py (the shared journal study, owners, heartbeats) -> runner.py (each trial a
`python main.py fit` of its own; pruning.py reports from inside it) -> report.py (trials.md, sweep.png, best.yaml).
Optuna is optional: imported only when a sweep runs (storage.import_optuna names its pip line).
"""
