"""``tools/readme_tables.py``: the README's generated tables equal what their sources render, and the sources are
what the commands write (``make train``'s table as train.py prints it, ``python -m experiments dp``'s results.json)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import readme_tables  # noqa: E402

from tests.helpers.training import train_here  # noqa: E402


def test_the_readme_tables_are_what_their_sources_render():
    text = (ROOT / "README.md").read_text()
    assert {m.group(2) for m in readme_tables.BLOCK.finditer(text)} == set(readme_tables.SOURCES)
    assert readme_tables.differences(text) == []
    assert readme_tables.main(["--check"]) == 0


def test_check_names_a_block_that_differs_and_write_repairs_it(tmp_path, capsys):
    readme = tmp_path / "README.md"
    good = (ROOT / "README.md").read_text()
    readme.write_text(good.replace("| 4 | 4.44 | 10.1 ± 3.6", "| 4 | 4.44 | 12.0 ± 3.6"))
    assert readme_tables.main(["--check", "--readme", str(readme)]) == 1
    assert "README block 'dp' differs from docs/measured/dp_results.json" in capsys.readouterr().err
    assert readme_tables.main(["--write", "--readme", str(readme)]) == 0
    assert readme.read_text() == good


def test_the_quickstart_source_is_a_default_make_train_run():
    summary = json.loads(readme_tables.SOURCES["quickstart"].read_text())
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    assert summary["rounds"] == config["trainer"]["max_steps"] and summary["algorithm"] == "FedRep"


def test_the_readme_test_example_names_a_checkpoint_a_default_run_keeps():
    """RoundCheckpoint keeps the 2 newest round checkpoints (save_top_k=2 on the step) every --checkpoint_every (10)
    rounds: of the quickstart's 100 rounds, round00090 and round00100."""
    rounds = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())["trainer"]["max_steps"]
    named = re.findall(r"runs/quickstart/checkpoints/round(\d+)\.ckpt", (ROOT / "README.md").read_text())
    assert named and all(int(n) in (rounds - 10, rounds) for n in named)


@pytest.mark.slow
def test_the_quickstart_table_renders_as_train_py_prints_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    args = ["--config", "configs/quickstart.yaml", "--trainer.max_steps", "2", "--run_dir", str(run_dir),
            "--trainer.enable_progress_bar", "false", "--model.algorithm.init_args.head_epochs", "1"]  # fmt: skip
    assert train_here(args) == 0
    printed = [ln.rstrip() for ln in capsys.readouterr().out.splitlines()]
    rendered = readme_tables.quickstart(json.loads((run_dir / "summary.json").read_text())).splitlines()
    table = rendered[1:4]  # header, rule, row (between the fence and "run:")
    start = printed.index(table[0])
    assert printed[start : start + 3] == table


@pytest.mark.slow
def test_the_dp_table_renders_the_dp_commands_results_json(tmp_path, capsys):
    from experiments import dp

    out = tmp_path / "dp"
    args = ["--sigmas", "0", "1", "--seeds", "2", "--rounds", "1", "--methods", "fedrep", "--out", str(out)]
    assert dp.main(args) == 0
    capsys.readouterr()
    records = json.loads((out / "results.json").read_text())
    finals = {(s, seed): json.loads((out / "runs" / f"fedrep_sigma{s}_seed{seed}_r1" / "summary.json").read_text())
              for s in ("0", "1") for seed in (0, 1)}  # fmt: skip
    table = readme_tables.dp(records).splitlines()
    assert table[0] == "| σ | ε | FedRep (body private, head local) |"
    for line, sigma in zip(table[2:4], ("0", "1")):
        accs = [finals[(sigma, seed)]["final"] for seed in (0, 1)]
        eps = finals[(sigma, 0)]["epsilon"]
        shown = "∞" if sigma == "0" else f"{eps:.3g}"
        mean, std = 100 * statistics.fmean(accs), 100 * statistics.pstdev(accs)
        assert line == f"| {sigma} | {shown} | {mean:.1f} ± {std:.1f} |"
    local = [json.loads((out / "runs" / f"local_seed{s}_r1" / "summary.json").read_text())["final"] for s in (0, 1)]
    mean, std = 100 * statistics.fmean(local), 100 * statistics.pstdev(local)
    assert table[-1] == f"Local Only (nothing uploaded, ε = 0), same rounds and seeds: {mean:.1f} ± {std:.1f}."


def test_the_batched_runs_source_is_the_readme_command_at_full_size():
    """The kept results.json is ``--workloads table1_digits digits_4x5 --grid_rounds 100``: Table 1's 15 methods × 3
    seeds and the 4 × 5 grid, 100 rounds, every number equal on both sides."""
    records = json.loads(readme_tables.SOURCES["batched_runs"].read_text())
    settings = {r["experiment"]: r["setting"] for r in records}
    assert settings == {"table1_digits": "table1_digits,methods=15,seeds=3,rounds=100",
                        "digits_4x5": "digits_4x5,methods=4,seeds=5,rounds=100"}  # fmt: skip
    assert all(r["value"] == 0 for r in records if r["metric"] == "max_abs_diff")
    assert "--workloads table1_digits digits_4x5 --grid_rounds 100" in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_the_batched_runs_tables_render_what_the_benchmark_measured(tmp_path, capsys, monkeypatch):
    """``batched_runs --quick`` on the 4 × 5 grid (3 rounds): the rendered tables hold its measured seconds (checked
    by structure, since they are times: each cell is the record's value, each ratio the quotient of the two sides),
    the parts of each side add up to its total CPU seconds, and the printed ceiling is the benchmark's."""
    from benchmarks import batched_runs

    monkeypatch.chdir(ROOT)
    out = tmp_path / "bench"
    assert batched_runs.main(["--quick", "--workloads", "digits_4x5", "--out", str(out)]) == 0
    capsys.readouterr()
    records = json.loads((out / "results.json").read_text())
    value = {(r["method"], r["metric"]): r["value"] for r in records}
    lines = readme_tables.batched_runs(records).splitlines()
    row = [c.strip() for c in lines[2].strip("|").split("|")]
    assert row[0] == "FedAvg, FedProx, Ditto, FedRep of Table 1 (4 methods × 5 seeds, 3 rounds)"
    seconds = [float(x) for x in re.findall(r"([\d.]+) s", row[1] + row[2])]
    ref_cpu, ref_wall, cpu, wall = (value[("default command", m)] for m in ("ref_cpu_s", "ref_wall_s", "cpu_s",
                                                                            "wall_s"))
    assert seconds == [round(ref_cpu, 1), round(ref_wall, 1), round(cpu, 1), round(wall, 1)]
    assert row[3] == f"{ref_cpu / cpu:.2f}×" and row[4] == f"{ref_wall / wall:.2f}×"
    assert row[5] == "0 (every final, last10, best)"
    parts = [[c.strip() for c in line.strip("|").split("|")] for line in lines[6:13]]
    assert [p[0] for p in parts][:2] == ["client training", "client evaluation"] and parts[-1][0] == "everything else"
    for side, column, total in (("sequential", 1, ref_cpu), ("default command", 2, cpu)):
        spent = [value[(side, f"cpu_s:{p[0]}")] for p in parts]
        assert [float(p[column].split(" s")[0]) for p in parts] == [round(v, 1) for v in spent]
        assert sum(spent) == pytest.approx(total)
    ceiling = value[("default command", "speedup_cpu_ceiling")]
    assert lines[-1] == f"Ceiling of the CPU ratio with client training and evaluation free: {ceiling:.2f}× on 4 × 5."
