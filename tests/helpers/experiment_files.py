"""Shared by the experiment runner's tests: a small experiment file (2 methods × seeds on digits, W&B off) written
to a folder, and a folder's contents by hash (``tree``: a refused command changes nothing)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "digits")


def tree(folder: Path) -> dict[str, str]:
    """Every file (its bytes' hash) and folder under ``folder``."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def write_experiment(folder: Path, data: dict) -> Path:
    path = folder / "exp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path



def tiny(name: str = "tiny", rounds: int = 3, seeds=(0, 1), **more) -> dict:
    """2 methods × len(seeds) seeds on digits, ``rounds`` rounds, W&B off."""
    data = {
        "name": name,
        "configs": [f"{DIGITS}/base.yaml"],
        "axes": {
            "method": {"fedavg": f"{DIGITS}/fedavg.yaml", "fedrep": f"{DIGITS}/fedrep.yaml"},
            "dataset": {"digits": None},
            "seed": list(seeds),
        },
        "set": {"trainer.max_steps": rounds, "checkpoint_every": 2, "trainer.enable_progress_bar": False},
        "wandb": {"mode": "disabled"},
    }
    data.update(more)
    return data
