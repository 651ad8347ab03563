"""API keys for OpenAI-compatible servers (:mod:`longreel.engines.secrets`): from the worker's environment
or from Google Secret Manager, resolved where the client is built, and never logged.

The Secret Manager round trip through Beam's ``GcpSecret`` needs google-cloud-secret-manager (``tox -e dataflow``,
marker ``dataflow``); its client is replaced by a fake that answers like the service, so nothing leaves the machine.
"""
from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from longreel.engines import secrets

VERSION = "projects/my-project/secrets/vllm-key/versions/3"
KEY = "sk-test-0123456789abcdef"


def test_an_environment_variable_name_reads_the_environment():
    assert secrets.resolve_api_key("MY_KEY", {"MY_KEY": KEY}) == KEY
    assert secrets.resolve_api_key("MY_KEY", {}) is None
    assert secrets.resolve_api_key("MY_KEY", {"MY_KEY": ""}) is None
    assert secrets.resolve_api_key("", {"": KEY}) is None and secrets.resolve_api_key(None) is None


def test_only_a_full_version_name_is_a_secret():
    assert secrets.is_secret_version(VERSION)
    assert secrets.is_secret_version("projects/p/secrets/s/versions/latest")
    for not_one in ("OPENAI_API_KEY", "projects/p/secrets/s", "projects/p/secrets/s/versions/", f"{VERSION}/x",
                    f" {VERSION}"):
        assert not secrets.is_secret_version(not_one), not_one


def test_a_secret_version_is_read_from_secret_manager_not_the_environment(monkeypatch):
    asked = []
    monkeypatch.setattr(secrets, "read_secret_version", lambda name: asked.append(name) or KEY)
    assert secrets.resolve_api_key(VERSION, {VERSION: "from-env"}) == KEY
    assert asked == [VERSION]


def test_a_missing_client_library_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.cloud.secretmanager", None)  # import fails as if not installed
    with pytest.raises(secrets.SecretError, match="google-cloud-secret-manager is not installed") as e:
        secrets.resolve_api_key(VERSION)
    assert VERSION in str(e.value)


def test_the_openai_engine_takes_its_key_from_the_named_secret(monkeypatch):
    from longreel.engines.openai_engine import OpenAIEngine

    monkeypatch.setattr(secrets, "read_secret_version", lambda name: KEY if name == VERSION else None)
    engine = OpenAIEngine("http://127.0.0.1:9/v1", "m", api_key_env=VERSION)
    engine.setup()  # on the worker: where the key is read
    assert engine._client.api_key == KEY
    monkeypatch.delenv("LONGREEL_TEST_UNSET_KEY", raising=False)
    unset = OpenAIEngine("http://127.0.0.1:9/v1", "m", api_key_env="LONGREEL_TEST_UNSET_KEY")
    unset.setup()
    assert unset._client.api_key == "none"  # local servers take any key; the SDK needs one


class _FakeSecretManager:
    """Answers ``access_secret_version`` like the service: the payload of a known version, else an error."""

    def __init__(self, *args, **kwargs):
        pass

    def access_secret_version(self, request):
        if request["name"] != VERSION:
            raise PermissionError(f"403 Permission 'secretmanager.versions.access' denied on {request['name']}")
        return SimpleNamespace(payload=SimpleNamespace(data=(KEY + "\n").encode()))


@pytest.mark.dataflow
def test_secret_manager_round_trip_through_beams_gcp_secret(monkeypatch, caplog):
    from google.cloud import secretmanager

    monkeypatch.setattr(secretmanager, "SecretManagerServiceClient", _FakeSecretManager)
    with caplog.at_level(logging.DEBUG):
        assert secrets.resolve_api_key(VERSION) == KEY  # the trailing newline of `echo key | gcloud ...` is gone
        with pytest.raises(secrets.SecretError) as e:
            secrets.resolve_api_key("projects/my-project/secrets/other/versions/1")
    assert "secrets/other/versions/1" in str(e.value) and "denied" in str(e.value)
    assert VERSION in caplog.text and KEY not in caplog.text
