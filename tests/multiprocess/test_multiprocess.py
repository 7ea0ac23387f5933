"""run_distributed: results by rank, torchrun's environment, the caller's environment as of the call
(the workers are forked from a server started earlier), and a failing rank's traceback."""

from __future__ import annotations

import os

import pytest

from megacispo.testing.harness import run_distributed

MARKER = "MEGACISPO_TEST_MARKER"


def _environment(keys: list[str]) -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in keys}


def _fail_on_rank_one() -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one was told to fail")
    return 0


def test_workers_see_torchruns_variables_and_the_callers_environment_now(monkeypatch):
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", MARKER]
    monkeypatch.delenv(MARKER, raising=False)
    first = run_distributed(_environment, 2, keys)
    assert [result["RANK"] for result in first] == ["0", "1"]
    assert [result["LOCAL_RANK"] for result in first] == ["0", "1"]
    assert all(result["WORLD_SIZE"] == "2" and result["MASTER_ADDR"] == "127.0.0.1" for result in first)
    assert all(result[MARKER] is None for result in first)
    # Set after the forkserver started (the first call started it, if nothing earlier had).
    monkeypatch.setenv(MARKER, "set after the server started")
    second = run_distributed(_environment, 1, keys)
    assert second[0][MARKER] == "set after the server started"


def test_a_failing_rank_fails_the_run_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*rank one was told to fail"):
        run_distributed(_fail_on_rank_one, 2)
