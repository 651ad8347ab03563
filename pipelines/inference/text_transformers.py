"""``transformers`` text backend: a local causal LM with JSON-schema-constrained decoding.

The decoding loop is our own (a left-padded batch of requests sharing one KV cache, one token per row and
step; ``batch_size`` requests at a time) so that each row's schema mask comes first,
before the repetition penalty, temperature and top-p: a sampling warper can then never remove every
allowed token. Greedy when ``temperature == 0`` (deterministic); otherwise sampled with a
``torch.Generator`` seeded from the request's seed. See :mod:`longreel.pipelines.inference.constrained` for the mask.
"""
from __future__ import annotations

import logging
import os
import time

from longreel.pipelines.inference.text_base import TextBackend, TextRequest, TextResult
from longreel.pipelines.inference.base import weights_revision
from longreel.pipelines.inference.text_models import load_tokenizer, resolve_model

log = logging.getLogger("longreel")


class TransformersTextBackend(TextBackend):
    backend = "transformers"
    supports_guided = True
    supports_pattern = False  # the constrained decoder here has no regex support

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
            from longreel.pipelines.inference.constrained import TokenMasker, token_texts

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
        """Decode a batch together (left padded, one KV cache), each row with its own schema mask, seed and
        sampling parameters. A row stops at end of sequence or at its own max_new_tokens."""
        import torch

        from longreel.pipelines.inference.constrained import Matcher

        tok, model = self.tokenizer, self._model
        prompts = [self.prompt_ids(r.messages) for r in reqs]
        b, width = len(reqs), max(len(p) for p in prompts)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        input_ids = torch.full((b, width), pad, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attn[i, width - len(ids):] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        masker = self.masker() if any(r.schema is not None for r in reqs) else None
        eos_ids = set(masker.eos_ids) if masker else {tok.eos_token_id}
        matchers = [Matcher.start(r.schema, r.max_string_chars) if r.schema is not None else None for r in reqs]
        gens = [torch.Generator().manual_seed(int(r.seed)) for r in reqs]
        produced: list[list[int]] = [[] for _ in reqs]
        finish = ["length"] * b
        done = [False] * b
        past = None
        limit = max(r.max_new_tokens for r in reqs)
        with torch.inference_mode():
            for step in range(limit):
                outputs = model(input_ids=input_ids, attention_mask=attn, position_ids=positions,
                                past_key_values=past, use_cache=True, logits_to_keep=1)
                past = outputs.past_key_values
                logits_all = outputs.logits[:, -1, :].float()
                nxt_ids = []
                for i, req in enumerate(reqs):
                    if done[i]:
                        nxt_ids.append(pad)
                        continue
                    nxt = self._pick(logits_all[i], req, matchers[i], masker, produced[i], gens[i])
                    if nxt is None:
                        finish[i], done[i] = "dead_end", True
                        nxt_ids.append(pad)
                        continue
                    if nxt in eos_ids:
                        finish[i], done[i] = "stop", True
                        nxt_ids.append(pad)
                        continue
                    produced[i].append(nxt)
                    if matchers[i] is not None:
                        matchers[i] = matchers[i].advance(masker.texts[nxt])
                    if len(produced[i]) >= req.max_new_tokens:
                        done[i] = True
                    nxt_ids.append(nxt)
                if all(done):
                    break
                input_ids = torch.tensor(nxt_ids, dtype=torch.long)[:, None]
                attn = torch.cat([attn, torch.ones((b, 1), dtype=torch.long)], dim=1)  # finished rows: ignored
                positions = positions[:, -1:] + 1
        return [TextResult(text=tok.decode(p, skip_special_tokens=True), finish=f, prompt_tokens=len(ids),
                           new_tokens=len(p), guided=m is not None or r.schema is not None)
                for p, f, ids, m, r in zip(produced, finish, prompts, matchers, reqs)]

    def _pick(self, logits, req: TextRequest, matcher, masker, produced: list[int], gen) -> int | None:
        """The next token of one row: schema mask first, then repetition penalty, temperature, top-p."""
        import torch

        n_vocab = logits.shape[0]
        if matcher is not None:
            allowed = masker.allowed(matcher)
            if allowed.shape[0] < n_vocab:  # the model's head may be padded beyond the tokenizer
                allowed = torch.cat([allowed, torch.zeros(n_vocab - allowed.shape[0], dtype=torch.bool)])
            allowed = allowed[:n_vocab]
            if not bool(allowed.any()):
                return None
            logits = logits.masked_fill(~allowed, float("-inf"))
        if req.repetition_penalty and req.repetition_penalty != 1.0 and produced:
            seen = torch.tensor(sorted(set(produced)), dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / req.repetition_penalty, vals * req.repetition_penalty)
        if req.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / req.temperature, dim=-1)
        if req.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < req.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        return int(torch.multinomial(probs, 1, generator=gen))
