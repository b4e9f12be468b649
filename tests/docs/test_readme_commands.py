"""Every command of the README, run as a new user would (issue 45), at its smallest size, or named with the reason
it is not run here.

* :func:`readme_commands` collects every command line of the README: the fenced ``bash`` blocks, the indented
  command blocks, and the commands of the Reproductions table; :data:`RUN_HERE`, :data:`RUN_ELSEWHERE` and
  :data:`NOT_RUN` together must name each of them exactly (a command added to the README without a test fails
  ``test_every_readme_command_is_run_by_a_test_or_named_as_not_run``).
* ``train.py`` lines run in order, in a fresh folder that sees the repository's ``configs/`` (and an ``X.yaml``, the
  placeholder of "fit, validate, test", copied from the quickstart, so that its run dir is ``runs/X``), after
  ``make train``'s job. Rounds are cut to 2 (the resume's 150 to 3) with a checkpoint every round, so the default
  run keeps round00001 and round00002, and the ``test`` line's ``round00090`` (the next-to-last checkpoint a default
  100-round run keeps) becomes round00001.
* The experiment runner's and the run axis' lines run in order with ``trainer.max_steps`` set to 2 (``--set`` for the
  runner, the dotted option for the run axis); ``FILE.yaml`` is the quick experiment under another name.
* ``make reproduce`` runs every runner of ``python -m experiments``: each runs here at its smallest size
  (:data:`SMALLEST`), or in the test named in :data:`REPRODUCE_ELSEWHERE`.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.training import train_here

ROOT = Path(__file__).resolve().parents[2]
#: the sections whose ``train.py`` lines ``test_the_readme_train_py_commands_run_in_order_at_reduced_rounds`` runs
TRAIN_SECTIONS = ("## Running experiments", "### fit, validate, test", "### Optimisers and learning-rate schedules",
                  "## Differential privacy")  # fmt: skip


def _normal(line: str) -> str:
    """A command line without its comment, the ``.venv/bin/`` prefix and repeated spaces."""
    words = shlex.split(line, comments=True)
    return " ".join(w.removeprefix(".venv/bin/") for w in words)


def _blocks(text: str) -> list[str]:
    """The command blocks of ``text``: fenced ``bash`` blocks, and indented blocks (4 spaces, after a blank line)."""
    fenced = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    indented = re.findall(r"(?<=\n\n)((?: {4}\S.*\n)+)", outside)  # two blocks may share one blank line
    return fenced + ["\n".join(ln[4:] for ln in block.splitlines()) for block in indented]


def block_commands(text: str) -> list[str]:
    """Every command line of ``text``'s command blocks (continuation lines joined; comments, ``#!``/``#SBATCH``
    lines and blank lines dropped), normalised by :func:`_normal`."""
    out = []
    for block in _blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(_normal(line))
    return out


def readme_commands() -> list[str]:
    """Every command of the README, in order: its command blocks, then the commands of the Reproductions table's
    first column and ``make reproduce`` (named in its prose)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Reproductions") :]
    section = section[: section.index("\n## ", 1)]
    table = [_normal(m) for m in re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)]
    assert "`make reproduce`" in section
    return list(dict.fromkeys([*block_commands(text), *table, "make reproduce"]))


def section_train_commands(title: str) -> list[list[str]]:
    """The ``train.py`` command lines of one README section, as argument lists after ``train.py``."""
    text = (ROOT / "README.md").read_text()
    body = text[text.index(title) :]
    body = body[: body.index("\n## ", 1)] if "\n## " in body[1:] else body
    body = body[: body.index("\n### ", 1)] if "\n### " in body[1:] else body
    commands = []
    for line in block_commands(body):
        words = shlex.split(line)
        if words[:2] == ["python", "train.py"]:
            commands.append(words[2:])
    return commands


def train_commands() -> list[list[str]]:
    return [c for title in TRAIN_SECTIONS for c in section_train_commands(title)]


#: commands run by the tests of this file, at reduced size (the test that runs each)
RUN_HERE = {
    **{"python train.py " + shlex.join(c): "test_the_readme_train_py_commands_run_in_order_at_reduced_rounds"
       for c in train_commands()},
    "make train": "test_the_readme_train_py_commands_run_in_order_at_reduced_rounds (its train.py line)",
    **{c: "test_the_readme_experiment_commands_run_in_order_at_reduced_rounds" for c in (
        "python -m fl_lightning.experiment run configs/experiments/quick_digits.yaml --dry-run",
        "python -m fl_lightning.experiment run configs/experiments/quick_digits.yaml",
        "python -m fl_lightning.experiment run FILE.yaml --set trainer.max_steps=5",
        "python -m fl_lightning.experiment compare runs/quick-digits runs/first",
        "python -m fl_lightning.experiment.run_axis --config configs/quickstart.yaml --seeds 0,1,2,3,4",
        "python -m fl_lightning.experiment.run_axis --runs runs.json",
    )},
    **{c: "test_make_reproduce_runs_every_runner_at_its_smallest_size" for c in (
        "make reproduce", "make reproduce-digits", "python -m experiments table1 --dataset digits",
        "python -m experiments mixed_regression", "python -m experiments lowrank_mf", "python -m experiments perfedsi",
    )},
    "python train.py --config configs/quickstart.yaml --config configs/trainer/cpu_ddp.yaml":
        "test_the_cpu_ddp_line_trains_in_two_processes",
}  # fmt: skip

#: commands run at reduced size by a test in another file: command -> "path::test"
RUN_ELSEWHERE = {
    "python -m experiments dp":
        "tests/tools/test_readme_tables.py::test_the_dp_table_renders_the_dp_commands_results_json",
    "python -m experiments representation": "tests/experiments/test_representation.py::test_reproduce_quick",
    "python -m experiments instructions":
        "tests/experiments/test_instructions.py::test_the_command_writes_feddpas_layout_and_a_covering_tokenizer",
    "python train.py --config configs/adapters/instruction_fedit.yaml":
        "tests/configs/test_adapters.py::test_the_instruction_config_runs_on_the_data_its_command_writes",
}  # fmt: skip

#: commands no test runs, and why (each is long, needs hardware, a cluster or a W&B account, or is the suite itself)
NOT_RUN = {
    "make test": "the test suite itself",
    "python -m pytest tests -q": "the test suite itself",
    "python -m pytest tests/engine/test_module.py -q": "one test file of the suite",
    "python -m pytest tests/engine/test_module.py::test_count_upload_accumulates -q": "one test of the suite",
    "python -m pytest tests -m not slow -q": "the suite without its slow tests",
    "python -m pytest tests -m gpu -q": "needs a CUDA machine",
    "make mutation": "hours of mutation testing (tools/mutation_run.py has its own tests)",
    "make mutation MUTANTS=fl_lightning.metrics*": "mutation testing of one module (minutes to hours)",
    "make mutation-report": "reads the verdicts of a mutation run (tests/tools/test_mutation_report.py)",
    "python -m fl_lightning.experiment run configs/experiments/table1_digits.yaml --jobs 2":
        "45 runs in 15 worker processes; the same file runs through `python -m experiments table1` in "
        "test_make_reproduce_runs_every_runner_at_its_smallest_size, and --jobs 2 in the worker_grid fixture "
        "(tests/experiment/conftest.py)",
    "python -m fl_lightning.experiment compare --wandb ENTITY/fl_lightning --group table1-digits --by method "
    "--metric last10,final --format latex": "needs a W&B account and the network (the same code reads a fake W&B API "
                                             "in tests/experiment/test_runner.py)",
    "wandb sweep configs/sweeps/digits_fedrep.yaml": "needs a W&B account and the network",
    "wandb agent ENTITY/PROJECT/SWEEP_ID": "needs a W&B account (test_train_py_accepts_the_arguments_a_sweep_agent_"
                                           "sends parses the agent's arguments)",
    "python train.py --config X.yaml --config configs/trainer/multi_gpu.yaml": "needs several GPUs",
    "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py --config X.yaml "
    "--trainer.accelerator gpu --trainer.devices 4 --trainer.num_nodes 2 --trainer.strategy ddp": "needs 2 GPU nodes",
    "srun python train.py --config X.yaml --config configs/trainer/slurm.yaml": "needs a SLURM cluster",
    "pip install -e .[pretrained]": "an installation (from PyPI: the network)",
    "python -m experiments adapters": "needs the optional `pretrained` package (all-MiniLM-L6-v2), which the test "
                                      "environment lacks; every adapter config trains through train.py on a tiny "
                                      "random BERT in tests/configs/test_adapters.py",
    "python -m fl_lightning.experiment run configs/experiments/pfl_baselines_digits.yaml":
        "30 runs (about 25 min); every run's arguments are parsed by "
        "tests/experiment/test_runner.py::test_the_repository_experiment_files_expand_and_parse",
}  # fmt: skip


def test_every_readme_command_is_run_by_a_test_or_named_as_not_run():
    commands = readme_commands()
    named = {**RUN_HERE, **RUN_ELSEWHERE, **NOT_RUN}
    assert len(named) == len(RUN_HERE) + len(RUN_ELSEWHERE) + len(NOT_RUN)  # each in one list only
    assert [c for c in commands if c not in named] == []  # a README command without a test
    assert [c for c in named if c not in commands] == []  # a stale entry
    assert len(commands) >= 40 and ["--help"] in train_commands()
    for where in RUN_ELSEWHERE.values():  # the named tests exist
        path, test = where.split("::")
        assert f"def {test}(" in (ROOT / path).read_text(), where
    this = Path(__file__).read_text()
    for test in set(RUN_HERE.values()):
        assert f"def {test.split()[0]}(" in this, test


def test_the_readme_test_line_names_a_checkpoint_this_file_maps():
    assert any(c[:1] == ["test"] and "runs/quickstart/checkpoints/round00090.ckpt" in c for c in train_commands())


def reduced(args: list[str]) -> list[str]:
    if "--help" in args or "--print_config" in args:
        return args
    args = [a.replace("round00090.ckpt", "round00001.ckpt") for a in args]
    if "--trainer.max_steps" in args:  # the resume: 50 more rounds of 100 -> 1 more of 2
        i = args.index("--trainer.max_steps")
        args = [*args[: i + 1], "3", *args[i + 2 :]]
    elif args[:1] not in (["validate"], ["test"]):
        args = [*args, "--trainer.max_steps", "2"]
    if "--model.client_lr_schedule.T_max" in args:
        i = args.index("--model.client_lr_schedule.T_max")
        args = [*args[: i + 1], "2", *args[i + 2 :]]
    fast = ["--checkpoint_every", "1", "--trainer.enable_progress_bar", "false", "--wandb.mode", "disabled"]
    return [*args, *fast] if args[:1] not in (["validate"], ["test"]) else [*args, *fast[2:]]


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch) -> Path:
    """A folder as a fresh clone has it: the repository's configs, no runs; W&B off."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "X.yaml").write_text((ROOT / "configs/quickstart.yaml").read_text())
    monkeypatch.setenv("WANDB_MODE", "disabled")
    return tmp_path


def run_train(args: list[str], capsys) -> None:
    try:
        code = train_here(reduced(args))
    except SystemExit as done:  # --print_config and `fit --help` print and exit, as jsonargparse does
        code = done.code or 0
    out = capsys.readouterr()
    assert code == 0, (args, out.err[-1500:])
    assert "Traceback" not in out.err, args


@pytest.mark.slow
def test_the_readme_train_py_commands_run_in_order_at_reduced_rounds(fresh_clone, capsys):
    make_train = ["--config", "configs/quickstart.yaml", "--overwrite", "true"]  # the Makefile's train line
    for args in [make_train, *train_commands()]:
        run_train(args, capsys)
    runs = fresh_clone / "runs"
    first = json.loads((runs / "first/summary.json").read_text())
    assert first["rounds"] == 3  # the resume line continued runs/first
    for name in ("lr0.05", "base_fedavg_ft", "X", "quickstart_fedadam", "adamw_cosine", "digits_fedrep"):
        assert (runs / name / "summary.json").is_file(), name
    tested = json.loads((runs / "quickstart/test.json").read_text())
    assert tested["checkpoint"].endswith("round00001.ckpt") and tested["round"] == 0
    assert (runs / "X/validate.json").is_file()
    assert "epsilon" in json.loads((runs / "digits_fedrep/summary.json").read_text())  # the DP line: ε beside acc
    assert sys.argv  # train_here put sys.argv back


def experiment_commands() -> list[tuple[str, list[str]]]:
    """The runner's and the run axis' lines of the README that :data:`RUN_HERE` names, in README order, as (module,
    arguments)."""
    words = [shlex.split(c) for c in readme_commands()
             if RUN_HERE.get(c) == "test_the_readme_experiment_commands_run_in_order_at_reduced_rounds"]  # fmt: skip
    return [(w[2], w[3:]) for w in words]


@pytest.mark.slow
def test_the_readme_experiment_commands_run_in_order_at_reduced_rounds(fresh_clone, capsys):
    from fl_lightning.experiment.__main__ import main as experiment_main
    from fl_lightning.experiment.run_axis.__main__ import main as run_axis_main

    quick = yaml.safe_load((ROOT / "configs/experiments/quick_digits.yaml").read_text())
    (fresh_clone / "FILE.yaml").write_text(yaml.safe_dump({**quick, "name": "file"}, sort_keys=False))
    run_train(["--config", "configs/quickstart.yaml", "--run_dir", "runs/first"], capsys)  # compare reads it
    two = ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false", "--wandb.mode", "disabled"]
    (fresh_clone / "runs.json").write_text(json.dumps([["--config", "configs/quickstart.yaml", *two, "--run_dir",
                                                        f"runs/listed/s{s}", "--seed_everything", str(s)]
                                                       for s in (0, 1)]))  # fmt: skip
    for module, args in experiment_commands():
        if module == "fl_lightning.experiment":
            if args[:1] == ["run"] and "--dry-run" not in args:
                args = [a if not a.startswith("trainer.max_steps=") else "trainer.max_steps=2" for a in args]
                args = args if "--set" in args else [*args, "--set", "trainer.max_steps=2"]
                args += ["--set", "wandb.mode=disabled", "--set", "trainer.enable_progress_bar=false"]
            code = experiment_main(args)
        else:
            code = run_axis_main(args if "--runs" in args else [*args, *two])
        out = capsys.readouterr()
        assert code == 0, (module, args, out.err[-1500:])
        assert "Traceback" not in out.err + out.out, args
        if "--dry-run" in args:
            assert out.out.count("[new]") == 4 and "python train.py" in out.out
    runs = fresh_clone / "runs"
    for grid in ("quick-digits", "file"):
        summaries = sorted(runs.glob(f"{grid}/*/digits/s*/summary.json"))
        assert len(summaries) == 4 and all(json.loads(p.read_text())["rounds"] == 2 for p in summaries), grid
    assert len(list(runs.glob("quickstart/s*/summary.json"))) == 5  # --seeds 0,1,2,3,4
    assert len(list(runs.glob("listed/s*/summary.json"))) == 2


#: each runner of ``python -m experiments`` (what ``make reproduce`` runs) at its smallest size: its arguments
SMALLEST = {
    "digits": ["--seeds", "1", "--rounds", "1"],
    "table1": ["--dataset", "digits", "--methods", "fedavg", "--seeds", "1", "--rounds", "1"],
    "perfedsi": ["--seeds", "1", "--rounds", "1", "--imc-rounds", "2"],
    "mixed_regression": ["--seeds", "1", "--rounds", "2", "--settings", "C1"],
    "lowrank_mf": ["--draws", "1", "--sketches", "1"],
}
#: the runners that another test runs at a small size
REPRODUCE_ELSEWHERE = {
    "dp": RUN_ELSEWHERE["python -m experiments dp"],
    "representation": RUN_ELSEWHERE["python -m experiments representation"],
    "leaderboard": "tests/experiments/test_leaderboard.py::"
                   "test_the_leaderboard_is_recomputed_from_the_runs_and_a_clean_rerun_gives_the_same_csv",
}  # fmt: skip


def test_make_reproduce_runs_no_runner_that_no_test_runs():
    from experiments.__main__ import available

    assert sorted(available()) == sorted([*SMALLEST, *REPRODUCE_ELSEWHERE, "adapters"])  # adapters: NOT_RUN's reason
    makefile = (ROOT / "Makefile").read_text()
    assert "available()" in makefile and "$(PY) -m experiments $$name" in makefile  # make reproduce loops over them
    for where in REPRODUCE_ELSEWHERE.values():
        path, test = where.split("::")
        assert f"def {test}(" in (ROOT / path).read_text(), where


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALLEST))
def test_make_reproduce_runs_every_runner_at_its_smallest_size(name, fresh_clone, capsys):
    """Each runner prints its table and ends with ``results: PATH`` (its results.json, under ``--out``)."""
    code = importlib.import_module(f"experiments.{name}").main([*SMALLEST[name], "--out", str(fresh_clone / "out")])
    out = capsys.readouterr()
    assert code == 0, out.err[-1500:]
    assert "Traceback" not in out.err
    last = out.out.strip().splitlines()[-1]
    assert last.startswith("results: ") and Path(last.removeprefix("results: ")).is_file(), last


@pytest.mark.slow
def test_the_cpu_ddp_line_trains_in_two_processes(fresh_clone):
    """The README's 2-CPU-process line (``configs/trainer/cpu_ddp.yaml``), 1 round: both ranks train, rank 0 writes
    the summary."""
    import os
    import subprocess

    line = next(shlex.split(c) for c in readme_commands() if c.endswith("configs/trainer/cpu_ddp.yaml"))
    args = [*line[2:], "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false", "--run_dir", "runs/ddp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=fresh_clone, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert json.loads((fresh_clone / "runs/ddp/summary.json").read_text())["rounds"] == 1
