"""Representation-learning experiments in the two-layer linear setting, as batched tensor math.

* ``fedavg_linear``: FedAvg with τ local steps on head and body vs D-GD (spec 004), the principal-angle
  distance, the global gradient norm, new-client fine-tuning and Proposition 2's construction.
* ``fedrep_linear``: FedRep's synthetic experiments (spec 000 §3.1, §5): FedRep / GD-GD / 10GD-GD, FedSGD,
  Local Only, Method-of-Moments and projected-GD initialisations, new-client errors.
* ``features``: the absolute cosine similarity of per-class features (spec 004 §4.2, Figure 4).

The engine runs the same algorithms client by client (``fl_lightning.algorithms.LinearFedAvg``,
``LinearFedRep``); ``tests/algorithms/test_representation.py`` checks that both paths agree.
"""
