"""`treespec chat`: a multi-turn chat on stdin/stdout."""

from __future__ import annotations

import sys

from .common import CliError, configs, load
from .generate import constraint_of


def run(args) -> None:
    """A multi-turn chat on stdin/stdout: each turn re-renders the whole conversation with the
    chat template and streams the reply; the runners keep the cached turns the new prompt
    shares (`Runner.prefix_reuse`), so a turn prefills only what is new."""
    tree, sampling = configs(args)
    constraint = constraint_of(args)  # every reply matches it; a bad one fails before loading
    dec = load(args)
    if dec.tokenizer is None or not getattr(dec.tokenizer, "chat_template", None):
        raise CliError("this model has no chat template; use treespec generate")
    for runner in (dec.target_runner, dec.draft_runner):
        if runner is not None:
            runner.prefix_reuse = True
    from .. import parallel
    from ..output import TextStream

    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:  # tensor parallel: rank 0 reads the terminal, every rank decodes its line
            line = parallel.agree(input("> ") if parallel.leader() else None)
        except EOFError:
            line = parallel.agree("")  # the others learn of rank 0's end of input
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        stream = TextStream(dec.tokenizer)

        def show(new: list[int], sources: list[str], stream: TextStream = stream) -> None:
            sys.stdout.write(stream.feed(new))
            sys.stdout.flush()

        out = dec.generate(
            messages,
            args.max_new_tokens,
            tree=None if args.plain else tree,
            sampling=sampling,
            seed=args.seed,
            on_tokens=show,
            constraint=constraint,
        )
        sys.stdout.write(stream.finish(out.token_ids) + "\n")
        messages.append({"role": "assistant", "content": out.text})
