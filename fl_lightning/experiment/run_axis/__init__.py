"""The run axis: several runs of one process trained as one vectorized job.

``python -m fl_lightning.experiment.run_axis --config A.yaml [--config B.yaml] [--key value …] --seeds 0,1,2,3,4``
trains the runs of ``A+B`` with seeds 0–4 together (run dirs ``<run_dir>/s0`` …), ``--runs FILE.json`` any ``train.py``
argument lists. Each run writes exactly what ``python train.py`` writes; see ``driver`` for the design,
``lockstep`` for the scheduling, ``cohorts`` for the stacked client updates, ``shared_data`` for the data pool.
"""

from fl_lightning.experiment.run_axis.driver import BatchedRuns, RunOutcome, check_batchable, parse_config, run_batched

__all__ = ["BatchedRuns", "RunOutcome", "check_batchable", "parse_config", "run_batched"]
