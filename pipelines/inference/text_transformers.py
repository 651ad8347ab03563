"""``transformers`` text backend: a local causal LM with JSON-schema-constrained decoding.

Decoding is transformers' ``model.generate`` (a left-padded batch, one KV cache). The schema constraint is
llguidance's JSON-schema grammar (chosen by ``benchmarks/constrained_libs.py``: as fast and as valid as xgrammar
on SmolLM2 here, and a single wheel without dependencies), applied as the *first* logits processor of every row,
before the repetition penalty, temperature and top-p: a sampling warper can then never remove every allowed
token. ``generate``'s own processors are switched off for that reason and longreel adds them after the mask.
Greedy when ``temperature == 0`` (deterministic); otherwise rows are sampled per seed (one ``generate`` call per
distinct seed, under a forked RNG), so a request's sample does not depend on its batch. Each JSON string is
capped at the request's ``max_string_chars`` (``maxLength`` in the grammar), and a schema ``pattern`` (e.g.
``qra.reasoning_prefix``) is enforced by the grammar.
"""
from __future__ import annotations

import json
import logging
import os
import time

from longreel.pipelines.inference.base import weights_revision
from longreel.pipelines.inference.text_base import TextBackend, TextRequest, TextResult
from longreel.pipelines.inference.text_models import load_tokenizer, resolve_model

log = logging.getLogger("longreel")


class TransformersTextBackend(TextBackend):
    backend = "transformers"
    supports_guided = True
    supports_pattern = True  # llguidance's grammar takes JSON-schema patterns

    def __init__(self, model: str = "smollm2", revision: str = "", *, trust_remote_code: bool = False,
                 dtype: str = "float32", threads: int | None = None, batch_size: int = 1):
        m = resolve_model(model)
        weights = os.path.join(m.directory, m.gguf_file) if m.gguf_file else m.directory
        super().__init__(model, revision or weights_revision(weights) or "")
        self.local = m
        self.trust_remote_code = trust_remote_code
        self.dtype = dtype
        self.threads = threads
        self.batch_size = max(1, int(batch_size))
        self._model = None
        self._tok = None
        self._lltok = None

    def setup(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        t0 = time.monotonic()
        self._tok = load_tokenizer(self.model)
        self._model = AutoModelForCausalLM.from_pretrained(
            self.local.directory, dtype=getattr(torch, self.dtype), trust_remote_code=self.trust_remote_code,
            **self.local.load_kwargs())
        self._model.eval()
        log.info("transformers: loaded %s (%s) in %.1f s", self.model, self.revision, time.monotonic() - t0)

    @property
    def tokenizer(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.model)
        return self._tok

    def eos_ids(self) -> list[int]:
        """Every token that ends a response: the tokenizer's end of sequence and the model's own."""
        tok = self.tokenizer
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        gen_eos = getattr(getattr(self._model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            eos.add(gen_eos)
        elif gen_eos:
            eos.update(gen_eos)
        return sorted(eos)

    def ll_tokenizer(self):
        """The vocabulary as llguidance sees it (built once per model)."""
        if self._lltok is None:
            import llguidance.hf

            self.setup()
            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self._model.config.vocab_size,
                                                       eos_token=self.eos_ids())
        return self._lltok

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        text = "\n\n".join(m["content"] for m in messages) + "\n\n"
        return tok.encode(text)

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.prompt_ids(messages))

    def generate(self, requests: list[TextRequest]) -> list[TextResult]:
        self.setup()
        out: list[TextResult] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            t0 = time.monotonic()
            try:
                results = self._generate_batch(chunk)
            except Exception as e:  # a model failure is a result, not a crash of the run
                log.exception("transformers: generation failed")
                results = [TextResult(text="", finish="error", error=f"{type(e).__name__}: {e}") for _ in chunk]
            dt = time.monotonic() - t0
            n_new = sum(r.new_tokens for r in results)
            log.info("transformers: %d requests, %d new tokens in %.1f s (%.1f tokens/s)", len(chunk), n_new, dt,
                     n_new / max(dt, 1e-9))
            for r in results:
                r.latency_s = round(dt / len(chunk), 3)
            out.extend(results)
        return out

    def _generate_batch(self, reqs: list[TextRequest]) -> list[TextResult]:
        """A batch, in groups of rows that share their sampling settings (and seed, when sampling): one
        ``generate`` call per group, results in request order."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            sampled = r.temperature > 0
            key = (r.temperature, r.top_p if sampled else 1.0, r.repetition_penalty, r.seed if sampled else None)
            groups.setdefault(key, []).append(i)
        out: list[TextResult | None] = [None] * len(reqs)
        for rows in groups.values():
            for i, res in zip(rows, self._generate_group([reqs[i] for i in rows])):
                out[i] = res
        return out

    def _generate_group(self, reqs: list[TextRequest]) -> list[TextResult]:
        import torch
        from transformers import (GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                  TemperatureLogitsWarper, TopPLogitsWarper)

        tok, model, first = self.tokenizer, self._model, reqs[0]
        prompts = [self.prompt_ids(r.messages) for r in reqs]
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        input_ids = torch.full((len(reqs), width), pad, dtype=torch.long)
        attn = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attn[i, width - len(ids):] = 1
        mask = SchemaMask([r.schema for r in reqs], [r.max_string_chars for r in reqs], self.ll_tokenizer())
        processors = LogitsProcessorList([mask])
        if first.repetition_penalty and first.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(first.repetition_penalty))
        sampled = first.temperature > 0
        if sampled:
            processors.append(TemperatureLogitsWarper(first.temperature))
            if first.top_p < 1.0:
                processors.append(TopPLogitsWarper(first.top_p))
        eos = self.eos_ids()
        # generate's own processors off: every one of them is in `processors`, after the mask
        config = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in reqs), do_sample=sampled,
                                  temperature=1.0, top_p=1.0, top_k=None, repetition_penalty=1.0,
                                  pad_token_id=pad, eos_token_id=eos)
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(int(first.seed))
            out = model.generate(input_ids=input_ids, attention_mask=attn, generation_config=config,
                                 logits_processor=processors)
        results = []
        for i, (r, ids) in enumerate(zip(reqs, prompts)):
            new = [int(x) for x in out[i, width:]]
            stop = next((k for k, x in enumerate(new) if x in eos), None)
            stopped = stop is not None and stop < r.max_new_tokens  # ended before its own token limit
            text_ids = new[:stop] if stopped else new[:r.max_new_tokens]
            finish = "dead_end" if mask.dead_end(i) else "stop" if stopped else "length"
            results.append(TextResult(text=tok.decode(text_ids, skip_special_tokens=True), finish=finish,
                                      prompt_tokens=len(ids), new_tokens=len(text_ids), guided=r.schema is not None))
        return results


def with_max_length(schema, limit: int):
    """``schema`` with ``maxLength: limit`` on every free string (what ``max_string_chars`` promises)."""
    if isinstance(schema, dict):
        out = {k: with_max_length(v, limit) for k, v in schema.items()}
        if out.get("type") == "string" and "enum" not in out:
            out["maxLength"] = min(limit, out.get("maxLength", limit))
        return out
    if isinstance(schema, list):
        return [with_max_length(v, limit) for v in schema]
    return schema


class SchemaMask:
    """A logits processor holding one llguidance matcher per row (None: that row is free text). At each step it
    first feeds every matcher the token its row chose last, then masks each row's logits to what its grammar
    allows; a finished row is pinned to end of sequence."""

    def __init__(self, schemas: list, max_chars: list[int], lltok):
        import llguidance
        import llguidance.torch

        self.lltok = lltok
        self.matchers = []
        for schema, limit in zip(schemas, max_chars):
            if schema is None:
                self.matchers.append(None)
                continue
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(with_max_length(schema, limit)), overrides={"whitespace_flexible": False})
            self.matchers.append(llguidance.LLMatcher(lltok, grammar))
        self.bitmask = llguidance.torch.allocate_token_bitmask(len(schemas), lltok.vocab_size)
        self.started = False

    def dead_end(self, row: int) -> bool:
        m = self.matchers[row]
        return m is not None and m.is_error()

    def __call__(self, input_ids, scores):
        import llguidance.torch

        if not any(self.matchers):
            return scores
        for row, m in enumerate(self.matchers):
            if m is None:
                continue
            if self.started and not m.is_stopped() and not m.is_error():
                m.consume_token(int(input_ids[row, -1]))
            llguidance.torch.fill_next_token_bitmask(m, self.bitmask, row)
        self.started = True
        rows = [row for row, m in enumerate(self.matchers) if m is not None]
        if len(rows) == len(self.matchers):
            llguidance.torch.apply_token_bitmask_inplace(scores, self.bitmask)
        else:  # free-text rows keep their logits
            sub = scores[rows]
            llguidance.torch.apply_token_bitmask_inplace(sub, self.bitmask[rows])
            scores[rows] = sub
        return scores
