"""Tokenizer training (tools/train_tokenizer.py, train_sentencepiece) and the Tokenizer wrapper."""

from __future__ import annotations

from pathlib import Path

import pytest
from arithmetic_tasks import ArithmeticTask, generate_task_data

from megacispo.data.prompts import PromptRecord, build_sft_example, encode_prompt
from megacispo.data.tokenizer import MODEL_FILENAME, Tokenizer, train_sentencepiece
from megacispo.testing.tool_modules import load_tool


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    data = generate_task_data(ArithmeticTask("add_sub", digits=2), num_train=400, num_test=1, seed=0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(line + "\n" for line in data.corpus_lines()), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus_path, tmp_path_factory) -> Tokenizer:
    return Tokenizer.load(train_sentencepiece([corpus_path], 512, tmp_path_factory.mktemp("tokenizer")))


def test_special_ids_are_fixed_and_distinct(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    # 4 specials + 256 byte pieces + 10 digits, the whitespace marker, "+", "-", "=".
    assert tokenizer.vocab_size == 4 + 256 + 10 + 1 + 3


def test_digits_and_operators_are_single_tokens(tokenizer):
    for char in "0123456789+-=":
        (token_id,) = tokenizer.encode(char)
        assert tokenizer.id_to_piece(token_id) == char
    # split_digits: a number is one token per digit, never a multi-digit piece.
    assert [tokenizer.id_to_piece(i) for i in tokenizer.encode("1234+56=1290")] == list("1234+56=1290")


@pytest.mark.parametrize(
    "text",
    ["12+7=19", "99-100=-1", "0", "  3 + 4 = 7  ", "7\n8\t9", "héllo wörld €5 ✓", ""],
)
def test_encode_decode_round_trip_is_exact(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_id not in ids, "byte fallback: no character is unknown"


def test_bos_eos_only_on_request(tokenizer):
    plain = tokenizer.encode("12+7=")
    assert tokenizer.bos_id not in plain and tokenizer.eos_id not in plain
    assert tokenizer.encode("12+7=", add_bos=True, add_eos=True) == [tokenizer.bos_id] + plain + [tokenizer.eos_id]
    assert tokenizer.decode([tokenizer.bos_id] + plain + [tokenizer.eos_id, tokenizer.pad_id]) == "12+7="


def test_prompt_and_answer_encode_like_their_concatenation(tokenizer):
    # No dummy prefix: the SFT sequence is exactly the tokens of the text the model would read.
    for prompt, answer in [("12+7=", "19"), ("3-50=", "-47")]:
        example = build_sft_example(tokenizer, PromptRecord(prompt, answer))
        assert example.token_ids == encode_prompt(tokenizer, prompt) + tokenizer.encode(answer) + [tokenizer.eos_id]
        assert example.token_ids[1:-1] == tokenizer.encode(prompt + answer)


def test_ids_past_the_vocabulary_decode_as_unknown(tokenizer):
    one, nine = tokenizer.encode("1") + tokenizer.encode("9")
    decoded = tokenizer.decode([one, tokenizer.vocab_size + 5, nine])
    assert decoded != "19" and decoded.startswith("1") and decoded.endswith("9")


def test_training_is_deterministic(corpus_path, tokenizer, tmp_path):
    again = train_sentencepiece([corpus_path], 512, tmp_path)
    assert again.read_bytes() == tokenizer.path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_FILENAME], "no temporary files left"


def test_vocab_size_is_an_upper_bound_unless_exact(corpus_path, tmp_path):
    assert Tokenizer.load(train_sentencepiece([corpus_path], 300, tmp_path)).vocab_size == 274
    with pytest.raises(ValueError, match=r"at most 274 pieces.*--vocab-size 274 or less"):
        train_sentencepiece([corpus_path], 300, tmp_path / "exact", exact_vocab_size=True)
    with pytest.raises(ValueError, match="vocab_size=100 is too small.*need 274"):
        train_sentencepiece([corpus_path], 100, tmp_path / "small")
    assert not (tmp_path / "exact").exists() and not (tmp_path / "small").exists()


def test_bad_corpus_is_named(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(ValueError, match="missing.txt"):
        train_sentencepiece([missing], 512, tmp_path / "out")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no text"):
        train_sentencepiece([blank], 512, tmp_path / "out")


def test_load_missing_model_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none" / MODEL_FILENAME)):
        Tokenizer.load(tmp_path / "none" / MODEL_FILENAME)
    # A directory without a model: the error names the file looked for.
    with pytest.raises(FileNotFoundError, match=str(tmp_path / MODEL_FILENAME)):
        Tokenizer.load(tmp_path)


def test_load_corrupt_model_names_the_path(tmp_path):
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match=f"{corrupt}.*not a valid sentencepiece model"):
        Tokenizer.load(corrupt)


def test_load_accepts_the_directory(tokenizer):
    assert Tokenizer.load(tokenizer.path.parent).encode("1+1=") == tokenizer.encode("1+1=")


def test_cli_trains_and_reports(corpus_path, tmp_path, capsys):
    train_tokenizer = load_tool("train_tokenizer")

    out = tmp_path / "tok"
    assert train_tokenizer.main(["--input", str(corpus_path), "--vocab-size", "512", "--out", str(out)]) == 0
    assert f"wrote {out / MODEL_FILENAME} (vocab_size=274" in capsys.readouterr().out
    arguments = ["--input", str(corpus_path), "--vocab-size", "512", "--out", str(tmp_path / "x"), "--exact-vocab-size"]
    assert train_tokenizer.main(arguments) == 2
    assert "larger than this corpus supports" in capsys.readouterr().err


def test_sentencepiece_save_files_and_no_chat_template(tokenizer, tmp_path):
    [written] = tokenizer.save_files(tmp_path / "export")
    assert written == tmp_path / "export" / MODEL_FILENAME and written.read_bytes() == tokenizer.path.read_bytes()
    assert Tokenizer.load(tmp_path / "export").encode("12+7=") == tokenizer.encode("12+7=")
    assert tokenizer.stop_ids == (tokenizer.eos_id,) and not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="has no chat template; set data.chat_template: false"):
        tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True)
