"""Trainer configuration: pydantic models with help text on every field, loaded from YAML + ``--set`` overrides.

One ``TrainConfig`` serves both stages (``longreel train sft`` and ``longreel train grpo``); each stage reads the
sections it needs. Load with ``longreel.schemas.config.load_yaml(TrainConfig, path, overrides)``; list every key with
``longreel train sft --show-config``.
"""
from __future__ import annotations

import os

from longreel.schemas.config import ConfigError, ConfigModel, cfg
from longreel.task.shard_reader import local_path
from longreel.trainer.stop_signals import parse_signal

__all__ = [
    "ModelConfig", "DataConfig", "OptimConfig", "RolloutConfig", "GRPOConfig", "SFTConfig", "RunConfig",
    "DistConfig", "EvalConfig", "MRSPConfig", "TrainConfig",
]


class ModelConfig(ConfigModel):
    path: str = cfg("", "Local directory of the policy (save_pretrained layout: config, weights, processor). "
                        "Hub ids are not fetched: download the model first.")
    dtype: str = cfg("auto", "Parameter dtype: auto (bf16 on a GPU that supports it, else fp32), float32, bfloat16.",
                     choices=("auto", "float32", "bfloat16"))
    attn_implementation: str = cfg("sdpa", "Attention kernel passed to from_pretrained (sdpa, eager, "
                                           "flash_attention_2 on GPU).")
    vision_attention: str = cfg("batched", "Vision tower attention on SDPA: batched (one SDPA call per run of "
                                           "equal-length frames) or native (transformers' per-frame loop; same "
                                           "values, slower).", choices=("batched", "native"))
    packed_row_attention: str = cfg("split", "Text attention of a packed row (a prompt and its responses in one "
                                             "row, the update under gradient checkpointing) on SDPA: split (the "
                                             "prompt causal, only the responses masked) or mask (one call with an "
                                             "L x L mask; same values, slower and a quadratic mask).",
                                    choices=("split", "mask"))
    trust_remote_code: bool = cfg(False, "Allow model code shipped with the checkpoint (needed for NVILA). Opt-in.")
    gradient_checkpointing: bool = cfg(False, "Recompute activations in the backward pass to save memory.")
    freeze_vision: bool = cfg(False, "Do not train the vision tower (its parameters get requires_grad=False).")


class DataConfig(ConfigModel):
    source: str = cfg("shards", "Where training items come from: 'shards' (WebDataset shards via trainer.data) or "
                                "'synthetic' (the procedural task of trainer.synthetic_task, generated in memory).",
                      choices=("shards", "synthetic"))
    train_urls: list[str] = cfg(default_factory=list,
                                help="Training shards: URLs (local, file://, http(s)://, gs://, s3://), brace patterns "
                                     "(ds-rl-{000000..000031}.tar), local globs (OUT/shards/*-rl-*.tar) or a wids "
                                     "index (.json).")
    eval_urls: list[str] = cfg(default_factory=list, help="Held-out shards for evaluation, as data.train_urls.")
    batch_size: int = cfg(4, "Prompts per optimizer step across all ranks (the global batch; must divide by the "
                             "data-parallel size: the world size, or world / mrsp.sp_size under GRPO with MR-SP).")
    shuffle: bool = cfg(True, "Shuffle the item order each epoch (deterministically from run.seed and the epoch).")
    synthetic_train: int = cfg(256, "synthetic: number of training items.")
    synthetic_eval: int = cfg(100, "synthetic: number of held-out items.")
    synthetic_seed: int = cfg(0, "synthetic: generator seed for the training items (held-out items use seed + 1000).")
    synthetic_kinds: list[str] = cfg(default_factory=lambda: ["colour"],
                                     help="synthetic: question kinds to draw from (see trainer.synthetic_task.KINDS).")
    on_error: str = cfg("raise", "Shard loader: a corrupt sample stops the run ('raise') or is skipped and counted "
                                 "('skip').", choices=("raise", "skip"))
    cache_remote: bool = cfg(True, "Download http(s)://, gs:// and s3:// shards once into data.cache_dir (checked "
                                   "against the index's sha256) and read them from there, memory-mapped: without "
                                   "it their frames are held in RAM for the whole run and downloaded again on "
                                   "every start.")
    cache_dir: str = cfg("", "Where data.cache_remote keeps remote shards ('': $LONGREEL_CACHE/shards, else "
                             "~/.cache/longreel/shards). Needs the shards' size in free disk.")
    fetch_retries: int = cfg(3, "Times a remote shard's download into the cache (or, with data.cache_remote=false, "
                                "its read, from its start) that failed in transport (reset, timeout, HTTP 5xx, "
                                "truncated) is tried again, after 1, 2, 4, ... s; a 4xx or a copy that does not match "
                                "the index is not retried.")
    stream: bool = cfg(False, "Read the training shards as a stream instead of loading every item before step 1: "
                              "shard order permuted per epoch, items interleaved within data.shuffle_buffer videos, "
                              "remote shards cached one at a time as they are reached (the next one downloading "
                              "meanwhile). For datasets too large to hold or download up front; needs run.steps > 0.")
    shuffle_buffer: int = cfg(16, "data.stream: videos whose questions are interleaved (within one shard).")

    def check(self) -> None:
        from longreel.trainer.synthetic_task import KINDS  # numpy: only when a config is checked

        unknown = [k for k in self.synthetic_kinds if k not in KINDS]
        if unknown or not self.synthetic_kinds:
            raise ConfigError(f"data.synthetic_kinds: {'unknown ' + str(unknown) if unknown else 'empty'}; choose "
                              f"from {list(KINDS)}")


class OptimConfig(ConfigModel):
    lr: float = cfg(1e-6, "Peak learning rate of AdamW.")
    weight_decay: float = cfg(0.0, "AdamW weight decay.")
    beta1: float = cfg(0.9, "AdamW beta1.")
    beta2: float = cfg(0.999, "AdamW beta2.")
    eps: float = cfg(1e-8, "AdamW epsilon.")
    warmup_steps: int = cfg(0, "Linear warm-up steps from 0 to lr.")
    schedule: str = cfg("constant", "LR schedule after warm-up.", choices=("constant", "linear", "cosine"))
    min_lr_ratio: float = cfg(0.0, "linear/cosine: final LR as a fraction of lr.")
    max_grad_norm: float = cfg(1.0, "Clip the global gradient norm to this (<= 0: no clipping, norm still logged).")
    grad_accum: int = cfg(1, "Micro-steps accumulated per optimizer step; the global batch is split into this many "
                             "micro-batches (per rank).")


class RolloutConfig(ConfigModel):
    engine: str = cfg("transformers", "Rollout engine: 'transformers' (generate, CPU/GPU) or 'vllm' (GPU; weights "
                                      "synced from the trainer after each update).", choices=("transformers", "vllm"))
    n: int = cfg(8, "G: rollouts per prompt (the GRPO group size).")
    temperature: float = cfg(1.0, "Sampling temperature (log-probs are computed at the same temperature).")
    top_p: float = cfg(1.0, "Nucleus sampling threshold (1.0: off).")
    max_new_tokens: int = cfg(256, "Longest response, in tokens.")
    prompts_per_decode: int = cfg(0, "transformers engine: the rollouts of this many prompts are decoded in one "
                                     "batch, each prompt's K/V kept once (0: all of a step's prompts on the rank). "
                                     "Lower it when the prompts' K/V together do not fit in memory.")
    vllm_gpu_memory_utilization: float = cfg(0.4, "vllm: fraction of GPU memory the engine may take.")
    vllm_max_model_len: int = cfg(8192, "vllm: longest prompt + response.")
    vllm_prefix_caching: bool = cfg(True, "vllm: a prompt's G samples share its prefill and K/V blocks through vLLM's "
                                          "prefix cache (cleared at every weight sync); false: each prefills it alone.")
    vllm_sleep_level: int = cfg(0, "vllm: free the engine's GPU memory from the end of a step's rollouts to the "
                                   "weight sync, for the trainer's log-prob passes and update (vLLM's sleep mode, "
                                   "CUDA/ROCm only). 0: keep it; 1: weights moved to CPU memory, KV cache dropped; "
                                   "2: both dropped (the sync reloads every weight: no CPU copy).", choices=(0, 1, 2))


class GRPOConfig(ConfigModel):
    adv_estimator: str = cfg("grpo", "Advantage estimator: grpo ((r-mean)/(std+eps)) or dr_grpo (r-mean).",
                             choices=("grpo", "dr_grpo"))
    clip_low: float = cfg(0.2, "Lower clip: the ratio is clipped below at 1 - clip_low.")
    clip_high: float = cfg(0.28, "Upper clip (DAPO clip-higher): the ratio is clipped above at 1 + clip_high.")
    loss_agg: str = cfg("token_mean", "Loss aggregation over tokens and sequences.",
                        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"))
    beta: float = cfg(0.0, "KL coefficient to the reference model; the reference is loaded only when > 0.")
    kl_estimator: str = cfg("k3", "KL estimator for the penalty.", choices=("k1", "k2", "k3", "low_var_kl"))
    ppo_epochs: int = cfg(1, "Passes over each rollout batch (more than 1 makes later passes off-policy, where the "
                             "clip matters).")
    mix_policy: bool = cfg(False, "Mix-policy: an item's offline trajectory (its CoT target) replaces one of its G "
                                  "rollouts.")
    behaviour_cap: float = cfg(5.0, "Cap of the decoupled off-policy weight exp(logp_prox - logp_behav).")
    behaviour_correction: bool = cfg(False, "Apply the capped behaviour weight when rollouts come from older weights "
                                            "(engine logprobs differ from the trainer's proximal ones).")
    reward_format_weight: float = cfg(0.0, "longreel.task.rewards format_weight: reward of a well-formatted wrong answer.")
    dynamic_sampling: bool = cfg(False, "DAPO's dynamic sampling, an online pass-rate filter: a group whose rewards "
                                        "all tie (every rollout right, or every one wrong) has no advantage, so it is "
                                        "dropped and more prompts are drawn until the step has data.batch_size "
                                        "groups with signal or grpo.max_draws batches were drawn. Extra draws advance "
                                        "the loader (its position is checkpointed) and cost rollouts.")
    max_draws: int = cfg(3, "dynamic_sampling: most batches of prompts drawn in one step (1: drop tied groups, draw "
                            "no more).")


class SFTConfig(ConfigModel):
    max_items: int = cfg(0, "Use only the first N training items (0: all); a small N leaves room for GRPO.")
    epochs: int = cfg(1, "Passes over the (possibly truncated) SFT set; run.steps, if > 0, wins.")


class RunConfig(ConfigModel):
    out_dir: str = cfg("runs/train", "Output directory: checkpoints/, final/, metrics.jsonl, tensorboard/.")
    steps: int = cfg(100, "Optimizer steps to train (GRPO; SFT too when > 0, else sft.epochs).")
    seed: int = cfg(0, "Seed of the model-independent randomness (data order, rollout sampling).")
    save_every: int = cfg(50, "Save a resumable checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = cfg(2, "Keep the newest N step checkpoints (older ones are deleted).")
    resume: bool = cfg(True, "Resume from the newest checkpoint in out_dir/checkpoints when there is one (its stage "
                             "and config must match this run's, but for where/how long it runs, logging, saving, "
                             "launch and eval keys: trainer.preflight.RESUMABLE; memory settings with a warning: "
                             "RESUMABLE_WITHIN_ROUNDING). false: start over, removing the "
                             "checkpoints there.")
    save_final: bool = cfg(True, "Write out_dir/final with save_pretrained (model + processor) at the end.")
    log_every: int = cfg(1, "Write metrics every N steps.")
    tensorboard: bool = cfg(True, "Also write TensorBoard event files (out_dir/tensorboard).")
    progress: bool = cfg(True, "Show a tqdm progress bar on rank 0.")
    device: str = cfg("auto", "auto (cuda when available), cpu, or cuda.")
    threads: int = cfg(0, "torch intra-op CPU threads (0: torch's default). 1 is fastest for tiny models on a busy "
                          "machine.")
    deterministic: bool = cfg(True, "torch.use_deterministic_algorithms (warn-only) for reproducible runs.")
    stop_after: int = cfg(0, "Stop once this step is done (after saving a checkpoint), as if interrupted; 0: run "
                             "to run.steps. The schedule still follows run.steps, so a resumed run continues it; "
                             "at run.steps itself the run finishes as usual (final/).")
    dump_grads: str = cfg("", "Debug: write the step-1 (post all-reduce) gradients to this safetensors file.")
    stop_signals: list[str] = cfg(default_factory=lambda: ["SIGTERM", "SIGUSR1"],
                                  help="Signals that stop the run cleanly: the step in flight ends, a checkpoint is "
                                       "saved, and the command exits with 128 + the signal's number; the same "
                                       "command resumes. A second signal acts at once. SIGTERM: Slurm preemption "
                                       "or scancel, Kubernetes, torchrun's shutdown; SIGUSR1: sbatch --signal=USR1@"
                                       "300. []: none.")


class DistConfig(ConfigModel):
    backend: str = cfg("auto", "torch.distributed backend under torchrun: auto (nccl on GPU, gloo on CPU), gloo, nccl.",
                       choices=("auto", "gloo", "nccl"))
    strategy: str = cfg("ddp", "Data-parallel strategy: ddp (a full replica per rank, gradients all-reduced) or fsdp "
                               "(FSDP2 fully_shard: weights, gradients and optimizer state sharded over the ranks; "
                               "checkpoints sharded through torch.distributed.checkpoint).", choices=("ddp", "fsdp"))
    fsdp_param_dtype: str = cfg("auto", "fsdp: dtype the gathered weights compute in (MixedPrecisionPolicy "
                                        "param_dtype; the sharded master weights keep model.dtype). auto: bfloat16 "
                                        "on CUDA, off on CPU.", choices=("auto", "off", "float32", "bfloat16"))
    fsdp_reduce_dtype: str = cfg("auto", "fsdp: dtype gradients are reduce-scattered in (MixedPrecisionPolicy "
                                         "reduce_dtype). auto: float32 on CUDA, off (the compute dtype) on CPU.",
                                 choices=("auto", "off", "float32", "bfloat16"))
    timeout_s: float = cfg(3600.0, "How long a rank waits at a collective (and the ranks at the rendezvous) before "
                                   "the run fails. Under ddp rank 0 alone writes checkpoints and final/ while the "
                                   "others wait for it, which for a 7B model can outlast torch's default under nccl "
                                   "(10 minutes; its watchdog then stops the run).")
    fsdp_reshard_after_forward: bool = cfg(True, "fsdp: free each decoder layer's gathered weights after its forward "
                                                 "in the update and gather them again for the backward (ZeRO-3); "
                                                 "false keeps them until the optimizer step (ZeRO-2: more memory, "
                                                 "less traffic).")


class MRSPConfig(ConfigModel):
    enabled: bool = cfg(True, "MR-SP in GRPO (trainer.mrsp): every unique video of a step goes through the policy's "
                              "vision tower once (rollouts, old log-probs and the update reuse it) and the "
                              "reference's once; the log-probs are computed from the cached features and M-RoPE "
                              "positions. Numerically the same step as the plain path (tests/test_grpo_mrsp.py); "
                              "false: the plain path (the update re-encodes the video in every micro-batch).")
    vision: str = cfg("auto", "What the update does with the vision tower. auto: frozen when model.freeze_vision, "
                              "else deferred. frozen: the cached features are used as they are (needs "
                              "model.freeze_vision). deferred: the step's one encode keeps its autograd graph and "
                              "the gradient accumulated on the features over the micro-batches is pushed through "
                              "it once before the optimizer step (one tower pass per video; holds the tower's "
                              "activations from rollout to update). recompute: the update re-encodes each video "
                              "once with grad (two passes per video; activations held only during the update).",
                      choices=("auto", "frozen", "deferred", "recompute"))
    sp_size: int = cfg(1, "Ranks per sequence-parallel group under torchrun (1: off). The ranks of a group take the "
                          "same prompts (data-parallel size = world / sp_size), encode disjoint frame ranges of each "
                          "video, split each prompt's rollouts and each log-prob pass (rows, or the sequence above "
                          "sp_min_tokens). Under dist.strategy=ddp and fsdp alike (fsdp shards the weights over the "
                          "whole world; the sequence-parallel prefill runs each decoder layer as an FSDP forward).")
    sp_min_tokens: int = cfg(3072, "Sequences of at least this many tokens (prompt + response) are prefilled "
                                   "sequence-parallel across the SP group; shorter ones split the G rows over it. "
                                   "The default is the CPU crossover measured by benchmarks/mrsp.py.")

    frozen_cache_mb: float = cfg(0.0, "Video features of frozen towers kept across steps (MB; 0: off): the "
                                      "reference's (its tower never trains) and, with mrsp.vision=frozen, the "
                                      "policy's. A video that recurs in a later step (several questions per video) "
                                      "reuses its features bitwise instead of another tower pass. Entries are keyed "
                                      "by a digest of the pixels (a pass over the pixel bytes per video per step), "
                                      "least recently used evicted first (trainer.mrsp.frozen_cache). Pays only "
                                      "when videos recur within the cache's reach.")
    ref_prefix_cache_mb: float = cfg(0.0, "Reference-model K/V of each prompt's video prefix (the template text and "
                                          "the video, before the question) kept across steps (MB; 0: off; one "
                                          "process, not under mrsp.sp_size > 1). The reference then runs only the "
                                          "question, the generation prompt and the responses for a video seen "
                                          "before, under any question (trainer.mrsp.ref_prefix); log-probs equal "
                                          "the one-pass prompt's within fp32 rounding. Per prefix token: layers x 2 "
                                          "x KV heads x head dim values (a 7B Qwen2-VL: 56 KiB in bf16).")
    frozen_feature_dir: str = cfg("", "A local (or mounted) directory keeping the frozen towers' video features on "
                                      "disk across runs, restarts and epochs ('': off): the reference's and, with "
                                      "mrsp.vision=frozen, the policy's. Read when the memory store "
                                      "(mrsp.frozen_cache_mb) misses, written after each encode, as safetensors "
                                      "under a digest of the tower's weights, device, dtypes, attention kernels and "
                                      "torch/transformers versions, so a run that would compute other bits never "
                                      "reads them (trainer.mrsp.feature_dir). Not under mrsp.sp_size > 1.")
    frozen_cache_offload: bool = cfg(True, "Keep the mrsp.frozen_cache_mb and mrsp.ref_prefix_cache_mb stores in host "
                                           "memory (entries are copied back to the device on a hit); false: on the "
                                           "model's device.")

    def resolved_vision(self, freeze_vision: bool) -> str:
        """The vision mode the update runs: ``model.freeze_vision`` implies ``frozen``."""
        if self.vision == "auto":
            return "frozen" if freeze_vision else "deferred"
        return self.vision


class EvalConfig(ConfigModel):
    max_new_tokens: int = cfg(256, "Longest greedy answer when evaluating.")
    max_items: int = cfg(0, "Evaluate only the first N held-out items (0: all).")
    every: int = cfg(0, "During training, evaluate on data.eval_urls every N steps (0: never): each rank decodes "
                        "every world-th item and rank 0 logs eval_accuracy (overall and per category), "
                        "eval_format_rate, eval_n and eval_skipped, as one process evaluating all the items would.")
    batch_size: int = cfg(8, "Held-out items decoded together (each answer is the item's own greedy answer); "
                             "lower it when that many prompts' K/V do not fit in memory.")


class TrainConfig(ConfigModel):
    model: ModelConfig = cfg(default_factory=ModelConfig, help="Policy model.")
    data: DataConfig = cfg(default_factory=DataConfig, help="Training / held-out data.")
    optim: OptimConfig = cfg(default_factory=OptimConfig, help="Optimizer and schedule.")
    rollout: RolloutConfig = cfg(default_factory=RolloutConfig, help="Rollout sampling (GRPO).")
    grpo: GRPOConfig = cfg(default_factory=GRPOConfig, help="GRPO loss.")
    sft: SFTConfig = cfg(default_factory=SFTConfig, help="CoT-SFT stage.")
    run: RunConfig = cfg(default_factory=RunConfig, help="Run control: steps, checkpoints, logging.")
    dist: DistConfig = cfg(default_factory=DistConfig, help="Distributed training.")
    eval: EvalConfig = cfg(default_factory=EvalConfig, help="Evaluation.")
    mrsp: MRSPConfig = cfg(default_factory=MRSPConfig, help="MR-SP: video embedding reuse and sequence parallelism "
                                                            "in GRPO.")

    def check(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.data.batch_size >= 1, "data.batch_size must be >= 1")
        need(self.run.out_dir.strip() != "", "run.out_dir must name a directory ('' wrote the run into the current "
                                            "one)")
        need(self.dist.timeout_s > 0, "dist.timeout_s must be > 0")
        need(self.data.shuffle_buffer >= 1, "data.shuffle_buffer must be >= 1")
        need(self.data.fetch_retries >= 0, "data.fetch_retries must be >= 0")
        need(not self.data.stream or self.data.source == "shards", "data.stream needs data.source=shards")
        need(not self.data.stream or self.run.steps > 0,
             "data.stream needs run.steps > 0 (the number of items is not known before the shards are read)")
        need(self.optim.grad_accum >= 1, "optim.grad_accum must be >= 1")
        need(self.optim.lr >= 0, "optim.lr must be >= 0")
        need(self.optim.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        need(0.0 <= self.optim.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]")
        need(self.rollout.n >= 1, "rollout.n must be >= 1")
        need(self.rollout.temperature > 0, "rollout.temperature must be > 0 (use eval for greedy decoding)")
        need(0 < self.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]")
        need(self.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        need(self.eval.batch_size >= 1, "eval.batch_size must be >= 1")
        need(self.rollout.prompts_per_decode >= 0, "rollout.prompts_per_decode must be >= 0 (0: all prompts)")
        need(0.0 <= self.grpo.clip_low < 1.0, "grpo.clip_low must be in [0, 1)")
        need(self.grpo.clip_high >= 0.0, "grpo.clip_high must be >= 0")
        need(self.grpo.beta >= 0.0, "grpo.beta must be >= 0")
        need(self.grpo.ppo_epochs >= 1, "grpo.ppo_epochs must be >= 1")
        need(self.grpo.behaviour_cap > 0, "grpo.behaviour_cap must be > 0")
        need(0.0 <= self.grpo.reward_format_weight <= 1.0, "grpo.reward_format_weight must be in [0, 1]")
        need(self.grpo.max_draws >= 1, "grpo.max_draws must be >= 1")
        need(self.run.steps >= 0, "run.steps must be >= 0")
        need(self.run.save_every >= 0, "run.save_every must be >= 0")
        need(self.run.keep_checkpoints >= 1, "run.keep_checkpoints must be >= 1")
        need(self.run.threads >= 0, "run.threads must be >= 0")
        need(self.run.log_every >= 1, "run.log_every must be >= 1")
        for name in self.run.stop_signals:
            try:
                parse_signal(name)
            except ValueError as e:
                raise ConfigError(f"run.stop_signals: {e}") from None
        need(self.run.device in ("auto", "cpu", "cuda"), "run.device must be auto, cpu or cuda")
        need(self.sft.max_items >= 0 and self.sft.epochs >= 1, "sft.max_items >= 0 and sft.epochs >= 1")
        need(self.mrsp.sp_size >= 1, "mrsp.sp_size must be >= 1")
        need(self.mrsp.sp_min_tokens >= 1, "mrsp.sp_min_tokens must be >= 1")
        need(self.mrsp.frozen_cache_mb >= 0, "mrsp.frozen_cache_mb must be >= 0")
        need(self.mrsp.ref_prefix_cache_mb >= 0, "mrsp.ref_prefix_cache_mb must be >= 0")
        need(self.mrsp.enabled or self.mrsp.sp_size == 1, "mrsp.sp_size > 1 needs mrsp.enabled=true")
        need(not self.mrsp.frozen_feature_dir or self.mrsp.enabled, "mrsp.frozen_feature_dir needs mrsp.enabled=true")
        # the sharded encoder is a collective: every rank of a group must miss together, which files other ranks
        # are writing cannot promise
        need(not self.mrsp.frozen_feature_dir or self.mrsp.sp_size == 1,
             "mrsp.frozen_feature_dir is not supported with mrsp.sp_size > 1")
        need(not (self.mrsp.vision == "frozen" and not self.model.freeze_vision),
             "mrsp.vision=frozen trains no vision tower: set model.freeze_vision=true too (or use deferred)")
        need(not (self.mrsp.vision in ("deferred", "recompute") and self.model.freeze_vision),
             f"mrsp.vision={self.mrsp.vision} trains the vision tower but model.freeze_vision=true: use auto or frozen")


def absolute_path(path: str) -> str:
    """A local path made absolute against the working directory; a URL, a ``pipe:`` command and '' unchanged."""
    if not path or local_path(path) != path:
        return path
    return os.path.abspath(path)


def with_absolute_paths(config: TrainConfig) -> TrainConfig:
    """``config`` with its local paths absolute, as the command meant them from its working directory.

    Why: a run records its config (``RUN/config.yaml``, and each checkpoint's state). With the paths as typed, a
    relaunch from that file in another directory (``cd RUN && longreel train sft --config config.yaml --set
    run.steps=N``, meant to extend the run) read them from there: a relative ``run.out_dir`` started a new run
    inside the old one, from step 1, exit 0."""
    out = config.model_copy(deep=True)
    out.model.path = absolute_path(out.model.path)
    out.run.out_dir = absolute_path(out.run.out_dir)
    out.data.train_urls = [absolute_path(u) for u in out.data.train_urls]
    out.data.eval_urls = [absolute_path(u) for u in out.data.eval_urls]
    out.data.cache_dir = absolute_path(out.data.cache_dir)
    out.mrsp.frozen_feature_dir = absolute_path(out.mrsp.frozen_feature_dir)
    return out
