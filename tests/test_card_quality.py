"""The card's quality gates: the quality funnel (duplicates, judge, blind) with counts by reason, the answer-letter
and blind pass-count plots, and `card verify` recomputing what the shards allow (the letters and their chi-square,
the released blind pass counts) and failing on a mismatch."""
import json
import os
import shutil

import pytest

from test_blind import ScriptedEngine
from test_judge import ScriptedJudge, _verdict


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
    from longreel.pipelines.card.build import build_card
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.sample_corpus import demo_items
    from longreel.schemas.config import load_yaml

    class Judge(ScriptedJudge):
        def generate(self, requests):  # the first question (by id) fails the answer check, the others pass
            first = min(r.key for r in requests)
            self.verdicts = {r.key.split(":", 1)[1]: _verdict(follows=r.key != first) for r in requests}
            return super().generate(requests)

    tmp = tmp_path_factory.mktemp("gated")
    out = str(tmp / "out")
    cfg = load_yaml(CurateConfig, None, ["stages=[caption, qra, judge, blind, pack]", "blind.k=4"])
    stats = run_curate(demo_items(), out, cfg, handlers={"blind": lambda: ScriptedEngine(lambda opts: "A"),
                                                         "judge": lambda: Judge({})})
    card_dir = str(tmp / "card")
    card = build_card(out, card_dir)
    return out, card_dir, card, stats


def _claims(card):
    return {c["id"]: c["value"] for c in card["claims"]}


def test_quality_funnel_and_plots(gated_run):
    out, card_dir, card, stats = gated_run
    cl = _claims(card)
    gates = {g["gate"]: g for g in cl["quality/funnel"]}
    assert set(gates) == {"duplicates", "judge", "blind"}
    by = {s["stage"]: s for s in stats["stages"]}
    for g in gates.values():
        st = by[g["stage"]]
        assert (g["in"], g["out"], g["rejected"]) == (st["in"], st["out"], st["rejected"])
    assert set(gates["judge"]["rejected"]) == {"judge_answer_unsupported"}  # one question per video fails
    assert gates["blind"]["in"] == gates["judge"]["out"]  # the judge runs first, the blind filter sees its kept
    readme = open(os.path.join(card_dir, "README.md"), encoding="utf-8").read()
    row = gates["judge"]
    assert (f"| judge | judge | question | {row['in']} | {row['out']} | judge_answer_unsupported: "
            f"{row['rejected']['judge_answer_unsupported']} |") in readme
    assert "| duplicates | dedup | video | 4 | 4 | none |" in readme
    for png in ("answer_letters.png", "blind_pass_count.png"):
        with open(os.path.join(card_dir, png), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"({png})" in readme
    # the released questions carry their blind pass counts: the card's released histogram is theirs
    released = cl["dist/released_blind_pass_count"]
    assert sum(released.values()) == sum(sp["questions"] for k, sp in cl.items() if k.startswith("split/"))


def test_verify_recomputes_letters_and_blind_counts_from_the_shards(gated_run, tmp_path):
    from longreel.pipelines.card.verify import verify

    out, card_dir, card, _ = gated_run
    shards = os.path.join(out, "shards")
    rep = verify(card_dir, shards)  # the trainer's loader reads the shards, judge verdicts and blind counts in them
    assert rep.ok, rep.table()
    assert {"quality/answer_letters", "quality/blind: no released question is text-answerable"} <= {
        r["claim"] for r in rep.rows}

    def tampered(edit):
        d = str(tmp_path / f"card{len(os.listdir(tmp_path))}")
        shutil.copytree(card_dir, d)
        path = os.path.join(d, "card.json")
        doc = json.load(open(path, encoding="utf-8"))
        for c in doc["claims"]:
            edit(c)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        return verify(d, shards, loader=False)

    def letters(c):
        if c["id"] == "quality/answer_letters":
            first = next(iter(c["value"]["counts"]))
            c["value"]["counts"][first] += 1

    def blind_hist(c):
        if c["id"] == "quality/blind":
            c["value"]["pass_count_histogram"] = [0] * len(c["value"]["pass_count_histogram"])

    def gate_counts(c):
        if c["id"] == "quality/funnel":
            c["value"][0]["out"] -= 1

    for edit, claim in ((letters, "quality/answer_letters"),
                        (blind_hist, "quality/blind: released blind pass counts within the card's histogram"),
                        (gate_counts, "quality/funnel")):
        rep = tampered(edit)
        assert not rep.ok
        assert any(f["claim"].startswith(claim) for f in rep.failures()), (claim, rep.table())


def test_gates_added_later_join_the_quality_funnel_by_their_stage_names():
    from longreel.pipelines.card.build import quality_funnel

    stats = {"stages": [{"stage": s, "unit": "u", "in": 5, "out": 4, "rejected": {"r": 1}}
                        for s in ("ingest", "dedup", "segment", "clip_dedup", "caption", "caption_align", "qra",
                                  "qra_dedup", "judge", "blind", "pass_rate")]}
    assert [(g["gate"], g["stage"]) for g in quality_funnel(stats)] == [
        ("duplicates", "dedup"), ("duplicates", "clip_dedup"), ("alignment", "caption_align"),
        ("duplicates", "qra_dedup"), ("judge", "judge"), ("blind", "blind")]
