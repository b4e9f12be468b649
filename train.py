"""Train a federated run: ``python train.py --config configs/quickstart.yaml [--model.lr 0.05 ...]``."""

import sys

from fl_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main())
