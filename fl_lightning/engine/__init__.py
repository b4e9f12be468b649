"""The round: the LightningModule (``module``), which path a round's clients take (``executor``: the one choice
between the sequential reference, ``fl_lightning.engine.sequential.ClientContext``, and the stacked path, ``stacked``),
aggregation and the server step, evaluation, checkpoint identity (``checkpoint``), the module's settings checks
(``settings``), the client-state bank, the ledger.

Algorithms never import this package: they are written against ``fl_lightning.client`` and
``fl_lightning.algorithms.base`` only (``tests/test_import_graph.py`` checks it).
"""
