#!/usr/bin/env python
"""Unigram and bigram token counts of the bundled pair's training corpus, for the count drafters.

    python experiments/build/build_count_drafters.py            # writes treespec/zoo/pycode/counts.npz

The corpus is exactly the pair's training split (`train_pycode_pair.collect_files`: the `.py`
files of this Python's standard library minus test dirs and site-packages, held-out files
excluded), tokenized with the bundled tokenizer, each file preceded by <|endoftext|> (as in
training). Stored:

    unigram            [V] int64  count of each token
    bigram_indptr      [V+1] int64, bigram_indices [nnz] int16/int32, bigram_counts [nnz] int32:
                       CSR rows: counts of (previous token, next token) pairs
    min_bigram_count   pairs seen fewer times than this are dropped (their mass falls back to
                       the drafter's unigram prior), to keep the file small

`treespec.drafters.counts` turns these into draft distributions (see `UnigramDrafter`,
`BigramDrafter`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from treespec.drafters.counts import write_counts

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/build/

from train_pycode_pair import EOS, collect_files  # noqa: E402  (same corpus, same split)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "treespec" / "zoo" / "pycode" / "counts.npz")
    ap.add_argument("--min-bigram-count", type=int, default=2)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REPO / "treespec" / "zoo" / "pycode" / "target" / "tokenizer.json"))
    V, eos = tok.get_vocab_size(), tok.token_to_id(EOS)
    root, train, heldout, skipped = collect_files()
    ids = []
    for enc in tok.encode_batch([text for _, text in train]):
        ids.append(np.array([eos], dtype=np.int64))
        ids.append(np.asarray(enc.ids, dtype=np.int64))
    stream = np.concatenate(ids)
    meta = {
        "corpus": f"stdlib {root}: {len(train)} training files "
        "(held-out split of train_pycode_pair.py excluded)",
        "python": sys.version.split()[0],
        "corpus_sha1": hashlib.sha1(stream.astype(np.int32).tobytes()).hexdigest(),
        "command": "python experiments/build/build_count_drafters.py"
        + (f" --min-bigram-count {args.min_bigram_count}" if args.min_bigram_count != 2 else ""),
    }
    meta.update(write_counts([stream], V, args.out, args.min_bigram_count, meta))
    print(json.dumps(meta, indent=1))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
