"""Split models (shared body, personal head, optional side-information branch) and the papers' networks."""

from fl_lightning.models.benchmark import FedAvgCNN
from fl_lightning.models.digits import DigitsCNN, DigitsMLP
from fl_lightning.models.fedrep import CifarCNN, FemnistMLP, Sent140LSTM
from fl_lightning.models.linear import LinearRepresentation
from fl_lightning.models.perfedsi import ConvNet4, PerFedSIConcat, PerFedSIMask
from fl_lightning.models.split import Concat, GroupExpand, Mask, SplitModel
from fl_lightning.models.transfer import TransferCNN

__all__ = [
    "FedAvgCNN",
    "CifarCNN",
    "Concat",
    "DigitsCNN",
    "DigitsMLP",
    "FemnistMLP",
    "GroupExpand",
    "LinearRepresentation",
    "Mask",
    "ConvNet4",
    "PerFedSIConcat",
    "PerFedSIMask",
    "Sent140LSTM",
    "SplitModel",
    "TransferCNN",
]

from fl_lightning.models.regression import ClusteredLinear, LowRankFactors  # noqa: E402

__all__ += ["ClusteredLinear", "LowRankFactors"]

from fl_lightning.models.adapters import LoRAClassifier  # noqa: E402

__all__ += ["LoRAClassifier"]

from fl_lightning.models.causal_lm import LoRACausalLM  # noqa: E402

__all__ += ["LoRACausalLM"]
