"""Post-training runs keep their encoded prompts in the text-feature cache on disk, as generate and eval do: the same
run again reads them back and never builds the text encoder (most of a short run's start-up), training the same bits;
a cache that cannot be written is said once and costs the run nothing."""

from __future__ import annotations

import pytest
from helpers import EXAMPLE_CARDS, TINY_RUNS
from typer.testing import CliRunner

from cardtool.cli import app

RUNS = ["distill", "rl"]


def _run(name: str, folder) -> tuple:
    result = CliRunner().invoke(app, [*TINY_RUNS[name], "--out", str(folder / "card"), "--run-dir",
                                      str(folder / "run")])
    assert result.exit_code == 0, result.output
    return result, (folder / "card" / "transformer.safetensors").read_bytes()


@pytest.mark.parametrize("name", RUNS)
def test_a_second_run_reads_its_prompts_back_and_never_runs_the_text_encoder(tmp_path, monkeypatch, name):
    from cardtool.backends import builders, hf_encoder

    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    calls, real = [], hf_encoder.HFTextEncoder.__call__

    def counted(self, prompts):
        calls.extend(prompts)
        return real(self, prompts)

    monkeypatch.setattr(hf_encoder.HFTextEncoder, "__call__", counted)
    builders._hf_encoder.cache_clear()  # as a new process finds it: this one's other tests built the encoder
    _, first = _run(name, tmp_path / "first")
    assert "" in calls, "the first run encodes its prompts (the empty one is CFG's null condition)"
    encoded = len(calls)
    _, second = _run(name, tmp_path / "second")
    assert len(calls) == encoded, f"the second run read every prompt back from the cache: {calls[encoded:]}"
    assert first == second, "the features read back are the bits the first run encoded"


@pytest.mark.parametrize("name", RUNS)
def test_an_unwritable_cache_is_said_and_the_run_goes_on(tmp_path, monkeypatch, name):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    result, _ = _run(name, tmp_path)
    assert result.output.count("encoded prompts are not kept on disk") == 1, result.output
