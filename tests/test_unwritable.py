"""Where results cannot be written, cardtool says so before the work (exit 2), and a disk failing mid-run is a
message (exit 1, error kind `failed`), never a traceback."""

from __future__ import annotations

import errno
import json
import os

import pytest
from helpers import REPO, write_idx_folder
from typer.testing import CliRunner

from cardtool.cli import app

EXAMPLES = REPO / "examples" / "cards"
TINY_TRAIN = ["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-base.yaml"),
              "--set", f"parents=[{REPO / 'examples' / 'cards' / 'tiny-base'}]", "--set", "model.dim=8",
              "--set", "model.heads=1", "--set", "model.ffn_dim=8", "--set", "model.depth=1", "--set", "optim.steps=1",
              "--set", "optim.batch_size=2", "--set", "train.precision=float32"]


@pytest.mark.parametrize(("where", "message"), [
    ("run", "cannot write to the run folder"),
    ("out", "cannot write to the card's folder"),
])
def test_training_refuses_an_unwritable_folder_before_it_trains(tmp_path, monkeypatch, where, message):
    from cardtool.core.training import train

    def never(*args, **kwargs):
        raise AssertionError("trained before the folders were checked")

    monkeypatch.setattr(train, "train_loop", never)  # the name train() calls
    (tmp_path / "a-file").write_text("")
    folders = {"run": tmp_path / "runs", "out": tmp_path / "cards" / "x"}
    folders[where] = tmp_path / "a-file" / where
    result = CliRunner().invoke(app, [*TINY_TRAIN, "--data", str(write_idx_folder(tmp_path / "idx")), "--run-dir",
                                      str(folders["run"]), "--out", str(folders["out"]), "--json"])
    assert result.exit_code == 2, result.output
    assert message in json.loads(result.stdout)["error"]["message"]


@pytest.mark.parametrize(("out", "run_dir", "extra", "message"), [
    ("same", "same", [], "is the card folder"),
    ("card", "card/run", [], "is inside the card folder"),
    ("notes", "runs", ["--overwrite"], "is not a card folder"),  # a folder --overwrite would not replace
    ("notes/..", "runs", ["--overwrite"], "names the current folder, a parent or the root"),  # no rename moves it
    ("/", "runs", ["--overwrite"], "names the current folder, a parent or the root"),
])
def test_an_output_the_card_could_not_be_written_to_is_refused_before_training(tmp_path, monkeypatch, out, run_dir,
                                                                              extra, message):
    from cardtool.core.training import train

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    monkeypatch.setattr(train, "train_loop", lambda *a, **k: pytest.fail("trained before the folders were checked"))
    result = CliRunner().invoke(app, [*TINY_TRAIN, "--data", str(write_idx_folder(tmp_path / "idx")), "--run-dir",
                                      str(tmp_path / run_dir), "--out", str(tmp_path / out), "--json", *extra])
    assert result.exit_code == 2, result.output  # before: it trained, then could not write its card there
    assert message in json.loads(result.stdout)["error"]["message"]


@pytest.mark.parametrize(("where", "message"), [
    ("run", "Too many levels of symbolic links"), ("run/sub", "Too many levels of symbolic links"),
    ("out", "already exists; choose another --out"), ("out/sub", "Too many levels of symbolic links")])
def test_a_folder_whose_links_go_round_in_a_circle_is_refused_before_training(tmp_path, monkeypatch, where, message):
    from cardtool.core.training import train

    monkeypatch.setattr(train, "train_loop", lambda *a, **k: pytest.fail("trained before the folders were checked"))
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    folders = {"run": tmp_path / "runs", "out": tmp_path / "cards" / "x"}
    folders[where.split("/")[0]] = tmp_path / "a" / where.partition("/")[2]
    result = CliRunner().invoke(app, [*TINY_TRAIN, "--data", str(write_idx_folder(tmp_path / "idx")), "--run-dir",
                                      str(folders["run"]), "--out", str(folders["out"]), "--json"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output  # was a RuntimeError
    assert message in json.loads(result.stdout)["error"]["message"]


@pytest.mark.parametrize("out", [".", "", "..", "/", "cards/.."])
def test_an_out_that_names_a_folder_by_where_it_is_is_refused_for_every_card_writer(out):
    """`--out .` used to pass every check, do the work, and fail at the swap ("Device or resource busy")."""
    from pathlib import Path

    from cardtool.core.cards.writer import card_folder_usable
    from cardtool.errors import BadInput

    with pytest.raises(BadInput, match="names the current folder, a parent or the root, not a new folder"):
        card_folder_usable(Path(out), "x", overwrite=True)


def test_an_output_folder_that_is_a_file_is_named(tmp_path):
    (tmp_path / "taken").write_text("")
    result = CliRunner().invoke(app, ["generate", str(REPO / "examples" / "cards" / "tiny-base"), "-p", "a bag",
                                      "--steps", "1", "--out", str(tmp_path / "taken")])
    assert result.exit_code == 2 and "it is a file, not a folder" in result.output
    below = CliRunner().invoke(app, ["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml"),
                                     "--out", str(tmp_path / "taken" / "runs")])  # the file is a parent: named
    assert below.exit_code == 2 and f"{tmp_path / 'taken'} is a file, not a folder" in below.output, below.output


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("out", ["/proc/a.png", "/proc/cardtool-new/a.png"])
def test_a_folder_whose_file_system_makes_nothing_new_is_said_so(out):
    """/proc answers every new name with ENOENT: 'No such file or directory' alone, about a folder that is there,
    read as a bug; the message says nothing new can be made there."""
    result = CliRunner().invoke(app, ["generate", str(EXAMPLES / "tiny-base"), "-p", "a bag", "--steps", "1",
                                      "--out", out])
    assert result.exit_code == 2, result.output
    assert f"cannot write to the output folder {os.path.dirname(out)}: No such file or directory — nothing new can " \
           "be made in /proc: choose a folder on another file system" in result.output, result.output


def test_a_disk_failing_mid_run_is_a_message_not_a_traceback_and_keeps_what_was_written(tmp_path, monkeypatch):
    from cardtool.core.sampling import outputs

    written, real = [], outputs.save_png

    def full_after_two(path, *args, **kwargs):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(outputs, "save_png", full_after_two)
    result = CliRunner().invoke(app, ["generate", str(REPO / "examples" / "cards" / "tiny-base"), "-p", "a bag",
                                      "-n", "4", "--steps", "1", "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed" and "No space left on device" in error["message"] and "out" in error["message"]
    assert "No space left on device — free space on its disk; the 2 images written before it are kept: the same " \
        "command with --skip-existing makes the rest" in error["message"]
    assert [image["path"] for image in error["partial"]["images"]] == [str(p) for p in written]
    assert all(p.is_file() for p in written)


@pytest.mark.parametrize(("count", "out", "said"), [
    (0, "out", "no image was written before it"),
    (1, "out", "the 1 image written before it is kept: the same command with --skip-existing makes the rest"),
    (3, None, "the 3 images made before it are kept (out=None: none is written)"),
])
def test_a_generation_a_failure_stops_says_what_it_keeps_in_words(count, out, said):
    from cardtool.core.sampling.generate import _kept_before

    assert _kept_before(count, out) == said


@pytest.mark.parametrize(("code", "said"), [
    (errno.ENOSPC, "out/x.png: No space left on device — free space on its disk"),
    (errno.EFBIG, "out/x.png: File too large — raise the file-size limit (ulimit -f)"),
    (errno.EROFS, "out/x.png: Read-only file system — put it on a writable file system"),
    (errno.EACCES, "out/x.png: Permission denied"),  # a read refused too: no advice that could be wrong
    (errno.EIO, "out/x.png: Input/output error"),
    (errno.EMFILE, "out/x.png: Too many open files — raise the open-file limit (ulimit -n, now 64)"),
    (errno.ENFILE, "out/x.png: Too many open files in system — close files elsewhere: the system's table of open "
                   "files is full"),
])
def test_a_disk_refusing_writes_mid_command_says_what_to_do(monkeypatch, code, said):
    """Any command's failing write the CLI reports (a merged card's weights, a run folder made once the disk is
    full) names the remedy of a full disk, a quota, a file-size limit or a read-only mount, as training's do."""
    from cardtool import errors
    from cardtool.errors import RunFailed, as_cardtool_error

    monkeypatch.setattr(errors, "resource", _Limits(nofile=64))
    with pytest.raises(RunFailed) as caught:
        with as_cardtool_error():
            raise OSError(code, os.strerror(code), "out/x.png")
    assert str(caught.value) == said


class _Limits:
    """The resource module with RLIMIT_NOFILE's soft limit at `nofile`."""

    RLIMIT_NOFILE, RLIM_INFINITY = object(), -1

    def __init__(self, nofile):
        self.nofile = nofile

    def getrlimit(self, which):
        assert which is self.RLIMIT_NOFILE
        return self.nofile, self.RLIM_INFINITY


def test_an_open_file_limit_said_without_a_count_where_there_is_none(monkeypatch):
    from cardtool import errors

    monkeypatch.setattr(errors, "resource", _Limits(nofile=_Limits.RLIM_INFINITY))
    assert errors.write_remedy(OSError(errno.EMFILE, "x")) == "raise the open-file limit (ulimit -n)"


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EACCES])
@pytest.mark.parametrize("where", ["manifest", "weights", "listing"])
def test_a_file_the_machine_would_not_open_is_its_error_not_a_broken_card(tmp_path, monkeypatch, code, where):
    """A card read when the process may open no more files (or map no more memory) was said to be invalid — 'cannot
    read: Too many open files', exit 2, the card blamed; it is the machine's error with its remedy (exit 1). A file
    this user may not read is still that card's problem (EACCES), the others listed as before."""
    import shutil
    from pathlib import Path

    from cardtool.core.cards import source, weight_files

    shutil.copytree(EXAMPLES / "tiny-base", tmp_path / "tiny-base")
    real_open, real_stat = Path.open, Path.stat

    def refused(path, *args, **kwargs):
        if where == "manifest" and path.name == "card.yaml" or where == "weights" and path.suffix == ".safetensors":
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    def unstatable(path, *args, **kwargs):
        if path.name == "card.yaml" and path.parent.name == "tiny-base":
            raise OSError(code, os.strerror(code), str(path))
        return real_stat(path, *args, **kwargs)

    source._cache.clear()
    monkeypatch.setattr(weight_files, "_header_cache", {}, raising=False)
    if where == "listing":
        monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path))
        monkeypatch.setattr(Path, "stat", unstatable)
        args = ["cards", "list", "--json"]
    else:
        monkeypatch.setattr(Path, "open", refused)
        args = ["cards", "validate", str(tmp_path / "tiny-base"), "--json"]
    result = CliRunner().invoke(app, args)
    source._cache.clear()
    document = json.loads(result.stdout)
    if code == errno.EACCES:
        cards = document["results"] if where != "listing" else document["cards"]
        mine = [c for c in cards if "tiny-base" in json.dumps(c)]
        assert "error" not in document and mine and "Permission denied" in json.dumps(mine), document
        return
    assert result.exit_code == 1, result.output
    said = {errno.EMFILE: "raise the open-file limit (ulimit -n", errno.ENFILE: "the system's table of open files",
            errno.ENOMEM: "out of memory"}[code]
    assert "error" in document, document
    assert document["error"]["kind"] == "failed" and said in document["error"]["message"], document


def test_an_unwritable_feature_cache_costs_nothing_but_its_reuse(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "a-file"))
    result = CliRunner().invoke(app, ["generate", str(REPO / "examples" / "cards" / "tiny-base"), "-p", "a bag",
                                      "--steps", "1", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "out").glob("*.png"))) == 1


def test_a_malformed_cache_entry_is_a_miss(tmp_path):
    import numpy as np

    from cardtool.core.sampling.text_cache import TextFeatureCache

    cache = TextFeatureCache(tmp_path)
    states, mask = np.ones((4, 3), np.float32), np.ones(4, bool)
    cache.put("ab" + "0" * 62, states, mask)
    fresh = TextFeatureCache(tmp_path)
    assert np.array_equal(fresh.get("ab" + "0" * 62)[0], states)
    for bad in ({"states": np.ones((4, 3)), "mask": np.ones(5, bool)}, {"states": np.ones(4), "mask": np.ones(4, bool)},
                {"states": np.full((4, 3), np.nan), "mask": np.ones(4, bool)}, {"states": states, "mask": np.ones(4)}):
        np.savez(tmp_path / "text" / "ab" / ("ab" + "0" * 62 + ".npz"), **bad)
        assert TextFeatureCache(tmp_path).get("ab" + "0" * 62) is None
    # well formed, but not what was written for this key: states of another width would reach the DiT's text
    # projection and fail the run there (its own check is a digest of the key and the arrays)
    cache.put("ab" + "1" * 62, np.ones((4, 2), np.float32), mask)
    for other in ("ab" + "0" * 62, "ab" + "1" * 62):
        path = tmp_path / "text" / "ab" / f"{other}.npz"
        with np.load(path) as f:
            kept = dict(f)
        np.savez(path, **{**kept, "states": np.ones((4, 5), np.float32)})
        assert TextFeatureCache(tmp_path).get(other) is None
    np.savez(tmp_path / "text" / "ab" / ("ab" + "0" * 62 + ".npz"), states=states, mask=mask)  # no digest: a miss
    assert TextFeatureCache(tmp_path).get("ab" + "0" * 62) is None


@pytest.mark.parametrize(("command", "over"), [
    (["cards", "merge", "tiny-base=0.5", "tiny-rl=0.5", "--id", "soup", "--overwrite"], "tiny-base"),
    (["cards", "extract-lora", "tiny-base", "tiny-rl", "--rank", "2", "--id", "x", "--overwrite"], "tiny-rl"),
    (["rl", "tiny-rl", "--reward", "tiny-judge", "--no-eval", "--force", "--set", "optim.steps=1"], "tiny-base"),
    (["distill", "tiny-rl", "--steps", "2", "--no-eval", "--force", "--set", "optim.steps=1"], "tiny-rl"),
    (["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-bold.yaml"), "--data",
      str(REPO / "examples" / "images"), "--set", "parents=[tiny-rl]", "--set", "data.transform=none", "--set",
      "optim.steps=1", "--overwrite"], "tiny-base"),
])
def test_a_new_card_is_never_written_over_a_card_it_is_made_from(tmp_path, monkeypatch, command, over):
    """--force / --overwrite replaced the input card itself (merge, extract-lora, rl, distill, train): its weights were
    deleted and the new card, extending that id, then extended itself."""
    import shutil

    for name in ("tiny-base", "tiny-rl", "tiny-judge"):
        shutil.copytree(REPO / "examples" / "cards" / name, tmp_path / "cards" / name)
    before = {p.name: p.read_bytes() for p in (tmp_path / "cards" / over).iterdir() if p.is_file()}
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "cards"))
    result = CliRunner().invoke(app, [*command, "--out", str(tmp_path / "cards" / over), "--json"])
    assert result.exit_code == 2, result.output
    assert f"is the folder of '{over}', which the new card is made from or descends from" in \
        json.loads(result.stdout)["error"]["message"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "cards" / over).iterdir() if p.is_file()} == before


@pytest.mark.parametrize(("code", "remedy"), [
    (errno.ENOSPC, "free space on its disk"), (errno.EDQUOT, "free space within your disk quota"),
    (errno.EFBIG, "raise the file-size limit (ulimit -f)"), (errno.EACCES, "make its folder writable"),
    (errno.EPERM, "make its folder writable"), (errno.EROFS, "put it on a writable file system"),
    (errno.EIO, "fix the disk"), (None, "fix the disk"),
])
def test_a_failed_write_is_told_what_to_do_by_its_errno(code, remedy):
    from cardtool.errors import write_remedy

    assert write_remedy(OSError(code, "failed") if code else OSError("failed")) == remedy


@pytest.mark.parametrize("command", ["distill", "rl"])
def test_a_run_refused_after_its_folders_are_proven_writable_leaves_none_behind(tmp_path, command):
    """The judge is checked after the card and run folders are proven writable: the refusal left an empty cards/ and
    runs/ID behind."""
    args = [command, str(EXAMPLES / "tiny-base"), *(["--reward", str(EXAMPLES / "tiny-judge")] * (command == "rl")),
            "--judge", str(EXAMPLES / "tiny-base"), "--out", str(tmp_path / "new" / "cards" / "s"), "--run-dir",
            str(tmp_path / "new" / "runs" / "r")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "card 'tiny-base' is not a reward" in result.output, result.output
    assert not (tmp_path / "new").exists()


def test_an_eval_refused_after_its_reports_folder_is_proven_writable_leaves_none_behind(tmp_path):
    result = CliRunner().invoke(app, ["eval", str(EXAMPLES / "tiny-base"), "--judge", str(EXAMPLES / "tiny-base"),
                                      "--out", str(tmp_path / "new" / "reports" / "r.json")])
    assert result.exit_code == 2 and "card 'tiny-base' is not a reward" in result.output, result.output
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("spare", [0, 1, 3])
def test_a_command_out_of_file_handles_says_the_limit_in_one_line(tmp_path, spare):
    """Under an open-file limit (`ulimit -n`) a few handles above what the started process holds, generate either
    runs or says the limit and its remedy in one line (exit 1): the text encoder's loader said 'cannot load the text
    encoder' as bad input (exit 2), a card's manifest was 'invalid'."""
    import subprocess
    import sys

    script = (
        "import os, resource, sys\n"
        "from cardtool.cli import main\n"
        f"held = len(os.listdir('/proc/self/fd')) - 1 + {spare}\n"  # less the listing's own handle, closed again
        "resource.setrlimit(resource.RLIMIT_NOFILE, (held, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        f"sys.argv = ['cardtool', 'generate', {str(EXAMPLES / 'tiny-base')!r}, '-p', 'a bag', '--steps', '1', "
        f"'--out', {str(tmp_path / 'out.png')!r}]\n"
        "main()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CARDTOOL_CACHE": str(tmp_path / "cache")})
    if done.returncode == 0:
        assert (tmp_path / "out.png").is_file()
        return
    lines = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(lines) == 1 and "Too many open files — raise the open-file limit (ulimit -n, now " in lines[0], lines
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize(("failing", "named"), [
    ("save_tensors", "x/transformer.safetensors"),  # safetensors' write
    ("copyfile", "x/adapters/tiny-rl.safetensors"),  # a copy: the error names its source first
    ("card.yaml", "x/card.yaml"),  # a write whose error names no file
    ("README.md", "x/README.md"),  # a text the command made (an export's model card): said in the folder too
    ("synced", "x"),  # flushing the whole card to disk: the card folder
])
def test_a_card_write_the_disk_refuses_names_the_file_in_the_card_folder(tmp_path, monkeypatch, failing, named):
    """A merged card's weights past `ulimit -f` said 'soup: File too large', the folder alone; it names the file, in
    the folder asked for (not the staging one), so the limit it needs can be seen."""
    import shutil
    from pathlib import Path

    from cardtool.core.cards import writer
    from cardtool.errors import RunFailed, as_cardtool_error

    def refused(*args, **kwargs):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    def refused_copy(source, target):
        error = OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        error.filename, error.filename2 = str(source), str(target)
        raise error

    real_write = Path.write_text
    if failing == "save_tensors":
        monkeypatch.setattr(writer, "save_tensors", refused)
    elif failing == "copyfile":
        monkeypatch.setattr(shutil, "copyfile", refused_copy)
    elif failing == "synced":  # past the check that the staged card loads (this manifest would not)
        monkeypatch.setattr(writer, "load_card", lambda *args, **kwargs: None)
        monkeypatch.setattr(writer, "synced", refused)
    else:
        monkeypatch.setattr(Path, "write_text", lambda p, *a, **k: refused() if p.name == failing else
                            real_write(p, *a, **k))
    adapter = tmp_path / "lora.safetensors"
    adapter.write_bytes(b"")
    with pytest.raises(RunFailed) as caught, as_cardtool_error():
        writer.write_card(tmp_path / "x", {"id": "x"}, {"transformer.safetensors": {}},
                          copies={"adapters/tiny-rl.safetensors": adapter}, texts={"README.md": "# x\n"})
    assert str(caught.value) == f"{tmp_path / named}: File too large — raise the file-size limit (ulimit -f)"
    assert not (tmp_path / "x").exists() and [p.name for p in tmp_path.iterdir()] == ["lora.safetensors"]
