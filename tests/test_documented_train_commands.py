"""Every ``longreel train`` / ``longreel eval`` command the README, docs/ and the commands' own help print parses:
its ``--set`` values are valid YAML of the right types (a brace pattern inside an unquoted flow list is not), and
the shard patterns it shows expand the way the loader expands them."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from longreel.schemas.config import load_yaml
from longreel.task.shard_reader import resolve_shards
from longreel.trainer import cli_eval, cli_train
from longreel.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def documented_commands() -> list[tuple[str, str]]:
    texts = {"README.md": (ROOT / "README.md").read_text(encoding="utf-8")}
    for module in (cli_train, cli_eval):  # the --help texts: the modules' docstrings and string constants
        texts[module.__name__] = "\n".join(v for v in vars(module).values() if isinstance(v, str))
    texts.update({f"docs/{p.name}": p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))})
    found = []
    for where, text in texts.items():
        for line in text.splitlines():
            m = re.search(r"longreel (train (sft|grpo)|eval)\b.*", line)
            if m and "--set" in m.group(0):
                found.append((where, m.group(0).split("  #")[0].rstrip("` ")))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_training_and_eval_commands():
    assert len(COMMANDS) >= 8, COMMANDS
    assert any("train_urls" in c for _, c in COMMANDS) and any("eval_urls" in c for _, c in COMMANDS)


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}:{i}" for i, (w, _) in enumerate(COMMANDS)])
def test_documented_command_parses(where, command):
    words = shlex.split(command.replace("...", ""))
    overrides = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
    cfg = load_yaml(TrainConfig, None, overrides)  # raises ConfigError naming the key
    for urls in (cfg.data.train_urls, cfg.data.eval_urls):
        for url in urls:
            if "{" in url:
                assert len(resolve_shards([url])) > 1, url
