"""A stage run alone on an existing run directory (``longreel caption/qra/blind/judge/filter/pack``, and ``card
build`` into its run): the lock, the marker, the command on record and the run's own data card.

Why a module of its own: finishing such a run rebuilds the run's card (:mod:`longreel.pipelines.card.build`), and
the card reads the run directory through :mod:`longreel.pipelines.io.run_dir`, so the session cannot live there.
"""
from __future__ import annotations

import json
import logging

from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.io.run_dir import (MARKER_NAME, IncompleteRun, RunIdentity, RunLock, looks_like_run,
                                           read_marker, remove_marker, write_marker)

log = logging.getLogger("longreel")

#: stats.json's list of the stage commands run alone on the directory since the run that wrote it, in order
STAGE_COMMANDS_KEY = "stage_commands"
CARD_DIR = "card"


class StageSession:
    """The contract for a stage run alone on a run directory: the lock for the whole command;
    :meth:`begin_writes` removes the marker before the first write; :meth:`finish` puts the command on record in
    ``stats.json``, rebuilds the run's card when it has one (it described the run before this stage), and writes the
    marker again, with this step and the directory's files, when the directory had one."""

    def __init__(self, out_dir: str, step: str, config_hash: str, command: str | None = None):
        self.out_dir, self.step, self.config_hash, self.command = out_dir, step, config_hash, command
        self.lock = RunLock(out_dir, command or f"longreel {step}", create=False)
        self.marker: dict | None = None

    def __enter__(self) -> "StageSession":
        self.lock.acquire()
        try:
            self.marker = read_marker(self.out_dir)
        except IncompleteRun as e:
            log.warning("%s: ignoring a damaged marker: %s", self.out_dir, e)
            self.marker = None
        if self.marker is None and looks_like_run(self.out_dir):
            # said up front: the stage's tables are complete, yet the directory stays unfinished, which card verify
            # and a trainer's check of the marker then refuse
            log.warning("%s: no %s: the run that wrote it did not finish (crashed, killed, or a stage run alone was "
                        "interrupted); %s runs on what is there and the directory stays unfinished: finish it with "
                        "`longreel curate ... --resume` (same inputs and config)", self.out_dir, MARKER_NAME,
                        self.step)
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()

    def begin_writes(self) -> None:
        if self.marker is not None:
            remove_marker(self.out_dir)

    def finish(self) -> None:
        if self.step != "card":
            record_stage_command(self.out_dir, self.step, self.command)
            warn_stale_later_steps(self.out_dir, self.step)
            refresh_card(self.out_dir)
        if self.marker is None:
            return
        m = self.marker
        ident = RunIdentity(config=m.get("config") or {}, config_hash=m.get("config_hash"),
                            stages=list(m.get("stages") or []), inputs_digest=(m.get("inputs") or {}).get("sha256"),
                            n_inputs=(m.get("inputs") or {}).get("count"))
        steps = [s for s in m.get("steps") or [] if s.get("step") != self.step]
        write_marker(self.out_dir, ident, steps + [{"step": self.step, "config_hash": self.config_hash}])


def record_stage_command(out_dir: str, step: str, command: str | None) -> None:
    """Append ``command`` to ``stats.json``'s :data:`STAGE_COMMANDS_KEY`, so that the run's record (and its card's
    reproduction section) names every command that shaped the directory, not only the curate that started it.

    The same stage run again right after itself replaces its entry (its outputs replaced the earlier ones whole);
    anything else is kept in order, since replaying the list reproduces the directory."""
    from longreel.pipelines.stats import read_json, write_json

    if not command:
        return
    path = FileSystems.join(out_dir, "stats.json")
    doc = read_json(path)
    if doc is None:
        return
    done = [e for e in doc.get(STAGE_COMMANDS_KEY) or [] if isinstance(e, dict)]
    if done and done[-1].get("step") == step:
        done.pop()
    doc[STAGE_COMMANDS_KEY] = done + [{"step": step, "command": command}]
    write_json(path, doc)


#: the stage commands in pipeline order: the funnel stage that shows a step ran, and the command that runs it alone
STEP_COMMANDS = {"caption": ("clip_facts", "longreel caption --clips-dir {out}"),
                 "qra": ("qra_context", "longreel qra --out {out}"),
                 "judge": ("judge", "longreel judge --out {out}"),
                 "blind": ("blind", "longreel blind --out {out}"),
                 "filter": ("passrate", "longreel filter --out {out}"),
                 "pack": ("pack_select", "longreel pack {out}")}


def stale_later_steps(stats: dict, step: str) -> list[str]:
    """The steps after ``step`` whose outputs the run holds (their funnel stages are in ``stats``): they were made
    from what ``step`` has just replaced."""
    from longreel.pipelines.stats import PIPELINE_ORDER

    if step not in STEP_COMMANDS:
        return []
    ran = {s.get("stage") for s in stats.get("stages") or [] if isinstance(s, dict)}
    at = PIPELINE_ORDER.index(STEP_COMMANDS[step][0])
    return [name for name, (stage, _) in STEP_COMMANDS.items() if PIPELINE_ORDER.index(stage) > at and stage in ran]


def warn_stale_later_steps(out_dir: str, step: str) -> None:
    """Say which of the run's later outputs a stage run alone left behind: ``longreel qra`` rewrote the questions,
    and the shards still held the earlier ones, with no word of it (``card verify`` now fails such shards)."""
    from longreel.pipelines.stats import read_json

    stale = stale_later_steps(read_json(FileSystems.join(out_dir, "stats.json")) or {}, step)
    if stale:
        log.warning("%s: the run's %s outputs were made from the %s outputs this run replaced; run %s to bring them "
                    "up to date", step, ", ".join(stale), step,
                    ", then ".join(f"`{STEP_COMMANDS[s][1].format(out=out_dir)}`" for s in stale))


def refresh_card(out_dir: str) -> None:
    """Rebuild ``OUT/card`` when the run has one, with the options it was built with (its title and Hub prefixes,
    read back from its ``card.json``). A stage run alone changes what the card states (tables, funnel, shards); a
    card left as it was described the run before, and the marker then vouched for it."""
    card_dir = FileSystems.join(out_dir, CARD_DIR)
    card_json = FileSystems.join(card_dir, "card.json")
    if not FileSystems.exists(card_json):
        return
    from longreel.pipelines.card.build import build_card

    with FileSystems.open(card_json, compression_type="uncompressed") as fh:
        claims = {c.get("id"): c.get("value") for c in json.loads(fh.read()).get("claims") or []
                  if isinstance(c, dict)}
    kw = {k: claims[cid] for k, cid in (("data_prefix", "hf/data_prefix"), ("tables_prefix", "hf/tables_prefix"))
          if isinstance(claims.get(cid), str)}
    name = claims.get("dataset/name")
    pretty = claims.get("dataset/pretty_name")
    if isinstance(pretty, str) and pretty != f"{name}: long-video reasoning questions":  # a title the user gave
        kw["pretty_name"] = pretty
    log.info("%s: rebuilding the run's data card in %s (it described the run before this stage)", out_dir, card_dir)
    build_card(out_dir, card_dir, **kw)
