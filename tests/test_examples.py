"""Every script in examples/ runs as its docstring says, at a tiny size: one process, or its ranks
under the `fspeed` launcher (gloo, one thread each)."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY_LM = ["--layers", "2", "--width", "32", "--seq", "16"]


def run(cwd, script, *args, ranks=1, launcher=False, timeout=240):
    """Run examples/<script> with `args` (under the launcher with more ranks than one, or when
    `launcher`); its stdout."""
    cmd = [sys.executable, str(EXAMPLES / script), *args] if ranks == 1 and not launcher else \
        [sys.executable, "-m", "fspeed.cli.launch", "--num_gpus", str(ranks), str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_api_example_on_one_process(tmp_path):
    out = run(tmp_path, "train_gpt_api.py", "--steps", "3", "--batch", "4", "--checkpoint-dir", "ck")
    assert "val loss at start" in out and "step 3:" in out
    assert (tmp_path / "ck" / "latest").read_text() == "global_step3"


def test_hydra_example_on_one_process(tmp_path):
    out = run(tmp_path, "train_gpt.py", "model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32",
              "train.micro_batch_size=2", "train.steps=2", "train.eval_every=0", "data.max_bytes=100000",
              "monitor.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "global_step2", out


def test_hf_causal_lm_through_initialize_with_zero3_bf16_on_two_ranks(tmp_path):
    out = run(tmp_path, "hf_causal_lm_initialize.py", *TINY_LM, "--steps", "2", "--micro-batch", "2",
              "--checkpoint-dir", "ck", "--save-dir", "hf", ranks=2)
    assert "2 ranks, ZeRO-3, bf16" in out and "after 2 steps" in out
    assert (tmp_path / "ck" / "latest").read_text() == "global_step2"
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "model.safetensors").exists()


def test_a_deepspeed_script_runs_and_resumes_with_only_its_import_changed(tmp_path):
    source = (EXAMPLES / "deepspeed_script_moved_over.py").read_text()
    assert "import fspeed as deepspeed  # was: import deepspeed" in source
    code = source.split('"""')[-1].replace("import fspeed as deepspeed", "")
    assert "fspeed" not in code  # below the docstring, the script names DeepSpeed only
    args = ["--deepspeed", "--deepspeed_config", str(EXAMPLES / "ds_config.json"), "--epochs", "1", "--samples", "64",
            "--width", "16", "--save_dir", "ck"]
    out = run(tmp_path, "deepspeed_script_moved_over.py", *args, ranks=2)
    assert "epoch 0: step 2," in out  # 64 samples over 2 ranks of 16
    out = run(tmp_path, "deepspeed_script_moved_over.py", *args, "--resume", ranks=1, launcher=True)  # resharded
    assert "epoch 1: step 6," in out  # 64 samples on one rank, 16 a step
    assert (tmp_path / "ck" / "latest").read_text() == "global_step6"


def test_functional_zero3_with_tensor_slicing_on_four_ranks(tmp_path):
    out = run(tmp_path, "functional_zero3_tensor_slicing.py", "--steps", "2", "--layers", "1", "--width", "32",
              "--seq", "16", "--batch", "2", "--checkpoint-dir", "ck", ranks=4)
    assert "zero(stage=3) | tensor_slicing" in out and "step 2:" in out and "gathered" in out
    assert len(list((tmp_path / "ck" / "global_step2").glob("rank_*.safetensors"))) == 4


def test_pipeline_3d_example_on_four_ranks(tmp_path):
    """The 8-rank example on 4 ranks (pipe 2 x model 2, data 1), which keeps CI's cost down: eight
    processes importing transformers take about twice as long; tests/test_pipeline.py trains the
    same Llama layers on pipe 2 x data 2 x model 2 against one process."""
    out = run(tmp_path, "pipeline_3d.py", *TINY_LM, "--steps", "2", "--batch", "4", "--micro-batches", "2",
              ranks=4, timeout=300)
    assert "step 2:" in out and "the Hugging Face module with the trained weights" in out


def test_zero_offload_equals_training_without_it(tmp_path):
    out = run(tmp_path, "zero_offload.py", "--steps", "2", "--layers", "1", "--width", "32", "--seq", "16",
              "--batch", "2")
    assert "offload_optimizer='cpu'" in out and "the same weights after 2 steps: True" in out


def test_sparse_long_sequence(tmp_path):
    out = run(tmp_path, "sparse_long_sequence.py", "--seq", "128", "--block", "16", "--layers", "1", "--width", "32",
              "--reps", "1")
    assert "bigbird layout: 8 x 8 blocks" in out and "block-sparse at S=128" in out


def test_curriculum_and_progressive_layer_dropping(tmp_path):
    out = run(tmp_path, "curriculum_and_pld.py", "--steps", "2", "--layers", "2", "--width", "32", "--seq", "16",
              "--batch", "2")
    assert "curriculum + dropping" in out and "x the baseline's time" in out


def test_prove_my_model(tmp_path):
    out = run(tmp_path, "prove_my_model.py", "--steps", "1")
    assert out.count("trains like one process") == 4
