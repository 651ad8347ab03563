"""The trainer's prompt format (longreel.task.prompting): layout, validation, rendering with a real chat template, and
agreement with the reward library (an answer written as instructed scores 1)."""
from __future__ import annotations

import pytest

from longreel.task import prompting
from longreel.task.prompting import (ANSWER_INSTRUCTIONS, SYSTEM_PROMPT, build_messages, format_options, messages_for_qra,
                               prompt_hash, question_text, render_prompt)
from longreel.task.rewards import registered_types, score


def test_messages_layout():
    msgs = build_messages("What happens first?", ["a dog runs", "a car stops", "it rains", "nothing"])
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == SYSTEM_PROMPT
    assert "<think>" in SYSTEM_PROMPT and "</think>" in SYSTEM_PROMPT
    assert "<answer>" in SYSTEM_PROMPT and "</answer>" in SYSTEM_PROMPT
    video, text = msgs[1]["content"]
    assert video == {"type": "video"}
    assert text["type"] == "text"
    assert text["text"] == (
        "Question: What happens first?\n"
        "Options:\nA. a dog runs\nB. a car stops\nC. it rains\nD. nothing\n"
        + ANSWER_INSTRUCTIONS["multiple_choice"]
    )


def test_options_and_types():
    assert format_options(["x", "  spaced   out\ntext "]) == "A. x\nB. spaced out text"
    with pytest.raises(ValueError):
        format_options(["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError):
        format_options([])
    with pytest.raises(ValueError):
        format_options(["a", "  "])
    with pytest.raises(ValueError):
        question_text("Which?", None, "multiple_choice")
    with pytest.raises(ValueError):
        question_text("   ", ["a", "b"])
    with pytest.raises(ValueError):
        question_text("How many?", None, "counting")
    # non-MC questions carry no options block, even when options are given
    t = question_text("How many cars pass?", ["1", "2"], "numerical")
    assert "Options" not in t and t.endswith(ANSWER_INSTRUCTIONS["numerical"])
    # every problem type the reward library scores has an instruction
    assert set(registered_types()) <= set(ANSWER_INSTRUCTIONS)


def test_messages_for_qra_row():
    row = {"question": "Is it raining?", "options": None, "problem_type": "boolean"}
    assert messages_for_qra(row) == build_messages("Is it raining?", None, "boolean")


def test_prompt_hash_identifies_the_format(monkeypatch):
    h = prompt_hash()
    assert len(h) == 64 and h == prompt_hash()
    monkeypatch.setattr(prompting, "SYSTEM_PROMPT", SYSTEM_PROMPT + " Be brief.")
    assert prompting.prompt_hash() != h
    monkeypatch.undo()
    monkeypatch.setitem(prompting.ANSWER_INSTRUCTIONS, "numerical", "Just a number.")
    assert prompting.prompt_hash() != h


@pytest.mark.parametrize("problem_type,options,answer,completion_answer", [
    ("multiple_choice", ["left", "right", "up", "down"], "B", "B"),
    ("numerical", None, "12", "12"),
    ("boolean", None, "yes", "yes"),
    ("temporal_grounding", None, "[3.0, 7.5]", "[3.0, 7.5]"),
])
def test_an_answer_written_as_instructed_scores_one(problem_type, options, answer, completion_answer):
    question_text("q?", options, problem_type)  # the format exists for the type
    done = score(f"<think>I watched the video.</think><answer>{completion_answer}</answer>", problem_type, answer,
                 options)
    assert done.reward == 1.0
    # and one that ignores the system prompt's format earns nothing
    assert score(completion_answer, problem_type, answer, options).reward == 0.0


def test_rendered_with_the_models_chat_template(tmp_path):
    import transformers  # noqa: F401
    from transformers import AutoProcessor

    from longreel.testing.tiny_model import build_tiny_qwen2vl

    proc = AutoProcessor.from_pretrained(build_tiny_qwen2vl(tmp_path / "tiny"))
    text = render_prompt(proc, build_messages("Which way?", ["left", "right"]))
    assert text == (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Question: Which way?\n"
        f"Options:\nA. left\nB. right\n{ANSWER_INSTRUCTIONS['multiple_choice']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text.count("<|video_pad|>") == 1  # one video item


def test_qra_row_without_problem_type():
    assert messages_for_qra({"question": "Which?", "options": ["a", "b"]}) == build_messages("Which?", ["a", "b"])
    assert messages_for_qra({"question": "Why?", "options": None}) == build_messages("Why?", None, "open_ended")


def test_the_trainer_uses_this_prompt():
    import torch  # noqa: F401
    import longreel.trainer.policy as policy
    item = {"question": "Which way?", "options": ["left", "right"], "problem_type": "multiple_choice"}
    assert policy.prompt_messages(item) == build_messages("Which way?", ["left", "right"])
