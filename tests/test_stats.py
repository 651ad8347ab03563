from longreel.pipelines.stats import build_stats, merge_stats


def test_merge_keeps_stages_listed_only_for_order():
    old = build_stats([(("ingest", "in"), 3), (("ingest", "out"), 2), (("ingest", "rejected:not_found"), 1)],
                      ["ingest"], {"ingest": "video"}, {})
    new = build_stats([(("caption", "in"), 5), (("caption", "out"), 5)], ["ingest", "caption"],
                      {"caption": "clip"}, {})
    merged = merge_stats(old, new, ["ingest", "caption"], computed={"caption"})
    by = {s["stage"]: s for s in merged["stages"]}
    assert by["ingest"]["in"] == 3 and by["ingest"]["rejected"] == {"not_found": 1}
    assert by["caption"]["out"] == 5 and [s["stage"] for s in merged["stages"]] == ["ingest", "caption"]
    # a re-run of the same stage replaces its old numbers
    again = merge_stats(merged, build_stats([(("caption", "in"), 4), (("caption", "out"), 3),
                                             (("caption", "rejected:empty_caption"), 1)],
                                            ["caption"], {"caption": "clip"}, {}), computed={"caption"})
    assert {s["stage"]: s["in"] for s in again["stages"]} == {"ingest": 3, "caption": 4}


def test_build_stats_balances_and_orders():
    doc = build_stats([(("b", "in"), 2), (("b", "out"), 1), (("a", "in"), 1), (("a", "out"), 1),
                       (("b", "rejected:x"), 1), (("b", "clips"), 7)], ["a", "b"], {"a": "video"}, {"m": 1})
    assert [s["stage"] for s in doc["stages"]] == ["a", "b"] and doc["m"] == 1
    b = doc["stages"][1]
    assert b["balanced"] and b["rejected_total"] == 1 and b["extra"] == {"clips": 7} and b["unit"] == "item"
    bad = build_stats([(("c", "in"), 2), (("c", "out"), 0)], ["c"], {}, {})
    assert not bad["stages"][0]["balanced"]



def test_run_pairs_go_to_the_run_key_never_into_the_funnel():
    from longreel.pipelines.stats import NONDETERMINISTIC_KEYS, RUN_KEY, run_count
    assert NONDETERMINISTIC_KEYS == (RUN_KEY,) == ("run",)
    funnel = [(("caption", "in"), 2), (("caption", "out"), 2), (("frame_cache", "in"), 1), (("frame_cache", "out"), 1)]
    plain = build_stats(funnel, ["caption", "frame_cache"], {}, {})
    assert RUN_KEY not in plain  # nothing timed or reused: the document is unchanged
    run = [run_count("caption", "timed"), run_count("caption", "latency_total_s", 0.125),
           run_count("caption", "timed"), run_count("caption", "latency_total_s", 0.375),
           run_count("frame_cache", "hit")]
    doc = build_stats(sorted(funnel + run), ["caption", "frame_cache"], {}, {})
    assert doc["run"] == {"caption": {"latency_mean_s": 0.25, "latency_total_s": 0.5, "timed": 2},
                          "frame_cache": {"hit": 1}}
    assert {k: v for k, v in doc.items() if k != RUN_KEY} == plain  # the funnel does not see them
    # a stage re-run alone replaces its own entry and keeps the other stages'
    again = merge_stats(doc, build_stats([(("caption", "in"), 1), (("caption", "out"), 1),
                                          run_count("caption", "timed"), run_count("caption", "latency_total_s", 0.1)],
                                         ["caption"], {}, {}), computed={"caption"})
    assert again["run"] == {"caption": {"latency_mean_s": 0.1, "latency_total_s": 0.1, "timed": 1},
                            "frame_cache": {"hit": 1}}
    # a re-run that timed nothing drops the stage's old entry rather than keeping a stale one
    none = merge_stats(doc, build_stats([(("caption", "in"), 0)], ["caption"], {}, {}), computed={"caption"})
    assert none["run"] == {"frame_cache": {"hit": 1}}


def test_nothing_survived_names_what_the_stages_before_rejected():
    """Every clip rejected by clip_facts: the caption stage got 0 in and rejected nothing, and the exit-3 line said
    "(none rejected)" of a run that had rejected every clip."""
    from longreel.pipelines.stats import nothing_survived

    doc = {"stages": [{"stage": "clip_facts", "in": 2, "out": 0, "rejected": {"decode_failed": 2}},
                      {"stage": "caption", "in": 0, "out": 0, "rejected": {}}]}
    assert nothing_survived(doc, ["caption"]) == "0 captions from 0 in (clip_facts rejected decode_failed 2)"
    doc["stages"][0]["rejected"] = {}
    assert nothing_survived(doc, ["caption"]).endswith("(none rejected)")
