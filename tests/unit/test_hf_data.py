"""Hugging Face tokenizers, chat templates, Parquet and nested-key data, and tools/make_tiny_hf.py.

A tiny byte-level BPE with a ChatML template (tools/make_tiny_hf.py, trained in about a second) is
compared with transformers' own AutoTokenizer: special and stop ids, encode/decode, the rendered
prompts, the SFT target and its loss mask, and the files save_files writes. Data files in verl's
Parquet layout and the same records as JSONL load alike; each bad record names file, row and field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megacispo.data import prompts as data_module
from megacispo.data.prompts import (
    PromptLimit,
    PromptRecord,
    PromptSampler,
    RecordFields,
    build_sft_example,
    collate_sft,
    encode_prompt,
    load_prompts,
)
from megacispo.data.tokenizer import UNKNOWN_TEXT, HFTokenizer, Tokenizer
from megacispo.testing.tool_modules import load_tool

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

make_tiny_hf = load_tool("make_tiny_hf")
CHAT = RecordFields(chat_template=True)
VERL = RecordFields(prompt_key="prompt", answer_key="reward_model.ground_truth", chat_template=True)
PROBLEMS = [("What is 1 + 2? Put the final answer in \\boxed{}.", "3"), ("What is 9 - 12?", "-3")]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tiny_hf.build_tokenizer(tmp_path_factory.mktemp("hf_tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir) -> HFTokenizer:
    return Tokenizer.load(tok_dir)


@pytest.fixture(scope="module")
def reference(tok_dir):
    """transformers' own view of the same files."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def hf_chat_ids(hf_tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    return hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=True)["input_ids"]


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


def test_special_and_stop_ids_match_transformers(tokenizer, reference):
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == len(reference) == 400
    ids = reference.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|pad|>"])
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id) == (ids[0], ids[2], None)
    assert tokenizer.stop_ids == (ids[0], ids[1]), "EOS, then the template's end of turn"
    assert tokenizer.has_chat_template


@pytest.mark.parametrize("text", ["What is 12 + 7?", "  spaces  and\nlines\t", "héllo ✓ €5", ""])
def test_encode_adds_nothing_and_decode_round_trips(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_decode_skips_special_tokens_and_shows_ids_past_the_vocabulary(tokenizer):
    one, nine = tokenizer.encode("1") + tokenizer.encode("9")
    assert tokenizer.decode([one, *tokenizer.stop_ids, tokenizer.pad_id, nine]) == "19"
    assert tokenizer.decode([one, tokenizer.vocab_size, nine, -1]) == f"1{UNKNOWN_TEXT}9{UNKNOWN_TEXT}"


def test_save_files_round_trips_through_transformers(tokenizer, reference, tmp_path):
    from transformers import AutoTokenizer

    written = tokenizer.save_files(tmp_path / "export")
    assert {path.name for path in written} >= {"tokenizer.json", "tokenizer_config.json"}
    assert not [path for path in (tmp_path / "export").iterdir() if path.name.startswith(".")], "no staging left"
    again = AutoTokenizer.from_pretrained(tmp_path / "export")
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    assert hf_chat_ids(again, messages, True) == hf_chat_ids(reference, messages, True)
    assert Tokenizer.load(tmp_path / "export").stop_ids == tokenizer.stop_ids


def test_without_pad_the_pad_id_is_eos_and_a_bos_starts_each_prompt(tmp_path):
    tokenizer = Tokenizer.load(make_tiny_hf.build_tokenizer(tmp_path, pad_token=None, bos_token="<s>"))
    assert tokenizer.pad_id == tokenizer.eos_id and tokenizer.bos_id is not None
    assert encode_prompt(tokenizer, "1+1=") == [tokenizer.bos_id] + tokenizer.encode("1+1=")
    assert encode_prompt(tokenizer, "1+1=", chat_template=True)[0] == tokenizer.bos_id


def test_a_tokenizer_without_bos_gives_prompts_without_one(tokenizer):
    assert encode_prompt(tokenizer, "1+1=") == tokenizer.encode("1+1=")


@pytest.mark.parametrize("template, stops", [
    # Llama 2 style: the turn ends with EOS itself.
    ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
     "{% endfor %}", "eos"),
    # A turn closed by plain text: only EOS can stop.
    ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n\\n' }}{% endfor %}", "eos"),
    (make_tiny_hf.CHAT_TEMPLATE, "eos+im_end"),
])
def test_end_of_turn_rule(tok_dir, template, stops):
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    hf_tokenizer.chat_template = template
    tokenizer = HFTokenizer(hf_tokenizer, tok_dir)
    end_of_turn = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = {"eos": (tokenizer.eos_id,), "eos+im_end": (tokenizer.eos_id, end_of_turn)}
    assert tokenizer.stop_ids == expected[stops]


def test_damaged_tokenizer_directories_name_the_path_and_the_fix(tok_dir, tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match=rf"{garbage}' does not load \(JSONDecodeError.*save_pretrained"):
        Tokenizer.load(garbage)
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=rf"{no_eos}' defines no eos_token; set \"eos_token\""):
        Tokenizer.load(no_eos / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="nor is .* a Hugging Face tokenizer directory"):
        Tokenizer.load(tmp_path)


# ---------------------------------------------------------------------------------------------
# Chat prompts and SFT targets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [
    "What is 1 + 2?",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}],
])
def test_chat_prompts_render_as_transformers_renders_them(tokenizer, reference, prompt):
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    assert encode_prompt(tokenizer, prompt, chat_template=True) == hf_chat_ids(reference, messages, True)


def test_chat_sft_loss_covers_the_assistant_turn_through_its_end(tokenizer, reference):
    record = PromptRecord("What is 1 + 2?", "The answer is \\boxed{3}.")
    example = build_sft_example(tokenizer, record, chat_template=True)
    messages = [{"role": "user", "content": record.prompt}, {"role": "assistant", "content": record.answer}]
    full = hf_chat_ids(reference, messages, False)
    # The template ends the turn with <|im_end|> and a newline: the newline is not taught.
    assert example.token_ids == full[:-1] and reference.decode(full[-1:]) == "\n"
    batch = collate_sft([example], tokenizer.pad_id)
    taught = batch.labels[batch.loss_mask.bool()].tolist()
    assert taught == tokenizer.encode(record.answer) + [tokenizer.stop_ids[1]]
    assert example.num_prompt_tokens == len(hf_chat_ids(reference, messages[:1], True))


def test_sft_pairs_loaded_with_the_template_store_their_target(tokenizer, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "answer": 4}) + "\n")
    limit = PromptLimit(tokenizer, 100, "the limit", with_answer=True)
    [record] = load_prompts(path, limit, CHAT)
    assert record.answer == "4"
    example = build_sft_example(tokenizer, record, chat_template=True)
    made_in_code = build_sft_example(tokenizer, PromptRecord(record.prompt, "4"), chat_template=True)
    assert example.token_ids == made_in_code.token_ids
    assert list(record.target_ids) == tokenizer.encode("4") + [tokenizer.stop_ids[1]]


def test_a_template_that_does_not_extend_the_prompt_is_an_error_naming_the_row(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    # The generation prompt says "bot", the assistant turn "assistant": the prompt is no prefix.
    hf_tokenizer.chat_template = make_tiny_hf.CHAT_TEMPLATE.replace("<|im_start|>assistant", "<|im_start|>bot")
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    limit = PromptLimit(HFTokenizer(hf_tokenizer, tok_dir), 100, "the limit", with_answer=True)
    with pytest.raises(ValueError, match=rf"{path}:1: the chat template renders .* does not start with the rendered"):
        load_prompts(path, limit, CHAT)


def test_overlong_chat_prompts_lose_their_start(tokenizer, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 2 + 3 + 4 + 5?", "answer": "15"}) + "\n")
    full = encode_prompt(tokenizer, "What is 1 + 2 + 3 + 4 + 5?", chat_template=True)
    limit = PromptLimit(tokenizer, len(full) - 3, "the limit", "truncate_left")
    [record] = load_prompts(path, limit, CHAT)
    assert list(record.prompt_ids) == full[3:], "no BOS to keep: the first tokens go"
    with pytest.raises(ValueError, match=r"long.jsonl:1: the prompt \(in the chat template, with the generation"):
        load_prompts(path, PromptLimit(tokenizer, len(full) - 3, "the limit"), CHAT)


def test_message_prompts_fingerprint_and_serialise(tmp_path):
    records = [PromptRecord([{"role": "user", "content": "1+1?"}], "2"), PromptRecord("x", "y")]
    sampler = PromptSampler(records, seed=0)
    sampler.load_state_dict(PromptSampler(list(records), seed=0).state_dict())
    assert records[0].to_json() == {"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}


# ---------------------------------------------------------------------------------------------
# Parquet and nested keys
# ---------------------------------------------------------------------------------------------


def verl_rows(problems) -> list[dict]:
    return [{"data_source": make_tiny_hf.DATA_SOURCE, "prompt": [{"role": "user", "content": question}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
             "extra_info": {"split": "train", "index": index}} for index, (question, answer) in enumerate(problems)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_and_jsonl_with_nested_keys_load_the_same_records(tmp_path):
    parquet = make_tiny_hf.write_math_parquet(tmp_path / "math.parquet", PROBLEMS)
    jsonl = tmp_path / "math.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in verl_rows(PROBLEMS)))
    records = load_prompts(parquet, fields=VERL)
    assert records == load_prompts(jsonl, fields=VERL)
    assert records[1] == PromptRecord(
        [{"role": "user", "content": "What is 9 - 12?"}], "-3",
        {"data_source": make_tiny_hf.DATA_SOURCE, "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "-3"}, "extra_info": {"split": "train", "index": 1}},
    )


def test_parquet_is_read_in_batches_and_numbers_are_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "PARQUET_BATCH_ROWS", 2)
    path = write_parquet(tmp_path / "ints.parquet", [{"q": f"{i}+1=", "sol": {"value": i + 1}} for i in range(5)])
    records = load_prompts(path, fields=RecordFields(prompt_key="q", answer_key="sol.value"))
    assert [(r.prompt, r.answer, r.extra) for r in records][-1] == ("4+1=", "5", {"sol": {"value": 5}})
    bad = write_parquet(tmp_path / "bad.parquet", [{"q": "a", "sol": {"value": 1}}] * 3 + [{"q": "b", "sol": None}])
    with pytest.raises(ValueError, match=rf"{bad}: row 3 \(0-based\): missing field 'sol.value'; every record needs "
                                         r"a prompt at data.prompt_key = 'q' and an answer at data.answer_key"):
        load_prompts(bad, fields=RecordFields(prompt_key="q", answer_key="sol.value"))


@pytest.mark.parametrize("rows, fields, message", [
    (verl_rows(PROBLEMS), RecordFields(answer_key="reward_model.answer", chat_template=True),
     r"row 0 \(0-based\): missing field 'reward_model.answer'"),
    (verl_rows(PROBLEMS), RecordFields(answer_key="reward_model.ground_truth"),
     r"row 0 \(0-based\): field 'prompt' is a list of chat messages, which only data.chat_template: true renders"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}], RecordFields(),
     r"row 1 \(0-based\): field 'answer' must be a string \(or a number\), got NoneType None"),
    ([{"prompt": "a", "answer": True}], RecordFields(),
     r"row 0 \(0-based\): field 'answer' must be a string \(or a number\), got bool True"),
    ([{"prompt": [{"role": "user", "content": None}], "answer": "1"}], CHAT,
     r"row 0 \(0-based\): field 'prompt', message 0: expected \{\"role\": str, \"content\": str\}"),
    ([{"prompt": 5, "answer": "1"}], CHAT,
     r"row 0 \(0-based\): field 'prompt' must be a string or a list of \{\"role\", \"content\"\} messages, got int"),
])
def test_bad_parquet_records_name_file_row_and_field(tmp_path, rows, fields, message):
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=rf"{path}: {message}"):
        load_prompts(path, fields=fields)


def test_unreadable_parquet_and_unknown_suffixes_are_named(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 not really a parquet file")
    with pytest.raises(ValueError, match=rf"{garbage}: not a readable Parquet file .*or convert it to .jsonl"):
        load_prompts(garbage)
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(ValueError, match=rf"{csv}' has the suffix '.csv'; use .jsonl .* or .parquet"):
        load_prompts(csv)


def test_bad_keys_are_named():
    with pytest.raises(ValueError, match=r"data.answer_key = 'reward_model.' is not a field name"):
        RecordFields(answer_key="reward_model.")


# ---------------------------------------------------------------------------------------------
# tools/make_tiny_hf.py
# ---------------------------------------------------------------------------------------------


def test_builders_are_deterministic_and_fit_megacispo(tok_dir, tmp_path):
    from megacispo.models.hf_names import config_from_hf

    again = make_tiny_hf.build_tokenizer(tmp_path / "tok")
    assert (again / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert make_tiny_hf.main(["model", "--out", str(tmp_path / "model"), "--vocab-size", "512"]) == 0
    config = config_from_hf(json.loads((tmp_path / "model" / "config.json").read_text()))
    assert (config.layer_pattern, config.vocab_size) == ("LLLLLLLS", 512)
    assert make_tiny_hf.main(["data", "--out", str(tmp_path / "data"), "--num-train", "3", "--num-test", "2"]) == 0
    train = load_prompts(tmp_path / "data" / "train.parquet", fields=VERL)
    assert len(train) == 3 and len(load_prompts(tmp_path / "data" / "test.parquet", fields=VERL)) == 2
    assert all(str(int(r.answer)) == r.answer and "\\boxed{}" in r.prompt[0]["content"] for r in train)


def test_the_quick_starts_m2_has_the_head_width_asked_for(tmp_path):
    """FAMILY=minimax-m2 bash examples/quickstart.sh's M2: tiny-m2 with 32-wide heads, RoPE on half of each."""
    from megacispo.models.config import model_config
    from megacispo.models.hf_names import config_from_hf

    argv = ["model", "--family", "minimax-m2", "--head-dim", "32", "--out", str(tmp_path), "--vocab-size", "512"]
    assert make_tiny_hf.main(argv) == 0
    config = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert config == model_config("tiny-m2", vocab_size=512, head_dim=32, rotary_dim=16)
