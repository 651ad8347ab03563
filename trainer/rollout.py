"""Rollout engines: sample G responses per prompt behind one interface.

``RolloutEngine.generate(prompts, sampling, seeds, video_embeds=None, items=None) -> list[RolloutGroup]``

* ``TransformersEngine``: ``model.generate`` on the trainer's own model (CPU or GPU). The video is encoded once
  per prompt (or taken from ``video_embeds``) and passed as ``mm_encoder_outputs``, so the vision tower does not
  run once per rollout; the prompt itself is prefilled once per group, its K/V kept as one copy that the G rows
  attend to, and the rows of the call's prompts decode together
  (:func:`longreel.engines.shared_prefix.sample_shared_prefixes`; ``prompts_per_decode`` caps the batch).
  Rollout ``k`` of prompt ``i`` is sampled from its own seed (``rollout_row_seed(seeds[i], k)``), so a prompt
  gives the same rollouts on whichever rank handles it, after a resume, and when an SP group splits its G
  rollouts over its ranks (``group``: each rank samples its share, then they are all-gathered).
* ``VLLMEngine`` (GPU): the shared vLLM engine of :mod:`longreel.engines` (the one the curation stages use),
  holding its own copy of the weights; ``sync_weights(model)`` copies the trainer's weights into it after every
  update. vLLM is imported lazily, only when this engine is built. With
  ``video_embeds`` it passes the cached embeddings (``{"video": {"video_embeds", "video_grid_thw"}}``, needs
  ``enable_mm_embeds``) instead of the frames, so vLLM does not re-encode the video. A prompt's G samples share
  its prefill and K/V blocks through vLLM's prefix cache, which every weight sync clears. An SP ``group`` splits
  each prompt's G rollouts the same way (one request of ``n = hi - lo`` seeded ``seed + lo``: vLLM seeds child
  ``j`` of a request seeded ``s`` with ``s + j``), then all-gathers them.

A ``RolloutGroup`` holds right-padded response ids ending at (and including) the first EOS, their mask, the decoded
texts (special tokens skipped, reasoning tags kept), and, when the engine reports them, the behaviour log-probs.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from longreel.trainer.policy import PromptInputs, VideoEmbeds, encode_video

__all__ = ["SamplingConfig", "RolloutGroup", "RolloutEngine", "TransformersEngine", "VLLMEngine", "make_engine",
           "pad_responses", "pad_logprobs"]

log = logging.getLogger("longreel.trainer")


@dataclass(frozen=True)
class SamplingConfig:
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    greedy: bool = False


@dataclass
class RolloutGroup:
    """The ``G`` responses to one prompt. ``response_ids``/``response_mask``: ``[G, T]``; ``behav_logp``:
    optional ``[G, T]`` (engine-reported log-probs of the sampled tokens); ``finished``: ``BoolTensor[G]``
    (stopped at EOS rather than at max_new_tokens)."""

    key: str
    response_ids: Tensor
    response_mask: Tensor
    texts: list[str]
    finished: Tensor
    behav_logp: Tensor | None = None
    # behav_logp came from the trainer's own weights on the step's own video features (the transformers
    # engine's decode): they are the old-policy log-probs, within fp32 rounding
    behav_is_policy: bool = False

    @property
    def lengths(self) -> Tensor:
        return self.response_mask.sum(-1)


def pad_responses(seqs: Sequence[Sequence[int]], pad_id: int, min_len: int = 1) -> tuple[Tensor, Tensor]:
    t = max([len(s) for s in seqs] + [min_len])
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def pad_logprobs(logprobs: Sequence[Sequence[float]], shape: tuple[int, int]) -> Tensor:
    """Per-token log-probs of each response, right-padded with 0 to ``shape`` ``[G, T]`` (float32)."""
    out = torch.zeros(shape, dtype=torch.float32)
    for j, lp in enumerate(logprobs):
        out[j, :len(lp)] = torch.as_tensor(list(lp), dtype=torch.float32)
    return out


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _pad_id(model, tokenizer) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_ids(model)[0]
    return int(pad)


def vision_token_ids(model) -> list[int]:
    """Placeholder/marker ids that must never be sampled: a response holding a ``<|video_pad|>`` would no longer
    match the video's feature count when the sequence is fed back to the model."""
    cfg = model.config
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id")
    return sorted({int(getattr(cfg, n)) for n in names if isinstance(getattr(cfg, n, None), int)})


def group_share(n: int, group) -> list[int]:
    """This rank's contiguous share of a prompt's ``n`` rollouts when an SP ``group`` splits them (``ceil(n /
    size)`` each, the last ranks fewer or none); every row without a group."""
    from longreel.trainer.mrsp.dist_ops import world

    # no group: this process samples every rollout (world(None) would be the whole torchrun world, whose
    # data-parallel ranks hold other prompts)
    rank, size = world(group) if group is not None else (0, 1)
    per = -(-n // size)
    return list(range(min(n, rank * per), min(n, (rank + 1) * per)))


def gather_group(mine: list, group) -> list[list]:
    """Every rank's per-prompt lists (token ids and the like: small), in rank order, so row order is one
    process's."""
    import torch.distributed as dist

    from longreel.trainer.mrsp.dist_ops import world

    if group is None or world(group)[1] == 1:
        return [mine]
    out: list = [None] * world(group)[1]
    dist.all_gather_object(out, mine, group=group)
    return out


class RolloutEngine(ABC):
    name = "base"

    @abstractmethod
    def generate(self, prompts: Sequence[PromptInputs], sampling: SamplingConfig, seeds: Sequence[int],
                 video_embeds: Sequence[VideoEmbeds | None] | None = None,
                 items: Sequence[dict] | None = None) -> list[RolloutGroup]:
        """Sample ``sampling.n`` responses for each prompt (``seeds[i]`` seeds prompt ``i``'s group)."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (no-op when it shares them)."""

    def release(self) -> None:
        """The step's rollouts are done: free what the engine holds that the trainer's passes could use until the
        next ``sync_weights`` (no-op when it holds nothing of its own)."""

    def close(self) -> None:
        pass


class TransformersEngine(RolloutEngine):
    """Rollouts on the shared transformers engine (:class:`longreel.engines.transformers_engine.TransformersEngine`)
    wrapped around the trainer's own model (shared weights: nothing to sync). Each prompt goes in as the model's
    keyword tensors with its cached vision features (``mm_encoder_outputs``), so the vision tower does not run
    again, and is prefilled once for its G rows (``share_prompt``)."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module, processor, *, share_prompt: bool = True, group=None,
                 prompts_per_decode: int = 0):
        from longreel.engines.transformers_engine import TransformersEngine as SharedTransformersEngine

        self.group = group  # an SP group: its ranks split each prompt's rollouts, then all-gather them
        self.report_logprobs = False  # fill RolloutGroup.behav_logp from the decode (the MR-SP trainer reuses them)
        self.model = model
        self.processor = processor
        self.engine = SharedTransformersEngine.from_model(model, processor, name="policy")
        self.share_prompt = share_prompt  # prefill each prompt once for its G rollouts (generate_shared_prefix)
        # the rows of this many prompts decode in one batch (0: all of the call's prompts); each prompt's K/V stay
        # in memory until its batch is done, so a long-video run on a small GPU lowers it
        self.prompts_per_decode = int(prompts_per_decode)
        self.eos = _eos_ids(model)
        self.pad_id = _pad_id(model, processor.tokenizer)
        self.suppress = vision_token_ids(model)

    def _inputs(self, prompt: PromptInputs, emb: VideoEmbeds) -> dict[str, Any]:
        inputs: dict[str, Any] = dict(
            input_ids=prompt.input_ids, attention_mask=prompt.attention_mask,
            video_grid_thw=prompt.video_grid_thw, mm_encoder_outputs=emb.as_mm_encoder_outputs(1))
        if prompt.mm_token_type_ids is not None:
            inputs["mm_token_type_ids"] = prompt.mm_token_type_ids
        inputs.update(prompt.extra)
        return inputs

    @torch.no_grad()
    def generate(self, prompts, sampling, seeds, video_embeds=None, items=None):
        """With an SP ``group`` each rank samples its contiguous share of every prompt's ``G`` rollouts (rollout
        ``k`` from ``rollout_row_seed(seeds[i], k)``, from the group's identical gathered video features), then the
        token ids are all-gathered: every rank returns the same groups, equal to one process's."""
        from longreel.engines.base import Sampling

        model = self.model
        was_training = model.training
        model.eval()
        try:
            rows = group_share(sampling.n, self.group)
            inputs, samplings = [], []
            for i, prompt in enumerate(prompts):
                emb = video_embeds[i] if video_embeds is not None and video_embeds[i] is not None else None
                if emb is None:
                    emb = encode_video(model, prompt)
                inputs.append(self._inputs(prompt, emb))
                samplings.append(Sampling(max_new_tokens=sampling.max_new_tokens, n=sampling.n, seed=int(seeds[i]),
                                          temperature=0.0 if sampling.greedy else sampling.temperature,
                                          top_p=sampling.top_p, top_k=0))
            done = self.engine.generate_prepared_many(inputs, samplings, share_prompt=self.share_prompt,
                                                      eos_ids=self.eos, pad_id=self.pad_id,
                                                      suppress_tokens=self.suppress, rows=rows,
                                                      prompts_per_decode=self.prompts_per_decode)
            mine = [(c.token_ids, c.finish, c.logprobs if self.report_logprobs else None) for c in done]
        finally:
            model.train(was_training)
        parts = gather_group(mine, self.group)
        tok = self.processor.tokenizer
        groups = []
        for i, prompt in enumerate(prompts):
            token_ids = [t for part in parts for t in part[i][0]]
            finish = [f for part in parts for f in part[i][1]]
            texts = tok.batch_decode([k[:-1] if f == "stop" else k for k, f in zip(token_ids, finish)],
                                     skip_special_tokens=True)
            ids, mask = pad_responses(token_ids, self.pad_id)
            dev = prompt.input_ids.device
            behav = None
            if all(part[i][2] is not None for part in parts):
                behav = pad_logprobs([lp for part in parts for lp in part[i][2]], tuple(ids.shape)).to(dev)
            groups.append(RolloutGroup(prompt.key, ids.to(dev), mask.to(dev), texts,
                                       torch.tensor([f == "stop" for f in finish]), behav,
                                       behav_is_policy=behav is not None))
        return groups


class VLLMEngine(RolloutEngine):
    """Rollouts on the shared vLLM engine (:class:`longreel.engines.vllm_engine.VLLMEngine`, GPU), with the
    trainer's weights loaded into it after each update.

    The engine runs in-process (``in_process=True``) so ``sync_weights`` can reach the model: the weights go as
    ``(name, tensor)`` pairs of the HF state dict to vLLM's in-place reload (``reload_weights``), whose
    ``load_weights`` maps them to its own layout. Log-probs are the processed ones (after temperature), to be
    comparable with the trainer's; vision placeholder tokens get a -100 logit bias so they are never sampled.

    Under ``torchrun`` (``external_launcher=True``) each rank's engine is built with vLLM's
    ``distributed_executor_backend="external_launcher"``: the engine joins the trainer's process group and takes the
    rank's GPU (``LOCAL_RANK``). vLLM's in-process default picks the device index in its ``device`` setting or 0,
    whatever the rank, so every rank's engine would be put on GPU 0 and each rank's current device switched to it.
    """

    name = "vllm"

    def __init__(self, model_path: str, processor, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.4,
                 max_model_len: int = 8192, seed: int = 0, enable_mm_embeds: bool = False,
                 external_launcher: bool = False, group=None, prefix_caching: bool = True, sleep_level: int = 0):
        from longreel.engines.vllm_engine import VLLMEngine as SharedVLLMEngine, on_cpu

        if sleep_level and on_cpu():
            from longreel.schemas.config import ConfigError

            raise ConfigError(f"rollout.vllm_sleep_level={sleep_level}: vLLM's sleep mode frees GPU memory (CUDA, "
                              "ROCm) and this vLLM runs on the CPU; set it to 0")
        self.processor = processor
        self.max_model_len = max_model_len
        self.group = group  # an SP group: its ranks split each prompt's rollouts, then all-gather them
        self.sleep_level, self.asleep = int(sleep_level), False
        launcher = {"distributed_executor_backend": "external_launcher"} if external_launcher else {}
        if self.sleep_level:
            launcher["enable_sleep_mode"] = True
        # a prompt's G samples share its prefill and its K/V blocks through vLLM's prefix cache (else each of the
        # G child requests prefills the whole prompt, the video's tokens included, into blocks of its own); the
        # cache is cleared at every weight sync
        self.engine = SharedVLLMEngine(model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                       max_model_len=max_model_len, seed=seed, return_logprobs=True,
                                       enable_mm_embeds=enable_mm_embeds, in_process=True,
                                       enable_prefix_caching=bool(prefix_caching), **launcher)
        try:
            self.engine.setup()
        except RuntimeError as e:
            raise RuntimeError("rollout.engine=vllm needs vllm installed (pip install 'longreel[gpu]') and a GPU") \
                from e
        tok = processor.tokenizer
        self.pad_id = tok.pad_token_id or 0
        ids = [tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                      "<|vision_end|>")]
        self.suppress = {int(i): -100.0 for i in ids if isinstance(i, int) and i != tok.unk_token_id}

    def _request(self, item: dict, embeds: VideoEmbeds | None, sampling: SamplingConfig, seed: int, n: int):
        from longreel.engines.base import EngineRequest, Sampling, Video
        from longreel.trainer.policy import _frames, _metadata_dict, item_metadata, prompt_messages

        meta = _metadata_dict(item_metadata(item))
        frames = _frames(item).numpy()
        video = Video(frames=frames, fps=float(meta["fps"]), frame_indices=[int(i) for i in meta["frames_indices"]],
                      total_frames=int(meta.get("total_num_frames") or len(frames)),
                      duration_s=float(meta.get("duration") or len(frames) / float(meta["fps"])),
                      embeds=None if embeds is None else {"video_embeds": embeds.features.detach(),
                                                          "video_grid_thw": embeds.grid_thw.reshape(-1, 3)})
        return EngineRequest(key=str(item.get("key", "")), messages=prompt_messages(item), video=video,
                             sampling=Sampling(max_new_tokens=sampling.max_new_tokens,
                                               temperature=0.0 if sampling.greedy else sampling.temperature,
                                               top_p=sampling.top_p, n=n, seed=int(seed)),
                             logit_bias=self.suppress or None)

    def generate(self, prompts, sampling, seeds, video_embeds=None, items=None):
        """With an SP ``group`` each rank asks its engine for its contiguous share ``lo..hi`` of every prompt's
        ``G`` rollouts, then the samples are all-gathered: every rank returns the same groups. vLLM seeds child
        ``j`` of a request seeded ``s`` with ``s + j`` (``ParentRequest``), so the share is one request of
        ``n = hi - lo`` seeded ``s + lo``: the rollouts one process's request of ``n = G`` gives."""
        if items is None:
            raise ValueError("the vllm engine needs the items (it renders the prompt and passes the frames itself)")
        if self.asleep:  # level 2's weights are gone, level 1's a step old: only a sync may wake it
            raise RuntimeError("the vllm engine is asleep (rollout.vllm_sleep_level): sync its weights first")
        self._check_lengths(prompts, sampling)
        rows = group_share(sampling.n, self.group)
        mine = self._sample(prompts, items, rows, sampling, seeds, video_embeds) if rows \
            else [([], [], [], [])] * len(prompts)
        parts = gather_group(mine, self.group)
        groups = []
        for i, prompt in enumerate(prompts):
            token_ids, finish, logprobs, texts = ([x for part in parts for x in part[i][f]] for f in range(4))
            ids, mask = pad_responses(token_ids, self.pad_id)
            dev = prompt.input_ids.device
            groups.append(RolloutGroup(prompt.key, ids.to(dev), mask.to(dev), texts,
                                       torch.tensor([f == "stop" for f in finish]),
                                       pad_logprobs(logprobs, tuple(ids.shape)).to(dev)))
        return groups

    def _sample(self, prompts, items, rows: list[int], sampling: SamplingConfig, seeds, video_embeds) -> list:
        """This rank's rows of every prompt, one request each: per prompt (token ids, finish reasons, log-probs,
        texts)."""
        requests = [self._request(item, video_embeds[i] if video_embeds is not None else None, sampling,
                                  int(seeds[i]) + rows[0], len(rows))
                    for i, item in enumerate(items)]
        out = []
        for prompt, c in zip(prompts, self.engine.generate(requests)):
            if not c.ok:
                raise RuntimeError(f"vllm rollout failed for {prompt.key}: {c.error_message}")
            out.append((c.token_ids, c.finish, c.logprobs, list(c.texts)))
        return out

    def _check_lengths(self, prompts: Sequence[PromptInputs], sampling: SamplingConfig) -> None:
        """vLLM refuses a request longer than its ``max_model_len``; a long video's prompt alone can be (1,024 frames
        of Qwen2-VL at 168x280 are ~30k tokens). Said here as the setting to change, before any request is sent,
        rather than as a failed rollout."""
        from longreel.trainer.preflight import InputCheckError

        longest = max(prompts, key=lambda p: p.length, default=None)
        if longest is not None and longest.length + sampling.max_new_tokens > self.max_model_len:
            raise InputCheckError(
                f"sample {longest.key!r}: its prompt ({longest.length} tokens, the video included) and "
                f"rollout.max_new_tokens ({sampling.max_new_tokens}) exceed rollout.vllm_max_model_len "
                f"({self.max_model_len}): set rollout.vllm_max_model_len to at least "
                f"{longest.length + sampling.max_new_tokens}, or sample fewer frames")

    def sync_weights(self, model: torch.nn.Module, weights: Iterable[tuple[str, Tensor]] | None = None) -> None:
        """``weights``: ``(name, tensor)`` pairs to load in place of ``model``'s own (FSDP's, gathered as the engine
        reads them)."""
        weights = weights if weights is not None else model.state_dict()
        if not self.asleep:
            self.engine.sync_weights(weights)
            return
        # the weights' memory back first (level 2: uninitialised, every tensor is loaded below), the KV cache's only
        # once they are loaded, so the trainer's gathered weights never share the GPU with the cache
        self.engine.wake_up(["weights"])
        self.engine.sync_weights(weights, forget_prefixes=False)
        if not self.engine.wake_up(["kv_cache"]):
            raise RuntimeError("vllm: the engine is not fully awake after its weights and KV cache woke")
        self.engine.forget_cached_prefixes()
        self.asleep = False

    def release(self) -> None:
        """vLLM's sleep mode (``rollout.vllm_sleep_level``): level 1 moves the engine's weights to CPU memory and
        drops its KV cache, level 2 drops both, so the trainer's log-prob passes and update get that GPU memory.
        The sync after the update wakes it. Level 2 copies nothing: the sync reloads every weight anyway."""
        if self.sleep_level and not self.asleep:
            self.engine.sleep(self.sleep_level)
            self.asleep = True

    def close(self) -> None:
        """Shut the engine down now, before the trainer's process group. vLLM's teardown of an in-process engine
        destroys torch.distributed's default group too (``cleanup_dist_env_and_memory``); left to interpreter exit,
        it ran after the trainer had destroyed that group and printed a traceback ("Invalid process group
        specified") from vLLM's finalizer."""
        self.engine.close()


def _under_torchrun() -> bool:
    """More than one trainer process: each rank's vLLM engine must join them rather than start a world of its own."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def make_engine(name: str, model, processor, *, model_path: str = "", rollout_cfg=None, seed: int = 0,
                dtype: str = "bfloat16", group=None) -> RolloutEngine:
    """``group``: an SP group whose ranks split each prompt's rollouts, then all-gather them."""
    if name == "transformers":
        return TransformersEngine(model, processor, group=group,
                                  prompts_per_decode=getattr(rollout_cfg, "prompts_per_decode", 0))
    if name == "vllm":
        # the trainer hands over each step's video embeddings (MR-SP encodes a video once for every pass), which
        # vLLM accepts only from an engine built with enable_mm_embeds
        return VLLMEngine(model_path, processor, dtype=dtype,
                          gpu_memory_utilization=getattr(rollout_cfg, "vllm_gpu_memory_utilization", 0.4),
                          max_model_len=getattr(rollout_cfg, "vllm_max_model_len", 8192), seed=seed,
                          enable_mm_embeds=True, external_launcher=_under_torchrun(), group=group,
                          prefix_caching=getattr(rollout_cfg, "vllm_prefix_caching", True),
                          sleep_level=getattr(rollout_cfg, "vllm_sleep_level", 0))
    raise ValueError(f"unknown rollout engine {name!r}; choose transformers or vllm")
