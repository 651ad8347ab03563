"""``transformers`` text backend: a local causal LM with JSON-schema-constrained decoding.

The decoding loop is our own (KV cache, one token at a time) so that the schema mask comes first,
before the repetition penalty, temperature and top-p: a sampling warper can then never remove every
allowed token. Greedy when ``temperature == 0`` (deterministic); otherwise sampled with a
``torch.Generator`` seeded from the request's seed. See :mod:`pipelines.qra.constrained` for the mask.
"""
from __future__ import annotations

import logging
import time

from pipelines.inference.text_base import TextBackend, TextRequest, TextResult
from pipelines.inference.text_models import load_tokenizer, resolve_model, weights_hash

log = logging.getLogger("longreel")


class TransformersTextBackend(TextBackend):
    backend = "transformers"
    supports_guided = True

    def __init__(self, model: str = "smollm2", revision: str = "", *, trust_remote_code: bool = False,
                 dtype: str = "float32", threads: int | None = None):
        m = resolve_model(model)
        super().__init__(model, revision or weights_hash(m.directory, m.gguf_file))
        self.local = m
        self.trust_remote_code = trust_remote_code
        self.dtype = dtype
        self.threads = threads
        self._model = None
        self._tok = None
        self._masker = None

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

    def masker(self):
        if self._masker is None:
            from pipelines.qra.constrained import TokenMasker, token_texts

            tok = self.tokenizer
            eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
            gen_eos = getattr(getattr(self._model, "generation_config", None), "eos_token_id", None)
            if isinstance(gen_eos, int):
                eos.add(gen_eos)
            elif gen_eos:
                eos.update(gen_eos)
            self._masker = TokenMasker(token_texts(tok), sorted(eos))
        return self._masker

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
        out = []
        for req in requests:
            t0 = time.monotonic()
            try:
                res = self._generate_one(req)
            except Exception as e:  # a model failure is a result, not a crash of the run
                log.exception("transformers: generation failed")
                res = TextResult(text="", finish="error", error=f"{type(e).__name__}: {e}")
            res.latency_s = round(time.monotonic() - t0, 3)
            out.append(res)
        return out

    def _generate_one(self, req: TextRequest) -> TextResult:
        import torch

        from pipelines.qra.constrained import Matcher

        tok, model = self.tokenizer, self._model
        ids = self.prompt_ids(req.messages)
        matcher = Matcher.start(req.schema, req.max_string_chars) if req.schema is not None else None
        masker = self.masker() if matcher is not None else None
        eos_ids = set(masker.eos_ids) if masker else {tok.eos_token_id}
        gen = torch.Generator().manual_seed(int(req.seed))
        input_ids = torch.tensor([ids], dtype=torch.long)
        past = None
        produced: list[int] = []
        finish = "length"
        with torch.inference_mode():
            for _ in range(req.max_new_tokens):
                outputs = model(input_ids=input_ids, past_key_values=past, use_cache=True)
                past = outputs.past_key_values
                logits = outputs.logits[0, -1, :].float()
                n_vocab = logits.shape[0]
                if masker is not None:
                    allowed = masker.allowed(matcher)
                    if allowed.shape[0] < n_vocab:  # the model's head may be padded beyond the tokenizer
                        allowed = torch.cat([allowed, torch.zeros(n_vocab - allowed.shape[0], dtype=torch.bool)])
                    allowed = allowed[:n_vocab]
                    if not bool(allowed.any()):
                        finish = "dead_end"
                        break
                    logits = logits.masked_fill(~allowed, float("-inf"))
                if req.repetition_penalty and req.repetition_penalty != 1.0 and produced:
                    seen = torch.tensor(sorted(set(produced)), dtype=torch.long)
                    vals = logits[seen]
                    logits[seen] = torch.where(vals > 0, vals / req.repetition_penalty, vals * req.repetition_penalty)
                if req.temperature <= 0:
                    nxt = int(torch.argmax(logits))
                else:
                    probs = torch.softmax(logits / req.temperature, dim=-1)
                    if req.top_p < 1.0:
                        sp, si = torch.sort(probs, descending=True)
                        keep = torch.cumsum(sp, 0) - sp < req.top_p
                        keep[0] = True
                        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
                    nxt = int(torch.multinomial(probs, 1, generator=gen))
                if nxt in eos_ids:
                    finish = "stop"
                    break
                produced.append(nxt)
                if matcher is not None:
                    matcher = matcher.advance(masker.texts[nxt])
                input_ids = torch.tensor([[nxt]], dtype=torch.long)
        text = tok.decode(produced, skip_special_tokens=True)
        return TextResult(text=text, finish=finish, prompt_tokens=len(ids), new_tokens=len(produced),
                          guided=matcher is not None)
