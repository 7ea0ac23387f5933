"""logging.metric_hooks: built at start-up by name or module:Class, with errors that name the hook's field."""

from __future__ import annotations

import pytest

from megacispo.config import load_config
from megacispo.rl.metric_hooks import ProbeToken, build_metric_hooks


class _Tokenizer:
    def single_token_id(self, text: str) -> int:
        if len(text) != 1:
            raise ValueError(f"{text!r} encodes to {len(text)} tokens")
        return ord(text)


class CountingHook:
    """A user's hook: what build_metric_hooks passes it."""

    def __init__(self, *, tokenizer, scale: float = 1.0):
        self.tokenizer, self.scale = tokenizer, scale


def test_built_in_and_user_hooks_are_built_with_their_parameters():
    tokenizer = _Tokenizer()
    probe, user = build_metric_hooks({"probe_token": {"token": "~"}, f"{__name__}:CountingHook": {"scale": 2.0}},
                                     tokenizer)
    assert isinstance(probe, ProbeToken) and probe.token_id == ord("~")
    assert isinstance(user, CountingHook) and (user.tokenizer, user.scale) == (tokenizer, 2.0)
    assert build_metric_hooks({}, tokenizer) == []


@pytest.mark.parametrize("specs, message", [
    ({"probe": {"token": "~"}}, r"logging.metric_hooks.probe: unknown metric hook; use one of probe_token"),
    ({"probe_token": {"token": "ab"}}, r"logging.metric_hooks.probe_token.token: 'ab' encodes to 2 tokens; choose"),
    ({"probe_token": {"tokn": "~"}}, r"logging.metric_hooks.probe_token: .*unexpected keyword argument 'tokn'"),
    ({"no_such_module_xyz:Hook": {}}, r"logging.metric_hooks.no_such_module_xyz:Hook: module 'no_such_module_xyz' "
                                      r"not found"),
    ({f"{__name__}:Missing": {}}, r"has no attribute 'Missing'"),
])
def test_a_bad_hook_names_its_field(specs, message):
    with pytest.raises(ValueError, match=message):
        build_metric_hooks(specs, _Tokenizer())


def test_a_hook_without_a_mapping_of_parameters_is_refused_at_load():
    with pytest.raises(ValueError, match=r"logging.metric_hooks.probe_token = 5: give the hook's parameters"):
        load_config(None, ["logging.metric_hooks.probe_token=5"])
