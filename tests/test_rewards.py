"""Table-driven tests of longreel.task.rewards: format gating, extraction and every registered problem type.

Each row gives the exact expected (format, accuracy, reward, reason, extracted). Graded scores that are not exactly
representable (1/3, ROUGE 0.8) are compared to 1e-12.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import FrozenInstanceError

import pytest

from longreel.task.rewards import (
    InvalidReference,
    RewardResult,
    UnknownProblemType,
    check_format,
    extract_answer_text,
    get_scorer,
    normalize_text,
    register,
    registered_types,
    score,
    score_batch,
    validate_reference,
)
from longreel.task.rewards.registry import unregister


def W(answer: str, think: str = "Let me look at the video.") -> str:
    """A well formatted completion around ``answer``."""
    return f"<think>{think}</think><answer>{answer}</answer>"


ABCD = ["Paris", "London", "Rome", "Oslo"]
BIG = "1" * 400
MC, NUM, OE, TG, SG, BOOL, MATH = (
    "multiple_choice", "numerical", "open_ended", "temporal_grounding", "spatial_grounding", "boolean", "math"
)


def case(id, ptype, completion, answer, options, expected, **params):  # noqa: A002 - pytest's own word
    return pytest.param(ptype, completion, answer, options, params, expected, id=id)


CASES = [
    # ---- format gating (multiple choice, reference C) ----
    case("fmt-ok", MC, W("C"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("fmt-whitespace-around", MC, "\n  <think>r</think>\n\n<answer>  C \n</answer>\n", "C", ABCD,
         (1.0, 1.0, 1.0, "ok", "C")),
    case("fmt-missing-think", MC, "<answer>C</answer>", "C", ABCD, (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-no-answer-tag", MC, "<think>r</think> The answer is C", "C", ABCD,
         (0.0, 0.0, 0.0, "no_answer_tag", None)),
    case("fmt-bare-letter-not-scored", MC, "C", "C", ABCD, (0.0, 0.0, 0.0, "no_answer_tag", None)),
    case("fmt-text-after-answer", MC, W("C") + " Hope this helps!", "C", ABCD, (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-text-before-think", MC, "Sure. " + W("C"), "C", ABCD, (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-two-answers-last-wins", MC, "<think>r</think><answer>A</answer><answer>C</answer>", "C", ABCD,
         (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-nested-answer", MC, "<think>r</think><answer>A<answer>C</answer></answer>", "C", ABCD,
         (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-empty-answer", MC, W("   "), "C", ABCD, (0.0, 0.0, 0.0, "empty_answer", "")),
    case("fmt-empty-think", MC, "<think> \n </think><answer>C</answer>", "C", ABCD,
         (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-answer-before-think", MC, "<answer>C</answer><think>r</think>", "C", ABCD,
         (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-unclosed-answer", MC, "<think>r</think><answer>C", "C", ABCD, (0.0, 0.0, 0.0, "no_answer_tag", None)),
    case("fmt-text-between-blocks", MC, "<think>r</think>So:<answer>C</answer>", "C", ABCD,
         (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-uppercase-tags", MC, "<THINK>r</THINK><ANSWER>C</ANSWER>", "C", ABCD,
         (0.0, 0.0, 0.0, "no_answer_tag", None)),
    case("fmt-nested-think", MC, "<think>a<think>b</think></think><answer>C</answer>", "C", ABCD,
         (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-answer-inside-think", MC, "<think>maybe <answer>A</answer></think><answer>C</answer>", "C", ABCD,
         (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-trailing-eos-token", MC, W("C") + "<|im_end|>", "C", ABCD, (0.0, 0.0, 0.0, "bad_format", "C")),
    case("fmt-weight-wrong", MC, W("B"), "C", ABCD, (1.0, 0.0, 0.1, "wrong", "B"), format_weight=0.1),
    case("fmt-weight-right", MC, W("C"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C"), format_weight=0.1),
    case("fmt-weight-bad-format", MC, "<answer>C</answer>", "C", ABCD, (0.0, 0.0, 0.0, "bad_format", "C"),
         format_weight=0.5),
    case("fmt-weight-unparseable", MC, W("Cat"), "C", ABCD, (1.0, 0.0, 0.5, "unparseable", "Cat"),
         format_weight=0.5),
    # ---- multiple choice ----
    case("mc-paren", MC, W("(C)"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-dot", MC, W("C."), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-letter-with-text", MC, W("C) Rome"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-letter-dot-text", MC, W("C. Rome"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-answer-colon", MC, W("Answer: C"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-boxed", MC, W(r"\boxed{C}"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-answer-is-boxed", MC, W(r"The answer is \boxed{C}."), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-lowercase-bare", MC, W("c"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-lowercase-paren", MC, W("(c)"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-lowercase-reference", MC, W("C"), "c", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-markdown-bold", MC, W("**C**"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-option-word", MC, W("Option C"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-letter-inside-word", MC, W("Cat"), "C", ABCD, (1.0, 0.0, 0.0, "unparseable", "Cat")),
    case("mc-article-is-not-letter", MC, W("A cat"), "A", ABCD, (1.0, 0.0, 0.0, "unparseable", "A cat")),
    case("mc-c-or-d", MC, W("C or D"), "C", ABCD, (1.0, 0.0, 0.0, "ambiguous", "C or D")),
    case("mc-a-comma-b", MC, W("A, B"), "A", ABCD, (1.0, 0.0, 0.0, "ambiguous", "A, B")),
    case("mc-paren-or-paren", MC, W("(C) or (D)"), "C", ABCD, (1.0, 0.0, 0.0, "ambiguous", "(C) or (D)")),
    case("mc-two-boxes", MC, W(r"\boxed{C} or \boxed{D}"), "C", ABCD,
         (1.0, 0.0, 0.0, "ambiguous", r"\boxed{C} or \boxed{D}")),
    case("mc-label-contradicts-text", MC, W("C) London"), "C", ABCD, (1.0, 0.0, 0.0, "ambiguous", "C) London")),
    case("mc-option-text", MC, W("Rome"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-option-text-case-period", MC, W("rome."), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-labelled-options", MC, W("Rome"), "C", ["A. Paris", "B. London", "C. Rome", "D. Oslo"],
         (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-reference-is-option-text", MC, W("C"), "Rome", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-wrong", MC, W("B"), "C", ABCD, (1.0, 0.0, 0.0, "wrong", "B")),
    case("mc-out-of-range", MC, W("E"), "C", ABCD, (1.0, 0.0, 0.0, "invalid", "E")),
    case("mc-six-options", MC, W("F"), "F", ["1", "2", "3", "4", "5", "6"], (1.0, 1.0, 1.0, "ok", "F")),
    case("mc-numeric-option-text", MC, W("5"), "E", ["1", "2", "3", "4", "5", "6"], (1.0, 1.0, 1.0, "ok", "E")),
    case("mc-fullwidth", MC, W("（Ｃ）"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-letter-is-other-option-text", MC, W("C"), "A", ["C", "D", "E", "F"],
         (1.0, 0.0, 0.0, "ambiguous", "C")),
    case("mc-prose", MC, W("I think C is right"), "C", ABCD, (1.0, 0.0, 0.0, "unparseable", "I think C is right")),
    case("mc-no-options", MC, W("C"), "C", None, (1.0, 1.0, 1.0, "ok", "C")),
    case("mc-zero-width-space", MC, W("C\u200b"), "C", ABCD, (1.0, 1.0, 1.0, "ok", "C")),
    # ---- numerical (defaults rel_tol=1e-3, abs_tol=1e-9) ----
    case("num-exact", NUM, W("12"), "12", None, (1.0, 1.0, 1.0, "ok", "12")),
    case("num-trailing-zero", NUM, W("12.0"), "12", None, (1.0, 1.0, 1.0, "ok", "12")),
    case("num-within-rel-tol", NUM, W("12.01"), "12", None, (1.0, 1.0, 1.0, "ok", "12.01")),
    case("num-rel-tol-zero", NUM, W("12.01"), "12", None, (1.0, 0.0, 0.0, "wrong", "12.01"), rel_tol=0.0),
    case("num-loose-tol", NUM, W("12.5"), "12", None, (1.0, 1.0, 1.0, "ok", "12.5"), rel_tol=0.05),
    case("num-wrong", NUM, W("12.5"), "12", None, (1.0, 0.0, 0.0, "wrong", "12.5")),
    case("num-thousands", NUM, W("1,234"), "1234", None, (1.0, 1.0, 1.0, "ok", "1234")),
    case("num-comma-decimal-rejected", NUM, W("1,5"), "1.5", None, (1.0, 0.0, 0.0, "unparseable", "1,5")),
    case("num-arabic-indic", NUM, W("١٢"), "12", None, (1.0, 1.0, 1.0, "ok", "12")),
    case("num-arabic-decimal-sep", NUM, W("٣٫٥"), "3.5", None, (1.0, 1.0, 1.0, "ok", "3.5")),
    case("num-fullwidth", NUM, W("１２"), "12", None, (1.0, 1.0, 1.0, "ok", "12")),
    case("num-nan", NUM, W("nan"), "12", None, (1.0, 0.0, 0.0, "unparseable", "nan")),
    case("num-inf", NUM, W("inf"), "12", None, (1.0, 0.0, 0.0, "unparseable", "inf")),
    case("num-infinity-symbol", NUM, W("∞"), "12", None, (1.0, 0.0, 0.0, "unparseable", "∞")),
    case("num-huge-exponent", NUM, W("1e999"), "1e999", None, (1.0, 1.0, 1.0, "ok", "1E+999")),
    case("num-huge-int-tolerance", NUM, W(BIG[:-1] + "2"), BIG, None, (1.0, 1.0, 1.0, "ok", BIG[:-1] + "2")),
    case("num-huge-int-exact", NUM, W(BIG[:-1] + "2"), BIG, None,
         (1.0, 0.0, 0.0, "wrong", BIG[:-1] + "2"), rel_tol=0.0, abs_tol=0.0),
    case("num-two-numbers", NUM, W("12 or 13"), "12", None, (1.0, 0.0, 0.0, "unparseable", "12 or 13")),
    case("num-unit", NUM, W("12 seconds"), "12", None, (1.0, 1.0, 1.0, "ok", "12")),
    case("num-boxed", NUM, W(r"\boxed{12}"), "12", None, (1.0, 1.0, 1.0, "ok", "12")),
    case("num-word", NUM, W("Twelve"), "12", None, (1.0, 1.0, 1.0, "ok", "12")),
    case("num-fraction", NUM, W("3/4"), "0.75", None, (1.0, 1.0, 1.0, "ok", "0.75")),
    case("num-zero-denominator", NUM, W("1/0"), "1", None, (1.0, 0.0, 0.0, "unparseable", "1/0")),
    case("num-abs-tol-near-zero", NUM, W("1e-12"), "0", None, (1.0, 1.0, 1.0, "ok", "0.000000000001")),
    case("num-outside-abs-tol", NUM, W("1e-6"), "0", None, (1.0, 0.0, 0.0, "wrong", "0.000001")),
    case("num-sign", NUM, W("-5"), "5", None, (1.0, 0.0, 0.0, "wrong", "-5")),
    case("num-percent-not-converted", NUM, W("45%"), "45", None, (1.0, 1.0, 1.0, "ok", "45")),
    case("num-superscript-not-digit", NUM, W("10²"), "10", None, (1.0, 0.0, 0.0, "unparseable", "10²")),
    case("num-unicode-minus", NUM, W("−5"), "-5", None, (1.0, 1.0, 1.0, "ok", "-5")),
    case("num-scientific-times", NUM, W(r"1.5 \times 10^{3}"), "1500", None, (1.0, 1.0, 1.0, "ok", "1500")),
    # ---- temporal grounding ----
    case("tg-exact", TG, W("[3, 7]"), "[3, 7]", None, (1.0, 1.0, 1.0, "ok", "[3.0, 7.0]")),
    case("tg-partial", TG, W("[5, 9]"), "[3, 7]", None, (1.0, 1 / 3, 1 / 3, "partial", "[5.0, 9.0]")),
    case("tg-reversed", TG, W("[7, 3]"), "[3, 7]", None, (1.0, 0.0, 0.0, "invalid", "[7, 3]")),
    case("tg-zero-length", TG, W("[5, 5]"), "[3, 7]", None, (1.0, 0.0, 0.0, "invalid", "[5, 5]")),
    case("tg-disjoint", TG, W("[8, 10]"), "[3, 7]", None, (1.0, 0.0, 0.0, "wrong", "[8.0, 10.0]")),
    case("tg-words-units", TG, W("from 3s to 7s"), "[3, 7]", None, (1.0, 1.0, 1.0, "ok", "[3.0, 7.0]")),
    case("tg-clock", TG, W("00:03 - 00:07"), "[3, 7]", None, (1.0, 1.0, 1.0, "ok", "[3.0, 7.0]")),
    case("tg-clock-minutes", TG, W("1:05-1:10.5"), "[65, 70.5]", None, (1.0, 1.0, 1.0, "ok", "[65.0, 70.5]")),
    case("tg-three-numbers", TG, W("[3, 5, 7]"), "[3, 7]", None, (1.0, 0.0, 0.0, "ambiguous", "[3, 5, 7]")),
    case("tg-one-number", TG, W("3.5"), "[3, 7]", None, (1.0, 0.0, 0.0, "unparseable", "3.5")),
    case("tg-negative", TG, W("[-3, 7]"), "[3, 7]", None, (1.0, 0.0, 0.0, "unparseable", "[-3, 7]")),
    case("tg-negative-second", TG, W("[3, -7]"), "[3, 7]", None, (1.0, 0.0, 0.0, "unparseable", "[3, -7]")),
    case("tg-between-and", TG, W("between 3 and 7 seconds"), "3-7", None, (1.0, 1.0, 1.0, "ok", "[3.0, 7.0]")),
    case("tg-threshold-pass", TG, W("[3, 6]"), "[3, 7]", None, (1.0, 1.0, 1.0, "ok", "[3.0, 6.0]"),
         iou_threshold=0.5),
    case("tg-threshold-fail", TG, W("[3, 6]"), "[3, 7]", None, (1.0, 0.0, 0.0, "wrong", "[3.0, 6.0]"),
         iou_threshold=0.8),
    case("tg-arabic-indic", TG, W("[٣, ٧]"), "[3, 7]", None, (1.0, 1.0, 1.0, "ok", "[3.0, 7.0]")),
    case("tg-prose", TG, W("the dog jumps at 3 and lands at 7"), "[3, 7]", None,
         (1.0, 0.0, 0.0, "unparseable", "the dog jumps at 3 and lands at 7")),
    case("tg-overflow", TG, W(f"[0, {'9' * 400}]"), "[3, 7]", None,
         (1.0, 0.0, 0.0, "unparseable", f"[0, {'9' * 400}]")),
    # ---- spatial grounding ----
    case("sg-exact", SG, W("[0, 0, 10, 10]"), "[0, 0, 10, 10]", None, (1.0, 1.0, 1.0, "ok", "[0.0, 0.0, 10.0, 10.0]")),
    case("sg-half", SG, W("[0, 0, 5, 10]"), "[0, 0, 10, 10]", None,
         (1.0, 0.5, 0.5, "partial", "[0.0, 0.0, 5.0, 10.0]")),
    case("sg-zero-area", SG, W("[5, 5, 5, 9]"), "[0, 0, 10, 10]", None, (1.0, 0.0, 0.0, "invalid", "[5, 5, 5, 9]")),
    case("sg-reversed", SG, W("[10, 10, 0, 0]"), "[0, 0, 10, 10]", None,
         (1.0, 0.0, 0.0, "invalid", "[10, 10, 0, 0]")),
    case("sg-qwen-json", SG, W('[{"bbox_2d": [0, 0, 5, 10], "label": "dog"}]'), "[0, 0, 10, 10]", None,
         (1.0, 0.5, 0.5, "partial", "[0.0, 0.0, 5.0, 10.0]")),
    case("sg-two-boxes", SG, W('[{"bbox_2d": [0, 0, 5, 10]}, {"bbox_2d": [1, 1, 2, 2]}]'), "[0, 0, 10, 10]", None,
         (1.0, 0.0, 0.0, "ambiguous", '[{"bbox_2d": [0, 0, 5, 10]}, {"bbox_2d": [1, 1, 2, 2]}]')),
    case("sg-three-numbers", SG, W("[0, 0, 10]"), "[0, 0, 10, 10]", None,
         (1.0, 0.0, 0.0, "unparseable", "[0, 0, 10]")),
    case("sg-nan", SG, W("[NaN, 0, 10, 10]"), "[0, 0, 10, 10]", None,
         (1.0, 0.0, 0.0, "unparseable", "[NaN, 0, 10, 10]")),
    case("sg-huge-no-overflow", SG, W("[0, 0, 1e200, 1e200]"), "[0, 0, 1e200, 1e200]", None,
         (1.0, 1.0, 1.0, "ok", "[0.0, 0.0, 1e+200, 1e+200]")),
    case("sg-point-pairs", SG, W("(0,0),(10,10)"), "[0, 0, 10, 10]", None,
         (1.0, 1.0, 1.0, "ok", "[0.0, 0.0, 10.0, 10.0]")),
    case("sg-disjoint", SG, W("[20, 20, 30, 30]"), "[0, 0, 10, 10]", None,
         (1.0, 0.0, 0.0, "wrong", "[20.0, 20.0, 30.0, 30.0]")),
    case("sg-threshold", SG, W("[0, 0, 5, 10]"), "[0, 0, 10, 10]", None,
         (1.0, 1.0, 1.0, "ok", "[0.0, 0.0, 5.0, 10.0]"), iou_threshold=0.5),
    # ---- boolean ----
    case("bool-yes", BOOL, W("Yes"), "yes", None, (1.0, 1.0, 1.0, "ok", "yes")),
    case("bool-wrong", BOOL, W("no"), "yes", None, (1.0, 0.0, 0.0, "wrong", "no")),
    case("bool-true-is-yes", BOOL, W("True"), "yes", None, (1.0, 1.0, 1.0, "ok", "yes")),
    case("bool-false-reference", BOOL, W("No."), "False", None, (1.0, 1.0, 1.0, "ok", "no")),
    case("bool-with-explanation", BOOL, W("Yes, the man enters."), "yes", None, (1.0, 1.0, 1.0, "ok", "yes")),
    case("bool-no-one", BOOL, W("No one enters"), "no", None, (1.0, 0.0, 0.0, "unparseable", "No one enters")),
    case("bool-yes-or-no", BOOL, W("yes or no"), "yes", None, (1.0, 0.0, 0.0, "ambiguous", "yes or no")),
    case("bool-yes-comma-no", BOOL, W("Yes, no"), "yes", None, (1.0, 0.0, 0.0, "ambiguous", "Yes, no")),
    case("bool-boxed", BOOL, W(r"\boxed{No}"), "no", None, (1.0, 1.0, 1.0, "ok", "no")),
    case("bool-maybe", BOOL, W("maybe"), "no", None, (1.0, 0.0, 0.0, "unparseable", "maybe")),
    case("bool-yesterday", BOOL, W("Yesterday"), "yes", None, (1.0, 0.0, 0.0, "unparseable", "Yesterday")),
    # ---- math (math-verify) ----
    case("math-frac", MATH, W(r"\frac{1}{2}"), "1/2", None, (1.0, 1.0, 1.0, "ok", r"\frac{1}{2}")),
    # extracted is math-verify's own rendering of what it parsed: 0.5 is read as the rational 1/2
    case("math-decimal", MATH, W("0.5"), "1/2", None, (1.0, 1.0, 1.0, "ok", r"\frac{1}{2}")),
    case("math-expand", MATH, W("(x+1)^2"), "x^2+2x+1", None, (1.0, 1.0, 1.0, "ok", "(x+1)^2")),
    case("math-sqrt", MATH, W(r"\sqrt{8}"), r"2\sqrt{2}", None, (1.0, 1.0, 1.0, "ok", r"\sqrt{8}")),
    case("math-boxed", MATH, W(r"so \boxed{3}"), "3", None, (1.0, 1.0, 1.0, "ok", "3")),
    case("math-wrong", MATH, W("2"), "3", None, (1.0, 0.0, 0.0, "wrong", "2")),
    case("math-power-tower", MATH, W("9^{9^{9^{9}}}"), "3", None, (1.0, 0.0, 0.0, "unparseable", "9^{9^{9^{9}}}")),
    case("math-big-exponent", MATH, W("10^{100000}"), "3", None, (1.0, 0.0, 0.0, "unparseable", "10^{100000}")),
    case("math-fullwidth-digit", MATH, W("３"), "3", None, (1.0, 1.0, 1.0, "ok", "3")),
    case("math-two-values", MATH, W("3 or 4"), "3", None, (1.0, 0.0, 0.0, "wrong", "3, 4")),
    # ---- open ended (ROUGE-L F) ----
    case("oe-exact", OE, W("The man opens the door."), "the man opens the door", None,
         (1.0, 1.0, 1.0, "ok", "The man opens the door")),
    case("oe-partial-stemmed", OE, W("A man opened the door."), "the man opens the door", None,
         (1.0, 0.8, 0.8, "partial", "A man opened the door")),
    case("oe-unrelated", OE, W("blue sky"), "the man opens the door", None, (1.0, 0.0, 0.0, "wrong", "blue sky")),
    case("oe-no-words", OE, W("!!!"), "the man opens the door", None, (1.0, 0.0, 0.0, "unparseable", "!!!")),
    case("oe-chinese", OE, W("猫在桌子下"), "猫在桌子上", None, (1.0, 0.8, 0.8, "partial", "猫在桌子下")),
    case("oe-boxed", OE, W(r"\boxed{the man opens the door}"), "the man opens the door", None,
         (1.0, 1.0, 1.0, "ok", "the man opens the door")),
    case("oe-rouge1", OE, W("door the opens man the"), "the man opens the door", None,
         (1.0, 1.0, 1.0, "ok", "door the opens man the"), rouge_type="rouge1"),
]


@pytest.mark.parametrize("ptype, completion, answer, options, params, expected", CASES)
def test_score_table(ptype, completion, answer, options, params, expected):
    fmt, acc, reward, reason, extracted = expected
    r = score(completion, ptype, answer, options, **params)
    assert isinstance(r, RewardResult)
    assert r.format == fmt
    assert r.accuracy == pytest.approx(acc, abs=1e-12)
    assert r.reward == pytest.approx(reward, abs=1e-12)
    assert (r.reason, r.extracted) == (reason, extracted)


def _all_results():
    out = []
    for p in CASES:
        ptype, completion, answer, options, params, _ = p.values
        out.append(score(completion, ptype, answer, options, **params))
    return out


def test_property_every_value_in_unit_interval_and_gated():
    assert len(CASES) >= 60
    for p, r in zip(CASES, _all_results()):
        for v in (r.format, r.accuracy, r.reward):
            assert isinstance(v, float) and math.isfinite(v) and 0.0 <= v <= 1.0, p.id
        assert r.format in (0.0, 1.0), p.id
        if r.format == 0.0:  # gated: a bad format earns nothing at all
            assert r.accuracy == r.reward == 0.0, p.id
        if "format_weight" not in p.values[4]:
            assert r.reward == r.accuracy, p.id  # default: reward = accuracy if format ok else 0
        if r.reason == "ok":
            assert r.accuracy == 1.0, p.id
        if r.reason not in ("ok", "partial"):
            assert r.accuracy == 0.0, p.id


def test_property_fuzz_never_raises_and_stays_in_range():
    rng = random.Random(1234)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", "C", "(B)", "yes", "no", "12", "nan", "inf", "[3, 7]",
              "[0,0,5,5]", "\\boxed{", "}", " or ", "١٢", "１", "-", ",", ".", "x^2", "\n", "Answer:", "猫", "{}", "["]
    refs = {MC: ("C", ABCD), NUM: ("12", None), OE: ("the cat", None), TG: ("[3, 7]", None),
            SG: ("[0, 0, 10, 10]", None), BOOL: ("yes", None), MATH: ("3", None)}
    for _ in range(60):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for completion in (body, W(body)):
            for ptype, (ans, opts) in refs.items():
                r = score(completion, ptype, ans, opts)
                for v in (r.format, r.accuracy, r.reward):
                    assert math.isfinite(v) and 0.0 <= v <= 1.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>A</answer> then <answer>B</answer>", "B"),
        ("<answer>x<answer>B</answer></answer>", "B"),
        ("<answer>A</answer><answer>C", "A"),
        ("no tags at all: C", None),
        ("</answer><answer>", None),
        ("<answer>\n  spaced  \n</answer>", "spaced"),
        ("<answer></answer>", ""),
    ],
)
def test_extract_answer_text(text, expected):
    assert extract_answer_text(text) == expected


def test_normalize_text_digits_and_superscripts():
    assert normalize_text("１２ ١٢ १२ 𝟏𝟐") == "12 12 12 12"
    assert normalize_text("10²") == "10²"  # superscripts are not digits: no NFKC
    assert normalize_text("−3\u200b") == "-3"


def test_check_format_answer_field():
    assert check_format(W(" C ")).answer == "C"
    assert check_format("<answer>C</answer>").answer is None


def test_bad_reference_raises_even_when_completion_is_badly_formatted():
    with pytest.raises(InvalidReference):
        score("garbage", MC, "E", ABCD)
    for ptype, ans, opts in [(MC, "Madrid", ABCD), (MC, "C", ["only one"]), (NUM, "nan", None), (NUM, "inf", None),
                             (TG, "[7, 3]", None), (TG, "[3, 3]", None), (SG, "[5, 5, 5, 9]", None),
                             (BOOL, "maybe", None), (MATH, "", None), (OE, "...", None)]:
        with pytest.raises(InvalidReference):
            validate_reference(ptype, ans, opts)
    validate_reference(MC, "Rome", ABCD)  # fine


def test_unknown_problem_type_and_params():
    with pytest.raises(UnknownProblemType, match="registered types: .*multiple_choice"):
        score(W("C"), "essay", "C")
    with pytest.raises(TypeError, match="rel_toll"):
        score(W("12"), NUM, "12", rel_toll=0.1)
    with pytest.raises(ValueError):
        score(W("12"), NUM, "12", rel_tol=float("nan"))
    with pytest.raises(ValueError):
        score(W("C"), MC, "C", format_weight=1.5)
    # a parameter of another type is accepted (shared params in a mixed batch) and ignored
    assert score(W("C"), MC, "C", ABCD, rel_tol=0.5).reward == 1.0


def test_registry_extension():
    assert set(registered_types()) >= {MC, NUM, OE, TG, SG, BOOL, MATH}

    @register("exact_string_test", params={"strip_case": True})
    def exact(prediction, reference, options, strip_case):
        return float(prediction.lower() == reference.lower()) if strip_case else float(prediction == reference)

    try:
        assert score(W("Hello"), "exact_string_test", "hello").reward == 1.0
        assert score(W("Hello"), "exact_string_test", "hello", strip_case=False).reason == "wrong"
        with pytest.raises(ValueError, match="already registered"):
            register("exact_string_test")(exact)
        assert get_scorer("exact_string_test").name == "exact_string_test"
    finally:
        unregister("exact_string_test")
    with pytest.raises(UnknownProblemType):
        get_scorer("exact_string_test")


def test_score_batch_and_result_is_frozen():
    out = score_batch([W("C"), W("12"), "<answer>yes</answer>"], [MC, NUM, BOOL], ["C", "12", "yes"],
                      [ABCD, None, None], format_weight=0.2)
    assert [r.reward for r in out] == [1.0, 1.0, 0.0]
    assert [r.reward for r in score_batch([W("B")] * 2, MC, ["C", "B"], None)] == [0.0, 1.0]
    with pytest.raises(ValueError, match="length mismatch"):
        score_batch([W("C")], [MC, MC], ["C"], None)
    with pytest.raises(FrozenInstanceError):
        out[0].reward = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError):
        RewardResult(1.0, float("nan"), 0.0, None, "ok")


def test_math_scorer_in_worker_thread():
    """math-verify's signal timeout cannot run off the main thread; the scorer must switch it off there."""
    results = []
    t = threading.Thread(target=lambda: results.append(score(W(r"\frac{1}{2}"), MATH, "0.5")))
    t.start()
    t.join(timeout=60)
    assert results and results[0].reward == 1.0
