"""Trainer plumbing on the tiny offline Qwen2-VL: prompts, the placeholder check, embedding reuse, rollouts, SFT loss,
eval, config and plots."""
from __future__ import annotations

import json

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.schemas.config import ConfigError, describe, load_yaml  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.policy import (VideoEmbeds, VideoTokenMismatch, encode_prompt, encode_video, load_policy,  # noqa: E402
                            sequence_logprobs, sft_inputs, video_token_id)
from longreel.trainer.rollout import SamplingConfig, TransformersEngine, vision_token_ids  # noqa: E402
from longreel.trainer.synthetic_task import KINDS, make_item, make_items  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d = build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)
    model, processor = load_policy(d)
    model.eval()
    return model, processor


def _prompt(policy, item):
    model, processor = policy
    return encode_prompt(processor, item, video_token_id=video_token_id(model))


def test_synthetic_items_are_deterministic_and_verifiable():
    from longreel.task.rewards import score

    a, b = make_item(3, seed=5, kinds=KINDS), make_item(3, seed=5, kinds=KINDS)
    assert torch.equal(a["frames"], b["frames"]) and a["question"] == b["question"]
    assert not torch.equal(make_item(4, seed=5)["frames"], a["frames"])
    for item in make_items(9, seed=1, kinds=KINDS):
        assert item["frames"].dtype == torch.uint8 and item["frames"].shape == (4, 56, 56, 3)
        assert item["video_metadata"]["total_num_frames"] == 4
        assert score(item["target"], item["problem_type"], item["answer"], item["options"]).reward == 1.0
    # the colour kind's answer is readable from the pixels: the ball's mean colour is closest to the answer's
    from longreel.trainer.synthetic_task import COLOURS

    for item in make_items(8, seed=2, kinds=("colour",)):
        f = item["frames"].float()
        bright = f.sum(-1) > 200
        mean_rgb = f[bright].mean(0)
        nearest = min(COLOURS, key=lambda c: float(((mean_rgb - torch.tensor(COLOURS[c]).float()) ** 2).sum()))
        assert "ABCD"[list(COLOURS).index(nearest)] == item["answer"]


def test_placeholder_check_names_the_sample(policy):
    model, processor = policy
    item = make_item(0)
    prompt = _prompt(policy, item)
    n = int((prompt.input_ids == video_token_id(model)).sum())
    assert n == int(prompt.video_grid_thw.prod()) // 4 > 0
    # a question that smuggles a placeholder token in: never silently truncated or padded
    bad = dict(item, key="clip42_q7", question="What is <|video_pad|> here?")
    with pytest.raises(VideoTokenMismatch, match="clip42_q7"):
        _prompt(policy, bad)
    # precomputed embeddings of the wrong size: a clear error naming the sample
    emb = encode_video(model, prompt)
    short = VideoEmbeds(emb.features[:-1], emb.grid_thw)
    resp = torch.tensor([[5, 6, 7]])
    with pytest.raises(VideoTokenMismatch, match=item["key"]):
        sequence_logprobs(model, prompt, resp, torch.ones_like(resp), video_embeds=short)


def test_logprobs_with_reused_embeddings_equal_the_plain_forward(policy):
    model, processor = policy
    prompt = _prompt(policy, make_item(1))
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(0, 200, (3, 6), generator=g)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    with torch.no_grad():
        emb = encode_video(model, prompt)
        reused = sequence_logprobs(model, prompt, resp, mask, video_embeds=emb, temperature=0.7)
        fresh = sequence_logprobs(model, prompt, resp, mask, temperature=0.7)
        # the plain path: every row carries its own pixels through the whole model, one sequence at a time
        for r in range(3):
            n = int(mask[r].sum())
            ids = torch.cat([prompt.input_ids, resp[r:r + 1, :n]], dim=1)
            mm = torch.cat([prompt.mm_token_type_ids, torch.zeros(1, n, dtype=prompt.mm_token_type_ids.dtype)], 1)
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm,
                        pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=prompt.video_grid_thw)
            logits = out.logits[0, prompt.length - 1:-1].float() / 0.7
            ref = torch.log_softmax(logits, -1).gather(-1, resp[r, :n, None]).squeeze(-1)
            torch.testing.assert_close(reused[r, :n], ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(fresh[r, :n], ref, atol=1e-5, rtol=0)


def test_rollouts_are_seeded_per_prompt_and_never_emit_placeholders(policy):
    model, processor = policy
    engine = TransformersEngine(model, processor)
    prompts = [_prompt(policy, make_item(i)) for i in range(2)]
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=12)
    a = engine.generate(prompts, sampling, seeds=[11, 12])
    b = engine.generate(prompts[1:], sampling, seeds=[12])  # alone, in another batch: same samples
    torch.testing.assert_close(a[1].response_ids, b[0].response_ids)
    c = engine.generate(prompts[:1], sampling, seeds=[99])
    assert not torch.equal(a[0].response_ids, c[0].response_ids)
    banned = set(vision_token_ids(model))
    assert video_token_id(model) in banned
    for g in a:
        assert g.response_ids.shape[0] == 4 and len(g.texts) == 4
        assert not banned & set(g.response_ids[g.response_mask.bool()].tolist())
        ends = g.response_mask.sum(-1) - 1
        for row, end, fin in zip(g.response_ids, ends, g.finished):
            # a finished response ends with its EOS, and nothing after it is a real token
            assert bool(fin) == (int(row[end]) in engine.eos)


def test_sft_loss_is_on_response_tokens_only(policy):
    model, processor = policy
    item = make_item(2)
    prompt = _prompt(policy, item)
    ids, mask = sft_inputs(processor, prompt, item["target"], processor.tokenizer.eos_token_id)
    assert processor.tokenizer.decode(ids[0, :-1]) == item["target"]
    logp = sequence_logprobs(model, prompt, ids, mask)
    ours = -(logp * mask).sum() / mask.sum()
    # transformers' own loss with every prompt/video label masked out gives the same number
    full = torch.cat([prompt.input_ids, ids], 1)
    labels = full.clone()
    labels[:, :prompt.length] = -100
    mm = torch.cat([prompt.mm_token_type_ids, torch.zeros_like(ids, dtype=prompt.mm_token_type_ids.dtype)], 1)
    out = model(input_ids=full, attention_mask=torch.ones_like(full), mm_token_type_ids=mm, labels=labels,
                pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=prompt.video_grid_thw)
    torch.testing.assert_close(ours, out.loss, atol=1e-5, rtol=0)


def test_evaluate_reports_per_category_and_skips_bad_items(policy):
    from longreel.trainer.eval import evaluate
    from longreel.task.rewards import score

    model, processor = policy
    items = make_items(4, seed=3, kinds=("colour", "count"))
    items.append(dict(make_item(9), key="broken", question="Look <|video_pad|>"))
    res = evaluate(model, processor, items, max_new_tokens=8, keep_outputs=True)
    assert res["n"] == 4 and res["skipped"] == 1 and res["skipped_items"][0]["key"] == "broken"
    assert set(res["per_category"]) == {"colour", "count"}
    assert res["per_problem_type"]["multiple_choice"]["n"] == 4
    again = [score(o["output"], "multiple_choice", o["answer"], it["options"]).accuracy
             for o, it in zip(res["outputs"], items)]
    assert res["accuracy"] == pytest.approx(sum(again) / 4)
    from longreel.trainer.eval import ci95

    assert res["accuracy_ci95"] == ci95(again)
    for k, v in res["per_category"].items():
        assert v["accuracy_ci95"] == ci95([a for a, it in zip(again, items) if it["category"] == k])


def test_ci95_is_wilson_for_right_or_wrong_and_the_mean_interval_for_partial_scores():
    from longreel.trainer.eval import ci95

    # the Wilson score interval's published values (e.g. 5 of 10: 0.2366-0.7634)
    assert ci95([1] * 5 + [0] * 5) == [0.236593, 0.763407]
    assert ci95([0] * 9) == [0.0, 0.299145]  # 0 right of 9: not [0, 0], as the normal interval would say
    assert ci95([1] * 10) == [0.722467, 1.0]
    assert ci95([1] * 100 + [0] * 100) == [0.431361, 0.568639]
    assert ci95([0.5, 0.7, 0.2]) == [0.181891, 0.751443]  # 0.4667 +- 1.96 * 0.2517 / sqrt(3)
    assert ci95([0.3]) == [0.0, 1.0] and ci95([]) is None
    low, high = ci95([1] * 30 + [0] * 70)
    assert low < 0.3 < high and high - low > ci95([1] * 300 + [0] * 700)[1] - ci95([1] * 300 + [0] * 700)[0]


def test_evaluate_answers_each_item_alike_in_any_batch(policy):
    """Items decoded together give each item's own greedy answer: batches of 1, 3 and all agree, with an item
    that cannot be encoded in the middle of a batch (skipped with its reason, the others unaffected)."""
    from longreel.trainer.eval import evaluate

    model, processor = policy
    items = make_items(6, seed=5, kinds=("colour", "count"))
    items.insert(2, dict(make_item(9), key="broken", question="Look <|video_pad|>"))
    runs = [evaluate(model, processor, items, max_new_tokens=8, keep_outputs=True, batch_size=b) for b in (1, 3, 16)]
    assert [r["outputs"] for r in runs[1:]] == [runs[0]["outputs"]] * 2
    assert len({o["output"] for o in runs[0]["outputs"]}) > 1  # the items' answers differ, so order matters
    assert all(r["n"] == 6 and r["skipped"] == 1 and r["skipped_items"][0]["key"] == "broken" for r in runs)


def test_an_evaluation_in_shares_is_the_whole_evaluation(policy):
    """Each rank of a run scores every world-th held-out item; the records put together, in any order, give what
    one process gives for all the items: the same outputs in the same order, counts, skips and means."""
    from longreel.trainer.eval import evaluate, score_items, summarize

    model, processor = policy
    items = make_items(7, seed=5, kinds=("colour", "count"))
    items.insert(4, dict(make_item(9), key="broken", question="Look <|video_pad|>"))
    whole = evaluate(model, processor, items, max_new_tokens=8, keep_outputs=True, batch_size=2)
    shares = [score_items(model, processor, items[r::3], indices=list(range(r, len(items), 3)), max_new_tokens=8,
                          keep_outputs=True, batch_size=2) for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 2]
    assert summarize([r for s in reversed(shares) for r in s], keep_outputs=True) == whole
    assert whole["n"] == 7 and whole["skipped_items"][0]["key"] == "broken"
    assert len({o["output"] for o in whole["outputs"]}) > 1  # the items' answers differ, so their order is checked


def test_config_help_validation_and_overrides(tmp_path):
    keys = describe(TrainConfig)
    assert all(h.strip() for _, _, h in keys), [k for k, _, h in keys if not h.strip()]
    assert ("rollout.n", "8", ) == tuple(next((k, d) for k, d, _ in keys if k == "rollout.n"))
    y = tmp_path / "c.yaml"
    y.write_text("rollout:\n  n: 4\ngrpo:\n  clip_high: 0.3\n")
    cfg = load_yaml(TrainConfig, str(y), ["rollout.n=6", "data.train_urls=[a.tar, b.tar]"])
    assert cfg.rollout.n == 6 and cfg.grpo.clip_high == 0.3 and cfg.data.train_urls == ["a.tar", "b.tar"]
    assert (cfg.grpo.clip_low, cfg.grpo.beta) == (0.2, 0.0)
    for bad in (["rollout.n=0"], ["grpo.loss_agg=mean"], ["rollout.temprature=1"], ["grpo.clip_low=1.5"]):
        with pytest.raises(ConfigError):
            load_yaml(TrainConfig, None, bad)


def test_plot_draws_png(tmp_path):
    from longreel.trainer.plot import plot_metrics

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "stage": "grpo", "reward_mean": i / 10, "loss": 1.0 / i} for i in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "c.png"
    drawn = plot_metrics([run], out)
    assert drawn == ["reward_mean", "loss"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # held-out accuracy, logged at the eval.every steps only, is drawn by default when the run evaluated
    rows[1]["eval_accuracy"], rows[3]["eval_accuracy"] = 0.25, 0.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_metrics([run], out) == ["reward_mean", "eval_accuracy", "loss"]
    # with its 95% interval, shaded around the curve rather than drawn as panels of their own
    rows[1].update(eval_accuracy_ci95_low=0.1, eval_accuracy_ci95_high=0.45)
    rows[3].update(eval_accuracy_ci95_low=0.3, eval_accuracy_ci95_high=0.7)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_metrics([run], out) == ["reward_mean", "eval_accuracy", "loss"]
    with pytest.raises(ValueError, match=r"--keys: nope not in the runs' metrics; they hold eval_accuracy, "
                                         r"eval_accuracy_ci95_high, eval_accuracy_ci95_low, loss, reward_mean"):
        plot_metrics([run], out, keys=["nope"])
    with pytest.raises(ValueError, match=r"--keys: los \(did you mean loss\?\) not in"):
        plot_metrics([run], out, keys=["loss", "los"])  # every key asked for by name is drawn, or none
    with pytest.raises(ValueError, match="holds no metrics.jsonl: not a training run's directory"):
        plot_metrics([tmp_path], out)
    # a last line cut short (a run killed while writing it) is left out; a bad line in the middle is named
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "stage": "grpo", "rew')
    assert plot_metrics([run], out, keys=["loss"]) == ["loss"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:5]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        plot_metrics([run], out)
    with open(run / "metrics.jsonl", "a") as fh:  # and a torn last line besides: the one in the middle is named
        fh.write('{"step": 6, "rew')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        plot_metrics([run], out)


def test_synthetic_task_through_the_shard_writer_and_loader(policy, tmp_path):
    """The procedural task is written with the pack stage's shard writer and read back with trainer.data: the
    trainer sees the same frames and answers, and the cached grid is checked against the processor's."""
    from longreel.trainer.config import DataConfig
    from longreel.trainer.runtime import load_items
    from longreel.trainer.synthetic_task import write_shards

    items = make_items(5, seed=4, kinds=("colour", "exit_side"))
    index = write_shards(items, str(tmp_path / "shards"), split="rl", per_shard=2)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        "synthetic-rl-000000.tar", "synthetic-rl-000001.tar", "synthetic-rl-000002.tar", "synthetic-rl.index.json"]
    got = {g["qra_id"]: g for g in load_items(DataConfig(source="shards", train_urls=[index]), "train")}
    assert sorted(got) == sorted(it["key"] for it in items)
    for it in items:
        g = got[it["key"]]
        assert torch.equal(g["frames"], it["frames"])
        assert (g["answer"], g["options"], g["target"]) == (it["answer"], it["options"], it["target"])
        a, b = _prompt(policy, g), _prompt(policy, it)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values_videos, b.pixel_values_videos)
    bad = dict(got[items[0]["key"]], video_grid_thw=[9, 9, 9])
    with pytest.raises(VideoTokenMismatch, match=items[0]["key"]):
        _prompt(policy, bad)


def test_vllm_engine_is_imported_lazily(policy):
    import importlib.util

    from longreel.trainer.rollout import make_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here, so the missing-vllm error cannot be provoked "
                    "(scripts/gpu_check_grpo_vllm.py runs the engine itself)")
    model, processor = policy
    with pytest.raises(RuntimeError, match="vllm"):
        make_engine("vllm", model, processor, model_path="/nonexistent")
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_engine("sglang", model, processor)
