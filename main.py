"""Train, validate, test or predict: `python main.py fit --config configs/ddp_amp.yaml`."""

if __name__ == "__main__":
    import os
    import signal

    # A sweep's trial under SLURM (lightning_app/sweep/placement.py): SLURM's warning signal reaches every process
    # of the step and by default ends one that has no handler yet (importing, starting ranks) or no longer (after
    # its fit), unsaved. Ignored, until the fit's handler saves on it (callbacks/stop_signals.py), which then puts
    # this back; the sweep sends its trials SIGTERM all the same.
    if "FIC_SWEEP_TRIAL" in os.environ and "SLURM_JOB_ID" in os.environ:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # Imported here, not at the top: DALI's spawned workers re-import this file as __mp_main__
    # and must not pay for importing Lightning.
    from lightning_app.cli import main

    main()
