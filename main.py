"""Train, validate, test or predict: `python main.py fit --config configs/ddp_amp.yaml`."""

if __name__ == "__main__":
    # Imported here, not at the top: DALI's spawned workers re-import this file as __mp_main__
    # and must not pay for importing Lightning.
    from lightning_app.cli import main

    main()
