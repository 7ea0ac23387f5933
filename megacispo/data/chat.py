"""The tokens of a conversation beyond its first prompt: what an environment's reply adds after a model
turn, rendered once, as ids, and never re-tokenized from the conversation's text.

A model turn ends with the token it sampled last: a stop id (EOS, the chat template's end of turn) or
one of env.stop_tokens (a tool call's closing tag, which a chat template would follow with its end of
turn). ``ReplyRenderer.reply_ids`` gives the ids fed after it, through the next assistant header:

    with the chat template:   what template(probe + replies, add_generation_prompt=True) adds after the
                              probe's assistant turn up to its end-of-turn token: the template's own
                              framing of tool and user messages (``apply_chat_template(..., tools=...)``),
                              the end-of-turn token first when the model stopped at a tool tag
    without it:               encode(content) of each reply message, one after the other (the
                              environment formats its replies as text the model reads)

The probe (a fixed user message and assistant answer) keeps the reply's ids independent of what the
model wrote: the conversation's sampled tokens are the training sequence as they were drawn.
SFT on multi-turn demonstrations (``turn_ids``) builds its sequences with the same renderer, so a
demonstration is laid out as a rollout of it would be.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from megacispo.data.prompts import Messages, TokenizerLike, chat_messages, encode_prompt

_PROBE: Messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "1"}]


class ReplyRenderer:
    """Ids of a conversation's first prompt and of the replies that follow model turns.
    ``tool_stop_ids``: the ids that end a model turn besides the tokenizer's stop ids (env.stop_tokens)."""

    def __init__(self, tokenizer: TokenizerLike, chat_template: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                 tool_stop_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tools = list(tools) if tools else None
        self.turn_stop_ids = frozenset(tokenizer.stop_ids) | frozenset(tool_stop_ids)
        """Every id that ends a model turn."""
        self.end_of_turn = tokenizer.eos_id
        """The id that closes an assistant turn: the template's end of turn, or EOS without one."""
        if chat_template:
            self._probe_ids, self._end_index = self._probe()
            self.end_of_turn = self._probe_ids[self._end_index]

    def _render(self, messages: Messages, add_generation_prompt: bool) -> list[int]:
        extra = {} if self.tools is None else {"tools": self.tools}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)

    def _probe(self) -> tuple[list[int], int]:
        """The probe conversation's ids and the index of its assistant turn's end-of-turn token."""
        prompt = self._render(_PROBE[:1], add_generation_prompt=True)
        full = self._render(_PROBE, add_generation_prompt=False)
        stops = self.tokenizer.stop_ids
        end = next((i for i in range(len(prompt), len(full)) if full[i] in stops), None)
        if full[:len(prompt)] != prompt or end is None:
            raise ValueError(
                "env.name with data.chat_template: the chat template's assistant turn does not extend its generation "
                "prompt and end with a stop id, so an environment's reply cannot be placed after a model turn; use a "
                "template that closes assistant turns with an end-of-turn token"
            )
        return full, end

    def prompt_ids(self, messages: Messages | str) -> list[int]:
        """The ids the first model turn is conditioned on (``encode_prompt``'s layout; without the chat
        template the messages' contents are one text)."""
        if self.chat_template:
            return self._render(chat_messages(messages), add_generation_prompt=True)
        text = messages if isinstance(messages, str) else "".join(message["content"] for message in messages)
        return encode_prompt(self.tokenizer, text)

    def reply_ids(self, replies: Messages, last_id: int) -> list[int]:
        """The ids fed after a model turn whose last sampled id is ``last_id`` and before the model's next
        turn: ``replies`` rendered (with the template, the end of turn first when the turn stopped at a tool tag)."""
        if not self.chat_template:
            return [token_id for message in replies for token_id in self.tokenizer.encode(message["content"])]
        full = self._render(_PROBE + list(replies), add_generation_prompt=True)
        base = self._probe_ids[: self._end_index + 1]
        if full[:len(base)] != base:
            raise ValueError(
                f"the chat template renders {[m['role'] for m in replies]} messages after an assistant turn so that the "
                "conversation before them changes, so the reply cannot be appended to the sampled tokens; use a "
                "template that renders each message after the previous ones"
            )
        return full[self._end_index + 1:] if last_id in self.tokenizer.stop_ids else full[self._end_index:]

    def turn_ids(self, turns: Messages) -> tuple[list[int], list[bool]]:
        """An SFT demonstration's turns after its prompt: (ids, True at the ids the model writes). An
        assistant turn is its content's ids, closed by ``end_of_turn`` unless they end a turn already
        (a tool tag); the messages between two assistant turns are ``reply_ids``, as a rollout feeds them."""
        ids: list[int] = []
        generated: list[bool] = []
        index = 0
        while index < len(turns):
            if turns[index]["role"] == "assistant":
                written = self.tokenizer.encode(turns[index]["content"])
                if not written or written[-1] not in self.turn_stop_ids:
                    written.append(self.end_of_turn)
                ids += written
                generated += [True] * len(written)
                index += 1
                continue
            replies = []
            while index < len(turns) and turns[index]["role"] != "assistant":
                replies.append(turns[index])
                index += 1
            if not ids:
                raise ValueError(f"turns start with a {replies[0]['role']!r} message: the first turn after the prompt "
                                 "is the model's (role 'assistant')")
            fed = self.reply_ids(replies, ids[-1])
            ids += fed
            generated += [False] * len(fed)
        return ids, generated
