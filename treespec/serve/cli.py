"""`treespec serve`: the OpenAI-compatible server on FastAPI + uvicorn.

    treespec serve --pair pycode --port 8000 --max-live 8
    python -m treespec.serve --target DIR --draft DIR --dtype float32

`add_arguments(parser)` adds the flags to an argparse parser (the `serve` subcommand of
`treespec`), `run(args)` serves until SIGTERM or Ctrl-C and returns the exit code: 0 after a
clean shutdown (SIGTERM: stop accepting, let in-flight requests finish for --grace-period
seconds, cancel the rest), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from ..config import AUTO_MAX_NODES, STRATEGIES, TreeConfig
from ..options import add_model_arguments, load_decoder, model_paths
from ..rules import rule_name

DEFAULT_MAX_LIVE = 8
DEFAULT_MAX_QUEUE = 64
DEFAULT_SHARED_TREE_NODES = AUTO_MAX_NODES  # larger trees decode plainly while shared (docs/serving.md)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SHUTDOWN_SLACK_S = 5.0  # after the grace period: time for cancelled requests to send their last chunk


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.set_defaults(compile=False)  # compiled graphs serve one-lane pools only: eager unless --compile
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: the pair)")

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument(
        "--max-live",
        type=int,
        default=DEFAULT_MAX_LIVE,
        help=f"requests decoded together (lanes; default {DEFAULT_MAX_LIVE})",
    )
    s.add_argument("--max-kv-tokens", type=int, default=None, help="KV cache slots live requests may reserve")
    s.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests waiting for a lane before new ones get 429 (default {DEFAULT_MAX_QUEUE})",
    )
    s.add_argument(
        "--speculate-max-live",
        default=None,
        help="draft nothing while more requests than this are live; 'auto' measures (default: always draft)",
    )
    s.add_argument(
        "--deterministic",
        action="store_true",
        help="same seed, same text, whatever else runs: each request forwards alone (batch-invariant; "
        "slower under load)",
    )
    s.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may run before they are cancelled (default 30)",
    )
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default on a CPU: torch's choice less one, for the HTTP thread)",
    )
    s.add_argument(
        "--max-tree-nodes",
        type=int,
        default=None,
        help="the largest draft tree a request may ask for, in nodes (default 64)",
    )
    s.add_argument(
        "--shared-tree-nodes",
        type=int,
        default=None,
        help="with other requests in a round, a request whose tree holds more nodes than this decodes "
        f"plainly, so that large trees cannot slow the others (default {DEFAULT_SHARED_TREE_NODES}, the "
        "automatic tree's largest; off with --deterministic)",
    )
    s.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds a client has to send a request's headers (after connecting or after the last "
        "response), and then its body; a late one gets 408 and the connection closes (default 30)",
    )
    s.add_argument("--max-body-mb", type=float, default=4.0, help="larger request bodies get 413 (default 4)")
    s.add_argument(
        "--round-tokens",
        type=int,
        default=None,
        help="prompt tokens one engine step may prefill beside the live decodes (chunked prefill; "
        "default: the engine's, 32); 0 prefills each prompt whole",
    )

    a = p.add_argument_group("access")
    a.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key /v1 requests must send as 'Authorization: Bearer KEY' (repeatable; or $TREESPEC_API_KEY)",
    )
    a.add_argument("--api-key-file", default=None, help="a file of keys, one per line")
    a.add_argument(
        "--allowed-origins",
        nargs="+",
        default=(),
        metavar="ORIGIN",
        help="origins a browser page may call the API from (CORS; default: none)",
    )
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))

    d = p.add_argument_group("defaults for requests that do not say (body fields tree, verification)")
    d.add_argument("--width", type=int, default=None, help="tree width (default: the automatic tree)")
    d.add_argument("--depth", type=int, default=None, help="tree depth (default: automatic; 6 with --width)")
    d.add_argument("--strategy", default=None, choices=STRATEGIES, help="default: auto (iid with --width)")
    d.add_argument("--plain", action="store_true", help="no speculation unless a request asks for a tree")
    d.add_argument(
        "--verification", default="auto", help="auto (the best that applies), token, block, traversal"
    )


def access(args) -> tuple[str, ...]:
    """The API keys of `args` (--api-key, $TREESPEC_API_KEY, --api-key-file); a warning where
    the server binds beyond loopback with none."""
    from .guard import API_KEY_ENV, read_api_keys

    keys = read_api_keys(args.api_key, args.api_key_file)
    if not keys and args.host not in LOOPBACK:
        logging.getLogger("treespec.serve").warning(
            "serving on %s with no API key: anyone who reaches the port may use the model "
            "(--api-key, $%s or --api-key-file)",
            args.host,
            API_KEY_ENV,
        )
    return keys


def engine_threads(available: int) -> int:
    """The torch threads a CPU server decodes with: all but one of the `available`, which the
    event loop (HTTP, streaming, detokenising) wakes on every step; sharing every core, it
    preempts one of torch's threads mid-product and the others wait for it (measured:
    docs/serving.md, "Threads")."""
    return max(1, available - 1)


def _speculate_max_live(value: str | None):
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--speculate-max-live must be an integer >= 1 or 'auto', got {value!r}") from None


def _missing(error: ImportError) -> str:
    return f"treespec serve needs {error.name}: pip install fastapi uvicorn prometheus_client"


def build(args):
    """The app for `args` (loads the models); ValueError for bad flags."""
    try:
        from .app import DEFAULT_MAX_TREE_NODES, DEFAULT_READ_TIMEOUT_S, ServeSettings, create_app
    except ImportError as e:
        raise ValueError(_missing(e)) from None

    for flag in ("max_live", "max_queue"):
        if getattr(args, flag) < 1 and not (flag == "max_queue" and getattr(args, flag) == 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    max_tree_nodes = DEFAULT_MAX_TREE_NODES if args.max_tree_nodes is None else args.max_tree_nodes
    if max_tree_nodes < 1:
        raise ValueError(f"--max-tree-nodes must be >= 1, got {max_tree_nodes}")
    read_timeout = DEFAULT_READ_TIMEOUT_S if args.read_timeout is None else args.read_timeout
    if not read_timeout > 0:
        raise ValueError(f"--read-timeout must be > 0 seconds, got {args.read_timeout}")
    if not args.max_body_mb > 0:
        raise ValueError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    api_keys = access(args)
    try:
        tree = None if args.plain else TreeConfig(width=args.width, depth=args.depth, strategy=args.strategy)
    except ValueError as e:
        raise ValueError(str(e).replace("TreeConfig.", "--")) from None
    if tree is not None and tree.max_nodes > max_tree_nodes:
        raise ValueError(
            f"the default tree drafts {tree.max_nodes} nodes, over --max-tree-nodes {max_tree_nodes}"
        )
    shared_tree_nodes = args.shared_tree_nodes
    if shared_tree_nodes is None and not args.deterministic:
        shared_tree_nodes = DEFAULT_SHARED_TREE_NODES
    if shared_tree_nodes is not None and args.deterministic:
        raise ValueError("--shared-tree-nodes trims trees by load; --deterministic rules that out")
    if shared_tree_nodes is not None and shared_tree_nodes < 0:
        raise ValueError(f"--shared-tree-nodes must be >= 0, got {shared_tree_nodes}")
    verification = rule_name(args.verification)  # bad flags fail before the models load
    target, _ = model_paths(args, args.plain)
    name = (
        args.served_model_name
        or args.pair
        or (Path(str(target)).parent.name if args.target is None else None)
    )
    name = name or Path(str(target)).name
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    chunking = {}  # --round-tokens: given, it replaces the engine's default budget
    if args.round_tokens is not None:
        if args.round_tokens < 0:
            raise ValueError(f"--round-tokens must be >= 0 (0: whole prompts), got {args.round_tokens}")
        chunking["round_tokens"] = args.round_tokens or None
    import torch

    from .. import parallel

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.device in (None, "cpu") and parallel.launched_rank() in (None, 0):  # the rank serving HTTP
        torch.set_num_threads(engine_threads(torch.get_num_threads()))
    dec = load_decoder(args, args.plain)
    if tree is not None and tree.auto:
        # the automatic tree's costs (measured once per machine and settings, logged) before
        # the port opens, not while the first request waits
        dec.planner.costs  # noqa: B018
    engine = dec.engine(
        max_live=args.max_live,
        max_kv_tokens=args.max_kv_tokens,
        speculate_max_live=_speculate_max_live(args.speculate_max_live),
        deterministic=args.deterministic,
        shared_tree_nodes=shared_tree_nodes,
        **chunking,
    )
    settings = ServeSettings(
        max_queue=args.max_queue,
        tree=tree,
        verification=verification,
        faults=os.environ.get("TREESPEC_SERVE_FAULTS") == "1",
        max_tree_nodes=max_tree_nodes,
        api_keys=api_keys,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        read_timeout=read_timeout,
        allowed_origins=tuple(args.allowed_origins),
    )
    if settings.verification is not None and tree is not None:
        from ..rules import choose_rule

        siblings = dec.drafter.siblings(tree, settings.verification)
        choose_rule(siblings, settings.verification)  # a rule that cannot apply fails now
    return create_app(engine, dec.tokenizer, name, settings, grace_period=args.grace_period), dec


def _follow(engine) -> int:
    """A tensor-parallel rank other than 0: step with rank 0 until it stops. A signal from the
    launcher (torchrun passes Ctrl-C / SIGTERM to every rank) is left to rank 0, which ends
    the run for all; a rank 0 that died or hung ends this one with an error."""
    from .. import parallel
    from .loop import follow

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        follow(engine)
    except Exception as e:  # noqa: BLE001 - a failed collective: rank 0 died, hung or diverged
        print(f"treespec: error: {parallel.lost(e)}", file=sys.stderr)
        return 1
    return 0


def run(args) -> int:
    """Serve until SIGTERM / Ctrl-C; the exit code."""
    try:
        import uvicorn
    except ImportError as e:  # installed with --no-deps: say what is missing, not a traceback
        print(f"treespec: error: {_missing(e)}", file=sys.stderr)
        return 2
    from ..backends.hf import quiet_transformers

    quiet_transformers()
    from .. import parallel

    # tensor parallel: the ranks other than 0 log only what goes wrong
    level = args.log_level.upper() if not parallel.launched_rank() else "WARNING"
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        app, _ = build(args)
    except ValueError as e:
        print(f"treespec: error: {e}", file=sys.stderr)
        return 2
    srv = app.state.server
    if not parallel.leader():  # tensor parallel: rank 0 serves, this rank steps alongside it
        return _follow(srv.loop.engine)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            srv.shut_down(args.grace_period)  # the app's own clock: at the grace period, cancel
            super().handle_exit(sig, frame)

    from .guard import timed_h11

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        # stalled headers: 408 and closed (the Guard times bodies)
        http=timed_h11(srv.settings.read_timeout) if srv.settings.read_timeout else "auto",
        log_level=args.log_level,
        # uvicorn's own cut (tasks cancelled mid-response) only past the app's: by then every
        # request has been cancelled and answered
        timeout_graceful_shutdown=args.grace_period + SHUTDOWN_SLACK_S,
        lifespan="on",
    )
    server = Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with the default
    # handlers that would kill the process with SIGTERM's status or raise KeyboardInterrupt,
    # so a graceful exit is 0 whichever signal asked for it
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        server.run()
        if server.force_exit:  # a second Ctrl-C: uvicorn's forced exit (the app's shutdown skipped)
            code = 130
        elif getattr(server, "started", True) is False:
            code = 1  # could not bind (uvicorn logged why)
    except KeyboardInterrupt:
        code = 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    from .app import STOP_WAIT_S

    # after a graceful shutdown the app has already waited STOP_WAIT_S for the thread
    return leave(srv.loop, code, STOP_WAIT_S if code else 0.1)


def leave(loop, code: int, wait: float) -> int:
    """`code`, once the engine thread has ended. A thread still inside a step (a long forward)
    after `wait` seconds is not waited for: the process ends at once (`os._exit`), since an
    interpreter that exits under a running torch op aborts ("terminate called without an
    active exception")."""
    if loop.stop(wait):
        return code
    logging.getLogger("treespec.serve").warning(
        "the engine thread is still in a step; exiting without it (%d)", code
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
