"""Build a tiny *random* Qwen2-VL-family checkpoint (model + processor) fully offline.

The result is an ordinary ``save_pretrained`` directory: production code loads it with
``AutoModelForImageTextToText.from_pretrained(dir)`` and ``AutoProcessor.from_pretrained(dir)``,
exactly as it loads real Qwen2-VL / Qwen2.5-VL weights. Nothing is downloaded.

What is in the directory
------------------------
* ``config.json`` / ``generation_config.json`` / ``model.safetensors``: a ``Qwen2VLConfig`` (or
  ``Qwen2_5_VLConfig``) with a 64-wide, 2-layer text model and a 32-wide, 2-block vision tower whose
  merger projects to the text width. Weights are the library's random init under ``seed``.
* ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE trained with ``tokenizers`` on a
  built-in English corpus (video-QA words), using exactly the Qwen2 normalizer/pre-tokenizer, wrapped
  as ``Qwen2Tokenizer`` (transformers 5's fast tokenizer class; ``Qwen2TokenizerFast`` is an alias).
  Special tokens follow Qwen's order after the BPE vocab: ``<|endoftext|> <|im_start|> <|im_end|>
  <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|>``, then the reasoning
  tags ``<think> </think> <answer> </answer>`` as ordinary (non-special) added tokens, so that
  ``decode(..., skip_special_tokens=True)`` keeps them for reward parsing.
* processor files (``processor_config.json``, ``chat_template.jinja``): a ``Qwen2VLProcessor`` (or
  ``Qwen2_5_VLProcessor``) with ``Qwen2VLImageProcessor`` and ``Qwen2VLVideoProcessor``; patch 14,
  temporal patch 2, merge 2, ``min_pixels``/``max_pixels`` small so a frame costs tens of tokens.
* ``longreel_tiny_build.json``: the build parameters, written last; its presence with equal
  parameters is what makes a rebuild a no-op.

The directory is built in a sibling temp dir and renamed into place, so a crash never leaves a
half-built checkpoint behind; concurrent builders of the same spec are safe (the loser discards its
copy). Same parameters give byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

__all__ = [
    "build_tiny_qwen2vl",
    "tiny_build_params",
    "is_complete_build",
    "training_corpus",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "REASONING_TOKENS",
    "FAMILIES",
    "MARKER_FILE",
    "PATCH_EMBEDS",
    "frame_difference_kernel",
    "install_build_dir",
]

#: bump when the on-disk layout or the meaning of a parameter changes; old builds are then rebuilt
BUILD_FORMAT_VERSION = 1
MARKER_FILE = "longreel_tiny_build.json"
FAMILIES = ("qwen2_vl", "qwen2_5_vl")
#: how the vision tower's 3-D patch embedding is initialised (``build_tiny_qwen2vl(patch_embed=...)``)
PATCH_EMBEDS = ("random", "frame_difference")

#: Qwen's special tokens, in Qwen's relative order (ids follow the BPE vocabulary).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: reasoning tags: added tokens (never split by BPE) but not "special" (kept by skip_special_tokens)
REASONING_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

_HEAD_DIM = 16  # text attention head dim; mrope_section must sum to _HEAD_DIM // 2
_MROPE_SECTION = [2, 3, 3]  # (temporal, height, width) rotary halves, Qwen's 1:1.5:1.5 ratio
_ROPE_THETA = 1000000.0  # Qwen2-VL's text rotary base
_BPE_VOCAB_SIZE = 1024
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "chat_template.jinja",
    MARKER_FILE,
)

# A Qwen2-VL-style chat template (written for this project). A {"type": "video"} item renders as
# <|vision_start|><|video_pad|><|vision_end|>; the processor expands <|video_pad|> to one token per
# merged visual patch. A default system prompt is added when the first message is not a system one.
CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for item in message['content'] %}
            {%- if item.get('type') == 'video' or 'video' in item %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif item.get('type') == 'image' or 'image' in item or 'image_url' in item %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


# --------------------------------------------------------------------------------------------------
# tokenizer corpus
# --------------------------------------------------------------------------------------------------

_FIXED_LINES = (
    "Watch the video carefully and answer the question.",
    "Think step by step before you answer.",
    "Put your reasoning inside <think> and </think> and the final answer inside <answer> and </answer>.",
    "<think> The man walks to the left, then he stops near the red door. </think> <answer> B </answer>",
    "<think> First the ball is on the table. Later it falls. So the answer is C. </think> <answer> C </answer>",
    "Question: What happens after the woman opens the door? Options: A. She leaves. B. She sits down. "
    "C. She waves. D. She closes the window.",
    "Answer with the option's letter from the given choices directly.",
    "The answer is A. The answer is B. The answer is C. The answer is D.",
    "Options: (A) red (B) green (C) blue (D) yellow",
    "How many people are in the room? How many cars pass the camera?",
    "Why does the dog run away? Because a loud car drives past.",
    "Where is the cup at the end of the video? It is on the shelf to the right of the lamp.",
    "When does the light turn green? At the beginning, in the middle, or at the end?",
    "Who enters the scene first, the child or the old man?",
    "Describe the video in detail, including colours, objects, actions and their order.",
    "The camera pans from left to right and zooms in on the bikes.",
    "In the first clip a cyclist rides along the road; in the second clip he turns right.",
    "Count the objects: one, two, three, four, five, six, seven, eight, nine, ten.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 15 20 25 30 45 60 90 100 1000.",
    "Time stamps: 00:00, 00:05, 00:10, 01:30, 10:00 seconds minutes hours frames fps.",
    "Punctuation: , . ; : ! ? ' \" ( ) [ ] { } - _ / \\ + = * & % $ # @ ~ < > |",
    "Yes. No. True. False. Correct. Incorrect. Maybe. Unknown.",
    "Before, after, during, while, then, first, second, third, finally, later, earlier, meanwhile.",
    "above below behind in front of next to between inside outside near far top bottom middle",
    "The video shows a person cooking in a kitchen, cutting vegetables and boiling water.",
    "A player kicks the ball into the goal and the crowd cheers loudly.",
    "The reasoning is correct, so the final answer is the second option.",
)

_COLOURS = ("red", "green", "blue", "yellow", "black", "white", "orange", "purple", "brown", "grey",
            "pink", "gray", "silver", "gold")
_OBJECTS = ("car", "bike", "ball", "dog", "cat", "person", "man", "woman", "child", "door", "table",
            "cup", "bottle", "box", "tree", "house", "bus", "phone", "book", "chair", "bird", "boat")
_ACTIONS = ("moves", "turns", "runs", "walks", "jumps", "stops", "falls", "rolls", "appears", "leaves")
_DIRECTIONS = ("left", "right", "up", "down", "forward", "backward", "away", "closer")
_LETTERS = ("A", "B", "C", "D")


def training_corpus(extra_lines: Iterable[str] | None = None) -> list[str]:
    """The built-in English training text for the tiny BPE (a few hundred lines, deterministic)."""
    lines = list(_FIXED_LINES)
    n = 0
    for ci, colour in enumerate(_COLOURS):
        for oi, obj in enumerate(_OBJECTS):
            if (ci + oi) % 2:
                continue
            action = _ACTIONS[(ci + 2 * oi) % len(_ACTIONS)]
            direction = _DIRECTIONS[(3 * ci + oi) % len(_DIRECTIONS)]
            letter = _LETTERS[n % 4]
            seconds = (7 * n) % 120
            lines.append(f"The {colour} {obj} {action} {direction} at {seconds} seconds.")
            lines.append(
                f"Question: Which way does the {colour} {obj} go? "
                f"<think> It {action} {direction}. </think> <answer> {letter} </answer>"
            )
            n += 1
    for letter, colour in zip(_LETTERS * 3, _COLOURS):
        lines.append(f"{letter}. The {colour} one. Answer: {letter}")
    if extra_lines:
        lines.extend(str(x) for x in extra_lines)
    return lines


# --------------------------------------------------------------------------------------------------
# build parameters / marker
# --------------------------------------------------------------------------------------------------


def tiny_build_params(
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 2,
    vocab_extra_lines: Sequence[str] | None = None,
    family: str = "qwen2_vl",
    min_pixels: int = 4 * 28 * 28,
    max_pixels: int = 64 * 28 * 28,
    temporal_patch_size: int = 2,
    rope_theta: float = _ROPE_THETA,
    patch_embed: str = "random",
    spatial_merge_size: int = 2,
    tie_word_embeddings: bool = False,
) -> dict:
    """The canonical, JSON-serialisable parameter set that identifies a build (stored in the marker)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if hidden_size <= 0 or hidden_size % _HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {_HEAD_DIM}, got {hidden_size}")
    if num_layers < 1 or vision_depth < 1:
        raise ValueError("num_layers and vision_depth must be >= 1")
    if not (0 < min_pixels <= max_pixels):
        raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
    if temporal_patch_size < 1:
        raise ValueError(f"temporal_patch_size must be >= 1, got {temporal_patch_size}")
    if not rope_theta > 1.0:
        raise ValueError(f"rope_theta must be > 1, got {rope_theta}")
    if patch_embed not in PATCH_EMBEDS:
        raise ValueError(f"patch_embed must be one of {PATCH_EMBEDS}, got {patch_embed!r}")
    if patch_embed == "frame_difference" and temporal_patch_size < 2:
        raise ValueError("patch_embed='frame_difference' needs temporal_patch_size >= 2 (frames to subtract)")
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    params = {
        "format_version": BUILD_FORMAT_VERSION,
        "family": family,
        "seed": int(seed),
        "hidden_size": int(hidden_size),
        "num_layers": int(num_layers),
        "vision_depth": int(vision_depth),
        "vocab_extra_lines": [str(x) for x in vocab_extra_lines] if vocab_extra_lines else [],
        "min_pixels": int(min_pixels),
        "max_pixels": int(max_pixels),
    }
    # recorded only when it differs from Qwen's 2, so that every earlier build keeps its marker (and its bytes)
    if temporal_patch_size != 2:
        params["temporal_patch_size"] = int(temporal_patch_size)
    # likewise recorded only when it differs from Qwen's 1e6. With head dim 16 the text rotary has 8 frequencies
    # and mrope gives height/width the slowest ones: at base 1e6 they turn by <= 0.1 rad (height) and ~5e-4 rad
    # (width) across a tiny video's token grid, so a smaller base lets the LM tell vision tokens apart by place
    if float(rope_theta) != _ROPE_THETA:
        params["rope_theta"] = float(rope_theta)
    # likewise recorded only when not the library's random init
    if patch_embed != "random":
        params["patch_embed"] = patch_embed
    # likewise recorded only when not Qwen's 2x2
    if spatial_merge_size != 2:
        params["spatial_merge_size"] = int(spatial_merge_size)
    # likewise recorded only when tied (Qwen2-VL-2B's and Qwen2.5-VL-3B's geometry: the LM head is the embeddings)
    if tie_word_embeddings:
        params["tie_word_embeddings"] = True
    return params


def _read_marker(path: Path) -> dict | None:
    try:
        with open(path / MARKER_FILE, encoding="utf-8") as fh:
            return json.load(fh).get("params")
    except (OSError, ValueError, AttributeError):
        return None


def is_complete_build(out_dir: str | os.PathLike, params: dict | None = None) -> bool:
    """True when ``out_dir`` holds every file of a finished build (with ``params``, when given)."""
    path = Path(out_dir)
    if not all((path / name).is_file() for name in _REQUIRED_FILES):
        return False
    found = _read_marker(path)
    return found is not None and (params is None or found == params)


# --------------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------------


def _build_tokenizer(lines: list[str]):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    # Train with exactly the normalizer / pre-tokenizer / decoder that Qwen2Tokenizer rebuilds at load
    # time (transformers 5 re-creates the pipeline from vocab+merges and ignores the ones in
    # tokenizer.json), so the saved and the reloaded tokenizer always agree.
    template = Qwen2Tokenizer().backend_tokenizer
    bpe = Tokenizer(
        models.BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    bpe.normalizer = template.normalizer
    bpe.pre_tokenizer = template.pre_tokenizer
    bpe.decoder = template.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknowns
    )
    bpe.train_from_iterator(lines, trainer=trainer, length=len(lines))
    model_json = json.loads(bpe.to_str())["model"]
    vocab = model_json["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]

    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",  # switched to <|im_end|> below, after the ids are laid out
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    tok.add_special_tokens({"extra_special_tokens": list(SPECIAL_TOKENS[1:])})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS) + list(REASONING_TOKENS))
    expected = list(range(len(vocab), len(vocab) + len(ids)))
    if ids != expected:  # pragma: no cover - guards a transformers behaviour change
        raise RuntimeError(f"unexpected special-token layout {ids}, expected {expected}")
    return tok


def _pad_vocab(n: int, multiple: int = 64) -> int:
    # like real Qwen checkpoints, the embedding table is a little larger than the tokenizer
    return ((n + multiple - 1) // multiple) * multiple


def _build_config(params: dict, tok):
    family = params["family"]
    hidden = params["hidden_size"]
    heads = hidden // _HEAD_DIM
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = {
        "vocab_size": _pad_vocab(len(tok)),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": params["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "max_window_layers": params["num_layers"],
        "rope_parameters": {"rope_type": "default", "rope_theta": params.get("rope_theta", _ROPE_THETA),
                            "mrope_section": list(_MROPE_SECTION)},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "dtype": "float32",
    }
    common = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": bool(params.get("tie_word_embeddings", False)),
        "dtype": "float32",
    }
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision_config = {
            "depth": params["vision_depth"],
            "embed_dim": 32,
            "hidden_size": hidden,  # merger output width == text width
            "num_heads": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": params.get("spatial_merge_size", 2),
            "temporal_patch_size": params.get("temporal_patch_size", 2),
        }
        return Qwen2VLConfig(text_config=text_config, vision_config=vision_config, **common)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision_config = {
            "depth": params["vision_depth"],
            "hidden_size": 32,  # the ViT width in Qwen2.5-VL's vision config
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": hidden,  # merger output width == text width
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": params.get("spatial_merge_size", 2),
            "temporal_patch_size": params.get("temporal_patch_size", 2),
            "window_size": 112,  # 4x4 merged tokens per attention window
            "fullatt_block_indexes": [params["vision_depth"] - 1],
            "tokens_per_second": 2,
        }
        return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **common)
    raise ValueError(f"unknown family {family!r}")  # pragma: no cover - validated earlier


def _build_processor(params: dict, tok):
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    size = {"shortest_edge": params["min_pixels"], "longest_edge": params["max_pixels"]}
    common = {"patch_size": 14, "temporal_patch_size": params.get("temporal_patch_size", 2),
              "merge_size": params.get("spatial_merge_size", 2),
              "size": size}
    image_processor = Qwen2VLImageProcessor(**common)
    # cap_pixels_per_frame is set explicitly: left unset, transformers 5.23 warns on every call
    video_processor = Qwen2VLVideoProcessor(**common, do_sample_frames=False, cap_pixels_per_frame=True)
    if params["family"] == "qwen2_vl":
        from transformers import Qwen2VLProcessor as processor_cls
    else:
        from transformers import Qwen2_5_VLProcessor as processor_cls
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def frame_difference_kernel(weight, generator=None):
    """A temporal patch embedding over frame differences, from a random 3-D patch kernel of the same shape.

    ``weight``: ``[E, C, T, P, P]`` (the vision tower's Conv3d over ``T`` frames of a ``P x P`` patch). Output channel
    ``e`` gets temporal pattern ``k = e % T``: ``k == 0`` the same spatial filter on every frame (the patch's content,
    as one frame shows it), ``k >= 1`` that filter on frame ``k`` minus frame ``k - 1`` (what changed between them).
    The spatial filters are ``weight[:, :, 0]`` (already random under the build seed), so a change in any pixel of
    the patch reaches a difference channel, and static content is zero there. Returns a new tensor; pure.
    """
    import torch

    e, _, t, _, _ = weight.shape
    spatial = weight[:, :, 0]
    out = torch.zeros_like(weight)
    for ch in range(e):
        k = ch % t
        if k == 0:
            # sum over frames scaled by 1/sqrt(T): a static patch gives a response of the default init's spread
            out[ch] = spatial[ch].unsqueeze(1).expand_as(out[ch]) / t ** 0.5
        else:
            out[ch, :, k] = spatial[ch]
            out[ch, :, k - 1] = -spatial[ch]
    return out


def _vision_patch_conv(model):
    convs = [m for name, m in model.named_modules() if name.endswith("patch_embed.proj")]
    if len(convs) != 1:  # pragma: no cover - guards a transformers module-layout change
        raise RuntimeError(f"expected one vision patch_embed.proj, found {len(convs)}")
    return convs[0]


def _build_model(config, seed: int, patch_embed: str = "random"):
    import torch
    from transformers import GenerationConfig

    if config.model_type == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration as model_cls
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration as model_cls
    # fork_rng keeps the caller's global RNG state untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(torch.float32).eval()
    if patch_embed == "frame_difference":
        conv = _vision_patch_conv(model)
        with torch.no_grad():
            conv.weight.copy_(frame_difference_kernel(conv.weight))
    text = config.get_text_config()
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[text.eos_token_id, text.bos_token_id],  # <|im_end|>, <|endoftext|>
        pad_token_id=text.pad_token_id,
        do_sample=False,
    )
    return model


def _write_build(tmp: Path, params: dict) -> None:
    tok = _build_tokenizer(training_corpus(params["vocab_extra_lines"]))
    config = _build_config(params, tok)
    processor = _build_processor(params, tok)
    model = _build_model(config, params["seed"], params.get("patch_embed", "random"))
    model.save_pretrained(str(tmp))
    processor.save_pretrained(str(tmp))
    marker = {"params": params, "transformers_version": _transformers_version()}
    with open(tmp / MARKER_FILE, "w", encoding="utf-8") as fh:  # written last: marks completeness
        json.dump(marker, fh, indent=2, sort_keys=True)
        fh.write("\n")
    missing = [n for n in _REQUIRED_FILES if not (tmp / n).is_file()]
    if missing:  # pragma: no cover - guards a transformers serialisation change
        raise RuntimeError(f"tiny build is missing {missing}; files: {sorted(os.listdir(tmp))}")
    # mkdtemp makes the dir 0700 and transformers writes the weights 0600: make the build readable
    # by others, like any checkpoint directory (it is often a shared cache)
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
        os.chmod(tmp / name, 0o644)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def build_tiny_qwen2vl(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 2,
    vocab_extra_lines: Sequence[str] | None = None,
    family: str = "qwen2_vl",
    min_pixels: int = 4 * 28 * 28,
    max_pixels: int = 64 * 28 * 28,
    temporal_patch_size: int = 2,
    rope_theta: float = _ROPE_THETA,
    patch_embed: str = "random",
    spatial_merge_size: int = 2,
    tie_word_embeddings: bool = False,
) -> str:
    """Build (or reuse) a tiny random Qwen2-VL-family checkpoint in ``out_dir``; return the dir path.

    Args:
        out_dir: target directory. If it already holds a complete build with the same parameters it
            is reused untouched. If it holds a build of ours with other parameters, it is replaced.
            An existing non-empty directory that is not one of our builds raises ``FileExistsError``.
        seed: torch seed for the random weights (the tokenizer does not depend on it).
        hidden_size: text width (multiple of 16; heads = hidden_size // 16, head_dim 16).
        num_layers: text decoder layers.
        vision_depth: vision transformer blocks.
        vocab_extra_lines: extra lines appended to the BPE training corpus.
        family: ``"qwen2_vl"`` (Qwen2VLConfig) or ``"qwen2_5_vl"`` (Qwen2_5_VLConfig).
        min_pixels / max_pixels: per-frame pixel bounds of the image and video processors.
        temporal_patch_size: frames per vision patch (Qwen's 2; the vision tower's 3-D patch embedding sees
            that many consecutive frames at once, and its attention runs within each such group of frames).
        rope_theta: base of the language model's (multimodal) rotary position embedding (Qwen2-VL's 1e6).
        patch_embed: ``"random"`` (the library's init) or ``"frame_difference"``: the vision tower's 3-D patch
            embedding is set to :func:`frame_difference_kernel` of its random init, so that most of its channels see
            the difference of consecutive frames within a temporal patch and one in ``temporal_patch_size`` sees the
            frames' content (the Conv3d is unchanged, only its weights: the checkpoint loads anywhere). Why: with the
            random kernel the answer to a question about time explains a few percent of the tower's output variance
            at most (``benchmarks/results/learn_time_trials.json``, D18); differencing makes what changed a
            large-variance direction while static content still reaches the tower. Most useful with
            ``temporal_patch_size`` equal to the clip length, so every pair of consecutive frames is differenced.
        spatial_merge_size: patches per side of one merged vision token (Qwen's 2). The merger concatenates the
            ``n x n`` patches' features in raster order before its MLP, so a merged token knows where in its block
            each patch lies; with ``8`` at 112 px frames one token holds a whole frame (or temporal patch), which
            leaves the language model no token to pick within a frame. The processor resizes frames to multiples of
            ``14 * n`` pixels.
        tie_word_embeddings: the LM head shares the token embeddings' weight (as in Qwen2-VL-2B).

    Same parameters give byte-identical files (weights, tokenizer, configs).
    """
    params = tiny_build_params(
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        vision_depth=vision_depth,
        vocab_extra_lines=vocab_extra_lines,
        family=family,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        temporal_patch_size=temporal_patch_size,
        rope_theta=rope_theta,
        patch_embed=patch_embed,
        spatial_merge_size=spatial_merge_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    target = Path(out_dir).absolute()
    if is_complete_build(target, params):
        return str(target)
    replace_old = False
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"{target} exists and is not a directory")
        if any(target.iterdir()):
            if _read_marker(target) is None:
                raise FileExistsError(f"{target} is not empty and is not a longreel tiny-model build")
            replace_old = True  # ours, but other parameters or incomplete
    target.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_build(tmp, params)
        install_build_dir(tmp, target, lambda d: is_complete_build(d, params), replace_old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def install_build_dir(tmp: Path, target: Path, same_build: Callable[[Path], bool], replace_old: bool) -> None:
    """Move the finished build directory ``tmp`` to ``target`` (atomic rename; an old build moved aside first).
    When a concurrent builder renamed its own copy into place first, theirs is kept if ``same_build(target)``."""
    if replace_old or (target.is_dir() and not any(target.iterdir())):
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        try:
            os.replace(target, trash / "old")
        except FileNotFoundError:
            pass  # someone else moved it already
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        # a concurrent builder won the race: keep theirs if it is the same spec
        if same_build(target):
            return
        raise


def main(argv: list[str] | None = None) -> int:
    """``python -m longreel.testing.tiny_model OUT_DIR [--family qwen2_vl|qwen2_5_vl] [--seed N]``: build offline."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m longreel.testing.tiny_model",
                                 description="Build a tiny random Qwen2-VL-family model + processor offline "
                                             "(for demos and tests; nothing is downloaded).")
    ap.add_argument("out_dir")
    ap.add_argument("--family", default="qwen2_vl", choices=sorted(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(build_tiny_qwen2vl(a.out_dir, seed=a.seed, family=a.family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
