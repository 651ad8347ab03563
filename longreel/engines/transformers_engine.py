"""The in-process ``transformers`` engine (CPU or GPU): one implementation for captions, QRA and pass-rate answers.

The model is a local directory or GGUF file (:func:`longreel.engines.local_models.resolve_model`; nothing is
downloaded). ``kind="vision"`` loads ``AutoModelForImageTextToText`` + ``AutoProcessor`` (video requests go to
the processor as already-sampled frames with their metadata and ``do_sample_frames=False``); ``kind="text"``
loads ``AutoModelForCausalLM`` + its tokenizer; ``auto`` picks vision when the directory holds a processor config.

Batching: requests are taken ``batch_size`` at a time; within that, requests with the same sampling settings
(and, when sampling, the same seed) share one ``generate`` call. Sampling runs under the request's seed in a
forked RNG, so a request's samples do not depend on its batch, its order or the caller's RNG. ``n > 1`` samples a
request's rows in that one call (``num_return_sequences``): the video is encoded once for all of them. A call
that raises is retried request by request, so one poisonous request fails alone (``model_error``).

Constrained decoding (``schema``): llguidance's grammar as the first logits processor (:mod:`.schema_mask`),
with repetition penalty, temperature and top-p after it and ``generate``'s own processors off, so a warper can
never remove every allowed token. Text models only; a request whose grammar allowed no token finishes
``dead_end``.

NVILA (``Efficient-Large-Model/NVILA-*``) is native in neither transformers nor vLLM: download the checkpoint once
on a machine with network access, then point the engine at the directory with ``trust_remote_code=True``; the
checkpoint's own Python code (``auto_map``) then runs. Without the explicit opt-in, remote code never runs. When
the remote code registers no ``AutoModelForImageTextToText`` class, ``AutoModelForCausalLM`` and then
``AutoModel`` are tried.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from longreel.engines.base import Completion, Engine, EngineRequest, Sampling, video_metadata, weights_revision
from longreel.engines.local_models import dequantized, load_tokenizer, resolve_model

log = logging.getLogger("longreel")

#: Qwen2-VL-family frames are cut in 14-pixel patches merged 2x2: frames whose sides are multiples of 28 are
#: already on the processor's grid, and resizing them again would only blur them.
QWEN_FRAME_FACTOR = 28
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def torch_dtype(name: str):
    import torch

    return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_device(device: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


class TransformersEngine(Engine):
    backend = "transformers"
    supports_schema = True
    supports_pattern = True  # llguidance's grammar takes JSON-schema patterns

    def __init__(self, model: str, revision: str | None = None, *, kind: str = "auto", dtype: str = "auto",
                 device: str = "cpu", trust_remote_code: bool = False, batch_size: int = 8,
                 threads: int | None = None):
        if kind not in ("auto", "vision", "text"):
            raise ValueError(f"kind must be auto, vision or text, got {kind!r}")
        self.local = resolve_model(model)
        weights = os.path.join(self.local.directory, self.local.gguf_file) if self.local.gguf_file \
            else self.local.directory
        super().__init__(model, weights_revision(weights, revision))
        if kind == "auto":
            kind = "vision" if not self.local.gguf_file and any(
                os.path.isfile(os.path.join(self.local.directory, f)) for f in PROCESSOR_FILES) else "text"
        self.kind, self.dtype, self.device = kind, dtype, device
        self.trust_remote_code = bool(trust_remote_code)
        self.batch_size, self.threads = max(1, int(batch_size)), threads
        self._model = None
        self._processor = None
        self._tok = None
        self._lltok = None

    @classmethod
    def from_model(cls, model, processor, name: str = "in-memory") -> "TransformersEngine":
        """An engine over a model already in memory (e.g. the policy a trainer is updating: it samples from the
        current weights, nothing to load or sync)."""
        engine = cls.__new__(cls)
        Engine.__init__(engine, name, None)
        engine.local, engine.kind, engine.dtype, engine.device = None, "vision", "auto", str(model.device)
        engine.trust_remote_code, engine.batch_size, engine.threads = False, 1, None
        engine._model, engine._processor, engine._lltok = model, processor, None
        engine._tok = getattr(processor, "tokenizer", processor)
        return engine

    # -- loading ----------------------------------------------------------------------------------------------
    def setup(self) -> None:
        if self._model is not None:
            return
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        t0 = time.monotonic()
        load = dict(self.local.load_kwargs(), dtype=torch_dtype(self.dtype),
                    trust_remote_code=self.trust_remote_code)
        if self.kind == "vision":
            import transformers

            self._processor = transformers.AutoProcessor.from_pretrained(
                self.local.directory, trust_remote_code=self.trust_remote_code, local_files_only=True)
            self._tok = self._processor.tokenizer
            model = self._load_vision(transformers, self.local.directory, load, self.trust_remote_code)
        else:
            from transformers import AutoModelForCausalLM

            path, kw = self._text_weights(load)
            model = AutoModelForCausalLM.from_pretrained(path, **kw)
        self._model = model.to(resolve_device(self.device)).eval()
        tok = self.tokenizer
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        log.info("transformers: loaded %s (%s, %s) in %.1f s", self.model, type(model).__name__, self.revision,
                 time.monotonic() - t0)

    def _text_weights(self, load: dict) -> tuple:
        """``(path, kwargs)`` for ``from_pretrained``: a GGUF model from its float32 copy in the cache (parsing the
        GGUF again costs every process tens of seconds; :func:`dequantized`), the GGUF itself where the cache
        cannot be written."""
        if not self.local.gguf_file:
            return self.local.directory, load
        try:
            path = dequantized(self.model)
        except OSError as e:
            log.warning("transformers: no dequantized copy of %s in the cache (%s); reading the GGUF", self.model, e)
            return self.local.directory, load
        return path, {k: v for k, v in load.items() if k != "gguf_file"}

    @staticmethod
    def _load_vision(transformers, path: str, load: dict, trust_remote_code: bool):
        try:
            return transformers.AutoModelForImageTextToText.from_pretrained(path, **load)
        except ValueError:
            if not trust_remote_code:
                raise
        for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel):  # remote-code checkpoints (NVILA)
            try:
                return cls.from_pretrained(path, **load)
            except ValueError:
                continue
        raise ValueError(f"{path}: no Auto class loads this checkpoint, even with trust_remote_code")

    @property
    def tokenizer(self):
        """The tokenizer, without loading the weights (token counts are asked for before any generation)."""
        if self._tok is None:
            if self.kind == "vision":
                self.setup()
            else:
                self._tok = load_tokenizer(self.model)
        return self._tok

    @property
    def hf_model(self):
        self.setup()
        return self._model

    @property
    def processor(self):
        self.setup()
        return self._processor

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

    # -- prompts ----------------------------------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a text model's prompt: its chat template with the assistant turn opened (a model without
        one gets the contents joined by blank lines)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        text = "\n\n".join(m["content"] for m in messages) + "\n\n"
        return tok.encode(text)

    def count_tokens(self, messages: list[dict]) -> int | None:
        return len(self.prompt_ids(messages)) if self.kind == "text" else None

    def vision_inputs(self, reqs: Sequence[EngineRequest]):
        """The processor's tensors for requests to a vision model (all with a video, or all without)."""
        processor = self.processor
        texts = [processor.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False) for r in reqs]
        with_video = [r for r in reqs if r.video is not None]
        if with_video and len(with_video) != len(reqs):
            raise ValueError("a batch mixes requests with and without a video")
        if not with_video:
            return processor(text=texts, return_tensors="pt", padding=True)
        from transformers.video_utils import VideoMetadata

        frames = [r.video.frames for r in reqs]
        on_grid = all(f.shape[1] % QWEN_FRAME_FACTOR == 0 and f.shape[2] % QWEN_FRAME_FACTOR == 0 for f in frames)
        return processor(text=texts, videos=frames, video_metadata=[VideoMetadata(**video_metadata(r.video))
                                                                    for r in reqs],
                         do_sample_frames=False, do_resize=not on_grid, return_tensors="pt", padding=True)

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, requests: list[EngineRequest]) -> list[Completion]:
        self.setup()
        out: list[Completion] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            t0 = time.monotonic()
            results = self._generate_chunk(chunk)
            dt = time.monotonic() - t0
            n_new = sum(r.new_tokens for r in results)
            log.info("transformers: %d requests, %d new tokens in %.1f s (%.1f tokens/s)", len(chunk), n_new, dt,
                     n_new / max(dt, 1e-9))
            for r in results:
                r.latency_s = round(dt / len(chunk), 3)
            out.extend(results)
        return out

    @staticmethod
    def _group_key(r: EngineRequest) -> tuple:
        s = r.sampling
        return (s.greedy, None if s.greedy else s.seed, None if s.greedy else s.temperature,
                None if s.greedy else s.top_p, s.top_k, s.repetition_penalty, s.n, s.min_new_tokens,
                r.video is not None)

    def _generate_chunk(self, reqs: list[EngineRequest]) -> list[Completion]:
        """Requests grouped by sampling settings (and seed when sampling): one ``generate`` call per group;
        a group that fails is retried request by request. Results in request order."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault(self._group_key(r), []).append(i)
        out: list[Completion | None] = [None] * len(reqs)
        for rows in groups.values():
            for i, res in zip(rows, self._generate_isolated([reqs[i] for i in rows])):
                out[i] = res
        return out

    def _generate_isolated(self, reqs: list[EngineRequest]) -> list[Completion]:
        try:
            return self._generate_group(reqs)
        except Exception as e:  # noqa: BLE001 - a model failure becomes the request's reject, not a crashed run
            if len(reqs) > 1:
                log.warning("transformers: a group of %d failed (%s: %s); retrying one by one", len(reqs),
                            type(e).__name__, e)
                return [res for r in reqs for res in self._generate_isolated([r])]
            log.exception("transformers: generation failed on %s", reqs[0].key)
            return [Completion.failed("model_error", f"{type(e).__name__}: {e}")]

    def _generate_group(self, reqs: list[EngineRequest]) -> list[Completion]:
        import torch

        if self.kind == "vision":
            if any(r.schema is not None for r in reqs):
                raise ValueError("constrained decoding needs a text model in the transformers engine")
            inputs = self.vision_inputs(reqs).to(self._model.device)
            kwargs, mask = self._sampling_kwargs(reqs), None
            prompt_tokens = [int(m.sum()) for m in inputs["attention_mask"]]
            vision_tokens = self._vision_token_counts(inputs)
        else:
            inputs, kwargs, mask = self._text_inputs(reqs)
            prompt_tokens = [int(m.sum()) for m in inputs["attention_mask"]]
            vision_tokens = [0] * len(prompt_tokens)
        width = inputs["input_ids"].shape[1]
        devices = [self._model.device.index or 0] if self._model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(int(reqs[0].sampling.seed))
            out = self._model.generate(**inputs, **kwargs)
        return self._completions(reqs, out[:, width:], mask, prompt_tokens, vision_tokens)

    def _sampling_kwargs(self, reqs: list[EngineRequest]) -> dict:
        """``generate`` keywords of a vision group: settings left None keep the model's generation config."""
        s = reqs[0].sampling
        kw = {"max_new_tokens": max(r.sampling.max_new_tokens for r in reqs), "do_sample": not s.greedy}
        if not s.greedy:
            kw.update(temperature=s.temperature, top_p=s.top_p)
        if s.top_k is not None:
            kw["top_k"] = s.top_k
        if s.repetition_penalty is not None:
            kw["repetition_penalty"] = s.repetition_penalty
        if s.n > 1:
            kw["num_return_sequences"] = s.n
        if s.min_new_tokens:
            kw["min_new_tokens"] = s.min_new_tokens
        return kw

    def _text_inputs(self, reqs: list[EngineRequest]):
        """A text group: left-padded prompt ids (each request's row repeated ``n`` times), the schema mask and
        every sampling step as explicit logits processors after it."""
        import torch
        from transformers import (GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                  TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

        from longreel.engines.schema_mask import SchemaMask

        tok, s = self.tokenizer, reqs[0].sampling
        rows = [r for r in reqs for _ in range(r.sampling.n)]
        prompts = [self.prompt_ids(r.messages) for r in rows]
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attn[i, width - len(ids):] = 1
        mask = SchemaMask([r.schema for r in rows], [r.max_string_chars or 360 for r in rows], self.ll_tokenizer())
        processors = LogitsProcessorList([mask])
        if s.repetition_penalty and s.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        if not s.greedy:
            processors.append(TemperatureLogitsWarper(s.temperature))
            if s.top_k:
                processors.append(TopKLogitsWarper(s.top_k))
            if s.top_p < 1.0:
                processors.append(TopPLogitsWarper(s.top_p))
        # generate's own processors off: every one of them is in `processors`, after the mask
        config = GenerationConfig(max_new_tokens=max(r.sampling.max_new_tokens for r in reqs), do_sample=not s.greedy,
                                  min_new_tokens=s.min_new_tokens or None,
                                  temperature=1.0, top_p=1.0, top_k=None, repetition_penalty=1.0,
                                  pad_token_id=pad, eos_token_id=self.eos_ids())
        inputs = {"input_ids": input_ids, "attention_mask": attn}
        return inputs, {"generation_config": config, "logits_processor": processors}, mask

    def _vision_token_counts(self, inputs) -> list[int]:
        """Video and image placeholder tokens per input row (what the vision tower's features fill)."""
        cfg = self._model.config
        ids = {getattr(cfg, n, None) for n in ("video_token_id", "image_token_id")} - {None}
        rows = inputs["input_ids"]
        return [sum(int((row == i).sum()) for i in ids) for row in rows]

    def generate_prepared(self, inputs: dict, sampling: Sampling, *, share_prompt: bool = True,
                          eos_ids: list[int] | None = None, pad_id: int | None = None,
                          suppress_tokens: list[int] | None = None, rows=None) -> Completion:
        """Samples of one prompt given as the model's keyword tensors: :meth:`generate_prepared_many` for one."""
        return self.generate_prepared_many([inputs], [sampling], share_prompt=share_prompt, eos_ids=eos_ids,
                                           pad_id=pad_id, suppress_tokens=suppress_tokens, rows=rows)[0]

    def generate_prepared_many(self, inputs: list[dict], samplings: list[Sampling], *, share_prompt: bool = True,
                               eos_ids: list[int] | None = None, pad_id: int | None = None,
                               suppress_tokens: list[int] | None = None, rows=None,
                               prompts_per_decode: int = 0) -> list[Completion]:
        """Samples of several prompts, each given as the model's keyword tensors (batch 1; e.g. a trainer's
        prompt carrying the vision tower's cached outputs as ``mm_encoder_outputs``): rows ``rows`` (default
        ``range(n)``) of each prompt's ``samplings[i].n``, row ``k`` sampled from its own generator seeded
        ``rollout_row_seed(samplings[i].seed, k)``, so a row is the same whether it is sampled here alone, with
        the group's other rows, with other prompts, or on another rank (an SP group splits a group's rows over
        its ranks).

        ``share_prompt``: each prompt is prefilled once for its rows (where the prompt allows it: no left
        padding): on Qwen2-VL-family decoders its K/V stay one copy that its rows attend to and the rows of up
        to ``prompts_per_decode`` prompts (0: all) are decoded in one batch
        (:func:`longreel.engines.shared_prefix.sample_shared_prefixes`); elsewhere each prompt's cache is
        repeated per row (``generate_shared_prefix``), one prompt at a time. ``suppress_tokens`` are never
        sampled. The ids of each sample run to (and include) the first end of sequence; the texts leave it out;
        ``logprobs`` are the sampled tokens' log-probs (temperature applied) when the shared decoder ran."""
        from longreel.engines.shared_prefix import rollout_row_seed, sample_shared_prefixes, supports_shared_decode

        eos = list(eos_ids) if eos_ids is not None else self.eos_ids()
        out: list[Completion | None] = [None] * len(inputs)
        shared = []
        for i, (x, s) in enumerate(zip(inputs, samplings)):
            share = share_prompt and bool(x["attention_mask"].all()) and supports_shared_decode(self._model)
            r = list(range(s.n)) if rows is None else [int(k) for k in rows]
            if share and r:
                shared.append(i)
            else:
                out[i] = self._generate_one(x, s, share=share_prompt and bool(x["attention_mask"].all()), eos=eos,
                                            pad_id=pad_id, suppress_tokens=suppress_tokens, rows=r)
        # prompts decode together only under one sampling setting (the decode's token limit and sampler are shared)
        by_setting: dict[tuple, list[int]] = {}
        for i in shared:
            s = samplings[i]
            by_setting.setdefault((s.n, s.max_new_tokens, s.temperature, s.top_p, s.top_k or 0, s.greedy), []).append(i)
        chunk = prompts_per_decode if prompts_per_decode > 0 else max(1, len(shared))
        for members in by_setting.values():
            for lo in range(0, len(members), chunk):
                part = members[lo:lo + chunk]
                s = samplings[part[0]]
                r = list(range(s.n)) if rows is None else [int(k) for k in rows]
                decs = sample_shared_prefixes(
                    self._model, [inputs[i] for i in part],
                    [[rollout_row_seed(samplings[i].seed, k) for k in r] for i in part],
                    max_new_tokens=s.max_new_tokens, eos_ids=eos, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k or 0, greedy=s.greedy, suppress_tokens=suppress_tokens)
                for i, dec in zip(part, decs):
                    c = self._new_completion(inputs[i])
                    c.token_ids, c.logprobs = dec.tokens, dec.logprobs
                    c.finish = ["stop" if f else "length" for f in dec.finished]
                    out[i] = self._finish_completion(c)
        return out

    def _new_completion(self, inputs: dict) -> Completion:
        ids = inputs["input_ids"]
        return Completion(token_ids=[], prompt_tokens=int(ids.shape[1]),
                          vision_tokens=self._vision_token_counts({"input_ids": ids})[0])

    def _finish_completion(self, c: Completion) -> Completion:
        c.new_tokens = sum(len(k) - (f == "stop") for k, f in zip(c.token_ids, c.finish))
        c.texts = self.tokenizer.batch_decode([k[:-1] if f == "stop" else k for k, f in zip(c.token_ids, c.finish)],
                                              skip_special_tokens=True)
        return c

    def _generate_one(self, inputs: dict, sampling: Sampling, *, share: bool, eos: list[int], pad_id: int | None,
                      suppress_tokens, rows: list[int]) -> Completion:
        """One prompt through ``generate`` (models the shared decoder does not cover, or a left-padded prompt)."""
        import torch

        from longreel.engines.shared_prefix import RowSampler, generate_shared_prefix, rollout_row_seed

        model = self._model
        pad = pad_id if pad_id is not None else (self.tokenizer.pad_token_id or eos[0])
        ids = inputs["input_ids"]
        c = self._new_completion(inputs)
        if not rows:
            return c
        # the last logits processor draws each row from its own generator and leaves only that token:
        # generate's own draw (sampling mode, which allows several rows per prompt) can then only pick it
        sampler = RowSampler([rollout_row_seed(sampling.seed, r) for r in rows], device=ids.device,
                             temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
                             greedy=sampling.greedy, suppress_tokens=suppress_tokens)
        kwargs = dict(max_new_tokens=sampling.max_new_tokens, eos_token_id=eos, pad_token_id=pad, use_cache=True,
                      do_sample=True, top_p=1.0, top_k=0, temperature=1.0,
                      logits_processor=[_RowSamplingProcessor(sampler)])
        devices = [ids.device] if ids.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            if share:
                out = generate_shared_prefix(model, inputs, len(rows), **kwargs)
            else:
                out = model.generate(**inputs, num_return_sequences=len(rows), **kwargs)
        stops = set(eos)
        for row in out[:, ids.shape[1]:].tolist():
            stop = next((j for j, t in enumerate(row) if t in stops), None)
            c.token_ids.append(row if stop is None else row[:stop + 1])
            c.finish.append("length" if stop is None else "stop")
        return self._finish_completion(c)

    def _completions(self, reqs: list[EngineRequest], new, mask, prompt_tokens: list[int],
                     vision_tokens: list[int]) -> list[Completion]:
        """Each request's ``n`` rows of ``new`` (``[sum(n), T]``) cut at the first end of sequence (kept in the
        ids, not in the text) or at the request's own token limit. ``prompt_tokens``: per input row (one per
        request for a vision model, one per sample for a text model)."""
        eos = set(self.eos_ids())
        per_sample = len(prompt_tokens) == new.shape[0]
        out, row = [], 0
        for j, r in enumerate(reqs):
            c = Completion(token_ids=[], guided=r.schema is not None,
                           prompt_tokens=prompt_tokens[row if per_sample else j],
                           vision_tokens=vision_tokens[row if per_sample else j])
            for _ in range(r.sampling.n):
                ids = [int(x) for x in new[row]]
                stop = next((k for k, x in enumerate(ids) if x in eos), None)
                stopped = stop is not None and stop < r.sampling.max_new_tokens
                text_ids = ids[:stop] if stopped else ids[:r.sampling.max_new_tokens]
                c.token_ids.append(text_ids + [ids[stop]] if stopped else text_ids)
                c.texts.append(self.tokenizer.decode(text_ids, skip_special_tokens=True))
                c.finish.append("dead_end" if mask is not None and mask.dead_end(row) else
                                "stop" if stopped else "length")
                c.new_tokens += len(text_ids)
                row += 1
            out.append(c)
        return out


class _RowSamplingProcessor:
    """A ``generate`` logits processor (last in the list, greedy decoding) that draws every row's token from its
    own generator (:class:`longreel.engines.shared_prefix.RowSampler`) and leaves only that token possible."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __call__(self, input_ids, scores):
        tok, _ = self.sampler(scores)
        out = scores.new_full(scores.shape, float("-inf"))
        return out.scatter(-1, tok[:, None], 0.0)
