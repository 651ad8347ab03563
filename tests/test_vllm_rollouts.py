"""The trainer's ``rollout.engine=vllm`` path, run against a stand-in for vLLM's offline API (tests/vllm_standin.py:
vLLM cannot run this model on this machine). What it checks is the trainer's side: the engine is built to take the
step's video embeddings, the rollouts come back as groups with the engine's log-probs, and after every update the
engine's weights are synced, so that its log-probs are the trainer's own (``behav_logp_absdiff`` ~ 0)."""
from __future__ import annotations

import json

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.schemas.config import load_yaml  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402

import vllm_standin  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _cfg(model: str, out, *extra: str) -> TrainConfig:
    return load_yaml(TrainConfig, None, [
        f"model.path={model}", f"run.out_dir={out}", "data.source=synthetic", "data.synthetic_train=8",
        "data.synthetic_kinds=[colour, count]", "data.batch_size=2", "run.steps=3", "run.save_every=0",
        "run.progress=false", "run.tensorboard=false", "run.seed=3", "optim.lr=1e-2", "rollout.engine=vllm",
        "rollout.n=4", "rollout.max_new_tokens=8", "grpo.mix_policy=true", *extra])


@pytest.mark.parametrize("mrsp", ["true", "false"])
def test_vllm_rollouts_take_the_steps_embeddings_and_follow_every_update(tiny, tmp_path, monkeypatch, mrsp):
    from longreel.trainer.grpo import run_grpo

    standin = vllm_standin.install(monkeypatch)
    out = run_grpo(_cfg(tiny, tmp_path / "run", f"mrsp.enabled={mrsp}"))
    assert out["step"] == 3
    [built] = standin.BUILT
    # the trainer hands the engine the step's video embeddings (MR-SP's reuse, and the plain path's one encode):
    # vLLM takes them only from an engine built with enable_mm_embeds
    assert built["enable_mm_embeds"] is True and built["logprobs_mode"] == "processed_logprobs"
    # a prompt's G samples share its prefill through vLLM's prefix cache, which each weight sync clears
    assert built["enable_prefix_caching"] is True
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the engine's log-probs of its own samples equal the trainer's old log-probs at every step: the weights it
    # sampled with were the policy's, also after the updates of steps 1 and 2
    for r in rows:
        assert r["behav_logp_absdiff"] < 1e-5, (r["step"], r["behav_logp_absdiff"])
    assert any(r["skipped_update"] == 0.0 for r in rows[:2])  # an update happened before a later step's rollouts
    llm = standin.LLM.last
    assert set(llm.sync_routes) == {"reload_weights"}  # vLLM's in-place reload, not load_weights alone
    # every sync clears the prefix cache before the next rollouts: no K/V of the old weights is reused
    syncs = [i for i, e in enumerate(llm.events) if e == "sync"]
    assert len(syncs) >= 2 and all(llm.events[i + 1] == "reset" for i in syncs), llm.events
    assert len(llm.synced_names) >= 2 and all(names == llm.synced_names[0] for names in llm.synced_names)
    from longreel.trainer.policy import load_policy

    final, _ = load_policy(str(tmp_path / "run" / "final"), dtype=torch.float32, device=torch.device("cpu"))
    trained, held = final.state_dict(), llm.model.state_dict()
    assert trained.keys() == held.keys() and all(torch.equal(trained[k], held[k]) for k in trained)
    base, _ = load_policy(tiny, dtype=torch.float32, device=torch.device("cpu"))
    assert any(not torch.equal(v, trained[k]) for k, v in base.state_dict().items())  # and they did change


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_vllm_engine_frees_its_memory_for_the_update_and_wakes_with_the_new_weights(
        tiny, tmp_path, monkeypatch, level):
    # vLLM's sleep mode between a step's rollouts and the weight sync: the stand-in's weights are NaN while asleep
    # and, at level 2, after the weights' wake until a load, so a rollout from anything but the synced weights shows
    from longreel.trainer.grpo import run_grpo

    standin = vllm_standin.install(monkeypatch)
    awake = run_grpo(_cfg(tiny, tmp_path / "awake"))
    assert "enable_sleep_mode" not in standin.BUILT[-1]
    assert not any(e.startswith(("sleep", "wake")) for e in standin.LLM.last.events)
    out = run_grpo(_cfg(tiny, tmp_path / "asleep", f"rollout.vllm_sleep_level={level}"))
    assert out["step"] == awake["step"] == 3
    assert standin.BUILT[-1]["enable_sleep_mode"] is True
    events = standin.LLM.last.events
    # each step: its rollouts, then sleep; the sync wakes the weights and loads them, and only then wakes the KV
    # cache and clears the prefix cache, before the next step's rollouts
    assert events == ["generate", f"sleep {level}", "wake weights", "sync", "wake kv_cache", "reset"] * 3, events
    rows, base = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("asleep", "awake"))
    for r, b in zip(rows, base, strict=True):
        assert r["behav_logp_absdiff"] < 1e-5, (r["step"], r["behav_logp_absdiff"])
        assert (r["loss"], r["reward_mean"]) == (b["loss"], b["reward_mean"])
    assert any(r["skipped_update"] == 0.0 for r in rows[:2])


def test_a_sleeping_vllm_engine_refuses_rollouts_until_a_sync(tiny, monkeypatch):
    from longreel.trainer.policy import load_policy
    from longreel.trainer.rollout import SamplingConfig, make_engine

    vllm_standin.install(monkeypatch)
    model, processor = load_policy(tiny, dtype=torch.float32, device=torch.device("cpu"))
    engine = make_engine("vllm", model, processor, model_path=tiny,
                         rollout_cfg=TrainConfig().rollout.model_copy(update={"vllm_sleep_level": 2}))
    engine.release()
    with pytest.raises(RuntimeError, match="asleep .* sync its weights first"):
        engine.generate([], SamplingConfig(n=2), [], items=[])
    engine.sync_weights(model)
    assert not engine.asleep and engine.generate([], SamplingConfig(n=2), [], items=[]) == []
    # vLLM's CPU backend has no sleep mode (it refuses the engine: tests/test_vllm_cpu_batches.py): the key is named
    from longreel.schemas.config import ConfigError

    monkeypatch.setattr("longreel.engines.vllm_engine.on_cpu", lambda: True)
    with pytest.raises(ConfigError, match=r"rollout.vllm_sleep_level=2: .* runs on the CPU; set it to 0"):
        make_engine("vllm", model, processor, model_path=tiny,
                    rollout_cfg=TrainConfig().rollout.model_copy(update={"vllm_sleep_level": 2}))


def test_a_vllm_without_reload_weights_is_synced_through_load_weights(tiny, tmp_path, monkeypatch):
    from longreel.trainer.grpo import run_grpo

    standin = vllm_standin.install(monkeypatch)
    monkeypatch.setattr(standin.LLM, "has_reload_weights", False)
    assert run_grpo(_cfg(tiny, tmp_path / "run"))["step"] == 3
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert any(r["skipped_update"] == 0.0 for r in rows[:2])
    assert all(r["behav_logp_absdiff"] < 1e-5 for r in rows), rows
    assert set(standin.LLM.last.sync_routes) == {"apply_model"}


def test_a_prefix_cache_vllm_will_not_clear_stops_the_run(tiny, tmp_path, monkeypatch):
    # the cached K/V of the old weights would be reused in silence: off-policy rollouts whose log-probs look right
    from longreel.trainer.grpo import run_grpo

    standin = vllm_standin.install(monkeypatch)
    monkeypatch.setattr(standin.LLM, "reset_ok", False)
    with pytest.raises(RuntimeError, match="prefix cache could not be cleared after a weight sync"):
        run_grpo(_cfg(tiny, tmp_path / "run"))
    # with the cache off (rollout.vllm_prefix_caching=false) there is nothing to clear
    assert run_grpo(_cfg(tiny, tmp_path / "off", "rollout.vllm_prefix_caching=false"))["step"] == 3
    assert standin.BUILT[-1]["enable_prefix_caching"] is False


def test_a_resumed_run_gives_its_vllm_engine_the_checkpoints_weights(tiny, tmp_path, monkeypatch):
    # the engine loads model.path (the start weights); a run resumed at step 2 must sync it before its first rollout
    from longreel.trainer.grpo import run_grpo

    vllm_standin.install(monkeypatch)
    out = tmp_path / "run"
    assert run_grpo(_cfg(tiny, out, "run.stop_after=2", "run.save_every=2"))["stopped"]
    assert run_grpo(_cfg(tiny, out, "run.save_every=2"))["step"] == 3
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and any(r["skipped_update"] == 0.0 for r in rows[:2])
    assert rows[2]["behav_logp_absdiff"] < 1e-5, rows[2]["behav_logp_absdiff"]


def test_under_torchrun_each_ranks_engine_takes_its_own_device(tiny, monkeypatch):
    # vLLM's in-process default puts the engine on the index in its `device` setting or 0 whatever the rank; under
    # torchrun every rank's engine would land on GPU 0. The external launcher joins the trainer's ranks and takes
    # LOCAL_RANK's device. One process here, with torch.distributed made to report a second rank.
    from longreel.trainer.policy import load_policy
    from longreel.trainer.rollout import make_engine

    standin = vllm_standin.install(monkeypatch)
    model, processor = load_policy(tiny, dtype=torch.float32, device=torch.device("cpu"))
    make_engine("vllm", model, processor, model_path=tiny)
    assert "distributed_executor_backend" not in standin.BUILT[-1]  # one process: vLLM's own default
    assert standin.BUILT[-1]["device_index"] == 0
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    make_engine("vllm", model, processor, model_path=tiny)
    assert standin.BUILT[-1]["distributed_executor_backend"] == "external_launcher"
    assert standin.BUILT[-1]["device_index"] == 1


def test_a_prompt_longer_than_the_engine_takes_names_the_setting(tiny, tmp_path, monkeypatch, capsys):
    # vLLM refuses a request over its max_model_len; a long video's prompt can be: one line, exit 2, naming the key
    from longreel.cli import main

    vllm_standin.install(monkeypatch)
    sets = [f"model.path={tiny}", f"run.out_dir={tmp_path / 'run'}", "data.source=synthetic", "run.steps=1",
            "rollout.engine=vllm", "rollout.n=2", "rollout.max_new_tokens=8", "rollout.vllm_max_model_len=64",
            "run.progress=false", "run.tensorboard=false"]
    assert main(["train", "grpo", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert "exceed rollout.vllm_max_model_len (64): set rollout.vllm_max_model_len to at least" in err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_syncs_its_vllm_engine(tiny, tmp_path, monkeypatch, strategy):
    """Each rank samples its own prompts on its own engine: every rank's engine must get the updated weights (under
    FSDP they are gathered from the shards on every rank, not on rank 0 only)."""
    from pathlib import Path

    from test_dist_resume import _run, _torchrun

    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    tests = Path(__file__).resolve().parent
    (site / "__init__.py").write_text(f"import sys\nsys.path.insert(0, {str(tests)!r})\nfrom vllm_standin import *\n")
    out = tmp_path / "run"
    sets = [f"model.path={tiny}", f"run.out_dir={out}", "data.source=synthetic", "data.synthetic_train=8",
            "data.synthetic_kinds=[colour, count]", "data.batch_size=2", "run.steps=3", "run.save_every=0",
            "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=3", "optim.lr=1e-2",
            "rollout.engine=vllm", "rollout.n=4", "rollout.max_new_tokens=8", "grpo.mix_policy=true",
            f"dist.strategy={strategy}"]
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))  # the ranks import the stand-in as vllm
    monkeypatch.setenv("VLLM_STANDIN_LOG", str(tmp_path / "built.jsonl"))
    _run([*_torchrun(2), "-m", "longreel", "train", "grpo", *[a for s in sets for a in ("--set", s)]])
    log = [json.loads(line) for line in (tmp_path / "built.jsonl").read_text().splitlines()]
    built = [r for r in log if r["event"] == "build"]
    # one engine a rank, each joined to the trainer's ranks and on its own rank's device (not both on device 0)
    assert sorted((b["rank"], b["device_index"]) for b in built) == [(0, 0), (1, 1)]
    assert all(b["distributed_executor_backend"] == "external_launcher" for b in built)
    # each rank's engine shut down at the end, before the trainer's process group (vLLM's teardown destroys it)
    assert sorted(r["rank"] for r in log if r["event"] == "shutdown") == [0, 1]
    syncs = [r for r in log if r["event"] == "sync"]
    assert sorted(r["rank"] for r in syncs) == [0, 0, 0, 1, 1, 1]  # after each of the 3 updates, on each rank
    if strategy == "fsdp":
        # each weight gathered from the shards only when the engine reads it: one full tensor alive at a time, not
        # a full copy of the model on every rank
        assert all(r["peak_alive"] == 1 for r in syncs), syncs
        assert all(r["n"] > 10 for r in syncs), syncs
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["skipped_update"] == 0.0 for r in rows[:2])
    for r in rows:  # both ranks' rollouts: the gap is summed over every rank's tokens
        assert r["behav_logp_absdiff"] < 1e-5, (r["step"], r["behav_logp_absdiff"])


@pytest.mark.slow
def test_an_sp_group_splits_each_prompts_vllm_rollouts_and_gets_one_processs(tiny, tmp_path, monkeypatch):
    """``mrsp.sp_size=2``: each rank's engine samples its half of every prompt's G rollouts (one request of n = G/2
    seeded s + its first row, vLLM's child-seed rule), then the halves are gathered: the step equals one
    process's, where one request of n = G samples them all."""
    import sys
    from pathlib import Path

    from test_dist_resume import _run, _torchrun

    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    tests = Path(__file__).resolve().parent
    (site / "__init__.py").write_text(f"import sys\nsys.path.insert(0, {str(tests)!r})\nfrom vllm_standin import *\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    sets = [f"model.path={tiny}", "data.source=synthetic", "data.synthetic_train=8",
            "data.synthetic_kinds=[colour, count]", "data.batch_size=2", "run.steps=1", "run.save_every=0",
            "run.save_final=false", "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=3",
            "rollout.engine=vllm", "rollout.n=4", "rollout.max_new_tokens=8", "mrsp.enabled=true",
            "grpo.mix_policy=true"]  # a target row in each group: the advantages, so the gradients, are not zero
    runs = {}
    for name, launcher, extra in (("one", [sys.executable], []),
                                  ("sp2", _torchrun(2), ["mrsp.sp_size=2", "mrsp.sp_min_tokens=1"])):
        out, log = tmp_path / name, tmp_path / f"{name}.jsonl"
        monkeypatch.setenv("VLLM_STANDIN_LOG", str(log))
        grads = f"run.dump_grads={tmp_path / name}.safetensors"
        _run([*launcher, "-m", "longreel", "train", "grpo",
              *[a for s in [*sets, f"run.out_dir={out}", grads, *extra] for a in ("--set", s)]])
        requests = [json.loads(line) for line in log.read_text().splitlines()]
        runs[name] = (read_metrics(out / "metrics.jsonl"), [r for r in requests if r["event"] == "request"])
    (one, one_req), (sp2, sp2_req) = runs["one"], runs["sp2"]
    # one process: a request of n=4 per prompt; the SP pair: each rank n=2, rank 1's seeded 2 past rank 0's
    assert [r["n"] for r in one_req] == [4, 4]
    by_rank = {rank: [r for r in sp2_req if r["rank"] == rank] for rank in (0, 1)}
    assert [r["n"] for r in by_rank[0]] == [r["n"] for r in by_rank[1]] == [2, 2]
    assert [r["seed"] for r in by_rank[0]] == [r["seed"] for r in one_req]
    assert [r["seed"] for r in by_rank[1]] == [r["seed"] + 2 for r in one_req]
    # the two halves are one process's rollouts, in order
    for i, whole in enumerate(one_req):
        assert by_rank[0][i]["token_ids"] + by_rank[1][i]["token_ids"] == whole["token_ids"]
    assert len({tuple(t) for t in one_req[0]["token_ids"]}) > 1  # distinct samples, not one repeated
    # and the step, from the gathered rollouts, is one process's: metrics, loss and step-1 gradients
    for k in ("reward_mean", "accuracy", "format_rate", "response_len_mean", "groups_with_signal"):
        assert one[0][k] == sp2[0][k], (k, one[0][k], sp2[0][k])
    assert abs(one[0]["loss"] - sp2[0]["loss"]) <= 1e-6
    from safetensors.torch import load_file

    g1, g2 = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "sp2.safetensors"))
    assert g1.keys() == g2.keys() and sum(float(g.abs().sum()) for g in g1.values()) > 0
    assert max(float((g1[k] - g2[k]).abs().max()) for k in g1) <= 1e-5
    assert one[0]["behav_logp_absdiff"] < 1e-5 and sp2[0]["behav_logp_absdiff"] < 1e-5
