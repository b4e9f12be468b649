"""``fl_lightning/experiment/spec.py``: an experiment file's axes expand into named runs, each with its run dir, W&B
name, tags and train.py arguments in order."""

from __future__ import annotations

from fl_lightning.experiment.spec import parse_experiment
from tests.helpers.experiment_files import DIGITS


def test_axes_expand_into_named_runs_with_their_arguments(tmp_path):
    data = {
        "name": "grid",
        "configs": [f"{DIGITS}/base.yaml"],
        "axes": {
            "method": {"fedavg": {"config": f"{DIGITS}/fedavg.yaml"}, "fedrep": {"config": [f"{DIGITS}/fedrep.yaml"],
                                                                               "model.lr": 0.05}},
            "model.momentum": [0.0, 0.9],
            "seed": [3, 4],
        },
        "set": {"trainer.max_steps": 7, "model.lr": 0.02},
        "wandb": {"project": "p", "tags": ["extra"]},
    }  # fmt: skip
    experiment = parse_experiment(data, runs_dir=tmp_path)
    runs = experiment.runs(extra=["--trainer.max_steps=2"])
    assert [r.wandb_name for r in runs] == [
        f"{m}-momentum={v}-s{s}" for m in ("fedavg", "fedrep") for v in ("0.0", "0.9") for s in (3, 4)
    ]
    assert len({r.run_dir for r in runs}) == 8
    run = runs[7]  # fedrep, momentum 0.9, seed 4
    assert run.run_dir == tmp_path / "grid" / "fedrep" / "momentum=0.9" / "s4"
    assert run.job_type == "fedrep" and run.seed == 4
    assert run.tags == ["method:fedrep", "model.momentum:0.9", "seed:4", "extra"]
    args = run.args()
    # configs first (file's, then the axis'), then `set`, the axis overrides, the seed, the command line's --set
    assert args[:4] == ["--config", f"{DIGITS}/base.yaml", "--config", f"{DIGITS}/fedrep.yaml"]
    assert args[4:10] == [
        "--trainer.max_steps=7",
        "--model.lr=0.02",
        "--model.lr=0.05",
        "--model.momentum=0.9",
        "--seed_everything=4",
        "--trainer.max_steps=2",
    ]
    assert "--wandb.group=grid" in args and "--wandb.job_type=fedrep" in args and "--wandb.project=p" in args
    assert run.command().startswith("python train.py --config ")
