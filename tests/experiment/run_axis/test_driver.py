"""``fl_lightning/experiment/run_axis/driver.py``: seeds batched in one job equal their solo runs and write
their own run dirs (SCAFFOLD's server variates included), a job resumes from its runs' checkpoints, configs that
cannot share a batch are refused in one line, and a grid's seeds share one parse."""

from __future__ import annotations

import json

import pytest
import torch

from fl_lightning.cli import train_config
from fl_lightning.errors import ConfigError
from fl_lightning.experiment.run_axis import BatchedRuns, check_batchable, parse_config
from fl_lightning.experiment.run_axis.__main__ import main as run_axis_main
from fl_lightning.experiment.run_axis.__main__ import seed_runs
from tests.helpers.run_axis_runs import QUICK, ROOT, assert_same_run, final_state


def test_three_seeds_batched_equal_three_solo_runs_and_write_their_own_run_dirs(tmp_path):
    seeds = [0, 1, 2]
    job = BatchedRuns(seed_runs([*QUICK, "--run_dir", str(tmp_path / "batched")], seeds))
    outcomes = job.run()
    assert [o.status for o in outcomes] == ["done"] * 3, [o.error for o in outcomes]
    assert job.lockstep.executor.calls == 4  # one stacked call per round for the three runs
    partitions = {tuple(m.fed.train.sizes.tolist()) for m in job.modules}
    assert len(partitions) == 3  # each seed has its own partition
    assert len({id(m.fed.train.pool) for m in job.modules}) == 1  # ... of one pooled copy of the rows
    for s in seeds:
        solo = tmp_path / "solo" / f"s{s}"
        train_config([QUICK[1]], [*QUICK[2:], "--seed_everything", str(s)], run_dir=solo)  # sequential executor
        batched = tmp_path / "batched" / f"s{s}"
        for name in ("metrics.csv", "summary.json", "config.yaml", "history.json", "checkpoints/last.ckpt"):
            assert (batched / name).is_file(), name
        assert "seed_everything: " + str(s) in (batched / "config.yaml").read_text()
        assert_same_run(batched, solo)
        rows = (batched / "metrics.csv").read_text().splitlines()
        assert len(rows) == len((solo / "metrics.csv").read_text().splitlines())


@pytest.mark.slow
def test_scaffold_seeds_batched_equal_their_solo_runs_server_variates_included(tmp_path):
    """SCAFFOLD's runs each update their own c (``server_update``) and train in one stacked call per round."""
    scaffold = [
        "--config", str(ROOT / "configs/digits/base.yaml"), "--config", str(ROOT / "configs/digits/scaffold.yaml"),
        "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    job = BatchedRuns(seed_runs([*scaffold, "--run_dir", str(tmp_path / "batched")], [0, 1]))
    assert [o.status for o in job.run()] == ["done"] * 2
    assert job.lockstep.executor.calls == 4
    variates = []
    for s in (0, 1):
        solo = tmp_path / "solo" / f"s{s}"
        train_config([scaffold[1], scaffold[3]], [*scaffold[4:], "--seed_everything", str(s)], run_dir=solo)
        assert_same_run(tmp_path / "batched" / f"s{s}", solo)  # the checkpoint's state_dict holds c
        variates.append(final_state(solo)["algorithm.c__head__weight"])
    assert float(variates[0].abs().max()) > 0 and not torch.equal(variates[0], variates[1])


def test_a_batched_job_resumes_from_its_runs_checkpoints(tmp_path):
    """Runs that crash at different rounds resume together (each from its own last checkpoint) to the result of
    an uninterrupted run."""
    runs = seed_runs([*QUICK, "--checkpoint_every", "1", "--run_dir", str(tmp_path / "job")], [0, 1])
    crashing = [
        [*args, "--trainer.callbacks+=tests.helpers.run_axis_runs.CrashAt", f"--trainer.callbacks.round={r}"]
        for args, r in zip(runs, (1, 3))
    ]
    logs = [tmp_path / "s0.log", tmp_path / "s1.log"]
    first = BatchedRuns(crashing, logs=logs).run()
    assert [o.status for o in first] == ["failed", "failed"] and "crash at round" in first[0].error
    texts = [log.read_text() for log in logs]  # each run's console output in its own log
    assert "crash at round 1" in texts[0] and "crash at round 3" not in texts[0]
    assert "crash at round 3" in texts[1] and "crash at round 1" not in texts[1]
    assert not (tmp_path / "job" / "s0" / "summary.json").exists()
    assert (tmp_path / "job" / "s1" / "checkpoints" / "round00003.ckpt").is_file()
    assert not (tmp_path / "job" / "s0" / "checkpoints" / "round00002.ckpt").exists()  # s0 resumes from round 1
    resumed = BatchedRuns([[*args, "--ckpt_path", "last"] for args in runs]).run()
    assert [o.status for o in resumed] == ["done", "done"], [o.error for o in resumed]
    for s in (0, 1):
        solo = tmp_path / "solo" / f"s{s}"
        train_config([QUICK[1]], [*QUICK[2:], "--seed_everything", str(s)], run_dir=solo)
        assert_same_run(tmp_path / "job" / f"s{s}", solo)


def test_configs_that_cannot_share_a_batch_are_refused_with_one_line(tmp_path, capsys):
    base = ["--config", str(ROOT / "configs/digits/base.yaml")]
    fedavg = [*base, "--config", str(ROOT / "configs/digits/fedavg.yaml")]
    fedrep = [*base, "--config", str(ROOT / "configs/digits/fedrep.yaml")]
    wide = [*fedavg, "--model.network.init_args.hidden=[256,64]"]
    configs = [parse_config(a) for a in (fedavg, fedrep, wide)]
    with pytest.raises(ConfigError, match=r"run 1 cannot share a batch with run 0: model.algorithm.class_path "
                                          r'"fl_lightning.algorithms.FedAvg" -> "fl_lightning.algorithms.FedRep" '
                                          r"\(and \d+ more\); a batched job's runs differ only in seed_everything"):
        check_batchable(configs[:2])
    with pytest.raises(ConfigError, match=r"cannot share a batch .*: model.network.hidden \[128, 64\] -> \[256, 64\];"):
        check_batchable([configs[0], configs[2]])
    with pytest.raises(ConfigError, match=r": model.lr 0.05 -> 0.01; "):  # a client learning rate: another job
        check_batchable([parse_config([*fedavg, "--model.lr", "0.05"]), configs[0]])
    with pytest.raises(ConfigError, match=r": model.drop_last false -> true; "):
        check_batchable([configs[0], parse_config([*fedavg, "--model.drop_last", "true"])])
    check_batchable([configs[0], parse_config([*fedavg, "--seed_everything", "3", "--trainer.max_steps", "7"])])
    ddp = parse_config([*fedavg, "--trainer.devices", "2", "--trainer.strategy", "ddp"])
    with pytest.raises(ConfigError, match="one process"):
        check_batchable([configs[0], ddp])
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([fedavg, fedrep]))
    assert run_axis_main(["--runs", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run 1 cannot share a batch")
    assert run_axis_main([*fedavg, "--seeds", "0,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_runs_that_differ_only_in_naming_and_seed_are_parsed_once(monkeypatch):
    """A grid's seeds share one parse (building train.py's parser is a large part of a short batched job)."""
    from fl_lightning.experiment.run_axis import driver

    base = ["--config", str(ROOT / "configs/digits/base.yaml"), "--config", str(ROOT / "configs/digits/fedavg.yaml")]
    seeds = [[*base, f"--seed_everything={s}", "--run_dir", f"/tmp/r/s{s}", f"--wandb.name=s{s}"] for s in range(3)]
    other = [*base, "--model.lr", "0.05", "--seed_everything", "4", "--run_dir=/tmp/r/lr"]
    parsed: list[list[str]] = []
    monkeypatch.setattr(driver, "parse_config", lambda a: parsed.append(list(a)) or parse_config(a))
    configs = driver.parse_configs([*seeds, other])
    assert parsed == [seeds[0], other]
    assert configs[0] is configs[1] is configs[2] and configs[3]["model"]["lr"] == 0.05
    assert configs[0]["model"] == parse_config(seeds[2])["model"]
