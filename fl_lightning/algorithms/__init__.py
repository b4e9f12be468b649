"""One algorithm per file; each holds only its math."""

from fl_lightning.algorithms.apfl import APFL
from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.algorithms.ditto import Ditto
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedavg_steps import FedAvgSteps
from fl_lightning.algorithms.fedmtl import FedMTL
from fl_lightning.algorithms.fedper import FedPer
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.fedrep import FedRep
from fl_lightning.algorithms.l2gd import L2GD
from fl_lightning.algorithms.lg_fedavg import LGFedAvg
from fl_lightning.algorithms.linear_fedavg import LinearFedAvg
from fl_lightning.algorithms.linear_fedrep import LinearFedRep
from fl_lightning.algorithms.local_only import LocalOnly
from fl_lightning.algorithms.perfedavg import PerFedAvg
from fl_lightning.algorithms.scaffold import SCAFFOLD

__all__ = [
    "APFL",
    "Ditto",
    "FedMTL",
    "FedProx",
    "L2GD",
    "PerFedAvg",
    "SCAFFOLD",
    "Algorithm",
    "ClientUpdate",
    "FedAvg",
    "FedAvgSteps",
    "FedPer",
    "FedRep",
    "LGFedAvg",
    "LinearFedAvg",
    "LinearFedRep",
    "LocalOnly",
]

from fl_lightning.algorithms.alternating_gd import AlternatingGD  # noqa: E402
from fl_lightning.algorithms.ifca import IFCA  # noqa: E402
from fl_lightning.algorithms.lowrank_power import PowerInitLocalGD  # noqa: E402
from fl_lightning.algorithms.moment_descent import FedMD  # noqa: E402
from fl_lightning.algorithms.oneshot_kmeans import OneShotClustering  # noqa: E402

__all__ += ["AlternatingGD", "FedMD", "IFCA", "OneShotClustering", "PowerInitLocalGD"]

from fl_lightning.algorithms.fedala import FedALA  # noqa: E402
from fl_lightning.algorithms.fedbabu import FedBABU  # noqa: E402
from fl_lightning.algorithms.fedbn import FedBN  # noqa: E402
from fl_lightning.algorithms.fedrod import FedRoD  # noqa: E402

__all__ += ["FedALA", "FedBABU", "FedBN", "FedRoD"]  # issue 17's pFL baselines (methods_a)

from fl_lightning.algorithms.feddyn import FedDyn  # noqa: E402
from fl_lightning.algorithms.fedproto import FedProto  # noqa: E402
from fl_lightning.algorithms.moon import MOON  # noqa: E402
from fl_lightning.algorithms.pfedme import PFedMe  # noqa: E402

__all__ += ["FedDyn", "FedProto", "MOON", "PFedMe"]

from fl_lightning.algorithms.feddpa import FedDPA  # noqa: E402
from fl_lightning.algorithms.fedit import FedIT  # noqa: E402
from fl_lightning.algorithms.fedsa_lora import FedSALoRA  # noqa: E402
from fl_lightning.algorithms.ffa_lora import FFALoRA  # noqa: E402
from fl_lightning.algorithms.flora import FLoRA  # noqa: E402

#: issue 43: methods for LoRA adapters on a pretrained model (``fl_lightning.models.LoRAClassifier``); kept out of
#: ``__all__``, whose every entry the property tests run on the digits networks, which have no adapters
ADAPTER_METHODS = (FFALoRA, FLoRA, FedDPA, FedIT, FedSALoRA)
