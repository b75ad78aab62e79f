"""What a tuning leaves: the best layout as overrides, as fspeed-train's config file and as a ds_config, each
reproducing the layout; and fspeed-autotune's command line."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from fspeed.autotune.command import UsageError, main, parse_command
from fspeed.autotune.outputs import ds_config, write_best
from fspeed.autotune.space import Candidate, SearchSpace
from fspeed.config import to_run_config
from fspeed.config.compose import compose_run_config

BASE = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "data.max_bytes=40000",
        "train.train_batch_size=8"]
LAYOUTS = [Candidate(2, 2, 2, data=2, offload_optimizer=True, overlap_comm=True, reduce_bucket_size=1000),
           Candidate(3, 4, 1, data=2, offload_optimizer=True, offload_param=True, remat="full"),
           Candidate(0, 1, 4, data=2, remat="save_matmuls", remat_every=2),
           Candidate(1, 2, 4, data=1, pipe=2, schedule="zero_bubble", remat="full", remat_every=1)]


@pytest.mark.parametrize("candidate", LAYOUTS, ids=lambda c: c.label())
def test_the_config_file_and_the_overrides_reproduce_the_layout(tmp_path, candidate):
    paths = write_best(tmp_path, BASE, candidate)
    expected, _ = compose_run_config(overrides=[*BASE, *candidate.to_overrides()], dp_world_size=candidate.data)
    from_lines, _ = compose_run_config(overrides=paths["overrides"].read_text().split(), dp_world_size=candidate.data)
    assert from_lines == expected
    with initialize_config_dir(str(tmp_path), version_base=None):
        cfg = compose("best", overrides=["checkpoint.dir=checkpoints"])
    assert to_run_config(cfg, dp_world_size=candidate.data) == expected
    assert Candidate.from_run_config(expected) == candidate


@pytest.mark.parametrize("candidate", LAYOUTS[:2], ids=lambda c: c.label())
def test_the_ds_config_translates_back_to_the_same_keys(tmp_path, candidate):
    paths = write_best(tmp_path, BASE, candidate)
    ds = json.loads(paths["ds_config"].read_text())
    assert ds == ds_config(candidate)
    translated, _ = compose_run_config(ds, [*BASE[:-1], f"parallel.data={candidate.data}"],
                                       dp_world_size=candidate.data)
    expected, _ = compose_run_config(overrides=[*BASE, *candidate.to_overrides()], dp_world_size=candidate.data)
    assert translated.zero == expected.zero and translated.batch == expected.batch
    assert "activation_checkpointing" not in ds  # DeepSpeed's block has no policy: the remat stays in the overrides


def test_command_line_keys_and_their_errors(tmp_path):
    settings = parse_command(["train.train_batch_size=8", "--nproc", "2", "autotune.space.zero_stage=[1,2]",
                              "autotune.memory_per_rank=2GiB", f"autotune.dir={tmp_path}", "autotune.max_trials=3",
                              "autotune.space.remat=[none,full:2]", "autotune.timeout_s=30"])
    assert settings.world == 2 and settings.base_overrides == ("train.train_batch_size=8",)
    assert settings.space.zero_stage == (1, 2) and settings.space.remat == ("none", "full:2")
    assert settings.memory_per_rank == 2 * 2**30 and settings.max_trials == 3 and settings.trial.timeout_s == 30
    for argv, message in [(["autotune.speed=1"], "autotune.speed: unknown autotune key; allowed:"),
                          (["autotune.space.zero=[1]"], "autotune.space.zero: unknown axis; allowed: zero_stage"),
                          (["autotune.space.zero_stage=[5]"], "autotune.space.zero_stage: 5"),
                          (["autotune.strategy=best"], "autotune.strategy='best'"),
                          (["--nproc", "0"], "autotune.nproc=0"),
                          (["autotune.memory_per_rank=lots"], "autotune.memory_per_rank: 'lots'"),
                          (["autotune.seed=3"], "autotune.seed applies to autotune.strategy=random"),
                          (["autotune.strategy=grid", "autotune.noise=0.1"], "autotune.noise applies to"),
                          (["autotune.space.overlap_comm=[true]"], "searched in the slow mode only")]:
        with pytest.raises(UsageError, match=message.replace("[", r"\[")):
            parse_command(argv)


def test_a_bad_command_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["autotune.speed=1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("fspeed-autotune: autotune.speed: unknown autotune key")


def test_fspeed_autotune_runs_one_trial_and_writes_the_best_layout(tmp_path, capsys):
    main([*BASE, "--nproc", "2", f"autotune.dir={tmp_path}", "autotune.max_trials=1", "autotune.warm_steps=1",
          "autotune.measured_steps=1", "autotune.space.zero_stage=[1]", "autotune.space.micro_batch=[4]",
          "autotune.space.remat=[none]", "autotune.space.offload_optimizer=[false]",
          "autotune.space.offload_param=[false]", "autotune.space.tensor=[1]", "autotune.space.pipe=[1]"])
    out = capsys.readouterr().out
    assert "<- best" in out and "best: z1 mb4x1 dp2" in out
    for name in ("best.overrides", "best.yaml", "ds_config.json", "results.csv", "results.json", "results.jsonl"):
        assert (tmp_path / name).exists(), name


def test_fspeed_plot_draws_a_tuning(tmp_path):
    from fspeed.cli.plot import main as plot_main

    rows = [{"configuration": f"z{s} mb4x1 dp2", "status": "ok", "predicted_step_s": 0.01 * (s + 1),
             "measured_step_s": 0.012 * (s + 1), "samples_per_s": 8 / (0.012 * (s + 1))} for s in range(3)]
    rows.append({"configuration": "z3 mb8x1 dp2", "status": "timeout", "predicted_step_s": 0.02,
                 "measured_step_s": None, "samples_per_s": None})
    (tmp_path / "results.json").write_text(json.dumps(rows))
    plot_main([str(tmp_path)])
    for name in ("autotune_step_time.png", "autotune_throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "results.json").write_text(json.dumps(rows[-1:]))
    with pytest.raises(SystemExit) as stop:
        plot_main([str(tmp_path)])
    assert stop.value.code == 2


def test_fs_autotune_is_the_package_called_and_wants_builders_by_path(tmp_path):
    import fspeed as fs
    from fspeed.autotune.tuner import _target_path

    assert callable(fs.autotune) and fs.autotune.SearchSpace is SearchSpace and fs.autotune.autotune.__module__ == \
        "fspeed.autotune.tuner"
    assert _target_path(_target_path, "model") == "fspeed.autotune.tuner._target_path"
    assert _target_path("my_pkg.build", "model") == "my_pkg.build"
    with pytest.raises(ValueError, match=r"autotune\(model=...\): give the function that builds it"):
        fs.autotune(torch.nn.Linear(2, 2), world=1, workdir=tmp_path)
    with pytest.raises(AttributeError, match="has no attribute 'tuning'"):
        fs.autotune.tuning
