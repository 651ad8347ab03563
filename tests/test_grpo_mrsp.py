"""MR-SP wired into the GRPO trainer: a step with ``mrsp.enabled`` gives the old/reference log-probs, loss and
gradients of the plain path (fp32, within 1e-5) while each unique video goes through the policy's vision tower once
per step (and the reference's once), on real decoded video; and ``torchrun --nproc_per_node 2`` with
``mrsp.sp_size=2`` (sequence parallel, gloo) gives the step-1 gradients of the 1-process run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from safetensors.torch import load_file  # noqa: E402

from longreel.schemas.config import ConfigError, load_yaml  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.grpo import grpo_group_loss as _GROUP_LOSS  # noqa: E402  (unpatched, for the spy)
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5
sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_mrsp_worker import video_items  # noqa: E402
from conftest import free_port  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def items(shared_videos):
    # 3 prompts on 2 videos: the two questions on vtest share one encode under MR-SP
    return video_items(shared_videos)


def _cfg(model: str, out: Path, *extra: str) -> TrainConfig:
    return load_yaml(TrainConfig, None, [
        f"model.path={model}", f"run.out_dir={out}", "run.steps=1", "run.save_final=false", "run.progress=false",
        "run.tensorboard=false", "run.threads=1", "run.seed=11", "data.batch_size=3", "data.shuffle=false",
        "rollout.n=4", "rollout.max_new_tokens=8", "optim.grad_accum=2", "grpo.mix_policy=true",
        "grpo.beta=0.05", "optim.lr=1e-3", *extra])


def _one_step(cfg: TrainConfig, items, monkeypatch):
    """One GRPO step; returns (metrics, per-chunk records of the update's inputs, tower call counts)."""
    import longreel.trainer.grpo as grpo
    from longreel.trainer.mrsp.embed_cache import VisionCallCounter

    records = []
    real = _GROUP_LOSS

    def spy(logp, g, rows, cfg_, denominator, norm_len):
        records.append({"item": g.item_index, "rows": (rows.start, rows.stop), "mask": g.response_mask[rows].clone(),
                        "old": g.old_logp[rows].detach().clone(), "ref": g.ref_logp[rows].detach().clone(),
                        "logp": logp.detach().clone(), "ids": g.response_ids[rows].clone()})
        return real(logp, g, rows, cfg_, denominator, norm_len)

    monkeypatch.setattr(grpo, "grpo_group_loss", spy)
    tr = grpo.GRPOTrainer(cfg, items=items)
    pol, ref = VisionCallCounter(tr.sess.model), VisionCallCounter(tr.ref)
    try:
        metrics = tr.step()
    finally:
        pol.close()
        ref.close()
        tr.engine.close()
        tr.sess.close()
    return metrics, records, {"policy": pol.calls, "policy_grad": pol.grad_calls, "ref": ref.calls}


def _masked_maxdiff(a, b, mask):
    return float(((a - b).abs() * mask).max())


@pytest.mark.parametrize("vision", ["frozen", "deferred"])
def test_mrsp_step_equals_plain_step_and_encodes_each_video_once(tiny, items, tmp_path, monkeypatch, vision):
    extra = ("model.freeze_vision=true",) if vision == "frozen" else ()
    on_cfg = _cfg(tiny, tmp_path / "on", f"run.dump_grads={tmp_path / 'on.safetensors'}", "mrsp.enabled=true",
                  f"mrsp.vision={vision}", *extra)
    off_cfg = _cfg(tiny, tmp_path / "off", f"run.dump_grads={tmp_path / 'off.safetensors'}", "mrsp.enabled=false",
                   *extra)
    m_on, r_on, calls_on = _one_step(on_cfg, items, monkeypatch)
    m_off, r_off, calls_off = _one_step(off_cfg, items, monkeypatch)

    # the same rollouts were sampled and scored, chunk by chunk
    assert [(r["item"], r["rows"]) for r in r_on] == [(r["item"], r["rows"]) for r in r_off]
    assert len(r_on) == 6  # 3 prompts x grad_accum 2
    for a, b in zip(r_on, r_off):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["mask"], b["mask"])
        for k in ("old", "ref", "logp"):
            d = _masked_maxdiff(a[k], b[k], a["mask"])
            assert d <= TOL, f"{k} log-probs differ by {d} (item {a['item']}, rows {a['rows']})"
    for k in ("reward_mean", "accuracy", "response_len_mean"):
        assert m_on[k] == m_off[k], k
    assert abs(m_on["loss"] - m_off["loss"]) <= TOL and abs(m_on["kl"] - m_off["kl"]) <= TOL

    g_on, g_off = load_file(str(tmp_path / "on.safetensors")), load_file(str(tmp_path / "off.safetensors"))
    assert g_on.keys() == g_off.keys()
    visual = [k for k in g_on if "visual" in k]
    if vision == "deferred":  # the tower still trains: its gradient is there, and equal
        assert visual and sum(float(g_on[k].abs().sum()) for k in visual) > 0
    else:
        assert not visual
    assert sum(float(g.abs().sum()) for g in g_on.values()) > 0  # a real gradient, not an all-tied batch
    worst = max(float((g_on[k] - g_off[k]).abs().max()) for k in g_on)
    assert worst <= TOL, f"max |grad(MR-SP) - grad(plain)| = {worst}"

    # tower passes per step: 2 unique videos (3 prompts) under MR-SP; the plain path encodes per prompt for the
    # rollout + once per update chunk, and the reference once per prompt
    assert calls_on["policy"] == 2, calls_on
    assert calls_on["policy_grad"] == (2 if vision == "deferred" else 0)
    assert calls_on["ref"] == (0 if vision == "frozen" else 2), calls_on  # frozen: the policy's features serve
    assert calls_off == {"policy": 3 + 3 * 2, "policy_grad": 3 * 2, "ref": 3}, calls_off


def test_step_with_prompts_decoded_one_at_a_time_equals_the_batched_decode(tiny, items, tmp_path, monkeypatch):
    """``rollout.prompts_per_decode=1`` (each prompt's rollouts decoded alone) against the default (the step's 3
    prompts, of different lengths, in one decode batch): the same responses, and the decode's log-probs (the MR-SP
    step's old log-probs), the update's log-probs, loss and KL within fp32 rounding."""
    import longreel.engines.shared_prefix as shared_prefix

    lengths: list = []
    stack = shared_prefix._stack_prompts
    monkeypatch.setattr(shared_prefix, "_stack_prompts",
                        lambda pre, layer: (layer or lengths.append([p.length for p in pre]), stack(pre, layer))[1])
    batched = _one_step(_cfg(tiny, tmp_path / "batched", "mrsp.enabled=true"), items, monkeypatch)
    assert len(lengths) == 1 and len(lengths[0]) == 3 and len(set(lengths[0])) > 1  # one batch, padded prompts
    monkeypatch.setattr(shared_prefix, "_stack_prompts", stack)
    alone = _one_step(_cfg(tiny, tmp_path / "alone", "mrsp.enabled=true", "rollout.prompts_per_decode=1"), items,
                      monkeypatch)
    (m_b, r_b, _), (m_a, r_a, _) = batched, alone
    assert len(r_b) == len(r_a) == 6
    for a, b in zip(r_b, r_a):
        assert (a["item"], a["rows"]) == (b["item"], b["rows"])
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["mask"], b["mask"])
        for k in ("old", "ref", "logp"):
            assert _masked_maxdiff(a[k], b[k], a["mask"]) <= TOL, k
    for k in ("reward_mean", "accuracy", "response_len_mean"):
        assert m_b[k] == m_a[k], k
    assert abs(m_b["loss"] - m_a["loss"]) <= TOL and abs(m_b["kl"] - m_a["kl"]) <= TOL


def test_recompute_and_two_ppo_epochs_match_plain(tiny, items, tmp_path, monkeypatch):
    """ppo_epochs=2: the tower changes between epochs, so each epoch's update must see the current tower."""
    common = ("grpo.ppo_epochs=2", "optim.max_grad_norm=0", "run.save_final=true", "run.steps=1")
    outs = {}
    for name, sets in {"deferred": ("mrsp.vision=deferred",), "recompute": ("mrsp.vision=recompute",),
                       "off": ("mrsp.enabled=false",)}.items():
        from longreel.trainer.grpo import run_grpo

        run_grpo(_cfg(tiny, tmp_path / name, *common, *sets), items=items)
        outs[name] = load_file(str(tmp_path / name / "final" / "model.safetensors"))
    base = load_file(str(Path(tiny) / "model.safetensors"))
    assert any(not torch.equal(base[k], v) for k, v in outs["off"].items())
    # AdamW's second step divides a momentum that can nearly cancel (g2 ~ -0.9 g1) by sqrt(v): at a few single
    # elements that amplifies fp32 rounding of the gradients ~1000x (3.5e-5 seen with lr 1e-3, against 1e-7
    # relative gradient differences). So: per tensor, the weights' difference relative to how far they moved,
    # and a max-abs bound of a tenth of one lr step. A tower left stale in epoch 2 moves whole tensors apart.
    for name in ("deferred", "recompute"):
        worst = max(float((outs[name][k] - outs["off"][k]).abs().max()) for k in outs["off"])
        assert worst <= 1e-4, f"{name}: weights after 2 ppo epochs differ from the plain path by {worst}"
        rel = max(float((outs[name][k] - outs["off"][k]).norm()) / float((outs["off"][k] - base[k]).norm())
                  for k in outs["off"] if float((outs["off"][k] - base[k]).norm()) > 0)
        assert rel <= 1e-3, f"{name}: a tensor's weights differ from the plain path by {rel} of their move"


def test_mrsp_config_validation():
    with pytest.raises(ConfigError, match="freeze_vision"):
        load_yaml(TrainConfig, None, ["mrsp.vision=frozen"])
    with pytest.raises(ConfigError, match="freeze_vision"):
        load_yaml(TrainConfig, None, ["mrsp.vision=deferred", "model.freeze_vision=true"])
    with pytest.raises(ConfigError, match="not one of"):
        load_yaml(TrainConfig, None, ["mrsp.vision=sometimes"])
    with pytest.raises(ConfigError, match="sp_size"):
        load_yaml(TrainConfig, None, ["mrsp.sp_size=0"])
    with pytest.raises(ConfigError, match="mrsp.enabled"):
        load_yaml(TrainConfig, None, ["mrsp.sp_size=2", "mrsp.enabled=false"])
    c = load_yaml(TrainConfig, None, ["model.freeze_vision=true"])
    assert c.mrsp.resolved_vision(c.model.freeze_vision) == "frozen"
    c = load_yaml(TrainConfig, None, [])
    assert c.mrsp.enabled and c.mrsp.resolved_vision(c.model.freeze_vision) == "deferred"


def test_sp_size_without_torchrun_is_a_clear_error(tiny, items, tmp_path):
    from longreel.trainer.grpo import GRPOTrainer

    with pytest.raises(ValueError, match="sp_size=2 needs torchrun"):
        GRPOTrainer(_cfg(tiny, tmp_path / "x", "mrsp.sp_size=2"), items=items)


# ---------------------------------------------------------------------------------------------- torchrun, SP = 2


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{cmd[:6]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("sp_min_tokens", [1, 100000], ids=["sp-prefill", "row-split"])
def test_torchrun_sequence_parallel_matches_one_process(tiny, shared_videos, tmp_path, sp_min_tokens):
    worker = str(Path(__file__).resolve().parent / "grpo_mrsp_worker.py")
    common = [tiny, str(shared_videos), f"mrsp.sp_min_tokens={sp_min_tokens}", "mrsp.vision=deferred"]
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, worker, str(one), str(tmp_path / "g1.safetensors"), *common])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(free_port()), worker, str(two), str(tmp_path / "g2.safetensors"), *common,
          "mrsp.sp_size=2"])

    from longreel.trainer.logging_utils import read_metrics

    g1, g2 = load_file(str(tmp_path / "g1.safetensors")), load_file(str(tmp_path / "g2.safetensors"))
    assert g1.keys() == g2.keys() and len(g1) > 10
    assert sum(float(g.abs().sum()) for g in g1.values()) > 0
    assert any("visual" in k and float(g1[k].abs().sum()) > 0 for k in g1)  # sharded tower gradients summed
    worst = max(float((g1[k] - g2[k]).abs().max()) for k in g1)
    assert worst <= TOL, f"max |grad(1 proc) - grad(2 ranks, SP)| = {worst}"
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert len(m1) == len(m2) == 1
    for k in ("reward_mean", "accuracy", "format_rate", "response_len_mean", "offline_groups", "rejected_items",
              "groups_with_signal"):
        assert m1[0][k] == m2[0][k], k  # the same rollouts, counted once per SP group
    assert abs(m1[0]["loss"] - m2[0]["loss"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_data_parallel_times_sequence_parallel_matches_one_process(tiny, shared_videos, tmp_path, strategy):
    """World 4 = 2 data-parallel replicas x SP groups of 2 (4 gloo processes): the step-1 gradients of the global
    batch equal the 1-process run; under FSDP the weights are sharded over all 4 ranks (the replicas prefill
    prompts of different lengths, the same layers in the same order)."""
    worker = str(Path(__file__).resolve().parent / "grpo_mrsp_worker.py")
    common = [tiny, str(shared_videos), "mrsp.sp_min_tokens=1", "mrsp.vision=deferred", "data.batch_size=4"]
    _run([sys.executable, worker, str(tmp_path / "one"), str(tmp_path / "g1.safetensors"), *common])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
          "--master_port", str(free_port()), worker, str(tmp_path / "four"), str(tmp_path / "g4.safetensors"),
          *common, "mrsp.sp_size=2", f"dist.strategy={strategy}"])
    g1, g4 = load_file(str(tmp_path / "g1.safetensors")), load_file(str(tmp_path / "g4.safetensors"))
    assert g1.keys() == g4.keys() and sum(float(g.abs().sum()) for g in g1.values()) > 0
    worst = max(float((g1[k] - g4[k]).abs().max()) for k in g1)
    assert worst <= TOL, f"max |grad(1 proc) - grad(2 replicas x SP 2)| = {worst}"


def test_sp_groups_share_prompts_and_split_the_batch_over_replicas():
    """world 4, sp_size 2: ranks {0, 1} and {2, 3} are the two data-parallel replicas; a group's ranks get the same
    prompts and the replicas together get the global batch once."""
    from types import SimpleNamespace

    from longreel.trainer.runtime import DistInfo, ItemStream, TrainSession

    items = [{"key": str(i)} for i in range(8)]
    shares = []
    for rank in range(4):
        cfg = SimpleNamespace(data=SimpleNamespace(batch_size=4))
        fake = SimpleNamespace(stream=ItemStream(items, seed=1), cfg=cfg, info=DistInfo(rank=rank, world=4, sp_size=2))
        shares.append([j for j, _, _ in TrainSession.local_batch(fake)])
    assert shares[0] == shares[1] and shares[2] == shares[3]
    assert sorted(shares[0] + shares[2]) == [0, 1, 2, 3]
    assert [DistInfo(rank=r, world=4, sp_size=2).sp_leader for r in range(4)] == [True, False, True, False]
