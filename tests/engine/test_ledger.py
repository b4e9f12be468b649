"""``fl_lightning/engine/ledger.py``: the communication ledger's byte counts from parameter shapes, what it describes
without a declaration, and its refusal of a personal upload."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fl_lightning.algorithms import FedRep
from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.engine.ledger import CommunicationLedger, PrivacyViolation
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.digits_runs import digits
from tests.helpers.split_models import ROUNDS, read_metrics
from tests.helpers.training import fit


def test_communication_bytes_from_parameter_shapes(fedper_run):
    """FedPer on the 64→16→10 MLP uploads and downloads the body only: fc1 = 16·64 + 16 float32 values,
    i.e. 4,160 bytes per client, for the 4 sampled clients (20 clients × participation 0.2)."""
    body_bytes = 4 * (16 * 64 + 16)
    rows = [r for r in read_metrics(fedper_run / "metrics.csv") if "comm/upload_bytes" in r]
    assert len(rows) == ROUNDS
    for r in rows:
        assert r["comm/upload_bytes"] == 4 * body_bytes and r["comm/download_bytes"] == 4 * body_bytes


def test_ledger_rejects_a_personal_upload():
    class Leaky(FedRep):
        def client_update(self, ctx, global_params, state):
            upd = super().client_update(ctx, global_params, state)
            return ClientUpdate({**upd.upload, "head.weight": state["head.weight"]}, upd.state, upd.num_samples)

    module = FederatedModule(Leaky(1, 1), DigitsMLP(), eval_every=100)
    with pytest.raises(PrivacyViolation, match="head.weight"):
        fit(module, digits(), rounds=1)


def test_ledger_without_a_declaration_describes_nothing_beyond_the_upload() -> None:
    """A ledger built without ``reveals`` (and without side information) says the uploads reveal nothing beyond
    the declared upload."""
    ledger = CommunicationLedger(("head.",), (), set(), ["body.w"])
    assert ledger.describe() == "nothing beyond the declared upload"


W = torch.zeros(3, 4, dtype=torch.float32)  # 12 · 4 = 48 bytes


DC = torch.zeros(2, dtype=torch.float64)  # 2 · 8 = 16 bytes


B = torch.zeros(5, dtype=torch.float16)  # 5 · 2 = 10 bytes


def make_ledger(**kwargs) -> CommunicationLedger:
    args = dict(
        personal=("head.",),
        state_prefixes=("c_i.",),
        state_names={"c_i.body.w", "assign"},
        template={"body.w", "body.b", "delta_c.body.w"},
        reveals="the control-variate delta",
        state_dependent=("delta_c.",),
        side_dependent=("body.",),
        side_reveals="the side branch",
    )
    args.update(kwargs)
    return CommunicationLedger(**args)


def test_one_round_record_splits_bytes_by_declared_prefix():
    ledger = make_ledger()
    ledger.new_round(7)
    ledger.upload(7, 0, {"body.w": W, "delta_c.body.w": DC})
    ledger.upload(7, 3, {"body.b": B})
    record = ledger.history[-1]
    assert record.round == 7 and record.uploads == 2
    assert record.bytes == 48 + 16 + 10
    assert record.state_dependent_bytes == 16  # only the delta_c. upload
    assert record.side_dependent_bytes == 48 + 10  # the body. uploads
    assert ledger.upload_bytes == 48 + 16 + 10


def test_a_new_round_index_opens_a_new_record_and_new_round_resets_the_counters():
    ledger = make_ledger()
    ledger.upload(0, 0, {"body.w": W})  # no new_round call: the first upload opens round 0's record
    ledger.upload(1, 0, {"body.b": B})  # a different round index opens another one
    assert [(r.round, r.uploads, r.bytes) for r in ledger.history] == [(0, 1, 48), (1, 1, 10)]
    assert ledger.upload_bytes == 58  # the per-run counter keeps adding until new_round
    ledger.download({"body.w": W}, num_clients=3)
    assert ledger.download_bytes == 3 * 48
    ledger.new_round(2)
    assert ledger.upload_bytes == 0 and ledger.download_bytes == 0
    assert ledger.history[-1].round == 2 and ledger.history[-1].uploads == 0 and ledger.history[-1].bytes == 0
    ledger.upload(2, 1, {"delta_c.body.w": DC})
    assert len(ledger.history) == 3 and ledger.history[-1].bytes == 16 and ledger.upload_bytes == 16


def test_download_bytes_accumulate_per_receiving_client():
    ledger = make_ledger()
    ledger.new_round(0)
    ledger.download({"body.w": W, "body.b": B}, num_clients=4)
    ledger.download({"body.b": B}, num_clients=2)
    assert ledger.download_bytes == 4 * (48 + 10) + 2 * 10


def test_private_names_are_personal_prefixes_state_prefixes_and_exact_bank_names():
    ledger = make_ledger()
    assert ledger.is_private("head.w") and ledger.is_private("c_i.anything") and ledger.is_private("assign")
    assert not ledger.is_private("assignment")  # a bank name is matched exactly, not as a prefix
    assert not ledger.is_private("body.w") and not ledger.is_private("delta_c.body.w")
    with pytest.raises(PrivacyViolation, match="'assign'"):
        make_ledger(template={"body.w", "assign"})
    with pytest.raises(PrivacyViolation, match="'head.w'"):
        make_ledger(template={"head.w"})
    with pytest.raises(PrivacyViolation, match="'c_i.x'"):
        make_ledger(template={"c_i.x"})
    ledger.new_round(0)
    with pytest.raises(PrivacyViolation, match="client 5 tried to upload 'body.extra' in round 0"):
        ledger.upload(0, 5, {"body.w": W, "body.extra": B})  # outside the declared template


def test_observers_see_every_upload_with_its_round_and_client(monkeypatch):
    ledger = make_ledger()
    local, everywhere = [], []
    ledger.observers.append(lambda r, c, t: local.append((r, c, sorted(t))))
    monkeypatch.setattr(CommunicationLedger, "global_observers", [lambda led, r, c, t: everywhere.append((led, r, c))])
    returned = ledger.upload(4, 9, {"body.w": W})
    assert set(returned) == {"body.w"} and returned["body.w"] is W
    assert local == [(4, 9, ["body.w"])]
    assert everywhere == [(ledger, 4, 9)]


def test_describe_joins_the_declarations():
    assert make_ledger().describe() == "the control-variate delta; the side branch"
    assert make_ledger(side_reveals=None).describe() == "the control-variate delta"
    assert make_ledger(reveals="", side_reveals=None).describe() == "nothing beyond the declared upload"


@pytest.mark.parametrize("side_reveals", [None, "the side branch"])
def test_for_algorithm_reads_each_declaration_into_its_role(side_reveals):
    algorithm = SimpleNamespace(
        personal=("head.",),
        state_prefixes=("v.",),
        reveals="its personal model's distance",
        state_dependent_uploads=("delta.",),
        side_dependent_uploads=("body.",),
    )
    ledger = CommunicationLedger.for_algorithm(algorithm, {"bank"}, {"body.w", "delta.x"}, side_reveals)
    assert ledger.personal == ("head.",) and ledger.state_prefixes == ("v.",)
    assert ledger.state_names == frozenset({"bank"}) and ledger.allowed == frozenset({"body.w", "delta.x"})
    assert ledger.reveals == "its personal model's distance" and ledger.side_reveals == side_reveals
    assert ledger.state_dependent == ("delta.",)
    assert ledger.side_dependent == (("body.",) if side_reveals is not None else ())
