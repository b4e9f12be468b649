"""FederatedModule: the Lightning plumbing of a federated run, shared by every algorithm.

One ``training_step`` is one communication round (manual optimisation), read top to bottom:

1. **sample**: the round loader gives the round index and the cohort (a pure function of ``(seed, round)``);
   this rank takes its share (``aggregation.assign_clients``: balanced by training samples, the same split on
   every rank) and draws which clients fail or straggle;
2. **run clients**: the algorithm's ``client_update`` for each of them (``fl_lightning.engine.executor``: the
   sequential loop, or all at once on the stacked path, whichever ``executor.choose_path`` picks);
3. **aggregate**: weighted sums of the uploads and the new client-state rows, summed over ranks in one
   collective (``fl_lightning.engine.aggregation``);
4. **scatter state**: the cohort's new rows go back into the client-state bank;
5. **server step**: the server optimiser steps on the negative mean update (``SGD(lr=1)`` is FedAvg), so
   ``trainer.global_step`` counts rounds;
6. **log** the round.

Evaluation is Lightning's validation loop (``fl_lightning.engine.evaluation``): every ``trainer.val_check_interval``
rounds and in each of the last ``eval_last`` rounds, every client evaluates its own model on its own
validation split (its test split when the DataModule carved none). At the end of ``fit`` the run summary
is built ("+FT" and held-out new clients are evaluated then); ``trainer.test`` reads the test split.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.client import ClientOptimizer, OptimizerCallable, Params, has_batchnorm1d
from fl_lightning.engine import aggregation, compiled, evaluation, executor, lightning_logging
from fl_lightning.engine import checkpoint as checkpoint_entries
from fl_lightning.engine.aggregation import CohortSums, CommunicationLedger, RoundStats, TrainingDiverged
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.evaluation import ClientEvaluation, FineTune, main_metric, mean_of_last, validation_metrics
from fl_lightning.engine.executor import ExecutorName
from fl_lightning.engine.optimizers import OPTIMIZER_ARGS, LRSchedulerCallable, RoundOptimizers
from fl_lightning.engine.privacy import Privacy, PrivacyEngine, PrivateAggregation, check_algorithm
from fl_lightning.engine.sequential import loss_fn_for, state_template
from fl_lightning.engine.settings import FP16_REFUSED, check_algorithm_fits, check_settings
from fl_lightning.engine.state import ClientStateBank, Placement, choose_placement, make_bank
from fl_lightning.engine.summary import run_summary
from fl_lightning.errors import ConfigError
from fl_lightning.metrics import PerClientScores

__all__ = ["FP16_REFUSED", "FederatedModule", "FineTune", "TrainingDiverged"]

lightning_logging.install()  # self.log without Lightning's per-call walk when nothing moves, signatures read once
log = logging.getLogger("fl_lightning")


class FederatedModule(lightning_logging.LeanHooks, L.LightningModule):
    """A federated run of ``algorithm`` on the split model ``network``.

    Args:
        algorithm: the method's math (``fl_lightning.algorithms``).
        network: a ``SplitModel``; its parameters are the initial global (and personal) parameters.
        lr, momentum, weight_decay, batch_size: the clients' local SGD; ``decay_bias=False`` applies weight
            decay to weights only (the FedRep authors' code uses 1e-4 that way; the paper does not say).
        aggregation: weight client uploads ``uniform``-ly or by ``num_samples``.
        server_lr, server_momentum: the server optimiser (SGD; lr 1 and momentum 0 is FedAvg).
        eval_every: the old name of ``trainer.val_check_interval`` (evaluate all clients every this many
            rounds), kept so that existing configs work; when set, it overrides the trainer's interval.
        eval_last: also evaluate in each of the last ``eval_last`` rounds; the summary's ``last10`` is the
            mean over the last ``eval_last`` evaluations.
        finetune: optional "+FT" evaluation at the end of training, under its own names in the summary:
            ``final_ft`` and ``final_ft_{std,worst10,min}`` beside the plain ``final``, ``last10``, ``best`` and
            ``final_{std,worst10,min}``, so X and X+FT come from one training run and never share a name.
        client_dropout: simulated faults: probability that a sampled client fails before reporting.
        stragglers, straggler_budget: probability that a sampled client is a straggler, which stops after
            ``straggler_budget`` of its local SGD steps and reports what it has.
        new_client_finetune: how held-out clients (``datamodule.new_clients``) adapt before they are evaluated
            at the end of training (default: 10 epochs of the head only, ``FineTune.head_only``: FedRep's new-client
            protocol, a fresh head on the learned representation; ``FineTune``'s own default is the whole model).
        executor: ``auto`` (default: the stacked path where it runs and wins, else the loop; logged once),
            ``sequential`` (the reference loop) or ``vectorized`` (``fl_lightning.engine.stacked``: all sampled
            clients at once, frozen-body features computed once, same results); ``executor.choose_path`` decides.
        client_optimizer: any ``torch.optim`` class with its init args (``{class_path: torch.optim.Adam,
            init_args: {lr: 0.001}}``); it then replaces ``lr``, ``momentum`` and ``weight_decay``.
        client_lr_schedule: a ``torch.optim.lr_scheduler`` class with its init args, stepped once per round: the
            client learning rate of each round (``StepLR``, ``CosineAnnealingLR``, ``ExponentialLR``, …).
        keep_client_optimizer_state: keep each client's optimiser state (momentum, Adam moments) across rounds
            in the client-state bank (checkpointed); by default a fresh optimiser per phase, every round (the
            algorithm's ``keep_client_optimizer_state`` can ask for it too).
        server_optimizer, server_lr_schedule: the server step on the pseudo-gradient (``FedAdam``, ``FedYogi``,
            ``FedAdagrad`` in ``fl_lightning.server_optimizers``, any ``torch.optim`` class; ``configs/server/``);
            it then replaces ``server_lr`` and ``server_momentum``. ``LearningRateMonitor`` logs ``lr/server`` and
            ``lr/client``.
        drop_last: skip every client minibatch of fewer than ``batch_size`` samples in local training and
            fine-tuning (``DataLoader(drop_last=True)``, as e.g. the FedProto authors' code); off, every sample
            trains, except that a 1-sample minibatch of a ``BatchNorm1d`` network is skipped (said once).
        privacy: user-level differential privacy of every upload (``fl_lightning.engine.privacy``: clipping on the
            client side of the ledger, Gaussian noise once on the sum, an accountant; ``configs/dp/``).
        client_state: where the client-state bank lives (``fl_lightning.engine.state``, issue 28): ``device`` (the
            module's device, checkpointed whole), ``host`` (CPU memory, pinned with CUDA; the cohort's rows move to
            the device each round), ``disk`` (memory-mapped files in ``<run_dir>/client_state``), host and disk
            checkpointed incrementally; ``auto`` (default) picks by size (``state.choose_placement``: device up to
            32 MiB, host up to half the available memory, else disk). Every placement gives the same numbers.
        eval_clients: the periodic evaluations score a fixed seeded sample of this many clients (the same each
            time, so curves compare; ``val/acc_mean_sem`` is the standard error of the sampled mean); the final
            evaluation of a fit (after its last round) scores every client. None (default): every client, always.
        compile: the stacked steps eager (``none``), compiled (``compile``) or CUDA graphs (``engine.compiled``).
    Survivors are aggregated with renormalised weights; a client whose upload is not finite is dropped.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        network: nn.Module,
        lr: float = ClientOptimizer.lr,  # the client optimiser's defaults (spec 000 §3.2), written once there
        momentum: float = ClientOptimizer.momentum,
        weight_decay: float = ClientOptimizer.weight_decay,
        batch_size: int = ClientOptimizer.batch_size,
        decay_bias: bool = ClientOptimizer.decay_bias,
        aggregation: Literal["uniform", "num_samples"] = "num_samples",
        server_lr: float = 1.0,
        server_momentum: float = 0.0,
        eval_every: int | None = None,
        eval_last: int = 10,
        finetune: FineTune | None = None,
        client_dropout: float = 0.0,
        stragglers: float = 0.0,
        straggler_budget: float = 0.5,
        executor: ExecutorName = "auto",
        new_client_finetune: FineTune | None = None,
        client_optimizer: OptimizerCallable | None = None,
        client_lr_schedule: LRSchedulerCallable | None = None,
        keep_client_optimizer_state: bool = False,
        server_optimizer: OptimizerCallable | None = None,
        server_lr_schedule: LRSchedulerCallable | None = None,
        drop_last: bool = ClientOptimizer.drop_last,
        privacy: Privacy | None = None,
        client_state: Placement = "auto",
        eval_clients: int | None = None,
        compile: compiled.CompileMode = "none",
    ) -> None:
        super().__init__()
        check_settings(lr, batch_size, eval_every, server_lr, client_dropout, stragglers, straggler_budget, eval_last,
                       momentum, weight_decay, eval_clients)  # fmt: skip
        choose_placement(client_state, 0)  # the value is checked here, the choice in setup
        self.client_state, self.eval_clients = client_state, eval_clients
        self.save_hyperparameters(ignore=["algorithm", "network", "finetune", "new_client_finetune", "privacy",
                                          *OPTIMIZER_ARGS])
        self.client_dropout, self.stragglers, self.straggler_budget = client_dropout, stragglers, straggler_budget
        self.executor, self.compile_mode = executor, compiled.set_mode(network, compile)  # a network's setting
        self.new_client_finetune = new_client_finetune or FineTune.head_only(epochs=10)  # FedRep Fig. 6
        self.automatic_optimization = False
        self.algorithm, self.net = algorithm, network
        self.privacy = None if privacy is None else PrivacyEngine(privacy)
        if batch_size < 2 and has_batchnorm1d(network):
            raise ConfigError(f"model.batch_size {batch_size} with a BatchNorm1d network: BatchNorm cannot train on "
                              "one sample; use a batch size of at least 2")  # fmt: skip
        self.client_optimizer = ClientOptimizer.from_config(
            client_optimizer, lr, momentum, weight_decay, batch_size, decay_bias, drop_last
        )
        self.round_optimizers = RoundOptimizers(
            self.client_optimizer, server_optimizer, server_lr, server_momentum, server_lr_schedule, client_lr_schedule
        )
        self.round_optimizers.check({"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.keep_client_optimizer_state = keep_client_optimizer_state or algorithm.keep_client_optimizer_state
        self.aggregation, self.eval_every, self.eval_last, self.finetune = aggregation, eval_every, eval_last, finetune
        self.bank: ClientStateBank | None = None
        self.fed: FederatedData | None = None
        self.history: list[dict[str, float]] = []  #: one entry per evaluation: round and validation metrics
        self.last_evaluation: ClientEvaluation | None = None  #: per-client numbers of the latest evaluation
        self.summary: dict[str, Any] = {}  #: the run's result row, set at the end of fit
        self.rounds_trained = 0  #: rounds whose update is in the global model (restored from checkpoints)
        self.final_clients: ClientEvaluation | None = None  #: per-client numbers behind final (final_ft with "+FT")
        self.finetuned_clients: ClientEvaluation | None = None  #: the "+FT" evaluation at the end of fit
        self.upload_bytes = 0.0  #: bytes uploaded by all clients so far (restored from checkpoints)
        self.run_axis: Any = None  #: the run axis' lockstep (``fl_lightning.experiment.run_axis``) when batched
        self._fit_start, self.resumed_wall_s = 0.0, 0.0  #: resumed: training seconds before the run's checkpoint

    # ---- set-up ------------------------------------------------------------------------------------------
    def global_params(self) -> Params:
        """The global model as a detached ``name -> tensor`` dict (parameters and buffers)."""
        out = {n: p.detach() for n, p in self.net.named_parameters()}
        out.update({n: b.detach() for n, b in self.net.named_buffers()})
        return out

    def attach_data(self, fed: FederatedData) -> None:
        """Bind client data and build the client-state bank (idempotent)."""
        self.fed = fed
        glob = self.global_params()
        self.algorithm.check_compatible(self.net, fed.num_classes)
        frozen = [n for n, p in self.net.named_parameters() if not p.requires_grad]  # + constant buffers (LoRA nets)
        self.algorithm.set_frozen(frozen + list(getattr(self.net, "constant_buffers", ())))
        check_algorithm_fits(self.algorithm, self.net, glob, self.aggregation)
        if self.bank is None or self.bank.num_clients != fed.num_clients:
            self.algorithm.setup(glob, fed.num_clients)
            template = self.algorithm.init_client_state(glob)
            if self.keep_client_optimizer_state:  # each client's optimiser state, kept across rounds
                trainable = {n: p.detach() for n, p in self.net.named_parameters() if p.requires_grad}
                template.update(state_template(self.client_optimizer, trainable))
            self.bank = make_bank(template, fed.num_clients, self.client_state, self._trainer).to(self.device)
            self.client_scores = PerClientScores(fed.num_clients).to(self.device)
            # DDP must not broadcast the bank at every forward: every rank keeps it identical (rows are gathered)
            self._ddp_params_and_buffers_to_ignore = [f"bank.{n}" for n, _ in self.bank.named_buffers()]
        self.loss_fn = loss_fn_for(fed.num_classes)
        self.algorithm.bind_ground_truth(fed.extras)  # population-gradient options (spec 004) read it
        template = self.algorithm.upload_template(glob)
        side = None if fed.side is None else getattr(getattr(self.net, "side", None), "reveals", "side information")
        self.ledger = CommunicationLedger.for_algorithm(self.algorithm, self.bank.names, template, side)
        self.aggregator = aggregation.Aggregation(self.ledger, self.aggregation, type(self.algorithm).__name__)
        if self.privacy is not None:
            check_algorithm(self.algorithm, self.net, template, self.aggregation)
            self.aggregator = PrivateAggregation(self.aggregator, self.privacy)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "federated"):
            raise ConfigError("FederatedModule needs a FederatedDataModule (trainer.fit(model, datamodule=...))")
        if str(self.trainer.precision) in ("16-mixed", "16"):
            raise ConfigError(FP16_REFUSED)
        if stage == TrainerFn.FITTING:
            self._schedule_validation()
        self.attach_data(datamodule.federated)
        if self.privacy is not None:
            self.privacy.setup(self.trainer, datamodule)

    def _schedule_validation(self) -> None:
        """A run is one epoch of rounds: validation counts rounds (``val_check_interval``), never epochs."""
        trainer = self.trainer
        if self.eval_every is not None:
            trainer.val_check_interval, trainer.check_val_every_n_epoch = self.eval_every, None
        if trainer.check_val_every_n_epoch not in (None, 1):
            raise ConfigError(
                f"trainer.check_val_every_n_epoch={trainer.check_val_every_n_epoch}: a run is one epoch of rounds; "
                "set trainer.val_check_interval (in rounds) instead"
            )

    def data_dtype(self) -> torch.dtype | None:
        """Floating client data follow the network's dtype (``trainer.precision: 64-true`` → float64; issue 18)."""
        return next((p.dtype for p in self.net.parameters() if p.is_floating_point()), None)

    def on_fit_start(self) -> None:
        self.on_validation_start()  # the client data on the module's device
        self._fit_start = time.perf_counter()
        evaluation.check_monitored_keys(self.fed, self.net, self.trainer.callbacks)

    def on_validation_start(self) -> None:
        moved = getattr(self, "_fed_moved", None)  # the data this moved there last time: left as it is
        self.fed, self._fed_moved = evaluation.data_to_device(self.fed, (self.device, self.data_dtype()), moved)

    on_test_start = on_validation_start

    def configure_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[dict[str, Any]]]:
        """The server optimiser and the client learning rate, each with its per-round schedule
        (``fl_lightning.engine.optimizers``)."""
        return self.round_optimizers.configure([p for p in self.net.parameters() if p.requires_grad])

    # ---- clients: fl_lightning.engine.executor decides and runs them ------------------------------------------
    def run_clients(
        self, clients: list[int], round_idx: int, glob: Params, states: list[Params], budgets: list[float]
    ) -> list[ClientUpdate]:
        """The local updates of ``clients`` (``executor.run_clients``: the loop or the stacked path)."""
        return executor.run_clients(self, clients, round_idx, glob, states, budgets)

    # ---- one round ---------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """One communication round: sample → run clients → aggregate → scatter state → server step → log."""
        # sample: the round's cohort (from the round loader), this rank's share, and who fails or straggles
        round_idx, cohort = self._check_round(batch)
        if self.privacy is not None:  # Poisson sampling draws the round's clients itself
            cohort = self.privacy.cohort(round_idx, cohort)
        glob = self.global_params()
        template = self.algorithm.upload_template(glob)
        cohort_states = self.bank.gather(torch.tensor(cohort, dtype=torch.long, device=self.device))
        # each rank's clients, balanced by training samples; which of them report (the same on every rank)
        layout = aggregation.assign_clients(self.fed.train.host_sizes(cohort), self.trainer.world_size)
        failed, slow = executor.simulate_faults(self, round_idx, cohort, list(range(len(cohort))))
        reporting = [[j for j in part if j not in failed] for part in layout]
        mine, active = layout[self.global_rank], reporting[self.global_rank]
        self.ledger.new_round(round_idx)
        self.ledger.download(self.algorithm.download_template(glob), len(cohort))

        # run clients: each active client's local update from the global model and its own state
        updates = self.run_clients(
            [cohort[j] for j in active],
            round_idx,
            glob,
            [{n: v[j] for n, v in cohort_states.items()} for j in active],
            [self.straggler_budget if j in slow else 1.0 for j in active],
        )

        # aggregate: this rank's weighted sums and state rows, then one sum over ranks
        stats = RoundStats(dropped=len(failed.intersection(mine)), stragglers=len((slow - failed).intersection(mine)))
        reports = aggregation.RoundReports(round_idx, cohort, active, updates, glob, template, cohort_states)
        ranks = aggregation.Ranks(self.trainer.strategy, self.global_rank, self.device, reporting)
        cohort_sums = self.aggregator.aggregate(reports, stats, ranks)  # clip → ledger → sum → noise → all ranks

        # scatter state, server step, log
        aggregation.scatter_state(self.bank, cohort, cohort_sums)
        self._server_step(template, cohort_sums, round_idx, len(cohort))
        self.rounds_trained = round_idx + 1
        self._log_round(round_idx, cohort_sums.stats)
        self.round_optimizers.step_schedules()  # next round's server and client learning rates (stays last)

    def _check_round(self, batch: dict[str, Tensor]) -> tuple[int, list[int]]:
        round_idx, cohort = int(batch["round"]), batch["clients"].tolist()  # the cohort as host ids, read once
        if round_idx != self.global_step:
            raise RuntimeError(f"round loader is at round {round_idx} but trainer.global_step is {self.global_step}")
        return round_idx, cohort

    def _server_step(self, template: Params, sums: CohortSums, round_idx: int, cohort_size: int) -> None:
        """Apply the cohort's mean update; stop with a checkpoint if the model turned non-finite."""
        if sums.stats.survivors == 0:
            log.warning("round %d: no client survived (%d sampled); the model is unchanged", round_idx, cohort_size)
        keep = getattr(self.algorithm, "updates_frozen", False)  # FLoRA merges into the frozen base; else not copied
        backup = aggregation.ParamBackup((n, p) for n, p in self.net.named_parameters() if p.requires_grad or keep)
        mean = self.aggregator.mean(sums, template)
        facts = RoundFacts(round_idx, num_aggregated=int(sums.stats.survivors))
        aggregation.server_step(self.net, self.optimizers()[0], self.algorithm, mean, facts)
        aggregation.check_finite(self.net, backup, self.trainer, round_idx)

    def _log_round(self, round_idx: int, stats: RoundStats) -> None:
        faults = {"dropped": stats.dropped, "non_finite": stats.non_finite, "stragglers": stats.stragglers}
        logs_faults = self.client_dropout or self.stragglers or stats.non_finite
        metrics = {f"faults/{k}": v for k, v in faults.items()} if logs_faults else {}
        metrics |= {"comm/download_bytes": float(self.ledger.download_bytes), "round": float(round_idx)}
        total = self._count_upload(stats.upload_bytes)
        if self.privacy is None:
            metrics.update({"train/loss": stats.mean_loss, "train/clients": stats.survivors,
                            "comm/upload_bytes": stats.upload_bytes, "comm/upload_bytes_total": total})  # fmt: skip
        else:  # under DP the clients' losses, their count and the upload bytes (which count them) are not released
            metrics.update({f"privacy/{k}": v for k, v in self.privacy.summary(round_idx + 1).items()})
        self.log_scalars(metrics)  # one call per round

    def log_scalars(self, metrics: dict[str, Any], prog_bar: bool | set[str] = False) -> None:
        """``self.log_dict(metrics)`` in one call (``lightning_logging.log_scalars``); ``prog_bar``: True or keys."""
        lightning_logging.log_scalars(self, metrics, prog_bar)

    def _count_upload(self, round_bytes: float) -> float:
        self.upload_bytes += float(round_bytes)
        return self.upload_bytes

    # ---- when to evaluate (fl_lightning.engine.evaluation) --------------------------------------------------
    def validates_after(self, round_idx: int) -> bool:
        """Whether Lightning's validation loop runs after round ``round_idx`` (``RoundCheckpoint`` asks)."""
        return evaluation.validates_after(self.trainer, self.eval_last, round_idx)

    def on_train_batch_start(self, batch: dict[str, Tensor], batch_idx: int) -> int | None:
        if self.privacy is not None and self.privacy.stop_before(self.rounds_trained):  # the budget: exit 0
            self.trainer.should_stop = True
            return -1
        # the last eval_last rounds are evaluated whatever the interval (their mean is the reported "last10")
        if evaluation.in_last_rounds(self.trainer, self.eval_last, int(batch["round"])):
            if self.trainer.val_check_batch is not None:
                self.trainer.val_check_batch = 1

    # ---- evaluation: Lightning's validation and test loops -----------------------------------------------
    def on_validation_epoch_start(self) -> None:
        with torch.inference_mode(False):
            self.client_scores.reset()

    @property
    def validation_split(self) -> str:
        """``val`` when the DataModule carved a validation split (``data.val_fraction``), else ``test``."""
        return "test" if self.fed.val is None else "val"

    def validation_step(self, clients: list[int], batch_idx: int) -> None:
        """Every client of the chunk evaluates its own model on its own validation (or test) split."""
        if not self.trainer.sanity_checking:
            evaluation.evaluate_clients(
                self, clients, self.rounds_trained - 1, self.client_scores, split=self.validation_split
            )

    def evaluation_sample(self) -> list[int] | None:
        """The clients of the periodic evaluations (``model.eval_clients``; None: all), fixed for the run."""
        key = None if self.fed is None else (self.fed.num_clients, self.eval_clients, self.fed.seed)
        if key is not None and getattr(self, "_sample_key", None) != key:
            self._sample_key, self._sample = key, evaluation.evaluation_sample(*key)
        return None if key is None else self._sample

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        sampled = self.trainer.state.fn == TrainerFn.FITTING and self.evaluation_sample() is not None
        if sampled and self.rounds_trained >= self.trainer.max_steps:  # the final evaluation scores every client
            evaluation.evaluate_all(self, self.rounds_trained - 1, split=self.validation_split)
        result = self._finish_evaluation()
        metrics = validation_metrics(result, self.fed, self.net)
        if self.trainer.state.fn == TrainerFn.FITTING:
            key = main_metric(self.fed)
            if self.eval_clients is not None:  # the standard error of a sampled evaluation's mean
                regression = self.fed.num_classes is None
                metrics[key + "_sem"] = evaluation.sampled_sem(result, self.fed.num_clients, regression)
            self.history.append({"round": result.round, **metrics})
            metrics[key.replace("_mean", "_last10")] = mean_of_last(self.history, key, self.eval_last)
        self.log_scalars({**metrics, "round": float(result.round)}, prog_bar=set(metrics))  # each row names its round

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def test_step(self, clients: list[int], batch_idx: int) -> None:
        evaluation.evaluate_clients(self, clients, self.rounds_trained - 1, self.client_scores, split="test")

    def on_test_epoch_end(self) -> None:
        """The test split of every client, plus held-out new clients and "+FT" where configured."""
        result = self._finish_evaluation()
        metrics = validation_metrics(result, self.fed, self.net, prefix="test")
        end = self.end_evaluations(result.round, split="test")
        metrics.update({k.replace("final/", "test/"): v for k, v in end.items()})
        self.log_scalars(metrics)

    def _finish_evaluation(self) -> ClientEvaluation:
        with torch.inference_mode(False):
            self.last_evaluation = ClientEvaluation.from_scores(self.client_scores.compute(), self.rounds_trained - 1)
        return self.last_evaluation

    def evaluate_clients(
        self, round_idx: int, finetune: FineTune | None = None, state_of: Any = None, split: str = "test"
    ) -> dict[str, Tensor]:
        """Evaluate all of this rank's clients now (``evaluation.evaluate_all``); per-client and mean scores."""
        return evaluation.evaluate_all(self, round_idx, finetune, state_of, split)

    def evaluate_new_clients(self, round_idx: int, new: FederatedData) -> dict[str, Tensor]:
        """Held-out clients that never trained (``evaluation.evaluate_new_clients``)."""
        return evaluation.evaluate_new_clients(self, round_idx, new)

    def end_evaluations(self, round_idx: int, split: str) -> dict[str, float]:
        return evaluation.end_evaluations(self, round_idx, split)

    # ---- end of fit ----------------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        """The run summary (``summary.run_summary``, after the last round's validation): "+FT" and new clients are
        evaluated here."""
        self.summary = run_summary(self)

    # ---- checkpoints: fl_lightning.engine.checkpoint ------------------------------------------------------------
    @property
    def attached_trainer(self) -> L.Trainer | None:
        """Lightning's trainer, or None when the module is not attached to one (``trainer`` raises then)."""
        return self._trainer

    def wall_seconds(self) -> float:
        """Training time of the run, over every process that trained it (resumes included)."""
        return self.resumed_wall_s + (time.perf_counter() - self._fit_start if self._fit_start else 0.0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint_entries.save_entries(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint_entries.load_entries(self, checkpoint)
