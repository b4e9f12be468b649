"""Experiments: many ``train.py`` runs, compared.

``python -m fl_lightning.experiment run configs/experiments/X.yaml [--dry-run] [--jobs N]`` expands an experiment
file (:mod:`~fl_lightning.experiment.spec`) into one run per point of its axes, checks every run with train.py's
parser (:mod:`~fl_lightning.experiment.validation`), runs them with one run dir, one log and one W&B run each
(:mod:`~fl_lightning.experiment.runner`), and reports mean ± std over seeds with ``results.json`` and plots
(:mod:`~fl_lightning.experiment.report`). ``... compare RUN_DIRS... | --wandb PROJECT --group G`` makes the same
report from any finished runs (:mod:`~fl_lightning.experiment.collect`). A single run stays
``python train.py ...``: the runner only composes its arguments, and prints them.
"""

from fl_lightning.experiment.spec import Experiment, ExperimentError, RunSpec, load_experiment, parse_experiment

__all__ = ["Experiment", "ExperimentError", "RunSpec", "load_experiment", "parse_experiment"]
