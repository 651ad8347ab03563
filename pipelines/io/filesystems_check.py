"""Whether this environment can read and write a remote path's scheme, asked before a run starts.

Beam registers a filesystem per scheme only when its client library imports (``gs://``: the ``gcp`` extra), and for
``s3://`` it registers one whose every call fails without boto3 ("Must provide one of client or options"); either
way the run used to stop in a traceback reported as an internal error. http(s) inputs are longreel's own reads."""
from __future__ import annotations

import importlib.util

from longreel.pipelines.io.input_kinds import is_remote

#: scheme -> (the extra that brings its client, the module the client needs; None: Beam's own registration tells)
SCHEME_CLIENTS = {"gs": ("gcp", None), "s3": ("aws", "boto3"), "azfs": ("azure", "azure.storage.blob"),
                  "hdfs": ("hadoopfilesystem", "hdfs")}
#: the extras longreel itself offers (setup.cfg); others are Beam's
LONGREEL_EXTRAS = ("gcp", "aws")


def missing_filesystem(paths) -> str | None:
    """Why one of ``paths`` names a scheme this environment cannot use, or None."""
    for path in paths:
        if not path or not is_remote(path):
            continue
        scheme = path.split("://", 1)[0].lower()
        if scheme not in SCHEME_CLIENTS:
            continue
        extra, module = SCHEME_CLIENTS[scheme]
        if module is None:
            from apache_beam.io.filesystems import FileSystems

            try:
                FileSystems.get_filesystem(path)
                continue
            except ValueError:
                pass
        elif _importable(module):
            continue
        install = (f"pip install 'longreel[{extra}]'" if extra in LONGREEL_EXTRAS
                   else f"pip install 'apache-beam[{extra}]'")
        return f"{path}: {scheme}:// paths need Beam's {extra} extra, which is not installed here ({install})"
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False
