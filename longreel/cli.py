"""``longreel``: the command line. Each subcommand lives beside the code it runs."""
from __future__ import annotations

import argparse
import atexit
import errno
import importlib
import logging
import os
import re
import signal
import sys
import threading
import traceback

from longreel.task.beam_quiet import quiet_beam_import

quiet_beam_import()  # before any subcommand imports Beam

# name -> (module, one-line help). Modules expose add_arguments(parser) and main(args, extra_args) -> int.
COMMANDS = {
    "curate": ("longreel.pipelines.cli_curate", "Run the curation pipeline (ingest, probe, segment, ...) on videos."),
    "card": ("longreel.pipelines.cli_card", "Data card: build (README.md, card.json, plots) or verify it against shards."),
    "caption": ("longreel.pipelines.cli_caption", "Caption the clips of a curate output (facts, transformers, openai, vllm)."),
    "qra": ("longreel.pipelines.cli_qra", "Question-reasoning-answer generation from the captions of an output directory."),
    "pack": ("longreel.pipelines.cli_pack", "Frame cache + WebDataset shards + wids index from an output directory."),
    "blind": ("longreel.pipelines.cli_blind", "Blind filter: reject questions a text-only model answers without the video."),
    "judge": ("longreel.pipelines.cli_judge", "Judge: an LLM checks each question against the captions it was written from."),
    "filter": ("longreel.pipelines.cli_filter", "Pass-rate filter: answer each question k times, keep the medium ones."),
    "cost": ("longreel.pipelines.cli_cost", "Project a curation run's GPU-hours stage by stage, and what each lever saves."),
    "train": ("longreel.trainer.cli_train",
              "Train the policy: CoT-SFT (sft), GRPO (grpo); plot a run's curves (plot); a step checkpoint as a model "
              "directory (export)."),
    "eval": ("longreel.trainer.cli_eval", "Greedy accuracy of a model on held-out shards, per category and problem type."),
    "cache": ("longreel.trainer.cli_cache", "List or prune the trainer's disk cache of remote shards."),
}

DESCRIPTION = """\
longreel turns long videos into a reasoning dataset (Apache Beam pipelines) and trains a
video-language model on it (CoT-SFT, then GRPO).

Run `longreel COMMAND --help` for a command's options. Pipeline commands accept standard
Beam options after their own, e.g. `--runner DataflowRunner --project P --region R
--temp_location gs://B/tmp --setup_file ./setup.py`; without --runner they run locally.
An option that is neither the command's nor Beam's is an error (exit 2).
"""


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_EMPTY = 0, 1, 2, 3

EXIT_CODES = """\
exit codes:
  0  success
  1  the run failed: an internal error (a traceback is printed; please report it), or the
     machine refused (disk full, permission denied while writing: one line, no traceback);
     an output directory is then left without _SUCCESS.json (unfinished). `card verify`
     also exits 1 when a claim does not match.
  2  usage or config error: bad arguments, config (YAML, keys, values), input specification
     (a path that does not exist), or an output directory that another run holds or that
     holds another run's outputs (curate: --resume / --overwrite). One line, no traceback.
  3  the run finished but nothing survived: 0 videos came through, or 0 items out of a stage
     that was asked for (captions, questions, kept or packed questions); its outputs, rejects
     and stats.json are written.
  130 interrupted (Ctrl-C, or SIGINT to its pid alone): one line; the worker processes end
     too, and an output directory is left unfinished (`curate --resume` continues it).
  143 terminated (SIGTERM: `timeout`, a supervisor, a job scheduler): as 130.
  train, eval and cache have their own list (their --help): no 3, and train's 128+N.
-v/--debug shows the traceback of any error.
"""

# errno values that mean "the machine refused", not "the code is wrong": reported in one line, exit 1.
# EISDIR/ENOTDIR: something the user put in OUT (a directory where a file is written, or the reverse).
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EMFILE,
                       errno.ENFILE, errno.EISDIR, errno.ENOTDIR}


class _Version(argparse.Action):
    """``--version``: the package version and, in a checkout, its commit (what stats.json and cards record as
    ``code_version``), read only when asked (it runs git)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import platform

        from longreel.pipelines.provenance import code_version

        print(f"longreel {code_version()} (Python {platform.python_version()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longreel", description=DESCRIPTION, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", "--debug", action="store_true",
                        help="Debug logging, and the traceback of any error.")
    parser.add_argument("-q", "--quiet", action="store_true", help="Warnings and errors only.")
    parser.add_argument("--version", action=_Version,
                        help="Print longreel's version (with the commit of a checkout) and exit.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_text, description=getattr(mod, "DESCRIPTION", help_text),
                            epilog=getattr(mod, "EXIT_CODES", EXIT_CODES),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        # after the command too (`longreel curate ... -v`, as every help's last line suggests); SUPPRESS: not given
        # here, the value given before the command stands
        sp.add_argument("-v", "--verbose", "--debug", action="store_true", default=argparse.SUPPRESS,
                        help="Debug logging, and the traceback of any error (as before the command).")
        sp.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="Warnings and errors only (as before the command).")
        # the command's own option strings: a misspelt one left over for Beam gets a suggestion from them
        sp.set_defaults(_module=mod, _options=tuple(re.findall(r"--[\w-]+", sp.format_usage())))
    return parser


def setup_logging(verbose: bool, quiet: bool) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("longreel").setLevel(level)
    # Beam is chatty at INFO about its own machinery; its warnings still show.
    logging.getLogger("apache_beam").setLevel(logging.WARNING if not verbose else logging.INFO)
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_OneLineBeamErrors())


class _OneLineBeamErrors(logging.Filter):
    """A failing step makes Beam log its traceback before the run raises; the CLI reports the failure itself
    (with the traceback for an internal error), so without -v Beam's record keeps only its first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("apache_beam") and record.levelno >= logging.ERROR:
            record.msg, record.args = record.getMessage().splitlines()[0] if record.getMessage() else "", ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def _chain(exc: BaseException):
    """``exc`` and the exceptions it was raised from or while handling, once each (runners wrap what a step raised)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def environment_error(exc: BaseException) -> str | None:
    """``strerror: filename`` when ``exc`` is (or wraps, as Beam's runners do) an OSError of the machine; or the
    runner's job service not answering (``--job_endpoint`` mistyped or not started): gRPC's timeout has no text."""
    for e in _chain(exc):
        if type(e).__name__ == "FutureTimeoutError" and type(e).__module__.startswith("grpc"):
            return ("the Beam job service did not answer in time (is the --job_endpoint right, and is its job "
                    "server running?)")
        if isinstance(e, OSError) and e.errno in _ENVIRONMENT_ERRNOS:
            return f"{e.strerror}: {e.filename}" if e.filename else str(e.strerror)
    # A runner that moves the failure between processes keeps only its text.
    m = re.search(r"\[Errno (\d+)\] ([^\n]*?)(?: \[while running|\n|$)", str(exc))
    if m and int(m.group(1)) in _ENVIRONMENT_ERRNOS:
        return m.group(2)
    return None


def report_error(command: str, exc: BaseException, debug: bool) -> int:
    """Turn an exception that reached the top into a message and an exit code (see EXIT_CODES)."""
    from longreel.pipelines.io.inputs import InputError
    from longreel.pipelines.io.run_dir import RunDirError
    from longreel.schemas.config import ConfigError

    prog = f"longreel {command}"
    if isinstance(exc, (ConfigError, InputError, RunDirError)):
        if debug:
            traceback.print_exception(exc)
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    env = environment_error(exc)
    if env is not None:
        if debug:
            traceback.print_exception(exc)
        print(f"{prog}: failed: {env}", file=sys.stderr)
        return EXIT_FAILED
    traceback.print_exception(exc)
    print(f"{prog}: internal error ({type(exc).__name__}): this is a bug; please report it with the traceback "
          "above", file=sys.stderr)
    return EXIT_FAILED


def _unknown_command(argv: list[str]) -> str | None:
    """Why ``argv`` names no command, with the nearest one, or None. The top-level options take no values, so the
    first word that is not an option is the command."""
    from longreel.schemas.config import closest

    word = next((a for a in argv if not a.startswith("-")), None)
    if word is None or word in COMMANDS:
        return None
    near = closest(word, COMMANDS)
    return f"unknown command {word!r}" + (f" (did you mean {near}?)" if near else "") + \
        f"; the commands: {', '.join(COMMANDS)}"


def main(argv: list[str] | None = None) -> int:
    from longreel.schemas.config import unexpected_arguments

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    problem = _unknown_command(argv)
    if problem is not None:
        print(f"longreel: {problem}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "command", None):
        if extra:  # an option of no command: one line, not the whole help
            options = ("--help", "--verbose", "--debug", "--quiet", "--version")
            print(f"longreel: {unexpected_arguments(extra, options)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 2
    setup_logging(args.verbose, args.quiet)
    args._argv = argv
    # the trainer keeps SIGTERM for itself (run.stop_signals: a checkpoint, then exit 128+N)
    _quiet_threads_once_interrupted(terminate_too=COMMANDS[args.command][0].startswith("longreel.pipelines."))
    try:
        return int(args._module.main(args, extra) or 0)
    except KeyboardInterrupt:
        return _interrupted(args.command)
    except Exception as e:  # noqa: BLE001 - the one place every error of every subcommand is reported
        if interrupt_inside(e):
            return _interrupted(args.command)
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            return EXIT_PIPE_CLOSED
        return report_error(args.command, e, args.verbose)


#: the reader of the output went away (``longreel train --show-config | head``): the shell's code for a command
#: that SIGPIPE ended, which is how such a command ends in any other tool, without a word
EXIT_PIPE_CLOSED = 128 + 13


def _stdout_closed() -> bool:
    """Whether standard output's reader has gone (a BrokenPipeError from it, not from a pipe of the command's own).
    If so, it is pointed at /dev/null, so that the interpreter's last flush of it does not fail again."""
    import select

    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        closed = any(events & select.POLLERR for _, events in poll.poll(0))  # a pipe with no reader
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture): not a closed pipe
        return False
    if closed:
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return closed


_INTERRUPTED = threading.Event()
_SIGNALS: list[int] = []  # the signal that stopped the command, for its last line and exit code


def _quiet_threads_once_interrupted(terminate_too: bool = False) -> None:
    """After Ctrl-C, a runner's threads whose worker processes ended with it (gRPC readers) fail on their way out;
    their tracebacks would follow the one line that says the run was interrupted. Earlier failures still print.
    ``terminate_too``: SIGTERM (what a supervisor, ``timeout`` or a job scheduler sends) ends the command the same
    way, exit 143, instead of killing it where it stands: its lock released, its workers ended and their scratch
    directories removed, one line. Only in the main thread, where Python runs signal handlers, and only over Python's
    own handlers (a signal the caller set up otherwise is left as it is)."""
    if threading.current_thread() is not threading.main_thread():
        return
    ours = [s for s, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))
            if (s == signal.SIGINT or terminate_too) and signal.getsignal(s) is default]
    if not ours:
        return  # someone else's handlers, or installed already
    previous_hook = threading.excepthook

    def hook(exc_args) -> None:
        if not _INTERRUPTED.is_set():
            previous_hook(exc_args)

    def on_signal(signum, frame) -> None:
        _SIGNALS.append(signum)
        _INTERRUPTED.set()
        raise KeyboardInterrupt

    threading.excepthook = hook
    for s in ours:
        signal.signal(s, on_signal)


def _interrupted(command: str) -> int:
    if _SIGNALS and _SIGNALS[-1] == signal.SIGTERM:
        print(f"longreel {command}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    print(f"longreel {command}: interrupted", file=sys.stderr)
    return 130


def interrupt_inside(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C wrapped by a runner: a pipeline run in this process (one worker) gets the
    KeyboardInterrupt inside a step, and Beam raises it again as a RuntimeError naming the step."""
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(exc))


def console_main() -> None:
    """The ``longreel`` executable: :func:`main`, then an exit that skips the interpreter's teardown.

    Once a run has imported Beam, PyAV and (in one process) torch and transformers, tearing the interpreter down --
    clearing thousands of modules, collecting their objects, unloading native libraries -- took 0.5 s after a
    2-worker ``curate`` and 1.6 s after a 1-worker one on a 2-core machine, all of it after the last output file was
    written. Everything a run leaves behind is written by then; what the normal exit would still do that matters is
    done here first: waiting for non-daemon threads, then the ``atexit`` handlers (logging's flush among them), then
    the standard streams. Under a profiler or tracer (``python -m cProfile``, coverage) the normal exit is kept,
    since those write their results after the program returns.
    """
    exit_without_teardown(main())


def exit_without_teardown(code: int) -> None:
    """``os._exit(code)`` after what a normal exit does that a caller can observe (see :func:`console_main`);
    ``sys.exit(code)`` under a profiler or tracer."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    # The two calls the interpreter makes first when it exits; neither has a public name. threading's runs the
    # callbacks that tell thread pools to stop (concurrent.futures registers them) and joins the non-daemon threads:
    # joining them without those callbacks would wait forever on a pool's idle threads.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to write to
            pass
    os._exit(code)


if __name__ == "__main__":
    console_main()
