"""Prompt data: its config section, prompt and SFT files, the tokenizer, padding, rewards and math grading."""
