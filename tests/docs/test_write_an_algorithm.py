"""docs/write_an_algorithm.md: its code block is a working algorithm that ``auto`` runs stacked, with the numbers of
the sequential loop."""

from __future__ import annotations

import importlib
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from fl_lightning.cli import train_config

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "write_an_algorithm.md"
#: the run's executor line (``executor.Decision.describe``), which the page quotes
LINE = ("executor: stacked (sgd: fused relu mlp, heads on cached features; eval: shared body) because ProxSmooth is "
        "vectorizable, 4 clients at a time on the cpu")


def page_code() -> str:
    """The page's first ``python`` code block, as a reader copies it."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks, "docs/write_an_algorithm.md has no python block"
    return blocks[0]


@pytest.fixture
def my_algorithm(tmp_path, monkeypatch):
    (tmp_path / "my_algorithm.py").write_text(page_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_algorithm.ProxSmooth"
    sys.modules.pop("my_algorithm", None)


def page_command() -> list[str]:
    """The arguments of the page's ``train.py`` command, before its ``--run_dir``."""
    command = re.search(r"python train.py (--config .*?--run_dir \S+)", PAGE.read_text().replace("\\\n", " "))
    assert command, "the page shows no train.py command"
    args = command.group(1).split()
    return args[: args.index("--run_dir")]


def stated_final() -> float:
    """The ``final`` the page says its command ends with."""
    found = re.search(r"`final`, the mean over the \d+ clients .*? is \*\*([0-9.]+)\*\*", PAGE.read_text(), flags=re.S)
    assert found, "the page states no result to expect"
    return float(found.group(1))


def test_the_page_runs_its_command_to_the_result_it_states_and_auto_stacks_it_with_the_loops_numbers(
    my_algorithm, tmp_path, caplog
):
    args = page_command()
    assert args[:4] == ["--config", "configs/quickstart.yaml", "--model.algorithm", my_algorithm]
    assert args[args.index("--trainer.max_steps") + 1] == "20"
    config, rest = [str(ROOT / args[1])], args[2:]
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        auto = train_config(config, rest, run_dir=tmp_path / "auto")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("executor: ")]
    assert said == [LINE], said
    assert f"`{LINE}`" in PAGE.read_text()  # the line the page quotes
    assert auto["algorithm"] == "ProxSmooth" and auto["rounds"] == 20
    digits = len(str(stated_final()).split(".")[1])
    assert round(auto["final"], digits) == stated_final()
    loop = train_config(config, [*rest, "--model.executor", "sequential"], run_dir=tmp_path / "loop")
    for key in ("final", "last10", "best", "upload_bytes"):
        assert math.isfinite(auto[key]) and auto[key] == pytest.approx(loop[key], abs=1e-5), key


def test_the_pages_closed_form_gradient_is_the_gradient_of_its_penalty(my_algorithm) -> None:
    """``proximal_gradient`` (given to ``Penalty`` as its closed form) is autograd's gradient of ``proximal``."""
    module = importlib.import_module(my_algorithm.rpartition(".")[0])
    algorithm = module.ProxSmooth(mu=0.3)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=g, requires_grad=True), "b": torch.randn(4, generator=g)}
    anchor = {"w": torch.randn(3, 4, generator=g)}
    (expected,) = torch.autograd.grad(algorithm.proximal(params, anchor), [params["w"]])
    closed = algorithm.proximal_gradient(params, anchor)
    assert set(closed) == {"w"}
    torch.testing.assert_close(closed["w"], expected)
    reference = 0.5 * 0.3 * float(((params["w"] - anchor["w"]) ** 2).sum())
    assert float(algorithm.proximal(params, anchor)) == pytest.approx(reference)
