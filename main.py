"""Train, validate, test or predict: `python main.py fit --config configs/ddp_amp.yaml`."""
from lightning_app.cli import main

if __name__ == "__main__":
    main()
