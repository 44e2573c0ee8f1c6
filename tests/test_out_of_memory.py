"""A request larger than the machine's memory is a message (exit 1, error kind `failed`) saying what to lower, never
a traceback; the waves written before it are kept. Any other error is not taken for one."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


@pytest.mark.parametrize(("error", "limited", "said"), [
    (ImportError("libtorch_cpu.so: failed to map segment from shared object"), True,
     "libtorch_cpu.so: failed to map segment from shared object"),
    (RuntimeError("could not create a primitive"), True, "could not create a primitive"),
    (SystemError("error return without exception set"), True, "error return without exception set"),
    (OSError(12, "Cannot allocate memory", "/lib/x"), False, "[Errno 12] Cannot allocate memory: '/lib/x'"),
    (MemoryError(), True, "MemoryError"),
    (ImportError("std::bad_alloc"), False, "std::bad_alloc"),  # C++'s, re-raised by an extension's import
    (ImportError("libtorch_cpu.so: failed to map segment from shared object"), False, None),  # no limit: not taken
    (SystemError("error return without exception set"), False, None),
    (ImportError("No module named 'torch'"), True, None),
    (OSError(28, "No space left on device"), True, None),
    (OSError(12, "an ENOMEM worded otherwise"), False, None),  # said as the disk's error, as any other OSError
])
def test_a_memory_limit_s_failures_are_said_as_out_of_memory_with_the_limit(monkeypatch, error, limited, said):
    """Under `ulimit -v` (as shared clusters set) torch's import fails to map its library, oneDNN fails to make a
    kernel, an import starved of memory raises CPython's SystemError: each is out of memory, with the limit named; the
    same texts without a limit, or a module that is not there, are not taken for one."""
    from cardtool import errors
    from cardtool.errors import OutOfMemory, as_cardtool_error

    monkeypatch.setattr(errors, "address_space_limit", lambda: 650 << 20 if limited else None)
    with pytest.raises(Exception) as caught:
        with as_cardtool_error():
            raise error
    if said is None:
        assert isinstance(caught.value, type(error) if not isinstance(error, OSError) else errors.RunFailed)
        assert not isinstance(caught.value, OutOfMemory)
        return
    assert isinstance(caught.value, OutOfMemory)
    limit = " within this process's memory limit of 650 MiB (ulimit -v): raise the limit, or" if limited else ";"
    assert str(caught.value).startswith(f"out of memory ({said}){limit} ask for less at once"), str(caught.value)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the process's size from /proc")
def test_a_memory_limit_too_small_for_torch_is_one_line_and_exit_1(tmp_path):
    """A command run under an address-space limit that leaves torch no room to load: the CLI is up, torch's import
    fails — one error line (no traceback, no teardown noise) and exit 1; the JSON document says kind `failed`."""
    import os
    import subprocess
    import sys

    script = (
        "import re, resource, sys\n"
        "from cardtool.cli import main\n"
        "size = int(re.search(r'VmSize:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))\n"
        f"sys.argv = ['cardtool', 'generate', {str(EXAMPLE_CARDS / 'tiny-base')!r}, '-p', 'a bag', '--steps', '1',\n"
        f"            '--out', {str(tmp_path / 'out')!r}, '--json']\n"
        "main()\n")
    # room for numpy's work (one BLAS thread's buffers: OpenBLAS exits the process when it finds none), not for
    # libtorch_cpu.so (434 MB in torch 2.13's CPU wheel)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error out of memory (") and "(ulimit -v)" in lines[0], lines[:20]
    assert json.loads(done.stdout)["error"]["kind"] == "failed"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(("error", "limited", "kind"), [
    (MemoryError("Cannot allocate memory"), False, "failed"),
    (RuntimeError("unable to mmap 90868376 bytes from file <model.safetensors>: Cannot allocate memory (12)"), True,
     "failed"),
    (OSError("Unable to load weights from this folder"), True, "bad_input"),  # a broken folder is the request's
])
def test_a_text_encoder_memory_cannot_hold_is_out_of_memory_not_bad_input(tmp_path, monkeypatch, error, limited, kind):
    """transformers raises many kinds for a broken encoder folder, each said as bad input (exit 2); memory running out
    while it loads is out of memory (exit 1) with what to do — it said 'cannot load the text encoder' and exit 2."""
    from cardtool import errors
    from cardtool.backends import builders, hf_encoder

    def starved(*args, **kwargs):
        raise error

    builders._hf_encoder.cache_clear()
    monkeypatch.setattr(hf_encoder, "HFTextEncoder", starved)
    monkeypatch.setattr(errors, "address_space_limit", lambda: 1100 << 20 if limited else None)
    result = CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag no cache holds",
                                      "--steps", "1", "--out", str(tmp_path / "out"), "--json"])
    builders._hf_encoder.cache_clear()
    document = json.loads(result.stdout)["error"]
    assert (result.exit_code, document["kind"]) == ((1, "failed") if kind == "failed" else (2, "bad_input")), document
    if kind == "failed":
        assert document["message"].startswith("out of memory (") and "(it ran out loading the text encoder in " in \
            document["message"], document["message"]
    else:
        assert document["message"].startswith("cannot load the text encoder in ")


@pytest.mark.parametrize(("limited", "preset", "threads"), [(True, None, "1"), (True, "4", "4"), (False, None, None)])
def test_under_a_memory_limit_openblas_starts_no_threads(monkeypatch, limited, preset, threads):
    """scipy's OpenBLAS (imported by transformers) spun for ever when `ulimit -v` left no room for its threads'
    stacks: under a limit the CLI asks for one thread, unless the user set a count; without one it sets nothing."""
    import sys

    import cardtool.cli as cli
    from cardtool import errors

    for name in ("stdout", "stderr", "meta_path"):  # main wraps the streams and adds a finder: the test's come back
        monkeypatch.setattr(sys, name, getattr(sys, name) if name != "meta_path" else list(sys.meta_path))
    monkeypatch.setattr(errors, "address_space_limit", lambda: 1000 << 20 if limited else None)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", preset or "")  # recorded, so what main sets is undone after
    if preset is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    monkeypatch.setattr(sys, "argv", ["cardtool", "--version"])
    with pytest.raises(SystemExit):
        cli.main()
    assert os.environ.get("OPENBLAS_NUM_THREADS") == threads
