"""The stacked multi-adapter step (``fl_lightning/models/stacked_lora.py``) against the per-client loop written here
in plain torch: K clients with their own LoRA adapters and heads, their losses, gradients and several SGD-with-
momentum steps equal the loop's to 1e-5, while the frozen base runs once per layer over all K clients' rows (not K
times) from the network's one copy; on CUDA too (``-m gpu``). Through the engine: ``train.py`` runs of the shipped
adapter configs on the stacked path (``model.executor: auto``) write the loop's metrics to 1e-5, and their summary's
``ran`` record says the adapters ran stacked."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from fl_lightning.models.stacked_lora import shared_base, stacked_forward, stacked_loss, stacked_names
from tests.helpers.lora_refs import loaded, params_of
from tests.helpers.lora_runs import module, text_data
from tests.helpers.split_models import ROOT
from tests.helpers.tiny_lora import tiny_config, tiny_net, token_batch, write_clients_hf, write_tokenizer
from tests.helpers.training import fit, train_here

K = 4


def clients(net, device):
    """Each client's own adapter and head (drawn around the network's), its inputs and labels."""
    g = torch.Generator().manual_seed(5)
    names = stacked_names(net)
    base = dict(net.named_parameters())
    own = [{n: (base[n].detach().cpu() + 0.1 * torch.randn(base[n].shape, generator=g)).to(device) for n in names}
           for _ in range(K)]  # fmt: skip
    x = torch.stack([token_batch(6, seed=10 + k) for k in range(K)]).to(device)
    y = torch.randint(0, 2, (K, 6), generator=g).to(device)
    return names, own, x, y


def loop_steps(net, own, x, y, steps, lr=0.1, momentum=0.5):
    """The reference: each client alone, a copy of the network with its tensors, torch.optim.SGD over them."""
    out = []
    for k in range(K):
        model = loaded(net, own[k])
        chosen = [p for n, p in model.named_parameters() if n in own[k]]
        opt = torch.optim.SGD(chosen, lr=lr, momentum=momentum)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x[k]), y[k]).backward()
            opt.step()
        out.append({n: p.detach() for n, p in model.named_parameters() if n in own[k]})
    return out


def run(device):
    torch.manual_seed(0)
    net = tiny_net().to(device).eval()
    names, own, x, y = clients(net, device)
    stacked = {n: torch.stack([o[n] for o in own]).requires_grad_(True) for n in names}
    logits = stacked_forward(net, stacked, x)
    for k in range(K):  # forward: each client's logits are its own model's
        want = loaded(net, own[k])(x[k])
        torch.testing.assert_close(logits[k], want, rtol=1e-5, atol=1e-5)
    opt = torch.optim.SGD(list(stacked.values()), lr=0.1, momentum=0.5)
    for _ in range(3):
        opt.zero_grad()
        stacked_loss(net, stacked, x, y).backward()
        opt.step()
    want = loop_steps(net, own, x, y, steps=3)
    for k in range(K):
        for n in names:
            torch.testing.assert_close(stacked[n][k].detach(), want[k][n], rtol=1e-5, atol=1e-5, msg=n)
        moved = sum(float((stacked[n][k] - own[k][n]).abs().max()) for n in names)
        assert moved > 1e-3


def test_stacked_step_equals_the_per_client_loop():
    run("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stacked_step_equals_the_per_client_loop_on_cuda():
    run("cuda")


def test_the_base_runs_once_per_layer_for_all_clients_from_one_copy():
    net = tiny_net().eval()
    names, own, x, y = clients(net, "cpu")
    stacked = {n: torch.stack([o[n] for o in own]) for n in names}
    calls, ptrs = [], set()
    bases = [m for n, m in net.named_modules() if n.endswith("base_layer")]

    def seen(module, args, out):
        calls.append(args[0].shape[0] * args[0].shape[1])  # rows × tokens of the batch it multiplied
        ptrs.add(module.weight.data_ptr())

    hooks = [m.register_forward_hook(seen) for m in bases]
    try:
        stacked_forward(net, stacked, x)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == len(bases)  # one call per adapted layer, not K
    assert all(rows == K * x.shape[1] * x.shape[2] for rows in calls)  # every client's tokens in that one call
    assert ptrs == {m.weight.data_ptr() for m in bases}  # the network's own base weights


def test_the_base_passed_as_one_tensor_seen_k_times_is_used_once_and_a_per_client_base_is_refused():
    """As the engine passes the global model (``[K, ...]`` stride-0 views): the step multiplies by that one tensor,
    so a changed base changes the output; a base stacked with different values per client is refused."""
    net = tiny_net().eval()
    names, own, x, _ = clients(net, "cpu")
    stacked = {n: torch.stack([o[n] for o in own]) for n in names}
    base = {n: p.detach() for n, p in net.named_parameters() if not p.requires_grad}
    expanded = {n: v.expand(K, *v.shape) for n, v in base.items()}
    assert set(shared_base(expanded)) == {n[len("body.") :] for n in base}
    torch.testing.assert_close(stacked_forward(net, {**expanded, **stacked}, x), stacked_forward(net, stacked, x))
    query = next(n for n in base if n.endswith("query.base_layer.weight"))
    other = base[query] + torch.randn(base[query].shape, generator=torch.Generator().manual_seed(1))
    moved = {**expanded, query: other.expand(K, *other.shape)}
    assert not torch.allclose(stacked_forward(net, {**moved, **stacked}, x), stacked_forward(net, stacked, x))
    per_client = {**expanded, query: torch.stack([base[query]] * K)}
    with pytest.raises(ValueError, match="differs per client"):
        stacked_forward(net, {**per_client, **stacked}, x)


# ---- through the engine: the executor's stacked path trains LoRA cohorts with this step ------------------------
def _columns(path: Path) -> dict[str, list[float]]:
    """A CSV's numeric columns (empty cells left out), time columns dropped."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {c: [float(r[c]) for r in rows if r[c] != ""] for c in rows[0] if "time" not in c and not c.endswith("_s")}


def _train(tmp_path: Path, method: str, executor: str) -> Path:
    data, tok = tmp_path / "data", tmp_path / "tok"
    if not data.exists():
        write_clients_hf(data, clients=4, train=6, test=4)
        write_tokenizer(tok)
    run = tmp_path / executor
    args = ["--config", str(ROOT / "configs/adapters/base.yaml"),
            "--config", str(ROOT / f"configs/adapters/{method}.yaml"),
            "--model.network.init_args.model", "null", "--model.network.init_args.layers", "null",
            "--model.network.init_args.config", json.dumps(tiny_config()), "--model.executor", executor,
            "--data.init_args.path", str(data), "--data.init_args.tokenizer", str(tok), "--data.init_args.num_clients",
            "4", "--data.init_args.max_length", "8", "--data.init_args.clients_per_round", "4",
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "1", "--trainer.enable_progress_bar", "false",
            "--run_dir", str(run)]  # fmt: skip
    assert train_here(args) == 0
    return run


@pytest.mark.parametrize("method", ["fedit", *(pytest.param(m, marks=pytest.mark.slow) for m in (
    "fedsa_lora", "ffa_lora", "fedrep", "ditto", "lg_fedavg"))])  # fmt: skip
def test_train_py_on_the_stacked_path_writes_the_loops_metrics(method: str, tmp_path: Path, caplog) -> None:
    """``model.executor: auto`` on a shipped adapter config (Adam, 4 clients a round): the cohort's adapters train in
    one stacked step per minibatch, the log line and ``summary.json``'s ``ran`` say so, and every metric of every
    round (train loss, test loss and accuracy, per client too) equals the sequential loop's to 1e-5."""
    loop = _train(tmp_path, method, "sequential")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        stacked = _train(tmp_path, method, "auto")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("executor: ")]
    assert len(said) == 1 and said[0].startswith("executor: stacked (") and "LoRA adapters stacked" in said[0], said
    ran = json.loads((stacked / "summary.json").read_text())["ran"]
    assert ran["executor"] == "stacked" and "LoRA adapters stacked over one frozen base" in ran["reason"]
    assert json.loads((loop / "summary.json").read_text())["ran"]["executor"] == "sequential"
    for name in ("metrics.csv", "clients.csv"):
        want, got = _columns(loop / name), _columns(stacked / name)
        assert set(want) == set(got) and ("train/loss" in want or name == "clients.csv")
        for column, values in want.items():
            assert len(values) == len(got[column]) > 0, column
            torch.testing.assert_close(torch.tensor(got[column]), torch.tensor(values), rtol=1e-5, atol=1e-5,
                                       msg=f"{name} {column}")  # fmt: skip


def _fit_tiny(tmp_path: Path, algorithm, executor: str, accelerator: str = "cpu"):
    run = fit(module(algorithm, tiny_net(), executor=executor, batch_size=4),
              text_data(tmp_path / executor, clients=6, train=10), rounds=2, accelerator=accelerator)  # fmt: skip
    return params_of(run.net), {k: float(v) for k, v in run.trainer.callback_metrics.items()}


def _stacked_equals_the_loop(tmp_path: Path, accelerator: str) -> None:
    from fl_lightning.algorithms import FedSALoRA

    want, want_metrics = _fit_tiny(tmp_path, FedSALoRA(), "sequential", accelerator)
    got, got_metrics = _fit_tiny(tmp_path, FedSALoRA(), "vectorized", accelerator)
    for n in want:
        torch.testing.assert_close(got[n].cpu(), want[n].cpu(), rtol=1e-5, atol=1e-5, msg=n)
    assert set(got_metrics) == set(want_metrics) and "train/loss" in want_metrics
    for k in want_metrics:
        assert got_metrics[k] == pytest.approx(want_metrics[k], rel=1e-5, abs=1e-5), k


def test_the_stacked_path_equals_the_loop_batch_by_batch(tmp_path: Path) -> None:
    """FedSA-LoRA (A shared, B and the head personal) over 6 clients of 10 texts in minibatches of 4 (a last
    partial one, padded and masked on the stacked path), 2 rounds: the global model and every logged metric of the
    stacked path equal the loop's to 1e-5."""
    _stacked_equals_the_loop(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_stacked_path_equals_the_loop_batch_by_batch_on_cuda(tmp_path: Path) -> None:
    """The same on CUDA, TF32 off (it rounds products to ~1e-3, which would hide the stacking's own error)."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _stacked_equals_the_loop(tmp_path, "gpu")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_a_lora_run_never_stacks_its_clients_with_another_runs() -> None:
    """On the run axis, runs of one config may train their clients in one call; a LoRA run does not (each run holds
    its own base, which one call over the runs would copy per client), whereas the same method on an MLP does."""
    from torch import nn

    from fl_lightning.algorithms import FedIT
    from fl_lightning.experiment.run_axis.cohorts import shares_calls
    from fl_lightning.models import SplitModel

    assert not shares_calls(module(FedIT(), tiny_net()))
    assert shares_calls(module(FedIT(), SplitModel(nn.Linear(3, 4), nn.Linear(4, 2))))
