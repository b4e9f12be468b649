"""One algorithm per file; each holds only its math."""

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedper import FedPer
from fl_lightning.algorithms.fedrep import FedRep
from fl_lightning.algorithms.lg_fedavg import LGFedAvg
from fl_lightning.algorithms.linear_fedrep import LinearFedRep
from fl_lightning.algorithms.local_only import LocalOnly

__all__ = ["Algorithm", "ClientUpdate", "FedAvg", "FedPer", "FedRep", "LGFedAvg", "LinearFedRep", "LocalOnly"]
