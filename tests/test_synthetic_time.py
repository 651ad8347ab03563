"""The synthetic task's time kinds need the video: one frame is at chance, all frames answer every item."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from longreel.task.rewards import score
from longreel.trainer.synthetic_solvers import find_balls, oracle_answer, single_frame_answer
from longreel.trainer.synthetic_task import (CHANGES, COLOURS, KINDS, TIME_KINDS, answer_from_trace, make_item,
                                             make_items, trace_words)

N_PER_KIND = 300


@pytest.fixture(scope="module")
def items():
    return make_items(N_PER_KIND * len(KINDS), seed=11, kinds=KINDS, size=56)


def _by_kind(items, kind):
    return [i for i in items if i["category"] == kind]


@pytest.mark.parametrize("kind", TIME_KINDS)
def test_single_frame_solver_is_at_chance_on_time_kinds(items, kind):
    its = _by_kind(items, kind)
    chance = 1.0 / len(its[0]["options"])
    # the answer letters themselves are balanced (a constant guess is at chance too)
    letters = [i["answer"] for i in its]
    assert max(letters.count(x) for x in set(letters)) / len(its) <= chance + 4 * math.sqrt(chance * (1 - chance) / len(its))
    for t in range(4):  # whichever frame it is shown
        acc = np.mean([single_frame_answer(i["frames"].numpy(), i["question"], i["options"], t) == i["answer"]
                       for i in its])
        bound = 4 * math.sqrt(chance * (1 - chance) / len(its))
        assert abs(acc - chance) <= bound, (kind, t, acc, chance)


def test_single_frame_solver_solves_the_single_frame_kind(items):
    its = _by_kind(items, "colour")
    acc = np.mean([single_frame_answer(i["frames"].numpy(), i["question"], i["options"]) == i["answer"] for i in its])
    assert acc == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_multi_frame_oracle_answers_every_item(items, kind):
    for i in _by_kind(items, kind):
        assert oracle_answer(i["frames"].numpy(), i["question"], i["options"]) == i["answer"], i["key"]
        # the CoT target is a correct, well-formed answer under the shared rewards
        assert score(i["target"], i["problem_type"], i["answer"], i["options"]).reward == 1.0


@pytest.mark.parametrize("kind", TIME_KINDS)
def test_time_kinds_are_deterministic_under_seed(kind):
    a, b = make_item(5, seed=7, kinds=(kind,), size=112), make_item(5, seed=7, kinds=(kind,), size=112)
    assert a["frames"].numpy().tobytes() == b["frames"].numpy().tobytes()
    assert (a["question"], a["options"], a["answer"], a["target"]) == (b["question"], b["options"], b["answer"],
                                                                       b["target"])
    others = [make_item(5, seed=8, kinds=(kind,), size=112), make_item(6, seed=7, kinds=(kind,), size=112)]
    assert all(o["frames"].numpy().tobytes() != a["frames"].numpy().tobytes() for o in others)


def test_time_kind_frames_show_what_the_question_is_about():
    # order: the same two balls in every frame; count_colours / direction / change: one ball per frame
    for item in make_items(40, seed=3, kinds=TIME_KINDS, size=112):
        for frame in item["frames"].numpy():
            balls = {k: v for k, v in find_balls(frame).items() if k in COLOURS}
            want = 2 if item["category"] == "order" else 1
            assert len(balls) == want, (item["key"], sorted(balls))
            if item["category"] == "order":
                assert set(balls) == set(item["options"])


def test_time_kinds_need_enough_frames():
    with pytest.raises(ValueError, match="at least 3 frames"):
        make_item(0, kinds=("order",), n_frames=2)


def test_time_kind_targets_fit_the_learning_benchmarks_rollout_budget(tmp_path):
    # benchmarks/learn.py samples 16 new tokens: a CoT target longer than that cannot be produced, so SFT would
    # teach an answer GRPO's rollouts never reach (trial T1 of results/learn_time_trials.json)
    from transformers import AutoTokenizer

    from longreel.testing.tiny_model import build_tiny_qwen2vl

    tok = AutoTokenizer.from_pretrained(build_tiny_qwen2vl(tmp_path / "m", seed=0, hidden_size=64))
    longest = max(len(tok(i["target"]).input_ids) for i in make_items(200, seed=4, kinds=TIME_KINDS, size=56))
    assert longest <= 15  # and one for the end-of-turn token


def test_shards_written_for_four_frame_patches_load_into_that_policy(tmp_path):
    # benchmarks/learn.py --temporal-patch 4: the cached video_grid_thw must be the 4-frame processor's, or
    # encode_prompt rejects every item; the 2-frame processor must reject those shards (the check is real)
    from transformers import AutoProcessor

    from longreel.testing.tiny_model import build_tiny_qwen2vl
    from longreel.trainer.config import DataConfig
    from longreel.trainer.policy import VideoTokenMismatch, encode_prompt
    from longreel.trainer.runtime import load_items
    from longreel.trainer.synthetic_task import write_shards

    items = make_items(4, seed=2, kinds=TIME_KINDS, n_frames=4, size=112)
    index = write_shards(items, str(tmp_path / "s"), split="rl", temporal_patch_size=4)
    got = load_items(DataConfig(source="shards", train_urls=[index]), "train")
    assert [list(g["video_grid_thw"]) for g in got] == [[1, 8, 8]] * 4
    four = AutoProcessor.from_pretrained(build_tiny_qwen2vl(tmp_path / "m4", seed=0, temporal_patch_size=4))
    two = AutoProcessor.from_pretrained(build_tiny_qwen2vl(tmp_path / "m2", seed=0))
    vt = four.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for g in got:
        assert int((encode_prompt(four, g, video_token_id=vt).input_ids == vt).sum()) == 16
        with pytest.raises(VideoTokenMismatch):
            encode_prompt(two, g, video_token_id=vt)


def test_answer_variance_share_of_the_varshare_diagnostic():
    # benchmarks/learn_varshare.py (diagnostics D18/D19): 1 when the features are the answer, about
    # (classes - 1) / (items - 1) when the answer is unrelated to them, the answer's share when mixed with nuisance
    import torch

    from conftest import load_benchmark

    vs = load_benchmark("learn_varshare")
    g = torch.Generator().manual_seed(0)
    labels = ["ABC"[i % 3] for i in range(600)]
    onehot = torch.nn.functional.one_hot(torch.tensor([i % 3 for i in range(600)]), 3).float()
    assert vs.answer_variance_share(onehot, labels) == pytest.approx(1.0)
    noise = torch.randn(600, 8, generator=g)
    assert vs.answer_variance_share(noise, labels) < 0.02
    # the answer as 3 one-hot dims (variance 3 x 2/9) beside 8 nuisance dims of variance 1
    mixed = torch.cat([onehot * 1.0, noise], 1)
    assert vs.answer_variance_share(mixed, labels) == pytest.approx((2 / 3) / (2 / 3 + 8), abs=0.02)


def _trace_of(target: str) -> list[str]:
    return trace_words(target)


def _answer_from_trace(item: dict) -> str:
    """The answer a reader of the trace alone gives (the rule each trace is written for)."""
    return answer_from_trace(item["category"], _trace_of(item["target"]), item["options"])


def test_a_malformed_trace_implies_no_answer():
    # a model's trace may be anything: the reads diagnostic (benchmarks/learn_reads.py) must tell "no rule
    # applies" from an answer
    opts = ["left", "right"]
    assert answer_from_trace("direction", ["3", "0", "1", "2"], opts) == "B"  # 3 -> 0 wraps: one step right
    assert answer_from_trace("direction", ["2", "1"], opts) == "A"
    assert answer_from_trace("direction", ["gre", "2"], opts) is None
    assert answer_from_trace("direction", ["2", "2", "2", "2"], opts) is None  # no step: no direction implied
    assert answer_from_trace("direction", ["0", "2"], opts) is None
    assert answer_from_trace("order", ["red", "2", "blue", "2"], ["red", "blue"]) is None
    assert answer_from_trace("order", ["red", "2", "blue"], ["red", "blue"]) is None
    assert answer_from_trace("order", ["red", "3", "blue", "1"], ["red", "blue"]) == "B"
    assert answer_from_trace("order", ["red", "1", "green", "3"], ["red", "blue"]) == "A"
    assert answer_from_trace("order", ["green", "1", "red", "3"], ["red", "blue"]) is None  # not an option
    assert answer_from_trace("count_colours", ["red", "red", "blue"], ["1", "2", "3", "4"]) == "B"
    assert answer_from_trace("count_colours", ["gre", "12"], ["1", "2", "3", "4"]) is None
    assert answer_from_trace("change", ["red", "1", "small", "red", "1", "small"], list(CHANGES)) is None
    assert answer_from_trace("change", ["red", "1", "small", "red", "5", "small"], list(CHANGES)) == "B"
    assert answer_from_trace("colour", ["red"], ["red"]) is None
    assert trace_words("<think>1 2 3 0.</think><answer>B</answer>") == ["1", "2", "3", "0"]
    assert trace_words("<think>1 2 3 0.") is None and trace_words("no tags") is None


def test_trace_reasoning_keeps_the_item_and_spells_out_the_frames():
    short = make_items(80, seed=6, kinds=TIME_KINDS, size=112)
    trace = make_items(80, seed=6, kinds=TIME_KINDS, size=112, reasoning="trace")
    for s, t in zip(short, trace):
        assert s["frames"].numpy().tobytes() == t["frames"].numpy().tobytes()
        assert (s["question"], s["options"], s["answer"]) == (t["question"], t["options"], t["answer"])
        assert t["target"] != s["target"]
        assert score(t["target"], t["problem_type"], t["answer"], t["options"]).reward == 1.0
        assert _answer_from_trace(t) == t["answer"], t["target"]
        # what the trace says each frame shows is what the pixels show
        frames, words = t["frames"].numpy(), _trace_of(t["target"])
        balls = [{k: v for k, v in find_balls(f).items() if k in COLOURS} for f in frames]
        if t["category"] == "count_colours":
            assert words == [next(iter(b)) for b in balls]
        elif t["category"] == "direction":
            assert [int(x) for x in words] == [next(iter(b.values()))["cell"] % 4 for b in balls]
        elif t["category"] == "change":
            for (colour, cell), b in ((words[0:2], balls[0]), (words[3:5], balls[-1])):
                assert list(b) == [colour] and b[colour]["cell"] == int(cell)
        else:
            # the balls in the options' order: which colour comes first must be readable from the question
            assert [words[0], words[2]] == t["options"]
            for colour, at in (words[0:2], words[2:4]):
                cells = [b[colour]["cell"] for b in balls]
                assert [i for i in range(1, len(cells)) if cells[i] != cells[i - 1]] == [int(at)]


def test_unknown_reasoning_style_is_refused():
    with pytest.raises(ValueError, match="reasoning must be one of"):
        make_item(0, kinds=("order",), reasoning="long")


def test_trace_targets_fit_a_24_token_rollout_budget(tmp_path):
    # benchmarks/learn.py --reasoning trace runs with --max-new-tokens 24 (diagnostic D25 of learn_time_trials.json)
    from transformers import AutoTokenizer

    from longreel.testing.tiny_model import build_tiny_qwen2vl

    tok = AutoTokenizer.from_pretrained(build_tiny_qwen2vl(tmp_path / "m", seed=0, hidden_size=64))
    items = make_items(200, seed=4, kinds=TIME_KINDS, size=56, reasoning="trace")
    assert max(len(tok(i["target"]).input_ids) for i in items) <= 23


def test_learn_summary_says_whether_all_four_time_kinds_were_run(tmp_path):
    # benchmarks/learn.py's `passed` is over the kinds a run holds; trial T9 ran direction alone, and the issue's
    # target pools the four time kinds, so the JSON says which were run and whether all four passed
    import json

    from conftest import load_benchmark

    learn = load_benchmark("learn")
    seed = {"gain_points": 20.0, "gain_points_time": 20.0, "cpu_s": {"total_with_eval": 900.0},
            "single_frame_time": 0.5, "chance_time": 0.5}
    for kinds, all_four in (("direction", False), ("colour," + ",".join(TIME_KINDS), True)):
        args = learn.build_parser().parse_args(["--kinds", kinds])
        out = tmp_path / "s.json"
        learn.summarise([dict(seed, seed=0), dict(seed, seed=1)], args, 10.0, 1800.0, out, tmp_path / "s.png", [])
        doc = json.loads(out.read_text())
        assert doc["passed"] is True and doc["passed_on_all_time_kinds"] is all_four
        assert doc["time_kinds_run"] == [k for k in TIME_KINDS if k in kinds.split(",")]
    args = learn.build_parser().parse_args(["--kinds", ",".join(TIME_KINDS)])
    learn.summarise([dict(seed, seed=0, gain_points_time=14.0)], args, 10.0, 900.0, out, tmp_path / "s.png", [])
    assert json.loads(out.read_text())["passed_on_all_time_kinds"] is False


def test_learning_benchmarks_draw_and_pack_items_with_the_runs_reasoning_and_patch(tmp_path):
    # benchmarks/passrate_value.py once wrote its shards with short reasoning and 2-frame patches whatever
    # --reasoning / --temporal-patch said; learn.py's run_items / write_run_shards are now the one place both
    # benchmarks (and learn_diagnose.py) draw and pack their items
    from conftest import load_benchmark

    from longreel.trainer.config import DataConfig
    from longreel.trainer.runtime import load_items

    learn = load_benchmark("learn")
    args = learn.build_parser().parse_args(["--kinds", "direction,change", "--reasoning", "trace",
                                            "--temporal-patch", "1", "--size", "56"])
    items = learn.run_items(4, 7, args)
    trace = make_items(4, seed=7, kinds=("direction", "change"), size=56, reasoning="trace")
    short = make_items(4, seed=7, kinds=("direction", "change"), size=56)
    assert [i["target"] for i in items] == [i["target"] for i in trace] != [i["target"] for i in short]
    index = learn.write_run_shards(items, tmp_path / "s", args, split="rl")
    got = load_items(DataConfig(source="shards", train_urls=[index]), "train")
    assert [list(g["video_grid_thw"]) for g in got] == [[4, 4, 4]] * 4  # 4 frames, one per temporal patch
    pv = load_benchmark("passrate_value")
    assert pv.run_items is pv.learn.run_items and pv.write_run_shards is pv.learn.write_run_shards


def test_learning_benchmarks_curves_keep_kl_signal_and_truncation(tmp_path):
    # the pass-rate ablation's per-run curves once kept only reward, accuracy and format: the KL to the reference,
    # the share of groups with signal and of truncated responses (what explained P3's one unstable arm) had to be
    # read back from the run directories
    from conftest import load_benchmark

    pv = load_benchmark("passrate_value")
    rows = [{"stage": "grpo", "step": 1, "reward_mean": 0.5, "format_rate": 1.0, "accuracy": 0.5,
             "response_len_mean": 9.0, "groups_with_signal": 0.75, "kl": 0.12, "truncated_frac": 0.0625,
             "dynamic_draws": 2, "dynamic_kept_groups": 8, "reward_mean/direction": 0.25},
            {"stage": "grpo", "step": 2, "reward_mean": 0.25, "format_rate": 0.5, "accuracy": 0.25,
             "response_len_mean": 11.0, "eval_accuracy": 0.4, "eval_accuracy/direction": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cv = pv.curves(tmp_path)
    first, second = cv["reward"]
    assert (first["kl"], first["groups_with_signal"], first["truncated_frac"]) == (0.12, 0.75, 0.0625)
    assert (first["dynamic_draws"], first["dynamic_kept_groups"]) == (2, 8)  # dynamic sampling's cost per step
    assert first["reward_by_kind"] == {"direction": 0.25}
    assert "kl" not in second and "dynamic_draws" not in second and second["reward_mean"] == 0.25  # not invented
    assert cv["held_out"] == [{"step": 2, "accuracy": 0.4, "per_kind": {"direction": 0.4}}]


def test_passrate_ablation_compares_arms_and_borrows_only_from_a_run_with_the_same_settings(tmp_path):
    # benchmarks/passrate_value.py --arms online --compare EARLIER.json: the new arm runs alone and the earlier
    # run's other arms of the same seed join the comparisons, but only when that run measured the same thing
    from conftest import load_benchmark

    pv = load_benchmark("passrate_value")
    held = lambda *accs: [{"step": 50 * i, "accuracy": a} for i, a in enumerate(accs)]  # noqa: E731
    arm = lambda *accs: {"held_out": held(*accs), "final_accuracy": accs[-1],  # noqa: E731
                         "mean_held_out": pv.mean_after_sft(held(*accs))}
    assert pv.mean_after_sft(held(0.1, 0.5, 0.7)) == pytest.approx(0.6)  # step 0 (the SFT model) left out
    args = pv.build_parser().parse_args(["--arms", "online", "--seeds", "0"])
    earlier = {"settings": dict(vars(pv.build_parser().parse_args([])), arms="medium,unfiltered"),
               "per_seed": [{"seed": 0, "sft_accuracy": 0.4, "arms": {"medium": arm(0.4, 0.5, 0.5),
                                                                      "unfiltered": arm(0.4, 0.45, 0.55)}}]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    results = [{"seed": 0, "sft_accuracy": 0.4, "arms": {"online": arm(0.4, 0.6, 0.6)}}]
    pv.add_compared_arms(results, str(path), args)
    r = results[0]
    assert r["arms"]["online"].get("from") is None and r["arms"]["medium"]["from"].endswith("earlier.json")
    c = r["comparisons"]
    assert c["online_minus_unfiltered"]["final_points"] == pytest.approx(5.0)
    assert c["online_minus_unfiltered"]["mean_over_evaluations_points"] == pytest.approx(10.0)
    assert c["medium_minus_unfiltered"]["mean_over_evaluations_points"] == pytest.approx(0.0)
    other = pv.build_parser().parse_args(["--arms", "online", "--seeds", "0", "--grpo-lr", "0.003"])
    with pytest.raises(SystemExit, match="settings differ .*grpo_lr"):
        pv.add_compared_arms([dict(results[0], arms={"online": arm(0.4, 0.6)})], str(path), other)
    with pytest.raises(SystemExit, match="SFT model differs"):
        pv.add_compared_arms([dict(results[0], sft_accuracy=0.41)], str(path), args)


def test_reads_tell_a_policy_that_misreads_the_frames_from_one_that_skips_the_rule():
    # benchmarks/learn_reads.py: per-position trace-word accuracy and whether the answer follows the model's own trace
    from conftest import load_benchmark

    lr = load_benchmark("learn_reads")
    items = [i for i in make_items(8, seed=3, kinds=TIME_KINDS, size=56, reasoning="trace")
             if i["category"] == "direction"]
    assert len(items) == 2
    row = lambda item, output, acc: {"kind": item["category"], "target": item["target"],  # noqa: E731
                                     "options": item["options"], "output": output, "accuracy": acc}
    exact = lr.trace_reads([row(i, i["target"], 1.0) for i in items])["direction"]
    assert exact == {"n": 2, "accuracy": 1.0, "trace_word_accuracy": [1.0] * 4, "well_formed": 1.0,
                     "answer_follows_own_trace": 1.0}
    # the right columns with the other letter: read, rule not applied
    flip = {"A": "B", "B": "A"}
    skipped = [row(i, i["target"].replace(f"<answer>{i['answer']}<", f"<answer>{flip[i['answer']]}<"), 0.0)
               for i in items]
    assert lr.trace_reads(skipped)["direction"]["trace_word_accuracy"] == [1.0] * 4
    assert lr.trace_reads(skipped)["direction"]["answer_follows_own_trace"] == 0.0
    # a degenerate trace: nothing read, no rule to apply
    junk = lr.trace_reads([row(i, "<think>gre 2.</think><answer>A</answer>", 0.5) for i in items])["direction"]
    assert junk["trace_word_accuracy"] == [0.0] * 4 and junk["well_formed"] == 0.0
    assert junk["answer_follows_own_trace"] is None and junk["accuracy"] == 0.5
    # kinds without a trace are not counted
    colour = make_items(1, seed=3, kinds=("colour",), size=56)[0]
    assert lr.trace_reads([row(colour, colour["target"], 1.0)]) == {}


def test_reads_tool_decodes_a_policy_directory_from_a_runs_command_line(tmp_path):
    # learn_reads.py end to end on a tiny policy; the build part of a learn.py command line (--spatial-merge,
    # --layers) parses, the training part is not asked for
    from conftest import load_benchmark
    from longreel.testing.tiny_model import build_tiny_qwen2vl

    lr = load_benchmark("learn_reads")
    policy = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    out = tmp_path / "reads.json"
    argv = ["--checkpoints", str(policy), "--seeds", "3", "--kinds", "direction,change", "--reasoning", "trace",
            "--size", "56", "--eval-items", "6", "--max-new-tokens", "8", "--spatial-merge", "2", "--layers", "2",
            "--work", str(tmp_path / "w"), "--out", str(out)]
    assert lr.main(argv) == 0
    doc = json.loads(out.read_text())
    reads = doc["checkpoints"][str(policy)]
    assert doc["seed"] == 3 and set(reads) <= {"direction", "change"}
    assert sum(r["n"] for r in reads.values()) == 6
    for r in reads.values():
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["well_formed"] <= 1.0
    with pytest.raises(SystemExit):
        lr.build_parser().parse_args(argv + ["--grpo-steps", "10"])
