"""``python -m fastpar.tokenizer``: train a small byte-level BPE tokenizer, offline, in seconds.

    python -m fastpar.tokenizer --vocab-size 512 --out tok.json                 # embedded corpus
    python -m fastpar.tokenizer --vocab-size 4096 --out tok.json --data my.txt
    python -m fastpar.train --model llama --tokenizer tok.json                  # then train on it

What it saves and reads: docs/training.md ("Data").
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from fastpar.cliutil import Parser
from fastpar.data import embedded_corpus, require_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>",)


def train_tokenizer(lines: Iterable[str], vocab_size: int, special_tokens=SPECIAL_TOKENS):
    """A trained byte-level BPE ``tokenizers.Tokenizer`` of at most ``vocab_size`` tokens."""
    tokenizers = require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    floor = 256 + len(special_tokens)
    if vocab_size < floor:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE holds the 256 bytes and "
            f"{len(special_tokens)} special token(s); use --vocab-size {floor} or more"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m fastpar.tokenizer", description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, required=True, help="tokens, >= 257")
    ap.add_argument("--out", required=True, help="the tokenizer.json to write")
    ap.add_argument(
        "--data", default=None, help="UTF-8 text to train on (default: embedded corpus)"
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.data is None:
            text, source = embedded_corpus().decode(), "the embedded corpus"
        else:
            with open(args.data, encoding="utf-8") as f:
                text, source = f.read(), args.data
        tok = train_tokenizer(text.splitlines(keepends=True), args.vocab_size)
    except (ValueError, ImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tok.save(args.out)
    n = tok.get_vocab_size(with_added_tokens=True)
    note = (
        "" if n == args.vocab_size else f" (the corpus allowed {n} of the {args.vocab_size} asked)"
    )
    print(
        f"wrote {args.out}: byte-level BPE, {n} tokens{note}, trained on {len(text.encode()):,} "
        f"bytes of {source} in {time.perf_counter() - t0:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
