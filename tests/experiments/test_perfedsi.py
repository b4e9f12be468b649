"""PerFedSI (issue 5): the concat and mask formulas, the feature shift, side information (z itself stays on the
client; what the uploads reveal about it is declared and tested in properties/test_privacy.py), BatchNorm averaging, the
synthetic matrix completion and the linear bias toy."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from datamodules import (
    ClientEmbedding,
    ClientOneHot,
    DigitsShiftDataModule,
    FeatureShift,
    MissingSideInfo,
    NoisySideInfo,
    ShiftOneHot,
)
from datamodules.feature_shift import affine_shift
from experiments.side_information import federated_imc, imc_problem, linear_bias_toy
from fl_lightning.algorithms import FedAvg, FedPer, LGFedAvg
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import ConvNet4, PerFedSIConcat, PerFedSIMask
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import make_trainer


# ---- independent references: plain torch ops on the model's weights --------------------------------------
def ref_block(h: torch.Tensor, sd: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    """Conv3×3(pad 1) → BatchNorm (eval: running statistics) → ReLU → MaxPool 2×2."""
    h = F.conv2d(h, sd[p + "conv.weight"], sd[p + "conv.bias"], padding=1)
    scale = sd[p + "bn.weight"] / torch.sqrt(sd[p + "bn.running_var"] + 1e-5)
    h = (h - sd[p + "bn.running_mean"][:, None, None]) * scale[:, None, None] + sd[p + "bn.bias"][:, None, None]
    return F.max_pool2d(h.clamp(min=0), 2)


def randomize(net: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Non-trivial weights and BN statistics; eval mode; returns the state dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(net.named_parameters()) + list(net.named_buffers()):
            if name.endswith("running_var"):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            else:
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
    net.eval()
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_concat_branch_is_h_of_concatenation_and_a_client_logit_bias():
    net = PerFedSIConcat(num_classes=7, side_dim=5, in_channels=1, image_size=16, width=4)
    sd = randomize(net)
    x, z = torch.randn(3, 1, 16, 16), torch.randn(3, 5)
    g = x
    for i in range(1, 5):
        g = ref_block(g, sd, f"body.conv{i}.")
    g = g.flatten(1)  # G(x): 4·1·1
    w = F.linear(z, sd["side.embed.fc.weight"], sd["side.embed.fc.bias"]).view(3, 4, 3, 3)
    w = ref_block(w, sd, "side.embed.conv.").flatten(1)  # W(z): Linear → (width, 3, 3) → conv block
    expected = torch.cat([g, w], 1) @ sd["head.weight"].T + sd["head.bias"]
    out = net(x, z)
    assert_close_finite(out, expected, rtol=1e-5, atol=1e-6)
    assert g.shape[1] == net.embedding_dim == 4 and net.head.in_features == 4 + 4
    # H linear ⇒ f = H'G(x) + H''W(z) + b: changing z shifts every input's logits by the same vector
    z2 = torch.randn(1, 5).expand(3, 5)
    shift = net(x, z2) - net(x, z[:1].expand(3, 5))
    assert_close_finite(shift, shift[:1].expand(3, 7), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask", ["fixed", "learned"])
def test_mask_branch_is_h_of_elementwise_product(mask):
    net = PerFedSIMask(num_classes=6, groups=4, mask=mask, in_channels=2, image_size=16, width=8)
    sd = randomize(net, seed=1)
    x = torch.randn(4, 2, 16, 16)
    z = torch.eye(4)[[2, 0, 3, 1]]
    g = x
    for i in range(1, 4):
        g = ref_block(g, sd, f"body.conv{i}.")  # G(x) = conv-3 features, [4, 8, 2, 2]
    if mask == "fixed":  # reading (a): channel c belongs to group c // (8/4)
        w = torch.stack([z[:, c // 2] for c in range(8)], 1)
    else:  # reading (b): W(z) = Wᵀz
        w = z @ sd["side.embed.weight"].T
    h = ref_block(g * w[:, :, None, None], sd, "head.conv4.").flatten(1)
    expected = h @ sd["head.fc.weight"].T + sd["head.fc.bias"]
    assert_close_finite(net(x, z), expected, rtol=1e-5, atol=1e-6)
    if mask == "fixed":  # a one-hot z zeroes exactly 3/4 of the conv-3 channels
        w_model = net.side.embed(z)
        assert (w_model == 0).sum(1).tolist() == [6, 6, 6, 6] and torch.equal(w_model, w)
        assert net.side(net.body(x), z)[w_model == 0].abs().sum() == 0
    else:  # initialised to ones: starts as "no mask" (Remark 2.2)
        assert torch.equal(PerFedSIMask(mask="learned").side.embed.weight, torch.ones(64, 4))


def test_side_batchnorm_keeps_and_uses_per_group_statistics():
    net = PerFedSIMask(num_classes=6, groups=4, mask="fixed", in_channels=1, image_size=16, width=8, norm="side")
    sd = randomize(net, seed=2)
    x, z = torch.randn(4, 1, 16, 16), torch.eye(4)[[3, 1, 0, 1]]
    g = x
    for i in range(1, 4):
        g = ref_block(g, sd, f"body.conv{i}.")
    w = torch.stack([z[:, c // 2] for c in range(8)], 1)
    h = F.conv2d(g * w[:, :, None, None], sd["head.conv4.conv.weight"], sd["head.conv4.conv.bias"], padding=1)
    mean, var = z @ sd["head.conv4.bn.running_mean"], z @ sd["head.conv4.bn.running_var"]  # each sample's group row
    h = (h - mean[:, :, None, None]) / torch.sqrt(var[:, :, None, None] + 1e-5)
    h = h * sd["head.conv4.bn.weight"][:, None, None] + sd["head.conv4.bn.bias"][:, None, None]
    expected = F.max_pool2d(h.clamp(min=0), 2).flatten(1) @ sd["head.fc.weight"].T + sd["head.fc.bias"]
    assert_close_finite(net(x, z), expected, rtol=1e-5, atol=1e-6)
    # training on a batch of group 2 moves only row 2 of the statistics, by momentum 0.1 towards the batch's
    net.train()
    before = {n: b.clone() for n, b in net.named_buffers() if n.startswith("head.conv4.bn")}
    feats = net.side(net.body(x), torch.eye(4)[[2] * 4])
    pre = net.head.conv4.conv(feats)
    net(x, torch.eye(4)[[2] * 4])
    rm, rv = net.head.conv4.bn.running_mean, net.head.conv4.bn.running_var
    assert_close_finite(rm[[0, 1, 3]], before["head.conv4.bn.running_mean"][[0, 1, 3]])
    assert_close_finite(rm[2], 0.9 * before["head.conv4.bn.running_mean"][2] + 0.1 * pre.mean((0, 2, 3)))
    assert_close_finite(rv[2], 0.9 * before["head.conv4.bn.running_var"][2] + 0.1 * pre.var((0, 2, 3)))


def test_bad_model_configs_are_one_line_errors():
    with pytest.raises(ConfigError, match="do not split into 3 groups"):
        PerFedSIMask(groups=3, width=64)
    with pytest.raises(ConfigError, match="too small"):
        ConvNet4(image_size=8)
    with pytest.raises(ConfigError, match="'fixed' or 'learned'"):
        PerFedSIMask(mask="soft")
    with pytest.raises(ConfigError, match="'shared' or 'side'"):
        PerFedSIMask(norm="group")


# ---- feature shift --------------------------------------------------------------------------------------
def test_rotations_move_a_known_pixel_clockwise():
    img = torch.zeros(1, 1, 6, 6)
    img[0, 0, 1, 4] = 1.0  # row 1, column 4
    n = 6
    expected = {90: (4, n - 1 - 1), 180: (n - 1 - 1, n - 1 - 4), 270: (n - 1 - 4, 1), 0: (1, 4)}
    for rotation, (r, c) in expected.items():
        out = affine_shift(img, rotation, 0.0)[0, 0]
        assert out.sum() == 1 and out[r, c] == 1, rotation


def test_clockwise_shear_tilts_a_vertical_stroke_to_the_right_at_the_top():
    n, col = 33, 16
    img = torch.zeros(1, 1, n, n)
    img[0, 0, :, col] = 1.0
    for shear in (3.0, 6.0, 9.0):
        out = affine_shift(img, 0.0, shear)[0, 0]
        rows = torch.arange(4, n - 4)  # away from the border
        centroid = (out[rows] * torch.arange(n)).sum(1) / out[rows].sum(1)
        expected = col - math.tan(math.radians(shear)) * (rows - (n - 1) / 2)
        assert_close_finite(centroid, expected.float(), rtol=0, atol=0.05)


def test_feature_shift_applies_each_clients_group_to_its_train_and_test_images():
    img = torch.zeros(1, 1, 9, 9)
    img[0, 0, 1:7, 2] = 1.0
    img[0, 0, 6, 2:6] = 1.0  # an "L"
    x = img.repeat(8, 1, 1, 1)
    ptr = torch.tensor([0, 2, 4, 6, 8])
    split = ClientSplit(x, torch.zeros(8, dtype=torch.long), ptr)
    fed = FederatedData(split, ClientSplit(x.clone(), split.y, ptr), 10)
    shift = FeatureShift()
    groups = shift.assign_groups(4, np.random.default_rng(0))
    assert sorted(groups.tolist()) == [0, 1, 2, 3]  # balanced
    out = shift.apply(fed, groups)
    paper = {0: (90, 3), 1: (180, 6), 2: (270, 9), 3: (0, 0)}
    for c, g in enumerate(groups.tolist()):
        rotation, shear = paper[g]
        want = torch.rot90(img, -rotation // 90, dims=(2, 3))
        if shear:
            want = affine_shift(want, 0.0, shear)
        for split_ in (out.train, out.test):
            xc, _ = split_.client(c)
            assert_close_finite(xc, want.expand(2, 1, 9, 9))
    assert torch.equal(out.extras["shift_group"], groups)


# ---- side information -----------------------------------------------------------------------------------
def fake_federation(num_clients: int) -> FederatedData:
    x = torch.zeros(num_clients, 1)
    split = ClientSplit(x, torch.zeros(num_clients, dtype=torch.long), torch.arange(num_clients + 1))
    return FederatedData(split, split, 2, extras={"shift_group": torch.arange(num_clients) % 4})


def test_one_hot_noisy_and_missing_side_information():
    fed = fake_federation(400)
    rng = np.random.default_rng(0)
    one_hot = ShiftOneHot(4)(fed, rng)
    assert torch.equal(one_hot, F.one_hot(torch.arange(400) % 4, 4).float())
    assert torch.equal(ClientOneHot()(fed, rng), torch.eye(400))
    noisy = NoisySideInfo(ShiftOneHot(4), std=0.5)(fed, np.random.default_rng(1))
    assert abs(float((noisy - one_hot).std()) - 0.5) < 0.03 and abs(float((noisy - one_hot).mean())) < 0.03
    missing = MissingSideInfo(ShiftOneHot(4), fraction=0.25)(fed, np.random.default_rng(2))
    blank = missing.abs().sum(1) == 0
    assert int(blank.sum()) == 100 and torch.equal(missing[~blank], one_hot[~blank])
    mean_fill = MissingSideInfo(ShiftOneHot(4), fraction=0.25, fill="mean")(fed, np.random.default_rng(2))
    assert_close_finite(mean_fill[blank], one_hot[~blank].mean(0).expand(100, 4))
    with pytest.raises(ConfigError, match="needs a feature shift"):
        ShiftOneHot()(FederatedData(fed.train, fed.test, 2), rng)


def test_client_embedding_is_the_mean_body_output_of_a_centrally_trained_group_classifier():
    provider = ClientEmbedding(group="shift_group", epochs=2, lr=0.05, width=8)
    dm = DigitsShiftDataModule(num_clients=8, seed=0, side=provider)
    dm.setup("fit")
    fed, net = dm.federated, provider.trained_network
    assert fed.side.shape == (8, 8)  # width 8, 16×16 → 1×1 after four pools
    assert net.head.out_features == 4  # a 4-way group (shift) classifier
    net.eval()
    with torch.no_grad():
        for c in range(8):
            xc, _ = fed.train.client(c)
            assert_close_finite(fed.side[c], net.body(xc).mean(0), rtol=1e-4, atol=1e-5)
    assert provider.train_accuracy > 0.5  # it learned to tell the shift groups apart (chance: 0.25)
    with pytest.raises(ConfigError, match="alphabet"):
        DigitsShiftDataModule(num_clients=4, seed=0, side=ClientEmbedding(epochs=0)).setup("fit")


# ---- the engine with side information -------------------------------------------------------------------
def observe_uploads(module: FederatedModule, sink: list) -> None:
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: sink.append((c, {n: v.clone() for n, v in t.items()})))

    module.attach_data = attach_and_observe


def test_mask_upload_reveals_the_side_group_as_declared_and_bn_buffers_are_averaged():
    """PerFedSI's mask model uploads every parameter and BN buffer (no other name, no z), but the learned mask's
    update moves only the client's column of W: the upload reveals the side group, which the ledger records
    as side-dependent (``Mask.reveals``, ``tests/properties/test_privacy.py``)."""
    torch.manual_seed(0)
    net = PerFedSIMask(10, 4, "learned", in_channels=1, image_size=16, width=8)
    dm = DigitsShiftDataModule(num_clients=8, clients_per_round=4, seed=0)
    module = FederatedModule(FedAvg(1), net, lr=0.05, aggregation="uniform", eval_every=100, eval_last=0)
    seen: list = []
    observe_uploads(module, seen)
    before = {n: b.clone() for n, b in net.named_buffers()}
    trainer = make_trainer(1)
    trainer.fit(module, datamodule=dm)
    side = dm.federated.side
    everything = {n for n, _ in net.named_parameters()} | {n for n, _ in net.named_buffers()}
    assert len(seen) == 4 and not FedAvg().personal
    for _, upload in seen:
        assert set(upload) == everything  # PerFedSI: every parameter and BN buffer is global, nothing else
    record = module.ledger.history[-1]
    assert record.side_dependent_bytes == record.bytes > 0 and "group" in module.ledger.describe()
    # the side branch saw each client's own z: the learned mask's moved columns are the client's one-hot group
    for client, upload in seen:
        moved = (upload["side.embed.weight"] - 1).abs().sum(0) > 0
        assert moved.tolist() == side[client].bool().tolist()
    # BatchNorm statistics: the new global buffer is the unweighted mean of the uploaded local ones
    for n, b in net.named_buffers():
        assert not torch.equal(b, before[n])
        assert_close_finite(b, torch.stack([u[n] for _, u in seen]).mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "algorithm,personal",
    [(FedPer(1), ["head."]), (LGFedAvg(1, personal=("body.conv1.", "body.conv2.")), ["body.conv1.", "body.conv2."])],
)
def test_baselines_keep_their_personal_layers_and_bn_on_the_client(algorithm, personal):
    net = ConvNet4(10, in_channels=1, image_size=16, width=8)
    module = FederatedModule(algorithm, net, lr=0.05, eval_every=100, eval_last=0)
    seen: list = []
    observe_uploads(module, seen)
    make_trainer(1).fit(module, datamodule=DigitsShiftDataModule(num_clients=8, clients_per_round=2, seed=0))
    names = {n for n, _ in net.named_parameters()} | {n for n, _ in net.named_buffers()}
    mine = {n for n in names if any(n.startswith(p) for p in personal)}
    assert mine and all(set(upload) == names - mine for _, upload in seen)
    if "body.conv1." in personal:  # SR/PR split includes the blocks' BatchNorm statistics
        assert "body.conv1.bn.running_mean" in module.bank.names


def write_cifar10(root, per_file: int = 40) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        blob = {"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8), "labels": list(range(10)) * 4}
        (folder / name).write_bytes(pickle.dumps(blob))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))


def test_cifar_shift_config_runs_end_to_end_through_train_py(tmp_path):
    from fl_lightning.cli import run

    write_cifar10(tmp_path)
    summary = run(
        [
            "--config", "configs/perfedsi/cifar10_m100.yaml",
            "--config", "configs/perfedsi/perfedsi_mask.yaml",
            "--data.init_args.base.init_args.num_clients", "8",
            "--data.init_args.base.init_args.data_dir", str(tmp_path),
            "--model.network.init_args.width", "8",
            "--trainer.max_steps", "2",
            "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false",
            "--run_dir", str(tmp_path / "run"),
        ]
    )  # fmt: skip
    assert summary["rounds"] == 2 and 0 <= summary["final"] <= 1


# ---- synthetic experiments ------------------------------------------------------------------------------
def test_matrix_completion_converges_linearly_with_side_information_only():
    rounds = 1000
    for seed in range(3):
        problem = imc_problem(seed=seed)  # d=16, M=20, k=4, r=2, 5 observed items per client
        assert np.bincount(problem.observed.ravel(), minlength=16).min() >= 2
        assert_close_finite(problem.L_star, problem.U_star @ problem.V_star.T @ problem.Z.T, rtol=1e-7, atol=0.0)
        with_si = federated_imc(problem, "given", rounds=rounds, seed=seed)
        assert with_si[-1] < 1e-5, (seed, with_si[-1])
        # linear convergence: log-error is a straight line in the rounds (after a short warm-up)
        t = np.arange(100, rounds + 1)
        log_err = np.log10(with_si[t])
        slope, intercept = np.polyfit(t, log_err, 1)
        r2 = 1 - ((log_err - (slope * t + intercept)) ** 2).sum() / ((log_err - log_err.mean()) ** 2).sum()
        assert slope < 0 and r2 > 0.95, (seed, slope, r2)
        for side in ("one_hot", "none"):  # the original problem (z = e_m) and a single shared prediction
            without = federated_imc(problem, side, rounds=rounds, seed=seed)
            assert without[-1] >= 100 * with_si[-1], (seed, side, without[-1], with_si[-1])


def test_imc_stochastic_step_is_the_gradient_of_the_local_loss_in_expectation():
    problem = imc_problem(seed=0)
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal((16, 2)), rng.standard_normal((4, 2))
    m = 3
    zm = problem.Z[m]
    # analytic gradient of L_m = ½ Σ_i (e_iᵀ(UVᵀ − M*) z_m)² scaled by 1/d (uniform item): E[e eᵀ] = I/d
    err = (u @ v.T - problem.U_star @ problem.V_star.T) @ zm  # d
    grad_u = np.outer(err, v.T @ zm) / 16
    grad_v = np.outer(zm, err @ u) / 16
    # the per-item SGD step of federated_imc, averaged over all d items
    gu, gv = np.zeros_like(u), np.zeros_like(v)
    for i in range(16):
        res = u[i] @ v.T @ zm - problem.L_star[i, m]
        gu[i] += res * (v.T @ zm) / 16
        gv += res * np.outer(zm, u[i]) / 16
    assert_close_finite(gu, grad_u, rtol=1e-7, atol=1e-12)
    assert_close_finite(gv, grad_v, rtol=1e-7, atol=1e-12)


def test_linear_toy_bias_floor_without_side_information_and_zero_error_with_it():
    for seed in range(3):
        without = linear_bias_toy(False, clients_per_round=50, seed=seed)
        floor = without.bias_floor  # closed form (b_m − b̄)²
        assert_close_finite(without.bias_error, floor, rtol=0.01, atol=0.01 * floor.mean())
        assert_close_finite(without.excess_risk, 0.5 * floor, rtol=0.01, atol=0.01 * floor.mean())
        with_si = linear_bias_toy(True, clients_per_round=50, seed=seed)
        assert with_si.excess_risk.max() < 1e-3 * max(floor.mean(), 1.0)
        # the spec's partial participation (10 of 50 clients per round) lands on the same floor on average
        partial = linear_bias_toy(False, seed=seed)
        assert abs(partial.bias_error.mean() / floor.mean() - 1) < 0.1
        assert linear_bias_toy(True, seed=seed).excess_risk.max() < 1e-3


def write_omniglot(root, alphabets: int = 2, characters: int = 3, drawings: int = 20) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for a in range(alphabets):
        part = "images_background" if a % 2 == 0 else "images_evaluation"
        for c in range(characters):
            folder = root / "omniglot-py" / part / f"Alphabet_{a}" / f"character{c:02d}"
            folder.mkdir(parents=True)
            for d in range(drawings):
                pixels = (rng.random((20, 20)) > 0.2).astype(np.uint8) * 255
                Image.fromarray(pixels).save(folder / f"{c:02d}_{d:02d}.png")


def test_omniglot_concat_config_with_alphabet_embedding_runs_end_to_end(tmp_path):
    from fl_lightning.cli import run

    write_omniglot(tmp_path)
    summary = run(
        [
            "--config", "configs/perfedsi/omniglot_m50.yaml",
            "--config", "configs/perfedsi/perfedsi_concat.yaml",
            "--data.init_args.base.init_args.num_clients", "2",
            "--data.init_args.base.init_args.data_dir", str(tmp_path),
            "--data.init_args.side.init_args.epochs", "1",
            "--data.init_args.side.init_args.width", "8",
            "--model.network.init_args.width", "8",
            "--model.network.init_args.side_dim", "32",  # 8 channels · 2 · 2 for 32×32 images
            "--trainer.max_steps", "2",
            "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false",
            "--run_dir", str(tmp_path / "run"),
        ]
    )  # fmt: skip
    assert summary["rounds"] == 2 and 0 <= summary["final"] <= 1
