from pipelines.stats import build_stats, merge_stats


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
