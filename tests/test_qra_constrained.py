"""The JSON-schema constrained decoder: the matcher accepts exactly the schema's compact JSON, and the
token mask allows exactly the tokens that keep the matcher alive (checked by brute force)."""
import json
import random

import pytest

from longreel.pipelines.inference.constrained import Matcher, TokenMasker, UnsupportedSchema, compile_schema
from longreel.pipelines.qra.json_schema import check_instance, generation_schema, refinement_schema

MC = {"question": "Which comes first?", "problem_type": "multiple_choice", "options": ["a", "b", "c", "d"],
      "reasoning": "At [00:10-00:20] x. So the answer is B.", "answer": "B"}
OPEN = {"question": "What colour?", "problem_type": "open_ended", "reasoning": "At 00:10 it is red.",
        "answer": "red"}


def compact(doc) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("doc,ok", [
    ({"questions": [MC]}, True),
    ({"questions": [OPEN]}, True),
    ({"questions": [MC, OPEN, MC]}, True),
    ({"questions": []}, False),                                    # minItems 1
    ({"questions": [{**MC, "answer": "E"}]}, False),               # enum
    ({"questions": [{**MC, "options": ["a", "b", "c"]}]}, False),  # 3 options
    ({"questions": [{**MC, "question": ""}]}, False),              # minLength
    ({"questions": [{**OPEN, "options": ["a", "b", "c", "d"]}]}, False),  # no such property / order
    ({"questions": [{k: MC[k] for k in ("problem_type", "question", "options", "reasoning", "answer")}]}, False),
])
def test_matcher_accepts_exactly_the_schema(doc, ok):
    m = Matcher.start(generation_schema(), 200)
    assert m.accepts_text(compact(doc)) is ok
    if ok:
        assert check_instance(doc, generation_schema()) == []


def test_matcher_bounds_count_and_text_and_pins_answers():
    two = Matcher.start(generation_schema(["open_ended"], min_questions=2, max_questions=2), 200)
    assert not two.accepts_text(compact({"questions": [OPEN]}))
    assert two.accepts_text(compact({"questions": [OPEN, OPEN]}))
    assert not two.accepts_text(compact({"questions": [OPEN, OPEN, OPEN]}))
    short = Matcher.start(generation_schema(["open_ended"]), 5)
    assert short.advance('{"questions":[{"question":"12345').in_string()
    assert short.advance('{"questions":[{"question":"123456').dead       # longer than max_string_chars
    pinned = Matcher.start(refinement_schema("C"), 100)
    assert pinned.accepts_text('{"reasoning":"At 0:10.","answer":"C"}')
    assert not pinned.accepts_text('{"reasoning":"At 0:10.","answer":"D"}')
    # no escapes, no control characters, no whitespace between tokens
    assert Matcher.start(refinement_schema(), 100).advance('{"reasoning":"a\\').dead
    assert Matcher.start(refinement_schema(), 100).advance('{"reasoning":"a\n').dead
    assert Matcher.start(refinement_schema(), 100).advance('{ ').dead
    assert Matcher.start(refinement_schema(), 100).advance('{"reasoning":"a \u00e9 \U0001F600').in_string()


def test_unsupported_schemas_are_errors_not_ignored():
    for bad in ({"type": "string", "pattern": "a+"}, {"type": "integer"},
                {"type": "object", "properties": {"a": {"type": "string"}}, "required": []},
                {"type": "object", "properties": {}, "additionalProperties": True},
                {"$ref": "#/x"}, {"enum": ['say "hi"']}):
        with pytest.raises(UnsupportedSchema):
            compile_schema(bad)


VOCAB = ['{', '}', '[', ']', ',', ':', '"', '{"', '"}', '"]', '",', '":', '":"', '","', '"}]', '"}]}', '"},{',
         '"questions', 'questions', '"question', 'question', 'problem', '_type', 'problem_type', 'multiple',
         '_choice', 'open', '_ended', 'options', 'reasoning', 'answer', 'A', 'B', 'C', 'D', 'E', 'a', ' the',
         ' video', ' at', ' 00', ':10', '-', '.', ' So', ' is', 'red', ' red', '\\', '\n', ' ', '  ', 'é', '":["',
         '"],"', '"answer', '"reasoning', '"options', '"problem_type', '":"multiple_choice","', '":"open_ended","',
         'x"', 'x",', 'xx', '":["a', '}]}', '}]', '},{', '"]}', '",""']
# every single printable character too, as in byte-level vocabularies (so that no text is a dead end)
VOCAB += [c for c in map(chr, range(32, 127)) if c not in VOCAB]


@pytest.mark.parametrize("schema", [generation_schema(), generation_schema(["multiple_choice"], min_questions=1,
                                                                           max_questions=2), refinement_schema("B")])
def test_token_mask_equals_brute_force_and_random_walks_end_valid(schema):
    eos = len(VOCAB)
    masker = TokenMasker(VOCAB + [None], [eos])
    rng = random.Random(0)
    finished = 0
    for walk in range(40):
        m = Matcher.start(schema, 12)
        text = ""
        for _ in range(400):
            allowed = masker.allowed(m)
            for i, tok in enumerate(VOCAB):  # brute force: allowed iff the matcher survives the token
                assert bool(allowed[i]) == (not m.advance(tok).dead), (text, tok)
            assert bool(allowed[eos]) == m.accepted
            ids = [i for i in range(len(VOCAB) + 1) if allowed[i]]
            assert ids, f"dead end after {text!r}"
            choice = rng.choice(ids)
            if choice == eos:
                break
            text += VOCAB[choice]
            m = m.advance(VOCAB[choice])
        if m.accepted:
            finished += 1
            doc = json.loads(text)
            assert check_instance(doc, schema) == [], text
    assert finished > 0
