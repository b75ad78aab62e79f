"""The ds_config translator's curriculum_learning and progressive_layer_drop blocks."""

import pytest
from test_deepspeed_config import BASE, hydra_tree, problems_of, run_from  # noqa: F401 - hydra_tree is a fixture

from fspeed.config import translate_deepspeed_config


def test_legacy_curriculum_translates_to_the_curriculum_section():
    ds = {**BASE, "curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 300, "difficulty_step": 8, "root_degree": 2,
                            "difficulty": [1, 2]}}}
    run = run_from(ds, "model.seq_len=64")
    c = run.curriculum
    assert (c.enabled, c.min_difficulty, c.max_difficulty, c.schedule, c.total_steps, c.difficulty_step,
            c.root_degree, c.difficulty) == (True, 8, 64, "fixed_root", 300, 8, 2, None)
    summary = translate_deepspeed_config(ds).summary()
    assert "curriculum_learning.schedule_config.total_curriculum_step -> curriculum.total_steps=300" in summary
    assert "difficulty = [1, 2] (DeepSpeed's fixed_root schedule does not read it)" in summary
    discrete = {**BASE, "curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 32,
        "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16, 32], "max_step": [10, 20]}}}
    c = run_from(discrete).curriculum
    assert (c.schedule, c.difficulty, c.max_step) == ("fixed_discrete", (8, 16, 32), (10, 20))


def test_progressive_layer_drop_translates():
    run = run_from({**BASE, "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.002}})
    pld = run.progressive_layer_drop
    assert (pld.enabled, pld.theta, pld.gamma) == (True, 0.5, 0.002)
    assert run_from({**BASE, "progressive_layer_drop": {"enabled": True}}).progressive_layer_drop.theta == 1.0
    off = translate_deepspeed_config({**BASE, "progressive_layer_drop": {"enabled": False, "theta": 0.5}})
    assert not any("progressive" in o for o in off.overrides) and "disabled" in off.summary()


@pytest.mark.parametrize("block, expected", [
    ({"enabled": True, "curriculum_type": "vocab", "min_difficulty": 1, "max_difficulty": 2,
      "schedule_type": "fixed_linear"}, ["curriculum_learning.curriculum_type", "seqlen"]),
    ({"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 1, "max_difficulty": 2,
      "schedule_type": "custom"}, ["curriculum_learning.schedule_type", "callback"]),
    ({"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 1, "max_difficulty": 2,
      "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 5}},
     ["schedule_config.difficulty_step", "required by fixed_linear"]),
    ({"enabled": True, "curriculum_type": "seqlen", "max_difficulty": 2, "schedule_type": "fixed_linear"},
     ["curriculum_learning.min_difficulty", "required"]),
    ({"enabled": False, "min_dificulty": 3}, ["curriculum_learning.min_dificulty", "min_difficulty"]),
])
def test_curriculum_problems_are_named(block, expected):
    message = problems_of({**BASE, "curriculum_learning": block})
    assert all(e in message for e in expected), message


def test_pld_problems_are_named():
    assert "progressive_layer_drop.tehta" in problems_of({**BASE, "progressive_layer_drop": {"enabled": True,
                                                                                             "tehta": 0.5}})


def test_data_efficiency_is_accepted_disabled_and_refused_enabled_with_the_alternative():
    off = translate_deepspeed_config({**BASE, "data_efficiency": {"enabled": False, "seed": 1234}})
    assert "data_efficiency = {enabled: false" in off.summary() and not any("curriculum" in o for o in off.overrides)
    message = problems_of({**BASE, "data_efficiency": {"enabled": True, "data_sampling": {"enabled": True}}})
    assert "data_efficiency.enabled" in message and "curriculum.curriculum_type=vocab_rarity" in message
