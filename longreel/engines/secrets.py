"""API keys of OpenAI-compatible servers, resolved where the client is built: on the worker.

A config names where the key lives, never the key (``caption.openai.api_key_env``, ``qra.api_key_env``); the
OpenAI-compatible engine resolves it in ``setup``:

* an environment variable name (``OPENAI_API_KEY``): read from the worker's environment. Local runs and workers
  started from the launcher's shell see it; Dataflow workers see none of the launcher's variables.
* a Google Secret Manager version, ``projects/P/secrets/S/versions/V`` (``latest`` or a number): read on the worker
  with the worker's service account through Beam's ``GcpSecret`` (needs ``google-cloud-secret-manager``, part of
  ``longreel[gcp]`` and of the worker images). This is the way for Dataflow.

No pipeline option carries the key itself: the command as typed, Beam options included, goes into stats.json, the
data card and the output directory's lock, and the Dataflow console shows every option. The key is never logged;
only where it came from is (the variable's or the secret version's name).
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger("longreel")

SECRET_VERSION = re.compile(r"projects/[^/\s]+/secrets/[^/\s]+/versions/[^/\s]+")


class SecretError(RuntimeError):
    """A named secret could not be read (the message names the secret, never a value)."""


def is_secret_version(ref: str | None) -> bool:
    return bool(ref) and SECRET_VERSION.fullmatch(ref) is not None


def read_secret_version(name: str) -> str:
    """The payload of Secret Manager version ``name``, as text without surrounding whitespace (a key saved with
    ``echo`` ends in a newline)."""
    try:
        from google.cloud import secretmanager  # noqa: F401 (checked here for a clear message; GcpSecret imports it)
    except ImportError:
        raise SecretError(f"{name} is a Secret Manager secret, but google-cloud-secret-manager is not installed on "
                          "this worker: pip install 'longreel[gcp]' (the worker images have it)") from None
    from apache_beam.utils.secret import GcpSecret

    try:
        return GcpSecret(name).get_secret_bytes().decode("utf-8").strip()
    except (RuntimeError, UnicodeDecodeError) as e:
        # GcpSecret's message names the version and the client's error; neither holds the payload
        raise SecretError(f"could not read the API key from {name}: {e}") from None


def resolve_api_key(ref: str | None, environ: dict | None = None) -> str | None:
    """The API key ``ref`` names (see the module docstring), or None when it names nothing that is set."""
    if not ref:
        return None
    if is_secret_version(ref):
        key = read_secret_version(ref)
        log.debug("API key from Secret Manager %s", ref)
        return key or None
    env = os.environ if environ is None else environ
    return env.get(ref) or None
