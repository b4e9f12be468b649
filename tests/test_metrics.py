"""``fl_lightning/metrics.py`` and the reported numbers: ``PerClientScores`` from hand counts, the reported accuracy
as the mean over clients with test data, the summary's last-n mean and the metrics.csv rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor

from fl_lightning.metrics import PerClientScores, client_spread
from tests.helpers.asserts import assert_close_finite
from tests.helpers.split_models import EVAL_EVERY, EVAL_LAST, ROUNDS, read_metrics


# ---- 3. metrics -------------------------------------------------------------------------------------------------
def test_per_client_scores_from_hand_counts():
    """Five clients with (correct, total, summed loss) written out; client 2 has no test data."""
    counts = [(9, 10, 3.0), (1, 4, 6.0), (0, 0, 0.0), (30, 40, 8.0), (0, 2, 5.0)]
    scores = PerClientScores(5)
    for c, (correct, total, loss) in enumerate(counts):
        if total:
            scores.update(c, correct, total, loss)
    out = scores.compute()
    with_data = [0.9, 0.25, 0.75, 0.0]  # clients 0, 1, 3, 4
    assert_close_finite(out["acc_mean"], sum(with_data) / 4, rtol=0, atol=1e-12)  # 0.475, not /5 = 0.38
    assert_close_finite(out["acc_weighted"], 40 / 56, rtol=0, atol=1e-12)  # Σ correct / Σ total
    assert_close_finite(out["loss_mean"], (0.3 + 1.5 + 0.2 + 2.5) / 4, rtol=0, atol=1e-12)
    assert_close_finite(out["acc_per_client"][[0, 1, 3, 4]], with_data, rtol=0, atol=1e-12)


def client_counts(run_dir: Path) -> list[tuple[int, int]]:
    """(correct, total) of every client, computed here: the final global body with the client's own head
    (from the last checkpoint) on the client's own test split, in plain torch."""
    from datamodules import DigitsDataModule, Dirichlet

    dm = DigitsDataModule(num_clients=20, participation=0.2, seed=0, partition=Dirichlet(alpha=0.05, min_samples=5))
    dm.setup("fit")
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    body = {n[len("net.") :]: t for n, t in state.items() if n.startswith("net.body.")}
    heads = {n: state["bank." + n.replace(".", "__")] for n in ("head.weight", "head.bias")}
    assert heads["head.weight"].shape == (20, 10, 16)
    counts = []
    for c in range(20):
        x, y = dm.federated.test.client(c)
        h = torch.relu(x.flatten(1) @ body["body.fc1.weight"].T + body["body.fc1.bias"])
        logits = h @ heads["head.weight"][c].T + heads["head.bias"][c]
        counts.append((int((logits.argmax(-1) == y).sum()), len(y)))
    return counts


def test_reported_accuracy_is_the_mean_over_clients_with_test_data(fedper_run):
    """``acc_mean`` (the papers' metric) = mean over clients with test data of correct/total, each client with
    its own model; ``acc_weighted`` = Σ correct / Σ total. Both from counts computed here."""
    counts = client_counts(fedper_run)
    assert any(t == 0 for _, t in counts)  # the definition must say what happens to a client without test data
    acc = [k / t for k, t in counts if t > 0]
    mean, weighted = sum(acc) / len(acc), sum(k for k, _ in counts) / sum(t for _, t in counts)
    assert abs(mean - weighted) > 1e-3 and abs(mean - sum(acc) / len(counts)) > 1e-3  # the definitions differ
    rows = [r for r in read_metrics(fedper_run / "metrics.csv") if "val/acc_mean" in r]
    last = rows[-1]
    assert int(last["step"]) == ROUNDS - 1
    assert_close_finite(last["val/acc_mean"], mean, rtol=0, atol=1e-6)
    assert_close_finite(last["val/acc_weighted"], weighted, rtol=0, atol=1e-6)
    summary = json.loads((fedper_run / "summary.json").read_text())
    assert_close_finite(summary["final"], mean, rtol=0, atol=1e-9)


EVALUATED = [r for r in range(ROUNDS) if (r + 1) % EVAL_EVERY == 0 or r >= ROUNDS - EVAL_LAST]  # 2, 5, 6, 7, 8, 9


def test_summary_last_n_is_the_mean_of_exactly_n_evaluations(fedper_run):
    """``last10`` (the papers' final-rounds average, N = ``eval_last``) is the mean of the last N evaluations.
    With eval_every = 3 and 10 rounds, rounds 2, 5 and the last four (6–9) are evaluated."""
    assert EVALUATED == [2, 5, 6, 7, 8, 9]
    by_round = {int(r["step"]): r for r in read_metrics(fedper_run / "metrics.csv")}
    values = [by_round[r]["val/acc_mean"] for r in EVALUATED]
    last_n = sum(values[-EVAL_LAST:]) / EVAL_LAST
    assert abs(last_n - sum(values[-EVAL_LAST + 1 :]) / (EVAL_LAST - 1)) > 1e-5  # N − 1 would be detectable
    assert abs(last_n - sum(values[-EVAL_LAST - 1 :]) / (EVAL_LAST + 1)) > 1e-5  # and N + 1
    summary = json.loads((fedper_run / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    assert_close_finite(summary["last10"], last_n, rtol=0, atol=1e-6)
    assert_close_finite(by_round[ROUNDS - 1]["val/acc_last10"], last_n, rtol=0, atol=1e-6)
    history = json.loads((fedper_run / "history.json").read_text())
    assert [h["round"] for h in history] == EVALUATED


def test_metrics_csv_has_evaluations_only_at_evaluated_rounds(fedper_run):
    logged = [int(r["step"]) for r in read_metrics(fedper_run / "metrics.csv") if "val/acc_mean" in r]
    assert logged == EVALUATED


BIG = 2**24 + 1  # the first integer float32 cannot hold (float32 rounds it to 2**24)


# ---- client_spread -------------------------------------------------------------------------------------------
def test_client_spread_without_any_client_with_data_is_nan_under_the_three_names() -> None:
    """Every client has 0 test samples: nothing to spread over, so std, worst10 and worst are all NaN."""
    out = client_spread(torch.tensor([0.7, 0.2, 0.9]), torch.tensor([0, 0, 0]))
    assert sorted(out) == ["std", "worst", "worst10"]
    assert all(isinstance(v, float) and math.isnan(v) for v in out.values()), out
    empty = client_spread(torch.tensor([]), torch.tensor([]), higher_is_better=False)
    assert sorted(empty) == ["std", "worst", "worst10"]
    assert all(math.isnan(v) for v in empty.values()), empty


def test_client_spread_of_a_single_client_with_data_is_that_client() -> None:
    """One client with test data (the others have none): std 0, worst10 = worst = its value."""
    values, samples = torch.tensor([0.25, 0.6, 0.8]), torch.tensor([0, 4, 0])
    for higher in (True, False):
        out = client_spread(values, samples, higher_is_better=higher)
        assert_close_finite(out["std"], 0.0)
        assert_close_finite(out["worst10"], 0.6, rtol=1e-6)
        assert_close_finite(out["worst"], 0.6, rtol=1e-6)


# ---- PerClientScores -----------------------------------------------------------------------------------------
def test_per_client_scores_update_accumulates_over_calls() -> None:
    """Two updates of the same client add up (a client scored in two slices of 2048 samples)."""
    m = PerClientScores(2)
    m.update(0, 3.0, 4, 2.0)
    m.update(0, 1.0, 6, 3.0)
    m.update(1, 2.0, 5, 1.0)
    out = m.compute()
    assert_close_finite(out["samples_per_client"], torch.tensor([10.0, 5.0], dtype=torch.float64))
    assert_close_finite(out["acc_per_client"], torch.tensor([4 / 10, 2 / 5], dtype=torch.float64))
    assert_close_finite(out["loss_per_client"], torch.tensor([5 / 10, 1 / 5], dtype=torch.float64))
    assert_close_finite(out["acc_weighted"], 6 / 15)


def test_per_client_scores_client_with_one_sample_is_divided_by_one() -> None:
    """A client with a single test sample: its accuracy and loss are its own (not halved); a client without
    samples reads 0 and is left out of the means; the weighted accuracy over one sample is that sample's."""
    m = PerClientScores(3)
    m.update(0, 1.0, 1, 0.75)
    m.update(2, 1.0, 4, 2.0)
    out = m.compute()
    assert_close_finite(out["acc_per_client"], torch.tensor([1.0, 0.0, 0.25], dtype=torch.float64))
    assert_close_finite(out["loss_per_client"], torch.tensor([0.75, 0.0, 0.5], dtype=torch.float64))
    assert_close_finite(out["acc_mean"], (1.0 + 0.25) / 2)
    assert_close_finite(out["loss_mean"], (0.75 + 0.5) / 2)
    single = PerClientScores(1)
    single.update(0, 1.0, 1, 0.5)
    assert_close_finite(single.compute()["acc_weighted"], 1.0)


def test_per_client_scores_counts_are_exact_beyond_float32() -> None:
    """The sums are float64: 2**24 + 1 samples (and correct predictions, and summed loss) stay exact."""
    m = PerClientScores(2)
    m.update(0, float(BIG), BIG, float(BIG))
    m.update(1, 1.0, 2, 1.0)
    out = m.compute()
    assert float(out["samples_per_client"][0]) == float(BIG)
    assert out["samples_per_client"].dtype == torch.float64
    assert float(out["acc_per_client"][0]) == 1.0
    assert float(out["loss_per_client"][0]) == 1.0
    assert float(out["acc_weighted"]) == (BIG + 1) / (BIG + 2)


def _two_ranks(rank0: PerClientScores, rank1: PerClientScores) -> None:
    """Make ``rank0`` sync as if ``rank1`` were the other process: the gather returns both ranks' state."""
    other = {"correct": rank1.correct, "total": rank1.total, "loss_sum": rank1.loss_sum}

    def gather(t: Tensor, group: object = None) -> list[Tensor]:
        name = next(n for n in other if getattr(rank0, n) is t)
        return [t, other[name]]

    rank0.dist_sync_fn = gather
    rank0.distributed_available_fn = lambda: True


def test_per_client_scores_sum_every_rank_clients_on_compute() -> None:
    """Two ranks each score their own clients (0 and 2 on rank 0, 1 on rank 1): ``compute`` sees every
    client's sums, as if one process had scored them all."""
    r0, r1 = PerClientScores(3), PerClientScores(3)
    r0.update(0, 3.0, 4, 1.0)
    r0.update(2, 1.0, 2, 0.5)
    r1.update(1, 5.0, 5, 2.5)
    r1.update(2, 1.0, 2, 1.5)  # a client both ranks saw: the sums add up
    _two_ranks(r0, r1)
    out = r0.compute()
    assert out["acc_per_client"].shape == (3,)
    assert_close_finite(out["samples_per_client"], torch.tensor([4.0, 5.0, 4.0], dtype=torch.float64))
    assert_close_finite(out["acc_per_client"], torch.tensor([3 / 4, 5 / 5, 2 / 4], dtype=torch.float64))
    assert_close_finite(out["loss_per_client"], torch.tensor([1 / 4, 2.5 / 5, 2 / 4], dtype=torch.float64))
    assert_close_finite(out["acc_weighted"], 10 / 13)
