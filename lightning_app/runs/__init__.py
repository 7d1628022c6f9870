"""One folder per run: `ROOT/version_N/` holds run.json, the TensorBoard events, config.yaml, checkpoints/.

The modules, in the order a command meets them:
- identity: run.json (training settings, host, start, SLURM jobs); IGNORED, the one list of what `last` ignores
- flags_over_checkpoint: flags win over a checkpoint, except what builds the network
- launch: this process as its launcher started it (the one launch-rank-zero process that makes a run folder and
  takes its lock; its SLURM job, torchrun worker group, sweep trial, command line)
- resolve: `--ckpt_path last|hpc|FILE` -> one run and one checkpoint (never an older run instead)
- lock: `version_N/.lock`, linked into place, with a heartbeat; the temp files of dead writers removed
- plan: the folder a subcommand writes to and what it loads, each said in one line (`RunPlan.lines`)
- guard: every rank on the same run (a fit-stage setup), atomic checkpoints, logs flushed before a save; the one
  module here that needs torch and Lightning, so this package does not import it (cli.py does)
- folders, signature: paths, atomic writes; what a checkpoint holds, read without running its code
"""
from lightning_app.runs.folders import CHECKPOINTS, LAST, new_run, run_dirs, run_of_checkpoint, write_atomically
from lightning_app.runs.identity import IGNORED, RUN_JSON, read_run
from lightning_app.runs.launch import is_launch_rank_zero
from lightning_app.runs.lock import LOCK_NAME, RunLock
from lightning_app.runs.plan import RunPlan, plan_run
from lightning_app.runs.signature import ModelSignature, check_compatible, mismatch

__all__ = ["CHECKPOINTS", "IGNORED", "LAST", "LOCK_NAME", "RUN_JSON", "ModelSignature", "RunLock", "RunPlan",
           "check_compatible", "is_launch_rank_zero", "mismatch", "new_run", "plan_run", "read_run",
           "run_dirs", "run_of_checkpoint", "write_atomically"]
