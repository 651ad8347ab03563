"""Stage 1: CoT-SFT (``longreel train sft``): teacher forcing on ``<think>..</think><answer>..</answer>`` targets.

The loss is the mean negative log-likelihood of the *response* tokens only (the target followed by the EOS token):
prompt and video tokens are context, never labels. Per step, each rank takes its share of the global batch; every
item's loss is divided by the global response-token count, so gradients summed over items, micro-batches and ranks
equal the single-process full-batch gradient. Items whose prompt fails the video-placeholder check, or that have no
target, are skipped with a warning and counted (``rejected_items``).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

from longreel.trainer.config import TrainConfig
from longreel.trainer.policy import VideoTokenMismatch, encode_prompt, sequence_logprobs, sft_inputs, video_token_id
from longreel.trainer.runtime import TrainSession, all_reduce_sum, load_items

__all__ = ["run_sft", "SFTTrainer"]

log = logging.getLogger("longreel.trainer")


class SFTTrainer:
    def __init__(self, cfg: TrainConfig, items: list[dict] | None = None):
        self.cfg = cfg
        if items is None and cfg.data.stream:  # read as the run goes: run.steps sets the length (config check)
            total = cfg.run.steps
        else:
            items = items if items is not None else load_items(cfg.data, "train")
            if cfg.sft.max_items:
                items = items[: cfg.sft.max_items]
            total = cfg.run.steps or cfg.sft.epochs * math.ceil(len(items) / cfg.data.batch_size)
        self.sess = TrainSession(cfg, "sft", items=items, total_steps=total)
        self.video_token_id = video_token_id(self.sess.model)
        self.rejected = 0

    def step(self) -> dict[str, Any]:
        s, cfg = self.sess, self.cfg
        t0 = time.perf_counter()
        tok = s.processor.tokenizer
        work = []
        for _, _, item in s.local_batch():
            if not item.get("target"):
                self.rejected += 1
                log.warning("skipping item %s: no SFT target", item.get("key"))
                continue
            try:
                prompt = encode_prompt(s.processor, item, video_token_id=self.video_token_id).to(s.device)
            except (VideoTokenMismatch, ValueError, KeyError) as e:
                self.rejected += 1
                log.warning("skipping item %s: %s", item.get("key"), e)
                continue
            ids, mask = sft_inputs(s.processor, prompt, item["target"], tok.eos_token_id)
            work.append((prompt, ids.to(s.device), mask.to(s.device)))
        denominator = all_reduce_sum(sum(float(m.sum()) for _, _, m in work), s.info)
        s.model.train()
        loss_sum = 0.0
        # FSDP: as many passes on every rank (a rank that skipped an item repeats its last one at weight 0)
        padded = work + work[-1:] * (s.lockstep_passes(len(work)) - len(work))
        for k, (prompt, ids, mask) in enumerate(padded):
            logp = sequence_logprobs(s.model, prompt, ids, mask)
            loss = -(logp * mask).sum() / max(denominator, 1.0)
            if k >= len(work):
                (loss * 0.0).backward()
                continue
            (loss * s.loss_scale).backward()
            loss_sum += float(loss.detach())
        s.reduce_gradients()
        if cfg.run.dump_grads and s.step == 0:
            s.dump_grads(cfg.run.dump_grads)
        grad_norm = s.clip_and_step()
        s.step += 1
        dt = time.perf_counter() - t0
        return {"loss": all_reduce_sum(loss_sum, s.info), "grad_norm": grad_norm, "lr": s.step_lr,
                "tokens": denominator, "tokens_per_s": denominator / max(dt, 1e-9), "time_step": dt,
                "rejected_items": int(all_reduce_sum(self.rejected, s.info))}

    def train(self) -> dict[str, Any]:
        try:
            return self.sess.run_steps(self.step)
        finally:
            self.sess.close()


def run_sft(cfg: TrainConfig, items: list[dict] | None = None) -> dict[str, Any]:
    """CoT-SFT for ``run.steps`` steps (or ``sft.epochs`` epochs when ``run.steps`` is 0); resumes when possible."""
    return SFTTrainer(cfg, items=items).train()
