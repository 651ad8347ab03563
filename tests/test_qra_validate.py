"""Parsing and validation of generated QRA items: malformed and adversarial model outputs, each with
the reject reason it must get (or acceptance), plus the schema and target helpers."""
from __future__ import annotations

import json

import pytest

from longreel.pipelines.qra.json_schema import (GENERATION_SCHEMA, SCHEMA_KEYWORDS, check_instance, generation_schema,
                                       refinement_schema, schema_json, schema_keywords)
from longreel.pipelines.qra.parse import ParseError, extract_json, parse_generation, strip_think
from longreel.pipelines.qra.targets import make_target, normalize_question, problem_type_of, qra_id
from longreel.pipelines.qra.validate import REASONS, concluded_letter, has_time_ref, validate_generation, validate_item

SPAN = 120.0

MC = {
    "question": "What does the man do right after he puts the kettle on the stove?",
    "problem_type": "multiple_choice",
    "options": ["He opens the window", "He takes a mug from the shelf", "He answers the phone",
                "He sits down at the table"],
    "reasoning": "At [00:10-00:20] the man places the kettle on the stove. In the next clip, 00:20-00:30, he "
                 "reaches up and takes a mug from the shelf, so the answer is B.",
    "answer": "B",
}

OPEN = {
    "question": "Why does the woman return to the car at the end of the video?",
    "problem_type": "open_ended",
    "reasoning": "Between 00:40 and 00:50 she pats her pockets and looks worried; at 00:55 she opens the car "
                 "door and picks up her keys from the seat.",
    "answer": "She forgot her keys in the car",
}

NUMERIC_MC = {
    "question": "How many cups are on the table at 00:10?",
    "problem_type": "multiple_choice",
    "options": ["10", "3", "4", "5"],
    "reasoning": "The caption of [00:10-00:20] counts ten cups lined up on the table. The answer is A.",
    "answer": "A",
}


def mc(**changes) -> dict:
    item = dict(MC)
    for key, value in changes.items():
        if value is ...:
            item.pop(key, None)
        else:
            item[key] = value
    return item


def op(**changes) -> dict:
    item = dict(OPEN)
    for key, value in changes.items():
        if value is ...:
            item.pop(key, None)
        else:
            item[key] = value
    return item


def wrap(*items) -> str:
    return json.dumps({"questions": list(items)}, ensure_ascii=False)


def run_text(text: str, category: str = "temporal", seen: frozenset = frozenset(), span: float | None = SPAN):
    return validate_generation(text, category=category, video_span_s=span, seen_questions=seen)


def one_reason(text: str, **kw) -> str | None:
    kept, rejects = run_text(text, **kw)
    assert len(kept) + len(rejects) == 1, (kept, rejects)
    return rejects[0][0] if rejects else None


# --- whole outputs: (id, raw model text, expected reason or None for acceptance) ----------------------

TEXT_CASES = [
    ("valid_wrapped", wrap(MC), None),
    ("code_fence_with_prose", "Sure! Here is the JSON:\n```json\n" + wrap(MC) + "\n```\nLet me know.", None),
    ("prose_before_and_after", "Here are the questions: " + wrap(MC) + " I hope these [2] help.", None),
    ("closed_think_preamble", "<think>\nThe captions show a kettle {maybe} ...\n</think>\n\n" + wrap(MC), None),
    ("orphan_think_closer_r1_style", "Okay, let me look at [00:10-00:20] first...\n</think>\n" + wrap(MC), None),
    ("think_uppercase_tags", "<THINK>draft</THINK>" + wrap(MC), None),
    ("unclosed_think_truncated", "<think>\nLet me read the captions. The man at 00:10 puts the kettle", "unparseable"),
    ("unclosed_think_with_draft_json", "<think>maybe {\"questions\": [] ... and then", "unparseable"),
    ("truncated_json", wrap(MC)[:-40], "unparseable"),
    ("truncated_in_fence", "```json\n" + wrap(MC)[:120], "unparseable"),
    ("empty_output", "", "unparseable"),
    ("whitespace_output", "  \n\t ", "unparseable"),
    ("prose_only", "I cannot generate questions for this video.", "unparseable"),
    ("python_literals", "{'questions': [{'question': 'x', 'answer': None}]}", "unparseable"),
    ("nan_constant", '{"questions": [{"question": "q", "answer": NaN}]}', "unparseable"),
    ("empty_question_list", '{"questions": []}', "unparseable"),
    ("questions_not_a_list", '{"questions": "none"}', "unparseable"),
    ("top_level_scalar", '"just a string"', "unparseable"),
    ("absurdly_deep_nesting", "[" * 50000 + "]" * 50000, "unparseable"),
    ("trailing_commas_repaired", wrap(MC).replace('"He sits down at the table"]', '"He sits down at the table",]'),
     None),
    ("bare_single_object", json.dumps(MC), None),
    ("questions_key_capitalized", json.dumps({"Questions": [MC]}), None),
    ("list_item_not_object", json.dumps({"questions": ["What does the man do?"]}), "unparseable"),
    ("unknown_wrapper_is_one_item", json.dumps({"error": "no content"}), "missing_field"),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in TEXT_CASES], ids=[c[0] for c in TEXT_CASES])
def test_generation_outputs(text, expected):
    assert one_reason(text) == expected


# --- single items: (id, item, category, expected reason or None) ------------------------------------

FULL_WIDTH_B = "\uff22"  # "Ｂ"

ITEM_CASES = [
    # answers
    ("answer_E", mc(answer="E"), "temporal", "mc_answer_not_in_options"),
    ("answer_lowercase_letter", mc(answer="b"), "temporal", None),
    ("answer_parenthesized", mc(answer="(B)"), "temporal", None),
    ("answer_option_prefix_word", mc(answer="Option B"), "temporal", None),
    ("answer_full_width_letter", mc(answer=FULL_WIDTH_B), "temporal", None),
    ("answer_is_option_text", mc(answer="He takes a mug from the shelf"), "temporal", None),
    ("answer_is_option_text_case_punct", mc(answer="he takes a mug from the shelf."), "temporal", None),
    ("answer_text_not_an_option", mc(answer="He drinks tea"), "temporal", "mc_answer_not_in_options"),
    ("answer_letter_with_other_options_text", mc(answer="B. He answers the phone"), "temporal",
     "mc_answer_not_in_options"),
    ("answer_letter_with_own_text", mc(answer="B. He takes a mug from the shelf"), "temporal", None),
    ("answer_integer_index", mc(answer=1), "temporal", "mc_answer_not_in_options"),
    ("answer_empty_mc", mc(answer=""), "temporal", "mc_answer_not_in_options"),
    ("answer_two_letters", mc(answer="B, C"), "temporal", "mc_answer_not_in_options"),
    ("answer_boolean", mc(answer=True), "temporal", "missing_field"),
    # options
    ("three_options", mc(options=MC["options"][:3]), "temporal", "mc_wrong_option_count"),
    ("five_options", mc(options=MC["options"] + ["He leaves"]), "temporal", "mc_wrong_option_count"),
    ("empty_option", mc(options=["He opens the window", "He takes a mug from the shelf", "", "He sits"]),
     "temporal", "mc_empty_option"),
    ("blank_option", mc(options=["  ", "He takes a mug from the shelf", "He answers", "He sits"]), "temporal",
     "mc_empty_option"),
    ("punctuation_only_option", mc(options=["He opens the window", "He takes a mug from the shelf", "...",
                                            "He sits"]), "temporal", "mc_empty_option"),
    ("null_option", mc(options=["He opens the window", "He takes a mug from the shelf", None, "He sits"]),
     "temporal", "mc_empty_option"),
    ("duplicate_options_case_punct", mc(options=["He opens the window", "He takes a mug from the shelf",
                                                 "he opens the WINDOW.", "He sits"]), "temporal",
     "mc_duplicate_options"),
    ("duplicate_options_whitespace", mc(options=["He opens  the   window ", "He takes a mug from the shelf",
                                                 "He opens the window", "He sits"]), "temporal",
     "mc_duplicate_options"),
    ("duplicate_options_full_width", mc(options=["ＨＥ ＳＩＴＳ", "He takes a mug from the shelf",
                                                 "He answers the phone", "he sits"]), "temporal",
     "mc_duplicate_options"),
    ("accents_are_not_duplicates", mc(options=["Il entre au café", "He takes a mug from the shelf",
                                               "Il entre au cafe", "He sits"]), "temporal", None),
    ("options_not_a_list", mc(options="A. x B. y C. z D. w"), "temporal", "missing_field"),
    ("options_missing", mc(options=...), "temporal", "missing_field"),
    ("options_null_mc", mc(options=None), "temporal", "missing_field"),
    ("letter_answer_without_type_or_options", mc(options=..., problem_type=...), "temporal", "missing_field"),
    ("numeric_options", mc(options=[1, 2, 3, 4], answer="B",
                           reasoning="At 00:20 the man takes 2 mugs. The answer is B."), "temporal", None),
    # leaks
    ("mc_answer_leaked", mc(question="He takes a mug from the shelf after the kettle: what happens next?"),
     "temporal", "answer_leaked"),
    ("mc_question_lists_options_not_leaked",
     mc(question="Which comes first after the kettle: he opens the window or he takes a mug from the shelf?"),
     "temporal", None),
    ("open_answer_leaked", op(question="She forgot her keys in the car; why does the woman return to the car?"),
     "goal_purpose", "answer_leaked"),
    ("open_short_answer_not_checked", op(question="What is red in the scene at the end?", answer="red"),
     "goal_purpose", None),
    ("timestamp_digits_not_a_leak", NUMERIC_MC, "temporal", None),
    # reasoning
    ("reasoning_no_timespan", mc(reasoning="The man puts the kettle on and then takes a mug, so the answer is B."),
     "temporal", "reasoning_no_timespan"),
    ("reasoning_seconds_words", mc(reasoning="About 20 seconds in, he takes a mug. The answer is B."), "temporal",
     None),
    ("reasoning_at_n_s", mc(reasoning="At 25 s he takes a mug from the shelf. The answer is B."), "temporal", None),
    ("reasoning_decade_is_no_time", mc(reasoning="The kitchen looks like the 1990s; the answer is B."),
     "temporal", "reasoning_no_timespan"),
    ("reasoning_concludes_other_letter", mc(reasoning="At 00:20 he takes a mug, so the answer is C."), "temporal",
     "reasoning_contradicts_answer"),
    ("reasoning_therefore_letter_at_end", mc(reasoning="At 00:20 he takes a mug from the shelf. Therefore, D."),
     "temporal", "reasoning_contradicts_answer"),
    ("reasoning_other_is_correct", mc(reasoning="At 00:20 he takes a mug; option (A) is the correct one."),
     "temporal", "reasoning_contradicts_answer"),
    ("reasoning_revises_to_answer", mc(reasoning="At first the answer is C, but [00:20-00:30] shows him take a "
                                                 "mug, so the answer is B; option C is incorrect."), "temporal", None),
    ("reasoning_without_letter", mc(reasoning="At 00:20 he takes a mug from the shelf."), "temporal", None),
    ("reasoning_full_width_letter", mc(reasoning="At 00:20 he takes a mug. The answer is \uff23."), "temporal",
     "reasoning_contradicts_answer"),
    ("time_beyond_video", mc(reasoning="At 05:00 he takes a mug from the shelf; the answer is B."), "temporal",
     "timespan_out_of_range"),
    ("question_time_beyond_video", op(question="Why does the woman return to the car at 03:10?"), "goal_purpose",
     "timespan_out_of_range"),
    # categories and problem types
    ("wrong_category", mc(category="spatial"), "temporal", "wrong_category"),
    ("unknown_category", mc(category="funny"), "temporal", "wrong_category"),
    ("category_not_text", mc(category=3), "temporal", "wrong_category"),
    ("category_spelled_differently", op(category="Goal-Purpose"), "goal_purpose", None),
    ("bad_problem_type", mc(problem_type="essay"), "temporal", "bad_problem_type"),
    ("schema_type_not_generated_here", mc(problem_type="numerical"), "temporal", "bad_problem_type"),
    ("problem_type_not_text", mc(problem_type=1), "temporal", "bad_problem_type"),
    ("open_ended_with_options", op(options=["a", "b", "c", "d"]), "goal_purpose", "bad_problem_type"),
    ("problem_type_alias", mc(problem_type="Multiple-Choice"), "temporal", None),
    ("problem_type_inferred", mc(problem_type=...), "temporal", None),
    # missing, null, wrong types, empty
    ("missing_answer", mc(answer=...), "temporal", "missing_field"),
    ("null_reasoning", mc(reasoning=None), "temporal", "missing_field"),
    ("missing_question", op(question=...), "goal_purpose", "missing_field"),
    ("question_is_number", mc(question=42), "temporal", "missing_field"),
    ("reasoning_is_list", mc(reasoning=["00:10 kettle", "00:20 mug"]), "temporal", "missing_field"),
    ("question_empty", mc(question="   "), "temporal", "question_empty"),
    ("reasoning_empty", op(reasoning=""), "goal_purpose", "reasoning_empty"),
    ("open_answer_empty", op(answer=" "), "goal_purpose", "open_answer_empty"),
    ("open_answer_number", op(question="How many times does she check her pockets?", answer=3), "goal_purpose",
     None),
    ("not_an_object", ["question", "answer"], "temporal", "unparseable"),
    ("capitalized_keys", {k.capitalize(): v for k, v in MC.items()}, "temporal", None),
    ("alias_keys", {"question": MC["question"], "type": "mcq", "choices": MC["options"],
                    "rationale": MC["reasoning"], "answer": "B"}, "temporal", None),
    # unicode
    ("emoji_and_accents_pass", op(question="Pourquoi la femme 🚗 revient-elle à la voiture à la fin ?"),
     "goal_purpose", None),
]


@pytest.mark.parametrize("item,category,expected", [c[1:] for c in ITEM_CASES], ids=[c[0] for c in ITEM_CASES])
def test_items(item, category, expected):
    kept, reason, message = validate_item(item, category=category, video_span_s=SPAN, seen_questions=frozenset())
    assert reason == expected, message
    assert (kept is None) == (expected is not None)
    if expected is not None:
        assert message
    else:
        assert set(kept) == {"question", "problem_type", "options", "answer", "reasoning", "category"}
        assert kept["category"] == category
        if kept["problem_type"] == "multiple_choice":
            assert kept["answer"] in "ABCD" and len(kept["options"]) == 4


def test_every_reason_is_exercised():
    covered = {c[2] for c in TEXT_CASES} | {c[3] for c in ITEM_CASES} | {"near_duplicate", "reasoning_prefix_mismatch"}  # the last two: own tests
    assert set(REASONS) <= covered
    assert len(TEXT_CASES) + len(ITEM_CASES) >= 30


# --- valid items pass unchanged ---------------------------------------------------------------------

@pytest.mark.parametrize("item,category", [(MC, "temporal"), (OPEN, "goal_purpose"), (NUMERIC_MC, "temporal"),
                                           ({**MC, "category": "temporal"}, "temporal")])
def test_valid_items_pass_unchanged(item, category):
    kept, reason, message = validate_item(item, category=category, video_span_s=SPAN, seen_questions=set())
    assert reason is None and message == ""
    assert kept == {"options": None, **item, "category": category}


def test_normalizations_are_reported():
    for answer in ("b", "(B)", FULL_WIDTH_B, "He takes a mug from the shelf"):
        kept, reason, message = validate_item(mc(answer=answer), category="temporal", video_span_s=SPAN,
                                              seen_questions=set())
        assert kept["answer"] == "B" and message
    kept, _, message = validate_item(mc(problem_type="MCQ"), category="temporal", video_span_s=SPAN,
                                     seen_questions=set())
    assert kept["problem_type"] == "multiple_choice" and "MCQ" in message


def test_options_dict_and_prefixes_are_normalized():
    as_dict = dict(zip("DCBA", reversed(MC["options"])))
    kept, _, _ = validate_item(mc(options=as_dict), category="temporal", video_span_s=SPAN, seen_questions=set())
    assert kept["options"] == MC["options"]
    prefixed = [f"{letter}. {text}" for letter, text in zip("ABCD", MC["options"])]
    kept, _, _ = validate_item(mc(options=prefixed), category="temporal", video_span_s=SPAN, seen_questions=set())
    assert kept["options"] == MC["options"]
    kept, _, _ = validate_item(mc(choices=MC["options"], options=...), category="temporal", video_span_s=SPAN,
                               seen_questions=set())
    assert kept["options"] == MC["options"]


def test_target_tags_removed_from_reasoning():
    kept, reason, _ = validate_item(mc(reasoning="<think>" + MC["reasoning"] + "</think>"), category="temporal",
                                    video_span_s=SPAN, seen_questions=set())
    assert reason is None and kept["reasoning"] == MC["reasoning"]
    assert make_target(kept["reasoning"], kept["answer"]).count("<think>") == 1


def test_span_check_skipped_without_span():
    item = mc(reasoning="At 05:00 he takes a mug from the shelf; the answer is B.")
    assert validate_item(item, category="temporal", video_span_s=None, seen_questions=set())[1] is None
    assert validate_item(item, category="temporal", video_span_s=400.0, seen_questions=set())[1] is None


# --- near duplicates --------------------------------------------------------------------------------

def test_near_duplicate_against_seen():
    seen = frozenset({normalize_question(MC["question"])})
    variant = mc(question="what does the man do  right after he puts the kettle on the stove ?!")
    assert one_reason(wrap(variant), seen=seen) == "near_duplicate"
    assert seen == frozenset({normalize_question(MC["question"])})


def test_near_duplicate_within_one_output():
    twin = mc(question="What does the man do, right after he puts the kettle on the stove")
    kept, rejects = run_text(wrap(MC, twin, OPEN), category="temporal")
    # OPEN declares no category: under "temporal" it is kept too.
    assert [k["question"] for k in kept] == [MC["question"], OPEN["question"]]
    assert [(r[0], r[2]) for r in rejects] == [("near_duplicate", twin)]


def test_mixed_output_counts_add_up():
    items = [MC, mc(answer="E"), "not an object", op(answer=""), OPEN]
    kept, rejects = run_text(json.dumps(items), category="goal_purpose")
    assert len(kept) + len(rejects) == len(items)
    assert [r[0] for r in rejects] == ["mc_answer_not_in_options", "unparseable", "open_answer_empty"]


def test_unknown_requested_category_is_a_caller_bug():
    with pytest.raises(ValueError):
        validate_item(MC, category="funny", video_span_s=SPAN, seen_questions=set())


# --- parsing helpers --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("<think>a</think>{}", "{}"),
    ("a</think>\n{}", "{}"),
    ("<think>a</think><think>b</think> {}", "{}"),
    ("<think>cut off", ""),
    ("{} <think>trailing", "{}"),
    ("no tags", "no tags"),
])
def test_strip_think(text, expected):
    assert strip_think(text) == expected


@pytest.mark.parametrize("text,detail", [
    ("", "empty"), ("hello", "no_json"), ('{"a": [1, 2', "truncated_json"), ('{"a": "b', "truncated_json"),
    ("{a: 1}", "invalid_json"),
])
def test_extract_json_errors(text, detail):
    with pytest.raises(ParseError) as err:
        extract_json(text)
    assert err.value.reason == "unparseable" and err.value.detail == detail


def test_extract_json_prefers_outermost_and_fences():
    assert extract_json('see [1] and {"a": {"b": [2]}} end') == {"a": {"b": [2]}}
    assert extract_json('x ```json\n{"a": 1}\n``` y {"b": 22222222}') == {"a": 1}
    assert extract_json('\ufeff[{"a": 1}]') == [{"a": 1}]


def test_parse_generation_details():
    with pytest.raises(ParseError) as err:
        parse_generation("<think>never closed")
    assert err.value.detail == "unclosed_think"
    assert parse_generation(json.dumps([MC, OPEN])) == [MC, OPEN]
    assert parse_generation(json.dumps({"questions": MC})) == [MC]


def test_time_references_and_conclusions():
    for text in ("[00:10-00:20]", "0:10", "at 10 s", "10s", "10 seconds", "1:02:03", "t=4"):
        assert has_time_ref(text), text
    for text in ("the 1990s", "ratio 16:9", "ten seconds", "version 2"):
        assert not has_time_ref(text), text
    assert concluded_letter("the answer is (C).") == "C"
    assert concluded_letter("C is the correct choice") == "C"
    assert concluded_letter("I choose option D") == "D"
    assert concluded_letter("the answer is not B") is None
    assert concluded_letter("so the answer is A man entering at 00:10") is None
    assert concluded_letter("so the answer is A.") == "A"


# --- targets and ids --------------------------------------------------------------------------------

def test_make_target_and_ids():
    assert make_target(" r ", "B") == "<think>r</think><answer>B</answer>"
    with pytest.raises(ValueError):
        make_target("x </think> y", "B")
    a = qra_id("0123456789abcdef", "temporal", MC["question"])
    assert a == qra_id("0123456789abcdef", "temporal", MC["question"].upper() + "  ")
    assert a != qra_id("0123456789abcdef", "spatial", MC["question"])
    assert len(a) == 16 and "." not in a and int(a, 16) >= 0
    assert normalize_question("What's  the man's goal?") == "whats the mans goal"
    assert normalize_question("ＡＢＣ, déjà vu!") == "abc déjà vu"
    assert problem_type_of({"options": ["a"]}) == "multiple_choice"
    assert problem_type_of({"problem_type": "open ended"}) == "open_ended"
    with pytest.raises(ValueError):
        problem_type_of({"problem_type": "essay"})


# --- JSON schemas -----------------------------------------------------------------------------------

def test_schemas_use_portable_keywords_and_accept_valid_output():
    for schema in (GENERATION_SCHEMA, generation_schema(["multiple_choice"], max_questions=3),
                   refinement_schema(), refinement_schema("B")):
        assert schema_keywords(schema) <= SCHEMA_KEYWORDS
        assert json.loads(schema_json(schema)) == schema
    assert check_instance({"questions": [MC, OPEN]}, GENERATION_SCHEMA) == []
    assert check_instance({"questions": [mc(options=MC["options"][:3])]}, GENERATION_SCHEMA)
    assert check_instance({"questions": [mc(answer="E")]}, GENERATION_SCHEMA)
    assert check_instance({"questions": [OPEN]}, generation_schema(["multiple_choice"]))
    assert check_instance({"questions": []}, GENERATION_SCHEMA)
    assert check_instance({"reasoning": "r", "answer": "B"}, refinement_schema("B")) == []
    assert check_instance({"reasoning": "r", "answer": "C"}, refinement_schema("B"))
    props = GENERATION_SCHEMA["properties"]["questions"]["items"]["anyOf"][0]["properties"]
    assert list(props).index("reasoning") < list(props).index("answer")
    with pytest.raises(ValueError):
        generation_schema(["numerical"])


def test_reasoning_prefix_in_the_schema_and_the_validator():
    prefix = r"Checking the video at \[[0-9]{2}:[0-9]{2}-[0-9]{2}:[0-9]{2}\]"
    plain = generation_schema(["multiple_choice"])
    assert "pattern" not in json.dumps(plain) and "pattern" not in json.dumps(refinement_schema("B"))
    for schema in (generation_schema(["multiple_choice", "open_ended"], reasoning_prefix=prefix),
                   refinement_schema("B", reasoning_prefix=prefix)):
        assert schema_keywords(schema) <= SCHEMA_KEYWORDS and json.dumps(schema).count('"pattern"') >= 1
    grounded = generation_schema(["multiple_choice"], reasoning_prefix=prefix)
    good = mc(reasoning="Checking the video at [00:10-00:20], the car is red. So the answer is B.")
    bad = mc(reasoning="The car is red at [00:10-00:20]. So the answer is B.")
    assert check_instance({"questions": [good]}, grounded) == []
    assert any("does not match" in e for e in check_instance({"questions": [bad]}, grounded))
    kw = dict(category="temporal", video_span_s=60.0, seen_questions=set())
    assert validate_item(good, reasoning_prefix=prefix, **kw)[1] is None
    assert validate_item(bad, reasoning_prefix=prefix, **kw)[1] == "reasoning_prefix_mismatch"
    assert validate_item(bad, **kw)[1] is None  # no prefix set: no rule
    assert "reasoning_prefix_mismatch" in REASONS
