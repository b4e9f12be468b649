"""The privacy boundary as a property, for every algorithm: what may an upload depend on? Personal parameters are
never uploaded."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fl_lightning.algorithms as algorithms
from fl_lightning.algorithms import Ditto, FedAvg, FedPer, FedRep, LGFedAvg, LocalOnly
from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.cli import train_config
from fl_lightning.engine.aggregation import CommunicationLedger, PrivacyViolation
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.digits_runs import digits
from tests.helpers.training import make_trainer


@pytest.mark.parametrize(
    "algorithm", [FedAvg(1), FedRep(2, 1), FedPer(1), LGFedAvg(1, personal=("body.fc1",)), LocalOnly(1)]
)
def test_uploads_never_contain_personal_parameters(algorithm):
    dm = digits()
    module = FederatedModule(algorithm, DigitsMLP(), eval_every=100)
    seen: list[str] = []
    trainer = make_trainer(3)
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.extend(t))

    module.attach_data = attach_and_observe
    trainer.fit(module, datamodule=dm)
    personal = [n for n, _ in module.net.named_parameters() if algorithm.is_personal(n)]
    assert not set(seen) & set(personal)
    if isinstance(algorithm, LocalOnly):
        assert seen == []
    else:
        assert seen and set(seen) == {n for n, _ in module.net.named_parameters()} - set(personal)


DIGITS = "configs/digits/base.yaml"


SI = "configs/perfedsi/digits.yaml"


SHORT = ["--model.eval_every", "100", "--model.eval_last", "1"]


# name -> (configs, overrides); every exported algorithm appears at least once
RUNS: dict[str, tuple[list[str], list[str]]] = {
    **{
        name: ([DIGITS, f"configs/digits/{cfg}.yaml"], [])
        for name, cfg in {
            "FedAvg": "fedavg",
            "FedProx": "fedprox",
            "SCAFFOLD": "scaffold",
            "FedMTL": "fedmtl",
            "PerFedAvg": "perfedavg",
            "LGFedAvg": "lg_fedavg",
            "L2GD": "l2gd",
            "APFL": "apfl",
            "Ditto": "ditto",
            "FedPer": "fedper",
            "FedRep": "fedrep",
            "LocalOnly": "local",
            "FedBN": "fedbn",  # issue 17 (methods_a): DigitsCNN with BatchNorm
            "FedBABU": "fedbabu",
            "FedRoD": "fedrod",
            "FedALA": "fedala",
            "PFedMe": "pfedme",
            "FedProto": "fedproto",
            "MOON": "moon",
            "FedDyn": "feddyn",
        }.items()
    },
    "LinearFedRep": (["configs/synthetic_fedrep.yaml"], []),
    "LinearFedRep-gd": (["configs/synthetic_fedrep.yaml"], ["--model.algorithm.init_args.head_solver", "gd"]),
    "LinearFedAvg": (["configs/representation/linear_base.yaml", "configs/representation/linear_fedavg.yaml"], []),
    "FedMD": (
        ["configs/mixed_regression/c1.yaml", "configs/mixed_regression/fedmd.yaml"],
        ["--model.algorithm.init_args.phase1_iters", "1"],  # rounds 0-2: Phase 1, round 3: Phase 2
    ),
    "IFCA": (["configs/mixed_regression/c1.yaml", "configs/mixed_regression/ifca.yaml"], []),
    "OneShotClustering": (["configs/mixed_regression/c1.yaml", "configs/mixed_regression/oneshot.yaml"], []),
    "PowerInitLocalGD": (["configs/lowrank_mf/synthetic.yaml"], []),
    "AlternatingGD": (
        ["configs/lowrank_mf/synthetic.yaml", "configs/lowrank_mf/alternating_gd.yaml"],
        ["--model.algorithm.init_args.sigma_rounds", "1"],  # round 0: σ_max, round 1: U from data, then GD on U
    ),
    # side information: PerFedSI's models (mask fixed / learned, concat) on the digits feature-shift stand-in
    "FedAvgSteps": (
        [SI, "configs/perfedsi/perfedsi_mask.yaml"],
        ["--model.algorithm", "fl_lightning.algorithms.FedAvgSteps"],
    ),
    "FedAvg-mask-fixed": ([SI, "configs/perfedsi/perfedsi_mask.yaml"], []),
    "FedAvg-mask-learned": ([SI, "configs/perfedsi/perfedsi_mask_learned.yaml"], []),
    "FedAvg-concat": ([SI, "configs/perfedsi/perfedsi_concat.yaml"], ["--model.network.init_args.side_dim", "4"]),
    "Ditto-mask-learned": (
        [SI, "configs/perfedsi/perfedsi_mask_learned.yaml"],
        ["--model.algorithm", "fl_lightning.algorithms.Ditto", "--model.algorithm.init_args.lam", "1.0"],
    ),
}


ROUNDS = {"FedMD": 4, "AlternatingGD": 4}
#: cheaper local work where the config's own is long (the property does not depend on it)
RUNS["PFedMe"][1].extend(["--model.algorithm.init_args.local_steps", "3"])


EXPORTED = sorted(
    n
    for n in algorithms.__all__
    if isinstance(getattr(algorithms, n), type) and issubclass(getattr(algorithms, n), Algorithm) and n != "Algorithm"
)


def test_every_exported_algorithm_is_covered_and_declares_what_it_reveals():
    assert set(EXPORTED) <= {n.split("-")[0] for n in RUNS}, set(EXPORTED) - {n.split("-")[0] for n in RUNS}
    for name in EXPORTED:
        kind = getattr(algorithms, name)
        instance = kind()
        assert isinstance(instance.reveals, str) and len(instance.reveals) > 10, name


def perturbed_state(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every entry moved (multiplicatively and additively, so zeros move and variances stay positive)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in state.items():
        if t.is_floating_point():
            u1, u2 = torch.rand(t.shape, generator=g, dtype=t.dtype), torch.rand(t.shape, generator=g, dtype=t.dtype)
            out[n] = t * (1 + 0.2 * u1) + 0.05 * u2
        else:
            out[n] = t + 1
    return out


def under(name: str, prefixes) -> bool:
    return any(name.startswith(p) for p in prefixes)


class Recorder:
    """Wraps ``FederatedModule.run_clients``: runs each cohort again with perturbed state and side information."""

    def __init__(self) -> None:
        self.module: FederatedModule | None = None
        self.changed = {"state": set(), "side": set()}  # upload names that changed under each perturbation
        self.uploads = 0
        self.records: list[tuple[int, int, dict, ClientUpdate]] = []  # (round, client, global, update)

    def wrap(self, original):
        def run_clients(module, clients, round_idx, glob, states, budgets):
            self.module = module
            snapshot = copy.deepcopy(module.algorithm)
            real, fed = module.algorithm, module.fed

            def rerun(client_states, data):
                module.algorithm, module.fed = copy.deepcopy(snapshot), data
                try:
                    return original(module, clients, round_idx, glob, client_states, budgets)
                finally:
                    module.algorithm, module.fed = real, fed

            moved = [perturbed_state(s, 1000 * round_idx + c) for s, c in zip(states, clients)]
            variants = {"state": rerun(moved, fed)}
            if fed.side is not None:
                variants["side"] = rerun(states, dataclasses.replace(fed, side=fed.side.roll(1, dims=-1)))
            base = original(module, clients, round_idx, glob, states, budgets)
            declared = {"state": real.state_dependent_uploads, "side": real.side_dependent_uploads}
            for kind, updates in variants.items():
                for c, upd, other in zip(clients, base, updates):
                    assert set(other.upload) == set(upd.upload)
                    for n, v in upd.upload.items():
                        if torch.equal(v, other.upload[n]):
                            continue
                        assert under(n, declared[kind]), (
                            f"{type(real).__name__}: upload '{n}' of client {c} in round {round_idx} depends on "
                            f"the client's {'personal state' if kind == 'state' else 'side information'}, which "
                            f"its declaration {declared[kind]} does not allow"
                        )
                        self.changed[kind].add(n)
            self.uploads += sum(1 for u in base if u.upload)
            frozen_glob = {n: v.clone() for n, v in glob.items()}  # glob views the live model, which the server moves
            self.records += [(round_idx, c, frozen_glob, u) for c, u in zip(clients, base)]
            return base

        return run_clients


def run_recorded(name: str, tmp_path, monkeypatch) -> Recorder:
    configs, overrides = RUNS[name]
    recorder = Recorder()
    monkeypatch.setattr(FederatedModule, "run_clients", recorder.wrap(FederatedModule.run_clients))
    rounds = ROUNDS.get(name, 3)
    summary = train_config(configs, [*overrides, "--trainer.max_steps", str(rounds), *SHORT], run_dir=tmp_path)
    assert summary["rounds"] == rounds
    return recorder


@pytest.mark.parametrize("name", sorted(RUNS))
def test_uploads_depend_on_personal_state_and_side_information_only_as_declared(name, tmp_path, monkeypatch):
    rec = run_recorded(name, tmp_path, monkeypatch)
    alg, ledger = rec.module.algorithm, rec.module.ledger
    if name == "LocalOnly":
        assert rec.uploads == 0 and not alg.state_dependent_uploads
        return
    assert rec.uploads > 0
    # every declared dependence shows up: the declaration is not wider than the method
    for kind, declared in (("state", alg.state_dependent_uploads), ("side", alg.side_dependent_uploads)):
        if kind == "side" and rec.module.fed.side is None:
            continue
        for prefix in declared:
            assert any(n.startswith(prefix) for n in rec.changed[kind]), (name, kind, prefix, rec.changed[kind])
    # the ledger's per-round record of the declared dependence
    assert [r.round for r in ledger.history[-2:]] == [ROUNDS.get(name, 3) - 2, ROUNDS.get(name, 3) - 1]
    last = ledger.history[-1]
    assert last.uploads > 0 and last.bytes > 0
    assert (last.state_dependent_bytes > 0) == bool(alg.state_dependent_uploads)
    assert (last.side_dependent_bytes > 0) == (rec.module.fed.side is not None)
    assert ledger.describe().startswith(alg.reveals)


@pytest.mark.parametrize("name", ["IFCA", "OneShotClustering", "FedMD"])
def test_clustered_methods_reveal_the_chosen_cluster_row_and_nothing_else(name, tmp_path, monkeypatch):
    """Phase-2 rounds: theta moves only in the row of the client's cluster (its declared reveal); one-shot
    clustering's round 0 puts the client's own estimate in its own row of ``estimates`` only."""
    rec = run_recorded(name, tmp_path, monkeypatch)
    alg = rec.module.algorithm
    phase2 = 0
    for round_idx, client, glob, upd in rec.records:
        if round_idx < alg.warmup_rounds:
            if name == "OneShotClustering":
                rows = upd.upload["estimates"].abs().sum(1).nonzero().flatten().tolist()
                assert rows == [client] and upd.upload["estimate_mask"].nonzero().flatten().tolist() == [client]
            continue
        moved = (upd.upload["theta"] != glob["theta"]).any(1).nonzero().flatten().tolist()
        assert moved == [int(upd.state["label"])] == upd.state["assign"].nonzero().flatten().tolist()
        phase2 += 1
    assert phase2 > 0


@pytest.mark.parametrize("mask", ["fixed", "learned"])
def test_perfedsi_mask_uploads_reveal_the_clients_side_group(mask, tmp_path, monkeypatch):
    """The declared side reveal, concretely: with the fixed mask only the client's quarter of the input channels
    of conv4 (the layer after the mask) moves; with the learned mask only the client's column of W moves."""
    rec = run_recorded(f"FedAvg-mask-{mask}", tmp_path, monkeypatch)
    side, net = rec.module.fed.side, rec.module.net
    assert "group" in type(net.side).reveals
    width = net.side.embed.weight.shape[0] if mask == "learned" else net.body.conv3.conv.out_channels
    for _, client, glob, upd in rec.records:
        group = int(side[client].argmax())
        if mask == "learned":
            moved = (upd.upload["side.embed.weight"] != glob["side.embed.weight"]).any(0)
            assert moved.nonzero().flatten().tolist() == [group]
        else:
            per = width // side.shape[1]
            moved = (upd.upload["head.conv4.conv.weight"] != glob["head.conv4.conv.weight"]).any(0).any(-1).any(-1)
            assert moved.nonzero().flatten().tolist() == list(range(group * per, (group + 1) * per))


# ---- the ledger enforces the declarations on its own ------------------------------------------------------------
class TemplateLeakingDitto(Ditto):
    """Ditto whose own upload template and upload both carry its personal model v (declared state ``v.``)."""

    def upload_template(self, global_params):
        return {**super().upload_template(global_params), **{"v." + n: t for n, t in global_params.items()}}

    def client_update(self, ctx, global_params, state):
        upd = super().client_update(ctx, global_params, state)
        return ClientUpdate({**upd.upload, **{n: t for n, t in state.items()}}, upd.state, upd.num_samples)


class OverridingFedRep(FedRep):
    """FedRep that redefines ``is_personal`` to let its head through and lists the head in its template."""

    def is_personal(self, name):
        return False

    def upload_template(self, global_params):
        return dict(global_params)

    def client_update(self, ctx, global_params, state):
        upd = super().client_update(ctx, global_params, state)
        return ClientUpdate({**upd.upload, **state}, upd.state, upd.num_samples)


@pytest.mark.parametrize("algorithm", [TemplateLeakingDitto, OverridingFedRep])
def test_ledger_refuses_declared_personal_names_even_when_the_template_allows_them(algorithm, tmp_path):
    from datamodules import DigitsDataModule
    from fl_lightning.models import DigitsMLP
    from tests.helpers.training import fit

    module = FederatedModule(algorithm(), DigitsMLP(hidden=(16,)), eval_every=100)
    with pytest.raises(PrivacyViolation, match=r"'(v\.body|head)\."):
        fit(module, DigitsDataModule(num_clients=10, clients_per_round=2, seed=0), rounds=1)


def test_ledger_refuses_state_names_and_names_outside_the_declared_upload():
    template = {"body.w", "delta_c.body.w"}
    ledger = CommunicationLedger(("head.",), ("c_i.",), {"c_i.body.w", "assign"}, template)
    w = torch.zeros(2)
    ledger.new_round(0)
    assert set(ledger.upload(0, 1, {"body.w": w, "delta_c.body.w": w})) == template
    for bad in ("c_i.body.w", "head.b", "assign", "body.other"):
        with pytest.raises(PrivacyViolation, match=bad):
            ledger.upload(0, 1, {"body.w": w, bad: w})
    for bad_template in ({"c_i.x"}, {"head.b"}, {"assign"}):  # declared private, even if the template lists it
        with pytest.raises(PrivacyViolation, match=next(iter(bad_template))):
            CommunicationLedger(("head.",), ("c_i.",), {"assign"}, bad_template)


def test_algorithms_with_per_client_models_declare_their_state_prefixes():
    """Their bank names are not model parameters, so without these declarations the ledger could not refuse them."""
    expected = {"Ditto": "v.", "APFL": "v.", "L2GD": "x.", "FedMTL": "w.", "SCAFFOLD": "c_i."}
    expected |= {"PFedMe": "theta.", "MOON": "prev.", "FedDyn": "grad."}
    for name, prefix in expected.items():
        assert getattr(algorithms, name).state_prefixes == (prefix,), name


def test_readme_says_what_each_algorithm_reveals():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## What crosses the privacy boundary") :]
    section = section[: section.index("\n## ", 5)]
    assert "nothing personal is uploaded" not in readme.replace('"nothing\npersonal is uploaded"', "")
    for name in EXPORTED:
        assert f"`{name}`" in section, name


def test_each_algorithms_personal_split_is_pinned_by_name():
    """The default split of every method (issue 20: LG-FedAvg's local *lower* layers, not FedPer's head)."""
    expected = {
        "FedAvg": (),
        "FedProx": (),
        "FedAvgSteps": (),
        "LinearFedAvg": (),
        "PerFedAvg": (),
        "SCAFFOLD": (),
        "Ditto": (),
        "APFL": (),
        "L2GD": (),
        "FedMTL": (),
        "FedPer": ("head.",),
        "FedRep": ("head.",),
        "LinearFedRep": ("head.",),
        "LGFedAvg": ("body.",),
        "LocalOnly": ("",),
        "IFCA": ("assign",),
        "FedMD": ("assign",),
        "OneShotClustering": ("assign",),
        "PowerInitLocalGD": ("U",),
        "AlternatingGD": ("U",),
        "FedBN": (),  # every BatchNorm layer of the network, found at set-up (tests/algorithms/test_fedbn.py pins it)
        "FedBABU": (),
        "FedRoD": (),  # its personal head is client state (``p_head.``), not a network layer
        "FedALA": (),  # its local model and weights are client state (``local.``, ``ala_w.``)
        "PFedMe": (),
        "FedProto": ("body.", "head."),  # the whole model: only prototypes and counts are uploaded
        "MOON": (),
        "FedDyn": (),
    }
    assert set(expected) == set(EXPORTED)
    for name, personal in expected.items():
        assert getattr(algorithms, name)().personal == personal, name
