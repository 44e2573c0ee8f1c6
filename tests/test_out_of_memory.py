"""A request larger than the machine's memory is a message (exit 1, error kind `failed`) saying what to lower, never
a traceback; the waves written before it are kept. Any other error is not taken for one."""

from __future__ import annotations

import json

import pytest
from helpers import EXAMPLE_CARDS
from typer.testing import CliRunner

from cardtool.cli import app

ALLOCATOR = "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to " \
            "allocate 163840000 bytes. Error code 12 (Cannot allocate memory)"


def generate_failing_in_the_second_wave(tmp_path, monkeypatch, error):
    from cardtool.core.sampling import generate

    real, calls = generate.sample, []

    def sample_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "sample", sample_then_fail)
    return CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "-n", "4",
                                    "--max-batch", "2", "--steps", "1", "--out", str(tmp_path / "out"), "--json"])


@pytest.mark.parametrize("error", [RuntimeError(ALLOCATOR), MemoryError(),
                                   RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_running_out_of_memory_is_a_message_that_says_what_to_lower(tmp_path, monkeypatch, error):
    result = generate_failing_in_the_second_wave(tmp_path, monkeypatch, error)
    assert result.exit_code == 1, result.output
    message = json.loads(result.stdout)["error"]["message"]
    assert json.loads(result.stdout)["error"]["kind"] == "failed"
    assert message.startswith("out of memory (") and "a lower --max-batch" in message, message
    written = sorted(str(p) for p in (tmp_path / "out").glob("*.png"))
    assert len(written) == 2 and "the 2 images written before it are kept" in message, "the first wave's are kept"
    assert sorted(i["path"] for i in json.loads(result.stdout)["error"]["partial"]["images"]) == written


def test_the_python_api_raises_it_as_a_failed_run(tmp_path, monkeypatch):
    from cardtool.core.sampling import generate
    from cardtool.errors import OutOfMemory, RunFailed

    monkeypatch.setattr(generate, "sample", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(ALLOCATOR)))
    with pytest.raises(OutOfMemory) as info:
        generate.LoadedCard(str(EXAMPLE_CARDS / "tiny-base")).generate(["a bag"], steps=1, out=tmp_path / "out")
    assert isinstance(info.value, RunFailed) and info.value.partial == {"images": []}


def test_the_message_quotes_the_allocator_s_first_line_cut_to_200_characters():
    """CUDA's message runs to several lines of allocator statistics; a MemoryError usually says nothing."""
    from cardtool.errors import OutOfMemory

    cuda = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB " + "x" * 400 + "\nOf the allocated memory …")
    assert str(OutOfMemory.of(cuda)).startswith(f"out of memory ({str(cuda)[:200]}); ask for less at once")
    assert str(OutOfMemory.of(MemoryError(), kept="; kept")).startswith("out of memory (MemoryError); ask")
    assert str(OutOfMemory.of(MemoryError(), kept="; kept")).endswith("continues from its last checkpoint); kept")
    assert OutOfMemory.of(RuntimeError("shapes do not match")) is None


def test_another_runtime_error_is_not_taken_for_one(tmp_path, monkeypatch):
    result = generate_failing_in_the_second_wave(tmp_path, monkeypatch, RuntimeError("shapes do not match"))
    assert isinstance(result.exception, RuntimeError) and str(result.exception) == "shapes do not match"


def test_a_training_run_out_of_memory_names_its_step_and_last_checkpoint(tmp_path, monkeypatch):
    from helpers import REPO, write_idx_folder

    from cardtool.core.training.methods import vae

    real, calls = vae.VAETask.loss, []

    def loss_then_fail(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(vae.VAETask, "loss", loss_then_fail)
    result = CliRunner().invoke(app, [
        "train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-vae.yaml"), "--set", "optim.steps=6",
        "--set", "optim.batch_size=4", "--set", "model.channels=[4, 8, 8]", "--set", "train.checkpoint_every=2",
        "--set", "train.precision=float32", "--data", str(write_idx_folder(tmp_path / "idx")),
        "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "card"), "--json"])
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed" and error["message"].startswith("out of memory (CUDA out of memory.")
    assert f"at step 3, the last good checkpoint is {tmp_path / 'run'}" in error["message"], error["message"]
    assert error["partial"]["step"] == 3
