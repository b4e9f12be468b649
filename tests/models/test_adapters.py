"""``LoRAClassifier`` (``fl_lightning/models/adapters.py``): a Hugging Face transformer with peft LoRA adapters as a
split model. Only adapters and the head train; the per-instance adapter weights equal peft's own per-adapter
scaling; ``package:NAME`` finds a checkpoint shipped zipped inside an installed package; personal patterns that
match nothing are refused in one line; a cohort of 8 clients trains on the one copy of the base weights."""

from __future__ import annotations

import copy
import sys
import zipfile

import pytest
import torch

from fl_lightning.algorithms import FedPer
from fl_lightning.algorithms.fedit import FedIT
from fl_lightning.engine.settings import check_algorithm_fits
from fl_lightning.errors import ConfigError
from fl_lightning.models import LoRAClassifier
from fl_lightning.models import adapters as adapters_module
from tests.helpers.lora_refs import params_of
from tests.helpers.lora_runs import module, text_data
from tests.helpers.tiny_lora import tiny_config, tiny_net, token_batch
from tests.helpers.training import fit


def test_only_the_adapters_and_the_head_train():
    net = tiny_net(("global", "local"))
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in net.named_parameters() if ".lora_" in n or n.startswith("head.")}
    assert {n for n in trained if ".lora_A." in n} and {n for n in trained if ".local." in n}
    frozen = sum(p.numel() for p in net.parameters() if not p.requires_grad)
    assert frozen > sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert set(net.constant_buffers) == {f"{n}" for n, _ in net.named_buffers()}


def test_padding_is_masked_out():
    """Changing what stands in the padded positions' embeddings cannot change the output (attention mask, pooling)."""
    net = tiny_net().eval()
    x = token_batch(4)
    other = copy.deepcopy(net)
    with torch.no_grad():
        other.body.lm.base_model.model.embeddings.word_embeddings.weight[0] += 1.0  # the [PAD] row
    torch.testing.assert_close(net(x), other(x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(net(x), other(x.flip(1)))


def peft_scaled(net, factors):
    net = copy.deepcopy(net)
    for m in net.modules():
        if isinstance(getattr(m, "scaling", None), dict) and hasattr(m, "lora_A"):
            for name, f in factors.items():
                m.scaling[name] *= f
    return net


def test_adapter_weights_equal_peft_scaling_per_instance():
    net = tiny_net(("global", "local")).eval()
    x = token_batch(3, seed=5)
    w = torch.tensor([0.0, 0.4, 1.0])
    with net.adapter_weights({"local": w, "global": 0.5}):
        out = net(x)
    for i in range(3):
        want = peft_scaled(net, {"local": float(w[i]), "global": 0.5})(x[i : i + 1])
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net(x), peft_scaled(net, {})(x))  # outside the block: unweighted
    with pytest.raises(ValueError, match="unknown adapters"):
        with net.adapter_weights({"nope": 1.0}):
            pass


def test_a_checkpoint_shipped_in_a_package_loads_without_download(tmp_path, monkeypatch):
    from transformers import AutoModel

    torch.manual_seed(0)
    cfg = dict(tiny_config())
    from transformers import AutoConfig

    saved = AutoModel.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    saved.save_pretrained(tmp_path / "ckpt")
    pkg = tmp_path / "site" / "tiny_pkg_fl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('resolving the model must not import the package')\n")
    with zipfile.ZipFile(pkg / "model.zip", "w") as zf:
        for f in (tmp_path / "ckpt").iterdir():
            zf.write(f, f.name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(adapters_module, "CACHE", tmp_path / "cache")
    net = LoRAClassifier(2, model="package:tiny_pkg_fl", rank=2, target_modules=["query"])
    assert (tmp_path / "cache" / "tiny_pkg_fl" / "config.json").is_file()
    base = dict(net.body.lm.base_model.model.named_parameters())
    for n, p in saved.named_parameters():
        key = n.replace("query.weight", "query.base_layer.weight").replace("query.bias", "query.base_layer.bias")
        assert torch.equal(base[key], p), n
    assert "tiny_pkg_fl" not in sys.modules


def test_missing_model_sources_are_refused_in_one_line(tmp_path):
    for kw in ({"model": "package:no_such_pkg_fl"}, {"model": str(tmp_path)}, {}):
        with pytest.raises(ConfigError) as err:
            LoRAClassifier(2, **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="target_modules"):
        LoRAClassifier(2, config=tiny_config(), target_modules=["no_such_module"])


def test_a_personal_pattern_matching_nothing_is_refused_in_one_line():
    net = tiny_net()
    glob = params_of(net)
    check_algorithm_fits(FedPer(personal=["*.lora_B", "head.*"]), net, glob, "num_samples")  # both match
    with pytest.raises(ConfigError, match=r"personal prefix '\*.lora_C'") as err:
        check_algorithm_fits(FedPer(personal=["*.lora_B", "*.lora_C"]), net, glob, "num_samples")
    assert "\n" not in str(err.value) and len(str(err.value)) < 1000


@pytest.mark.parametrize("executor", ["sequential", "auto"])
def test_a_cohort_of_8_trains_on_one_copy_of_the_base(tmp_path, executor):
    """Every client forward of a round reads the network's own base tensors (one storage per base weight; no copy
    per client), and the trained tensors are the adapters and the head. In the loop each client runs alone; on the
    stacked path (``auto``) the 8 clients run in one ``client_update`` and each base layer multiplies all 8 clients'
    tokens in one call per minibatch step."""
    net = tiny_net()
    bases = {m: n for n, m in net.named_modules() if n.endswith("base_layer")}
    own = {n: p.data_ptr() for n, p in net.named_parameters() if not p.requires_grad}
    seen: dict[str, set[int]] = {}
    rows: list[int] = []

    def record(mod, args):
        seen.setdefault(bases[mod], set()).add(mod.weight.data_ptr())
        rows.append(args[0].shape[0])

    hooks = [m.register_forward_pre_hook(record) for m in bases]
    calls = []
    original = FedIT.client_update

    def counted(self, ctx, glob, state):
        calls.append(list(ctx.clients) if hasattr(ctx, "clients") else [ctx.client])
        return original(self, ctx, glob, state)

    FedIT.client_update = counted
    try:
        run = fit(module(FedIT(), net, executor=executor), text_data(tmp_path, clients=8, train=4), rounds=1,
                  limit_val_batches=0)  # fmt: skip
    finally:
        FedIT.client_update = original
        for h in hooks:
            h.remove()
    assert sorted(c for call in calls for c in call) == list(range(8))
    assert len(calls) == (8 if executor == "sequential" else 1)
    if executor == "sequential":  # no base call sees more than one client's texts (4 to train, 6 to score)
        assert max(rows) <= 6
    else:  # the step: one full batch of 4 texts a client, the cohort's 32 in each base layer's one call
        assert rows.count(8 * 4) == len(bases), rows
    assert seen and all(ptrs == {own[f"{name}.weight"]} for name, ptrs in seen.items())
    assert all(p.data_ptr() == own[n] for n, p in run.net.named_parameters() if not p.requires_grad)
