"""What an input spec names, told from its text and one local stat: no Beam, so that the CLI can ask before it
imports Beam (see :func:`longreel.pipelines.cli_curate._default_workers`)."""
from __future__ import annotations

import os

VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpeg", ".mpg", ".ts", ".ogg", ".ogv",
                    ".flv", ".wmv", ".3gp")
MANIFEST_EXTENSIONS = (".txt", ".lst", ".jsonl", ".json", ".parquet")
GLOB_CHARS = "*?["


def is_glob(spec: str) -> bool:
    return any(c in spec for c in GLOB_CHARS)


def is_remote(uri: str) -> bool:
    return "://" in uri


def is_http(uri: str) -> bool:
    """A URL read with urllib (Beam has no http filesystem): a video is fetched, a manifest read, neither matched."""
    return uri.lower().startswith(("http://", "https://"))


def is_manifest_name(spec: str) -> bool:
    return spec.lower().endswith(MANIFEST_EXTENSIONS)


def names_one_local_file(spec: str) -> bool:
    """A spec that is one existing local file other than a manifest: one video (or one reject)."""
    return not is_glob(spec) and not is_remote(spec) and not is_manifest_name(spec) and os.path.isfile(spec)
