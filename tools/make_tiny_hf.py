"""Build tiny Hugging Face artifacts offline, for tests and examples: a chat tokenizer, a random MiniMax
model, and a verl-layout math Parquet set.

    python tools/make_tiny_hf.py tokenizer --out DIR [--vocab-size 400] [--seed 0] [--bos]
    python tools/make_tiny_hf.py model --out DIR --vocab-size 512 [--seed 0] [--family minimax-m2 [--head-dim 32]]
    python tools/make_tiny_hf.py data --out DIR [--num-train 64] [--num-test 16] [--seed 0]

tokenizer: a byte-level BPE trained on a small generated math corpus (tokenizer.json and
tokenizer_config.json with a ChatML chat template; EOS <|endoftext|>, end of turn <|im_end|>, pad
<|pad|>, no BOS unless --bos). model: a randomly initialised transformers MiniMaxForCausalLM with
megacispo's layer pattern (7 lightning layers, then 1 softmax layer), or with --family minimax-m2 a
MiniMaxM2ForCausalLM of megacispo's tiny-m2 shape (8 layers of softmax attention with QK-norm, 4
experts routed by sigmoid scores and a selection bias). data: DIR/train.parquet and
DIR/test.parquet in verl's layout (prompt = a list of chat messages, the answer in
reward_model.ground_truth). Nothing is downloaded; the same seed writes the same files.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    MiniMaxConfig,
    MiniMaxForCausalLM,
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    PreTrainedTokenizerFast,
)

from megacispo.files import atomic_save_pretrained, atomic_write_bytes
from megacispo.models.config import FAMILIES, M1, M2, model_config
from megacispo.models.hf_names import config_to_hf

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<s>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
# ChatML: each turn is <|im_start|>role\ncontent<|im_end|>\n; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
DATA_SOURCE = "megacispo/tiny_math"


def math_problems(count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` (question, answer) pairs of 2-digit addition and subtraction, fixed by ``seed``."""
    rng = random.Random(f"make_tiny_hf:{seed}")
    problems = []
    for _ in range(count):
        a, b, op = rng.randrange(100), rng.randrange(100), rng.choice("+-")
        problems.append((f"What is {a} {op} {b}? {BOXED_INSTRUCTION}", str(a + b if op == "+" else a - b)))
    return problems


def corpus_lines(seed: int = 0, count: int = 400) -> list[str]:
    """Text for the tokenizer: questions, boxed answers and chat role names."""
    lines = ["user assistant system", "The answer is \\boxed{42}."]
    for question, answer in math_problems(count, seed):
        lines += [question, f"{answer} so the answer is \\boxed{{{answer}}}."]
    return lines


def build_tokenizer(
    out_dir: str | os.PathLike, corpus: Iterable[str] | None = None, vocab_size: int = 400, seed: int = 0,
    bos_token: str | None = None, pad_token: str | None = PAD_TOKEN,
) -> Path:
    """Train a byte-level BPE on ``corpus`` (default: ``corpus_lines(seed)``) and save it with a ChatML
    template to ``out_dir``, loadable by ``transformers.AutoTokenizer.from_pretrained(out_dir)``.

    Special tokens: EOS <|endoftext|>, <|im_start|>, <|im_end|> (the end of a turn), then the pad and
    BOS tokens when given (pad_token=None leaves the tokenizer without one, as many chat tokenizers are).
    """
    specials = [EOS_TOKEN, TURN_START, TURN_END] + [t for t in (pad_token, bos_token) if t is not None]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(list(corpus if corpus is not None else corpus_lines(seed)), trainer)
    template = ("{{- bos_token }}" if bos_token else "") + CHAT_TEMPLATE
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=pad_token, bos_token=bos_token,
        additional_special_tokens=[TURN_START, TURN_END], chat_template=template,
    )
    atomic_save_pretrained(tokenizer, out_dir)
    return Path(out_dir)


def build_model(
    out_dir: str | os.PathLike, vocab_size: int, seed: int = 0, hidden_size: int = 64, num_layers: int = 8,
    num_experts: int = 4, max_position_embeddings: int = 4096,
) -> Path:
    """Save a randomly initialised ``transformers.MiniMaxForCausalLM`` (the tiny shape of
    megacispo.testing.hf_models) to ``out_dir``; ``vocab_size`` must be at least the tokenizer's."""
    if num_layers % 8:
        raise ValueError(f"num_layers={num_layers}: megacispo's layer pattern LLLLLLLS needs a multiple of 8")
    config = MiniMaxConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 2, num_local_experts=num_experts,
        num_experts_per_tok=2, layer_types=(["linear_attention"] * 7 + ["full_attention"]) * (num_layers // 8),
        block_size=16, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        linear_attn_alpha_factor=2.0, linear_attn_beta_factor=0.8, full_attn_alpha_factor=1.5,
        full_attn_beta_factor=1.2, mlp_alpha_factor=1.7, mlp_beta_factor=0.9,
    )
    torch.manual_seed(seed)
    model = MiniMaxForCausalLM(config).eval()
    atomic_save_pretrained(model, out_dir)
    return Path(out_dir)


def build_m2_model(out_dir: str | os.PathLike, vocab_size: int, seed: int = 0, head_dim: int | None = None) -> Path:
    """Save a randomly initialised ``transformers.MiniMaxM2ForCausalLM`` of megacispo's tiny-m2 shape
    (with ``vocab_size`` embedding rows; ``head_dim``, with RoPE on half of it, in place of tiny-m2's) to
    ``out_dir``."""
    heads = {} if head_dim is None else {"head_dim": head_dim, "rotary_dim": head_dim // 2}
    config = MiniMaxM2Config(**config_to_hf(model_config("tiny-m2", vocab_size=vocab_size, **heads)),
                             bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    atomic_save_pretrained(MiniMaxM2ForCausalLM(config).eval(), out_dir)
    return Path(out_dir)


def write_math_parquet(path: str | os.PathLike, problems: Sequence[tuple[str, str]], split: str = "train") -> Path:
    """Write (question, answer) pairs as a verl-layout Parquet file: data_source, prompt (one user
    message), ability, reward_model {"style": "rule", "ground_truth": answer}, extra_info."""
    rows: list[dict[str, Any]] = [
        {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": question}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": split, "index": index}}
        for index, (question, answer) in enumerate(problems)
    ]
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    atomic_write_bytes(path, buffer.getvalue().to_pybytes())
    return Path(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["tokenizer", "model", "data"])
    parser.add_argument("--out", required=True, help="directory to write into (created)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same files")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokenizer: most tokens (default 400); model: embedding rows (required, at least "
                             "the tokenizer's)")
    parser.add_argument("--bos", action="store_true",
                        help="tokenizer: add a BOS token <s> (the template starts with it)")
    parser.add_argument("--num-train", type=int, default=64, help="data: problems in train.parquet")
    parser.add_argument("--num-test", type=int, default=16, help="data: problems in test.parquet")
    parser.add_argument("--family", choices=FAMILIES, default=M1,
                        help="model: the MiniMax family (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="model, minimax-m2: the attention heads' width, RoPE on half of it (default tiny-m2's 16; "
                             "vLLM's CPU attention needs 32 or more)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.what == "tokenizer":
        bos_token = BOS_TOKEN if args.bos else None
        build_tokenizer(out, vocab_size=args.vocab_size or 400, seed=args.seed, bos_token=bos_token)
    elif args.what == "model":
        if not args.vocab_size:
            print("error: model needs --vocab-size (at least the tokenizer's vocabulary)", file=sys.stderr)
            return 2
        if args.family == M2:
            build_m2_model(out, args.vocab_size, seed=args.seed, head_dim=args.head_dim)
        else:
            build_model(out, args.vocab_size, seed=args.seed)
    else:
        problems = math_problems(args.num_train + args.num_test, args.seed)
        write_math_parquet(out / "train.parquet", problems[: args.num_train], split="train")
        write_math_parquet(out / "test.parquet", problems[args.num_train :], split="test")
    print(f"wrote {args.what} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
