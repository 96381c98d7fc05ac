"""Target/draft vocabulary compatibility: what must agree, and padded output layers.

Speculative decoding needs the draft's token ids to mean what the target's mean. What
matters is compared, not just sizes:

- the two tokenizers' vocabularies on every id both define (added/special tokens included);
- their EOS, BOS and UNK ids;
- each model's output rows against the tokenizer: a model may have more rows than the
  tokenizer has tokens (Qwen-style padding: 151,665 tokens in 151,936 or 152,064 rows).

Padding is handled by `fit_logits`: the draft's logits are cut (or padded with -inf) to the
target's row count and every id the tokenizer does not know gets -inf, so q puts no mass
there. Verification is lossless for any q as long as the q stored with a proposal is the one
it was drawn from, which `ModelDrafter` guarantees by fitting before the sampling transform;
p is never touched (the output is exactly the target's own sampling).
"""

from __future__ import annotations

import torch


def tokenizer_size(tokenizer) -> int | None:
    """Number of token ids the tokenizer defines (added tokens included), if it says."""
    try:
        return int(len(tokenizer))
    except TypeError:
        return None


def _vocab(tokenizer) -> dict[int, str] | None:
    get = getattr(tokenizer, "get_vocab", None)
    if get is None:
        return None
    return {int(i): t for t, i in get().items()}


def compare_tokenizers(target, draft) -> None:
    """ValueError naming the ids where the draft's tokenizer disagrees with the target's:
    differing tokens on shared ids, or differing EOS/BOS/UNK ids. Ids only one tokenizer
    defines are allowed (the draft is kept off them by `fit_logits`)."""
    if target is None or draft is None or target is draft:
        return
    tv, dv = _vocab(target), _vocab(draft)
    if tv is not None and dv is not None:
        differ = sorted(i for i in tv.keys() & dv.keys() if tv[i] != dv[i])
        if differ:
            shown = ", ".join(f"{i}: {tv[i]!r} vs {dv[i]!r}" for i in differ[:5])
            raise ValueError(
                f"the draft's tokenizer differs from the target's on {len(differ)} of "
                f"{len(tv.keys() & dv.keys())} "
                f"shared ids (target vs draft: {shown}{', ...' if len(differ) > 5 else ''}); "
                "speculative decoding "
                f"needs one vocabulary: use a draft from the target's model family"
            )
    for role in ("eos_token_id", "bos_token_id", "unk_token_id"):
        a, b = getattr(target, role, None), getattr(draft, role, None)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"target and draft tokenizers disagree on {role}: {a} vs {b}; use a draft with the "
                "target's tokenizer"
            )


def shared_support(target_rows: int, draft_rows: int, tokenizer) -> int:
    """How many leading ids q may put mass on, or a ValueError for a real mismatch.

    Without a tokenizer that reports its size, different row counts cannot be told apart
    from different vocabularies and are refused. With one, ids below the tokenizer's size
    are real tokens; the rows above it are padding.
    """
    n = tokenizer_size(tokenizer) if tokenizer is not None else None
    if n is None:
        if draft_rows != target_rows:
            raise ValueError(
                f"draft and target vocabularies differ ({draft_rows} vs {target_rows} tokens) and "
                "no tokenizer tells "
                "whether the extra rows are padding; pass tokenizer=... (the target's) or use one "
                "shared tokenizer"
            )
        return target_rows
    if draft_rows < min(n, target_rows):
        raise ValueError(
            f"the draft model has {draft_rows} output rows but the tokenizer has {n} tokens "
            f"(target: {target_rows} rows): "
            f"the draft cannot read every token the target emits; draft and target vocabularies differ"
        )
    return min(n, target_rows, draft_rows)


def fit_logits(logits: torch.Tensor, vocab_size: int, support: int) -> torch.Tensor:
    """[..., Vd] draft logits -> [..., vocab_size], -inf on every id >= `support`."""
    if logits.shape[-1] == vocab_size == support:
        return logits
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., :support] = logits[..., :support]
    return out
