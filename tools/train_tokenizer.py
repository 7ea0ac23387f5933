"""Train a sentencepiece tokenizer for megacispo and write DIR/tokenizer.model.

    python tools/train_tokenizer.py --input corpus.txt [more.txt ...] --vocab-size 512 --out DIR

--vocab-size is an upper bound: a small corpus (the arithmetic task's) yields fewer pieces, which a
model with a 512-row embedding uses as is. --exact-vocab-size turns a shortfall into an error.
--symbols makes texts single tokens (a tool call's tags, which env.stop_tokens must name as one token each).
The choices behind the model (digits split, byte fallback, fixed special ids) are documented in
megacispo/data/tokenizer.py.
"""

from __future__ import annotations

import argparse
import sys

from megacispo.data.tokenizer import Tokenizer, train_sentencepiece


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="UTF-8 text files, one sentence per line")
    parser.add_argument("--vocab-size", type=int, required=True, help="most pieces the tokenizer may have")
    parser.add_argument("--out", required=True, help="directory to write tokenizer.model into (created)")
    parser.add_argument(
        "--exact-vocab-size", action="store_true", help="fail unless the corpus fills exactly --vocab-size pieces"
    )
    parser.add_argument(
        "--symbols", nargs="*", default=[],
        help="texts that are always one token each, e.g. a tool call's tags: --symbols '<python>' '</python>'",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_path = train_sentencepiece(args.input, args.vocab_size, args.out, args.exact_vocab_size, args.symbols)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.load(model_path)
    print(
        f"wrote {model_path} (vocab_size={tokenizer.vocab_size}, pad={tokenizer.pad_id}, "
        f"bos={tokenizer.bos_id}, eos={tokenizer.eos_id})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
