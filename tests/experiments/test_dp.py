"""``python -m experiments dp`` (``experiments/dp.py``): the runs it asks for (each method at each σ and seed, then
Local Only), the records and the table's mean ± std it makes of their summaries, with the training replaced by
summaries chosen here; and the reuse of a finished run (the real runs: ``tests/tools/test_readme_tables.py``)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from experiments import dp


def _accuracy(method: str, sigma: float | None, seed: int) -> float:
    return 0.5 + 0.1 * seed - (0.05 * sigma if sigma is not None else 0.0) + (0.01 if method == "fedrep" else 0.0)


@pytest.fixture
def fake_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    asked: list[tuple] = []

    def run_one(method: str, sigma: float | None, seed: int, rounds: int, runs_dir: Path) -> dict:
        asked.append((method, sigma, seed, rounds))
        epsilon = math.inf if sigma == 0 else 10.0 / sigma if sigma else 0.0
        return {"final": _accuracy(method, sigma, seed), "epsilon": epsilon}

    monkeypatch.setattr(dp, "run_one", run_one)
    monkeypatch.setattr(dp, "plot", lambda path, *a: path.write_bytes(b"png"))
    return asked


def test_every_method_sigma_and_seed_then_local_only(fake_runs, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dp"
    assert dp.main(["--sigmas", "0", "2", "--seeds", "2", "--rounds", "5", "--methods", "fedavg", "fedrep",
                    "--out", str(out)]) == 0  # fmt: skip
    assert fake_runs == [(m, s, seed, 5) for m in ("fedavg", "fedrep") for s in (0.0, 2.0) for seed in (0, 1)] + [
        ("local", None, 0, 5), ("local", None, 1, 5)]  # fmt: skip
    records = json.loads((out / "results.json").read_text())
    acc = [r for r in records if r["metric"] == "acc" and r["method"] == "FedRep"]
    assert [(r["setting"], r["seed"], r["value"]) for r in acc] == [
        (f"sigma={s:g}", seed, pytest.approx(_accuracy("fedrep", s, seed))) for s in (0.0, 2.0) for seed in (0, 1)]
    assert {r["value"] for r in records if r["metric"] == "epsilon" and r["setting"] == "sigma=2"} == {5.0}
    text = capsys.readouterr().out
    accs = [_accuracy("fedavg", 2.0, seed) for seed in (0, 1)]
    cell = f"{100 * statistics.fmean(accs):.1f} ± {100 * statistics.pstdev(accs):.1f}"
    row = next(line for line in text.splitlines() if line.split()[:2] == ["2", "5"])
    assert cell in row and "inf" in next(line for line in text.splitlines() if line.split()[:1] == ["0"])
    local = [_accuracy("local", None, seed) for seed in (0, 1)]
    assert f"Local Only (nothing uploaded, ε = 0): {100 * statistics.fmean(local):.1f}" in text
    assert text.strip().splitlines()[-1] == f"results: {out / 'results.json'}"


def test_no_local_skips_the_reference(fake_runs, tmp_path: Path, capsys) -> None:
    assert dp.main(["--sigmas", "1", "--seeds", "1", "--methods", "ditto", "--no-local", "--out", str(tmp_path)]) == 0
    assert fake_runs == [("ditto", 1.0, 0, 30)]
    assert "Local Only" not in capsys.readouterr().out


def test_a_finished_run_is_reused(tmp_path: Path) -> None:
    run_dir = tmp_path / "fedrep_sigma0.5_seed1_r4"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"final": 0.25, "epsilon": 3.0}))
    assert dp.run_one("fedrep", 0.5, 1, 4, tmp_path) == {"final": 0.25, "epsilon": 3.0}
    local = tmp_path / "local_seed0_r4"
    local.mkdir()
    (local / "summary.json").write_text(json.dumps({"final": 0.5}))
    assert dp.run_one("local", None, 0, 4, tmp_path) == {"final": 0.5}
