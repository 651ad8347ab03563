"""Balanced options: the seeded permutation, the answer and the reasoning's letters moved with the options,
position-dependent options rejected, the qra_balance funnel, and the chi-square test of answer letters."""
import collections

import apache_beam as beam
import pytest

from longreel.pipelines.gates import options as O
from longreel.pipelines.qra.targets import make_target
from longreel.pipelines.qra.validate import concluded_letter


def _row(qid, options, answer, reasoning=None):
    reasoning = reasoning or f"Checking the video at [00:10-00:20]: option {answer} is shown. So the answer is {answer}."
    return {"qra_id": qid, "video_id": "v", "category": "spatial", "problem_type": "multiple_choice",
            "question": "Which colour dominates?", "options": list(options), "answer": answer,
            "reasoning": reasoning, "target": make_target(reasoning, answer), "generator": "scripted",
            "model": "m", "prompt_hash": "h", "sampling": "{}", "source_caption_ids": ["c"], "refined": False}


def test_permutation_is_seeded_by_the_question_and_recorded():
    assert O.permutation("q1", 4) == O.permutation("q1", 4)
    perms = {tuple(O.permutation(f"q{i}", 4)) for i in range(200)}
    assert len(perms) == 24  # every order of four occurs
    out, reason, _ = O.balance(_row("q7", ["red", "green", "blue", "grey"], "C"))
    assert reason is None
    perm = out["option_permutation"]
    assert out["options"] == [["red", "green", "blue", "grey"][i] for i in perm]
    assert out["options"][ord(out["answer"]) - ord("A")] == "blue"  # the answer moved with its option
    assert out["target"] == make_target(out["reasoning"], out["answer"])
    assert concluded_letter(out["reasoning"]) == out["answer"]


def test_reasoning_letters_move_and_the_article_stays():
    perm = [1, 0, 2, 3]  # A <-> B
    text = "Option A is at 00:10 and options A and C later; A man walks. So the answer is B."
    assert O.remap_letters(text, perm) == ("Option B is at 00:10 and options B and C later; A man walks. "
                                           "So the answer is A.")


@pytest.mark.parametrize("option", ["All of the above", "none of these", "Both A and B", "A and C",
                                    "Options B or D", "Neither of the above"])
def test_position_dependent_options_are_rejected(option):
    out, reason, message = O.balance(_row("q1", ["red", "green", "blue", option], "D"))
    assert out is None and reason == O.POSITION_DEPENDENT and option in message


@pytest.mark.parametrize("option", ["a dog and a cat", "grey", "It increases", "2, 3, 1", "All three at once"])
def test_ordinary_options_are_shuffled(option):
    out, reason, _ = O.balance(_row("q1", ["red", "green", "blue", option], "D"))
    assert reason is None and out["option_permutation"] is not None


def test_an_answer_that_is_no_option_letter_is_rejected_not_raised():
    out, reason, _ = O.balance(_row("q1", ["a", "b", "c", "d"], "E"))
    assert out is None and reason == O.BAD_ANSWER


def test_open_ended_rows_pass_unchanged():
    row = dict(_row("q1", ["a"], "A"), problem_type="open_ended", options=None, answer="blue")
    out, reason, _ = O.balance(row)
    assert out is row and reason is None


def test_a_writer_that_always_says_b_comes_out_uniform():
    rows = [_row(f"q{i}", ["w", "x", "y", "z"], "B") for i in range(400)]
    letters = collections.Counter(O.balance(r)[0]["answer"] for r in rows)
    before = O.chi_square_uniform([400 if x == "B" else 0 for x in "ABCD"])
    after = O.chi_square_uniform([letters[x] for x in "ABCD"])
    assert before["p_value"] < 1e-6 and after["p_value"] > 0.01 and sum(letters.values()) == 400


@pytest.mark.parametrize("counts", [[1, 4, 1, 0], [3, 3, 3, 3], [10, 2, 0, 1], [5, 9], [7, 1, 2], [0, 0, 0, 0],
                                    [40, 25, 31, 22, 12]])
def test_chi_square_matches_scipy(counts):
    stats = pytest.importorskip("scipy.stats")
    got = O.chi_square_uniform(counts)
    assert got["df"] == len(counts) - 1
    if sum(counts):
        want = stats.chisquare(counts)
        assert got["chi2"] == pytest.approx(want.statistic, abs=1e-6)
        assert got["p_value"] == pytest.approx(want.pvalue, abs=1e-6)
    else:
        assert got["p_value"] == 1.0


def test_the_stage_counts_and_rejects():
    from apache_beam.testing.util import assert_that, equal_to

    from longreel.pipelines.stages.balance import BalanceOptions

    rows = [_row("q1", ["a", "b", "c", "d"], "A"), _row("q2", ["a", "b", "c", "All of the above"], "D"),
            dict(_row("q3", ["a"], "A"), problem_type="open_ended", options=None, answer="x")]
    with beam.Pipeline() as p:
        out = p | beam.Create(rows) | BalanceOptions(True)
        assert_that(out["main"] | "Ids" >> beam.Map(lambda r: (r["qra_id"], r.get("option_permutation") is None)),
                    equal_to([("q1", False), ("q3", True)]), label="main")
        assert_that(out["rejects"] | "Reasons" >> beam.Map(lambda r: (r["key"], r["reason"])),
                    equal_to([("q2", "position_dependent_option")]), label="rejects")
        summed = out["counts"] | beam.CombinePerKey(sum)
        assert_that(summed, equal_to([(("qra_balance", "in"), 3), (("qra_balance", "out"), 2),
                                      (("qra_balance", "rejected:position_dependent_option"), 1),
                                      (("qra_balance", "shuffled"), 1), (("qra_balance", "passed_through"), 1)]),
                    label="counts")
