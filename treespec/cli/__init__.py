"""The `treespec` command: generate text with tree speculation, chat, serve, distil a draft,
or benchmark it.

    treespec generate "def quicksort(xs):" --width 2 --depth 4 --show-tree
    treespec bench --max-new-tokens 64 --repeats 3 --json bench.json

All default to the bundled pair (treespec/zoo/pycode). Errors are one line on stderr and
exit code 2.

    __init__.py  main(): parsing, logging, signals, tensor-parallel ranks and exit codes
    parser.py    the flags: build_parser and one add_<command>_args per subcommand
    common.py    what the subcommands share: CliError, configs from flags, loading, colour
    generate.py  treespec generate
    chat.py      treespec chat
    bench.py     treespec bench
serve and distill are `treespec.serve.cli` and `treespec.distill.cli`. Importing this package
loads no torch: main() answers Ctrl-C from its first line.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from .common import CliError
from .parser import build_parser

__all__ = ["build_parser", "console", "main", "show_progress"]


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, wherever it lands (imports included): no traceback
        return 130


def console() -> NoReturn:
    """The `treespec` command's process (the console script and `python -m treespec`): main(),
    then an exit that skips the interpreter's teardown, where unloading torch's libraries added
    ~0.5 s to every command. Exit handlers run and the standard streams are flushed first. A
    process with threads still running exits the ordinary way, which waits for them, and so does
    a tensor-parallel rank: one that ends at once has torchrun stop the others before they report."""
    code = main()
    # loaded by main() with torch; not imported here: after a Ctrl-C inside torch's import, a
    # second import of torch can crash, and a process that never loaded torch has no teardown
    parallel = sys.modules.get("treespec.parallel")
    if threading.active_count() > 1 or parallel is None or parallel.launched_rank() is not None:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more reaches it
            pass
    os._exit(code)


class _Stderr(logging.Handler):
    """One line per record on whatever sys.stderr is when it is written."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"treespec: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's convention: a failed write is reported, not raised
            self.handleError(record)


def show_progress() -> None:
    """What takes more than a moment (a GGUF file's conversion, measuring this machine's costs,
    compiling a forward) as one line each on stderr, from treespec's loggers (once however often
    main() runs in a process)."""
    logger = logging.getLogger("treespec")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
    logger.setLevel(logging.INFO)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2 with argparse's one-line message
    from ..parallel import launched_rank  # torch loads here

    rank = launched_rank()
    if rank:  # tensor parallel (torchrun): rank 0 prints and serves; the others only compute
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    from ..backends.hf import quiet_transformers  # transformers loads here

    quiet_transformers()
    if args.command == "bench" and rank is not None:
        print(
            "treespec: error: bench runs in one process (it compares Hugging Face's rows); time a "
            "tensor-parallel target with experiments/tp_bench.py (docs/parallel.md)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "serve":  # the server reports its own errors and exit code
            from ..serve.cli import run

            return run(args)
        if rank is not None:  # torchrun stops the others when one rank fails: say so
            signal.signal(signal.SIGTERM, _stopped_by_launcher)
        if not rank:
            show_progress()  # the server logs through its own --log-level
        return _run_command(args)
    finally:
        if rank is not None:
            from .. import parallel

            parallel.shutdown()


def _stopped_by_launcher(signum, frame) -> None:
    from ..parallel import launched_rank

    print(
        f"treespec: rank {launched_rank()}: stopped by the launcher (another rank failed, or the run "
        "was interrupted)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum)


def _command(name: str):
    """The function that runs the subcommand `name` (not serve: `_main` runs that)."""
    if name == "distill":
        from ..distill.cli import run
    elif name == "generate":
        from .generate import run
    elif name == "chat":
        from .chat import run
    elif name == "bench":
        from .bench import run
    else:
        raise ValueError(f"unknown command {name!r}")
    return run


def _run_command(args) -> int:
    """Run the subcommand; its errors as one line on stderr and the exit code."""
    from ..parallel import ParallelError, launched_rank, lost

    rank = launched_rank()
    where = "" if rank is None else f"rank {rank}: "
    try:
        _command(args.command)(args)
    except (CliError, ValueError) as e:
        print(f"treespec: {where}error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ParallelError as e:
        print(f"treespec: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a collective that failed inside a forward: a rank died or hung
        if rank is None:
            raise
        print(f"treespec: error: {lost(e)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (treespec generate --trace | head): stop quietly
        sys.stderr.close()  # nothing more can be said; keep Python's exit from complaining
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # stdout full or unwritable (> /dev/full): one line, not a traceback
        print(f"treespec: error: cannot write the output ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0
