"""``fl_lightning.identity``: a run's identity is its resolved config less what a resume may change."""

from __future__ import annotations

from fl_lightning.identity import RESUME_MAY_CHANGE, flatten, identity_differences, run_identity, same_value

CONFIG = {
    "seed_everything": 0,
    "trainer": {"max_steps": 10, "accelerator": "cpu", "callbacks": [{"class_path": "X"}]},
    "model": {"lr": 0.01, "algorithm": {"class_path": "A", "init_args": {"head_epochs": 10, "personal": ("head.",)}},
              "privacy": None},
    "data": {"class_path": "D", "init_args": {"partition": {"class_path": "S", "init_args": {"k": 2}}}},
    "wandb": {"mode": "offline", "tags": []},
    "run_dir": "runs/x",
    "checkpoint_every": 5,
}  # fmt: skip


def test_flatten_names_leaves_without_init_args_levels():
    leaves = flatten(CONFIG)
    assert leaves["model.algorithm.head_epochs"] == 10 and leaves["model.algorithm.class_path"] == "A"
    assert leaves["data.partition.k"] == 2 and leaves["model.privacy"] is None and leaves["wandb.tags"] == []
    assert leaves["trainer.callbacks"] == [{"class_path": "X"}]  # a list is one leaf


def test_the_identity_is_every_leaf_but_those_a_resume_may_change():
    identity = run_identity(CONFIG)
    assert set(identity) == {"seed_everything", "trainer.accelerator", "model.lr", "model.algorithm.class_path",
                             "model.algorithm.head_epochs", "model.algorithm.personal", "model.privacy",
                             "data.class_path", "data.partition.class_path", "data.partition.k"}  # fmt: skip
    for key in flatten(CONFIG):
        assert (key in identity) != any(key == p or key.startswith(p + ".") for p in RESUME_MAY_CHANGE), key


def test_a_key_the_code_gains_later_is_part_of_the_identity():
    more = {**CONFIG, "model": {**CONFIG["model"], "new_option": True}}
    assert run_identity(more)["model.new_option"] is True
    assert identity_differences(CONFIG, more) == ["model.new_option (unset) -> true"]
    assert identity_differences(CONFIG, more, only_shared=True) == []


def test_differences_name_each_key_old_and_new_value_and_skip_the_ignored():
    other = {**CONFIG, "seed_everything": 3, "wandb": {"mode": "disabled"}, "trainer": {**CONFIG["trainer"],
             "max_steps": 99, "accelerator": "gpu"}}  # fmt: skip
    assert identity_differences(CONFIG, other) == ['seed_everything 0 -> 3', 'trainer.accelerator "cpu" -> "gpu"']
    assert identity_differences(CONFIG, other, ignore=("seed_everything",)) == ['trainer.accelerator "cpu" -> "gpu"']
    assert identity_differences(CONFIG, other, ignore=("trainer",)) == ["seed_everything 0 -> 3"]


def test_same_value_reads_a_tuple_as_the_list_yaml_gives_back_and_an_int_as_its_float():
    assert same_value((128, 64), [128, 64]) and same_value(1, 1.0) and same_value({"a": (1,)}, {"a": [1]})
    assert not same_value((128, 64), [64, 128]) and not same_value(0.01, 0.02) and not same_value(None, 0)
