"""The round: the LightningModule (``module``), how clients run (``stacked``: the stacked path; the sequential
reference is ``fl_lightning.client.ClientContext``), aggregation, evaluation, the client-state bank, the ledger.

Algorithms never import this package: they are written against ``fl_lightning.client`` and
``fl_lightning.algorithms.base`` only.
"""
