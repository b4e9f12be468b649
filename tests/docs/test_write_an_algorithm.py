"""docs/write_an_algorithm.md: its code block is a working algorithm that ``auto`` runs stacked, with the numbers of
the sequential loop."""

from __future__ import annotations

import logging
import math
import re
import sys
from pathlib import Path

import pytest

from fl_lightning.cli import train_config

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "write_an_algorithm.md"


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


def test_the_page_runs_its_command_and_auto_stacks_it_with_the_loops_numbers(my_algorithm, tmp_path, caplog):
    command = re.search(r"python train.py (--config .*?--run_dir \S+)", PAGE.read_text().replace("\\\n", " "))
    assert command, "the page shows no train.py command"
    args = command.group(1).split()
    assert args[:4] == ["--config", "configs/quickstart.yaml", "--model.algorithm", my_algorithm]
    rest = args[4:]
    rest[rest.index("--trainer.max_steps") + 1] = "2"  # the page's run, shortened
    rest = rest[: rest.index("--run_dir")]
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        auto = train_config([str(ROOT / "configs/quickstart.yaml")], ["--model.algorithm", my_algorithm, *rest],
                            run_dir=tmp_path / "auto")  # fmt: skip
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("executor: ")]
    assert said == ["executor: stacked (ProxSmooth is vectorizable, 4 clients at a time on the cpu)"], said
    loop = train_config(
        [str(ROOT / "configs/quickstart.yaml")],
        ["--model.algorithm", my_algorithm, *rest, "--model.executor", "sequential"],
        run_dir=tmp_path / "loop",
    )
    assert auto["algorithm"] == loop["algorithm"] == "ProxSmooth" and auto["rounds"] == 2
    for key in ("final", "last10", "best", "upload_bytes"):
        assert math.isfinite(auto[key]) and auto[key] == pytest.approx(loop[key], abs=1e-5), key
