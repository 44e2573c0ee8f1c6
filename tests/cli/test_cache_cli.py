"""`cardtool cache info | clear`: what cardtool keeps (encoded prompts, weights digests) is counted and removed —
only cardtool's own files, whatever else shares the folder — and is recomputed on the next use."""

from __future__ import annotations

import json
import os

import pytest
from helpers import EXAMPLE_CARDS
from typer.testing import CliRunner

from cardtool.cache import prune
from cardtool.cli import app


def cache(*args):
    result = CliRunner().invoke(app, ["cache", *args, "--json"])
    return result, json.loads(result.stdout)


def test_info_counts_and_clear_removes_only_cardtools_files(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CARDTOOL_CACHE", str(root))
    made = CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--steps", "1",
                                    "--out", str(tmp_path / "a.png")])
    assert made.exit_code == 0, made.output
    result, info = cache("info")
    assert result.exit_code == 0 and info["path"] == str(root)
    assert info["text"]["files"] == 2, "the prompt and the empty prompt (CFG's null condition)"
    assert info["text"]["bytes"] > 0 and info["digests"]["files"] == 1
    foreign = [root / "notes.txt", root / "text" / "zz" / ("0" * 64 + ".npz"), root / "text" / "ab" / "mine.npz"]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not cardtool's")
    os.symlink(tmp_path / "a.png", root / "text" / "ab" / ("1" * 64 + ".npz"))  # never followed, never removed
    outside = tmp_path / "outside"  # a folder of someone else's, reached through links named as cardtool's files
    outside.mkdir()
    for name in ("3" * 64 + ".npz", "notes.json", ".digests.json.888888.tmp"):
        (outside / name).write_text("not cardtool's")
        foreign.append(outside / name)
    shard = next(f"{i:02x}" for i in range(256) if not (root / "text" / f"{i:02x}").exists())
    os.symlink(outside, root / "text" / shard)
    os.symlink(outside / ".digests.json.888888.tmp", root / ".digests.json.777777.tmp")
    (root / ".digests.json.999999.tmp").write_text("{")  # as versions before 2026-12-03 named them
    (root / "text" / "ab" / f".{'2' * 64}.npz.999999-7.tmp").write_text("half")
    (root / "features").mkdir()
    (root / "features" / ("4" * 64 + ".npz")).write_text("reference features")  # FID's, as an eval keeps them
    (root / "features" / f".{'4' * 64}.npz.999999.tmp").write_text("half")
    foreign.append(root / "features" / "notes.npz")
    foreign[-1].write_text("not cardtool's")
    assert cache("info")[1]["features"] == {"files": 1, "bytes": len("reference features")}
    result, cleared = cache("clear")
    assert result.exit_code == 0
    assert [cleared["cleared"][kind]["files"] for kind in ("text", "features", "temporary")] == [2, 1, 3]
    assert all(path.exists() for path in foreign) and (tmp_path / "a.png").exists()
    left = cache("info")[1]
    assert [(k, v["files"]) for k, v in left.items() if k not in ("path", "limit", "problem", "unreadable")] == [
        ("text", 0), ("digests", 0), ("features", 0), ("temporary", 0)]
    os.symlink(outside / "notes.json", root / "digests.json")  # the digests' name, linked elsewhere: not ours
    assert cache("info")[1]["digests"]["files"] == 0 and cache("clear")[0].exit_code == 0
    assert (outside / "notes.json").read_text() == "not cardtool's"
    (root / "digests.json").unlink()
    again = CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--steps", "1",
                                     "--out", str(tmp_path / "b.png")])
    assert again.exit_code == 0 and (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert cache("info")[1]["text"]["files"] == 2


def test_a_cache_that_is_not_there_is_empty_and_a_file_that_cannot_be_removed_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "nowhere"))
    result, info = cache("info")
    assert result.exit_code == 0 and info["text"] == {"files": 0, "bytes": 0}
    assert cache("clear")[0].exit_code == 0
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path))
    (tmp_path / "digests.json").write_text("{}")

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "unlink", refuse)
    result, report = cache("clear")
    assert result.exit_code == 1 and report["error"]["kind"] == "failed"
    assert "could not be removed" in report["error"]["message"] and "Permission denied" in report["error"]["message"]


def test_a_shard_another_user_keeps_private_is_said_by_info_and_fails_clear(tmp_path, monkeypatch):
    """On a shared cache, a text shard made under another user's umask 077 cannot be listed: info counted it as
    nothing and clear said 'cleared' while its entries stayed."""
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path))
    (tmp_path / "text" / "ab").mkdir(parents=True)
    (tmp_path / "text" / "ab" / ("ab" + "0" * 62 + ".npz")).write_bytes(b"theirs")
    (tmp_path / "text" / "cd").mkdir()
    listing = os.scandir

    def private(path, *args):
        if str(path).endswith(os.sep + "ab"):
            raise PermissionError(13, "Permission denied", str(path))
        return listing(path, *args)

    monkeypatch.setattr(os, "scandir", private)
    result, info = cache("info")
    assert result.exit_code == 0 and info["unreadable"] == [f"{tmp_path / 'text' / 'ab'}: Permission denied"]
    shown = CliRunner().invoke(app, ["cache", "info"])
    assert "warning 1 folder of cardtool's cache could not be read (another user's?)" in shown.stderr, shown.output
    result, report = cache("clear")
    assert result.exit_code == 1 and "text/ab: Permission denied" in report["error"]["message"], report
    monkeypatch.setattr(os, "scandir", listing)
    assert cache("info")[1]["unreadable"] == [] and cache("clear")[0].exit_code == 0


def test_prune_keeps_the_most_recently_used_within_the_size(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CARDTOOL_CACHE", str(root))
    for i in range(4):
        path = root / "text" / f"{i}{i}" / (f"{i}" * 64 + ".npz")
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1e9 + i, 1e9 + i))
    (root / "text" / "00" / "notes.txt").write_bytes(b"y" * 5000)  # not cardtool's: never counted or removed
    result, report = cache("prune", "--max-size", "2.5KB")
    assert result.exit_code == 0 and report["pruned"]["limit"] == 2500
    assert report["pruned"]["removed"] == {"files": 2, "bytes": 2000}
    assert sorted(p.name[0] for p in root.glob("text/*/*.npz")) == ["2", "3"]
    assert (root / "text" / "00" / "notes.txt").exists()

    def refuse(path, *args, **kwargs):
        raise OSError(30, "Read-only file system", path)

    with monkeypatch.context() as patched:  # a read-only cache: the command says so, as clear does (it said "kept")
        patched.setattr(os, "unlink", refuse)
        result, report = cache("prune", "--max-size", "0")
        assert result.exit_code == 1
        assert "2 of cardtool's cache files could not be removed" in report["error"]["message"]
        assert report["error"]["partial"]["text"] == {"files": 2, "bytes": 2000}
        assert prune(0, root)["text"]["files"] == 2, "a run holding the cache to its limit is never failed by it"
    assert cache("info")[1]["limit"] == 5 * 10**9
    assert cache("prune", "--max-size", "9" * 18)[1]["pruned"]["limit"] == int("9" * 18), "exact, never a float"
    assert [cache("prune", "--max-size", size)[1]["pruned"]["limit"] for size in ("1.5G", "2Gi", "3 mb")] == [
        1_500_000_000, 2 * 2**30, 3_000_000], "the B may be left out, as ccache and du write sizes"
    for bad, message in ((["prune", "--max-size", "5XB"], "is not a size"), (["prune", "--max-size", "-1"], "is not"),
                         (["prune", "--max-size", "1e9"], "is not a size"),
                         (["prune", "--max-size", "9" * 400], "more bytes than a file system holds")):
        result, report = cache(*bad)
        assert result.exit_code == 2 and message in report["error"]["message"]
    assert CliRunner().invoke(app, ["cache", "prune", "--max-size", "9" * 400]).exit_code == 2
    from cardtool.cache import parse_size
    from cardtool.errors import BadInput

    assert [parse_size(size) for size in ("123B", "123", "1K", "1kib", "2T", "1TiB", "0.5 MiB", str(2**63 - 1))] == [
        123, 123, 1000, 1024, 2 * 10**12, 2**40, 2**19, 2**63 - 1]
    with pytest.raises(BadInput, match="more bytes than a file system holds"):
        parse_size(str(2**63))
    for fraction in ("0.5", "1.5B", " 2.25 "):  # `--max-size 0.5` pruned every prompt (0 bytes); 0.5GB was meant
        with pytest.raises(BadInput, match="is a fraction of a byte: a size without a unit is a number of bytes"):
            parse_size(fraction)
    assert [parse_size(size) for size in ("2.0", "0.5GB", "1.5k")] == [2, 5 * 10**8, 1500], "whole, or with a unit"
    for digits in ("9" * 5000, "0." + "0" * 5000 + "1GB", "1" * 41):  # Fraction() raised past Python's int limit
        with pytest.raises(BadInput, match=f"has {len(digits.removesuffix('GB'))} digits: more bytes than a file"):
            parse_size(digits)
    assert parse_size("0." + "0" * 37 + "1TB") == 0 and parse_size("1" * 19) == int("1" * 19)
    monkeypatch.setenv("CARDTOOL_CACHE_MAX", "9" * 5000)
    result, report = cache("info")
    assert result.exit_code == 2 and "CARDTOOL_CACHE_MAX: '9999" in report["error"]["message"]
    monkeypatch.setenv("CARDTOOL_CACHE_MAX", "lots")
    result, report = cache("info")
    assert result.exit_code == 2 and "CARDTOOL_CACHE_MAX" in report["error"]["message"]


def test_a_cache_folder_that_cannot_exist_costs_the_encoding_not_the_run(tmp_path, monkeypatch):
    """A name past the file system's limit (ENAMETOOLONG on every use): generate still makes its image, and info,
    prune and clear report an empty cache."""
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / ("x" * 300)))
    made = CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--steps", "1",
                                    "--out", str(tmp_path / "a.png")])
    assert made.exit_code == 0 and (tmp_path / "a.png").is_file(), made.output
    for command in ("info", "prune", "clear"):
        result, report = cache(command)
        assert result.exit_code == 0, (command, result.output)
    assert cache("info")[1]["text"] == {"files": 0, "bytes": 0}


def test_a_cache_that_cannot_be_written_is_said_once_by_generate_and_by_info(tmp_path, monkeypatch):
    """A file where the cache folder should be: the run works, says once why its prompts were not kept, and `cache
    info` names the cause; a cache folder that is only not there yet is no problem."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "a-file"))
    card, warned = str(EXAMPLE_CARDS / "tiny-base"), []
    for name in ("a", "b"):
        made = CliRunner().invoke(app, ["generate", card, "-p", f"a bag {name}", "--steps", "1", "--out",
                                        str(tmp_path / f"{name}.png"), "--json"])
        assert made.exit_code == 0, made.output
        warned.append([w for w in json.loads(made.stdout)["warnings"] if "cache" in w])
    assert len(warned[0]) == 1 and "a-file cannot be written" in warned[0][0], warned
    result, info = cache("info")
    assert result.exit_code == 0 and info["problem"] == f"{tmp_path / 'a-file'} is not a folder"
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "not-yet" / "cache"))
    before = sorted(tmp_path.iterdir())
    assert cache("info")[1]["problem"] is None and sorted(tmp_path.iterdir()) == before, "info leaves nothing there"
    # a folder that os.access calls writable for root, where nothing can be made
    monkeypatch.setenv("CARDTOOL_CACHE", "/proc/cardtool-cache")
    assert cache("info")[1]["problem"] == ("/proc/cardtool-cache cannot be written (No such file or directory — "
                                           "nothing new can be made in /proc: choose a folder on another file system)")
    made = CliRunner().invoke(app, ["generate", card, "-p", "a bag c", "--steps", "1", "--out", str(tmp_path / "c.png"),
                                    "--json"])
    assert made.exit_code == 0 and [w for w in json.loads(made.stdout)["warnings"]
                                    if "nothing new can be made in /proc" in w], made.output


def test_info_for_people_counts_in_decimal_units_and_warns_of_a_cache_it_cannot_write(tmp_path, monkeypatch):
    from cardtool.cli.cache import _size

    assert [_size(n) for n in (0, 999, 1000, 26_400, 999_949, 999_999, 16_240_000, 1_300_000_000, 2 * 10**12)] == [
        "0 bytes", "999 bytes", "1.0 KB", "26.4 KB", "999.9 KB", "1.0 MB", "16.2 MB", "1.3 GB", "2.0 TB"]
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "cache"))
    empty = CliRunner().invoke(app, ["cache", "info"], env={"COLUMNS": "1000"}).stdout.splitlines()
    assert [line.split() for line in empty[1:]] == [["encoded", "prompts", "0", "files", "0", "bytes"],
                                                    ["weights", "digests", "0", "files", "0", "bytes"],
                                                    ["FID", "reference", "features", "0", "files", "0", "bytes"]], empty
    made = CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--steps", "1",
                                    "--out", str(tmp_path / "a.png")])
    assert made.exit_code == 0, made.output
    _, info = cache("info")
    shown = CliRunner().invoke(app, ["cache", "info"], env={"COLUMNS": "1000"})
    lines = shown.stdout.splitlines()
    assert shown.exit_code == 0 and lines[0].startswith(f"cache {tmp_path / 'cache'}  (encoded prompts kept up to")
    assert lines[1].split() == ["encoded", "prompts", "2", "files", *_size(info["text"]["bytes"]).split()]
    assert len(lines) == 4 and "left by interrupted writes" not in shown.stdout and not shown.stderr
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "a-file"))
    shown = CliRunner().invoke(app, ["cache", "info"], env={"COLUMNS": "1000"})
    assert shown.exit_code == 0 and "a-file is not a folder: runs keep nothing here" in shown.stderr, shown.output


def test_without_a_home_folder_runs_keep_their_prompts_in_memory_and_say_so(tmp_path, monkeypatch):
    """HOME unset and a user id the password database does not know (a container run as an arbitrary user):
    pathlib cannot find ~, and every command that reads the cache died with its RuntimeError. Runs now keep their
    encoded prompts in memory (said once), `cache` commands name the fix, and `~` in a card name stays as written."""
    import pwd

    for name in ("CARDTOOL_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(f"uid not found: {uid}")))
    made = CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--steps", "1",
                                    "--out", str(tmp_path / "a.png"), "--json"])
    assert made.exit_code == 0 and (tmp_path / "a.png").is_file(), made.output
    assert [w for w in json.loads(made.stdout)["warnings"] if "cache" in w] == [
        "no folder for cardtool's cache: HOME is not set and this user has no home folder in the password database; "
        "set CARDTOOL_CACHE (or XDG_CACHE_HOME) to a folder; encoded prompts are kept in memory only"]
    for command in ("info", "prune", "clear"):
        result, report = cache(command)
        assert result.exit_code == 2 and "set CARDTOOL_CACHE" in report["error"]["message"], (command, result.output)
    for name in ("~/tiny-base", "~no-such-user-here/tiny-base"):
        result = CliRunner().invoke(app, ["cards", "show", name])
        assert result.exit_code == 2 and f"no such card folder or manifest: {name}" in result.output, result.output
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache("info")[1]["path"] == str(tmp_path / "xdg" / "cardtool"), "no home needed where a folder is set"


def test_a_loaded_card_says_an_unwritable_cache_in_its_first_call_only(tmp_path, monkeypatch):
    from cardtool.core.sampling.generate import LoadedCard

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "a-file"))
    loaded = LoadedCard(str(EXAMPLE_CARDS / "tiny-base"))
    first = loaded.generate(["a bag"], steps=1, out=tmp_path / "one")
    second = loaded.generate(["a coat"], steps=1, out=tmp_path / "two")
    assert [w for w in first.warnings if "cache" in w] and not [w for w in second.warnings if "cache" in w]


def test_eval_says_an_unwritable_cache_in_its_warnings(tmp_path, monkeypatch):
    from helpers import write_idx_folder

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "a-file"))
    result = CliRunner().invoke(app, ["eval", str(EXAMPLE_CARDS / "tiny-base"), "--judge",
                                      str(EXAMPLE_CARDS / "tiny-judge"), "--per-class", "1", "--steps", "1", "--data",
                                      str(write_idx_folder(tmp_path / "idx")), "--json"])
    assert result.exit_code == 0, result.output
    assert [w for w in json.loads(result.stdout)["warnings"] if "a-file cannot be written" in w]


@pytest.mark.parametrize("home", ["", "relative/home"])
def test_a_home_that_is_empty_or_relative_is_not_where_the_cache_goes(tmp_path, monkeypatch, home):
    """HOME="" put the cache in /.cache (Python reads an empty HOME as the root folder), a relative HOME in the
    working folder — a cache in every folder a command runs in. The password database's home stands in for both."""
    import pwd
    from types import SimpleNamespace

    from cardtool.cache import cache_dir

    for name in ("CARDTOOL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", home)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: SimpleNamespace(pw_dir=str(tmp_path / "home")))
    assert cache_dir() == tmp_path / "home" / ".cache" / "cardtool"
    monkeypatch.setenv("HOME", str(tmp_path / "set"))
    assert cache_dir() == tmp_path / "set" / ".cache" / "cardtool"


@pytest.mark.parametrize("folder", ["text", "features"])
def test_a_text_or_features_folder_another_user_keeps_private_is_said_whole(tmp_path, monkeypatch, folder):
    """The whole `text` folder unlistable (not one shard), or `features/` (FID's reference and floors): info names it,
    and clear fails for it."""
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path))
    (tmp_path / "text" / "ab").mkdir(parents=True)
    (tmp_path / "features").mkdir()
    listing = os.scandir

    def private(path, *args):
        if str(path).endswith(os.sep + folder):
            raise PermissionError(13, "Permission denied", str(path))
        return listing(path, *args)

    monkeypatch.setattr(os, "scandir", private)
    result, info = cache("info")
    assert result.exit_code == 0 and info["unreadable"] == [f"{tmp_path / folder}: Permission denied"]
    result, report = cache("clear")
    assert result.exit_code == 1 and f"{folder}: Permission denied" in report["error"]["message"], report


def test_a_cache_folder_this_user_may_not_write_is_the_problem_info_names(tmp_path, monkeypatch):
    """As another user sees a shared cache root owns (root itself passes os.access everywhere)."""
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "cache"))
    granted = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(tmp_path) else
                        granted(path, mode, **kw))
    assert cache("info")[1]["problem"] == f"{tmp_path} is not writable", "the first folder that exists decides"


def test_entries_another_process_removes_while_they_are_counted_count_as_nothing(tmp_path, monkeypatch):
    """`cache info` or a prune racing another process's `cache clear`: an entry listed and then gone is no error."""
    import cardtool.cache as module

    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path))
    (tmp_path / "text" / "ab").mkdir(parents=True)
    for name in ("ab" + "0" * 62, "ab" + "1" * 62):
        (tmp_path / "text" / "ab" / f"{name}.npz").write_bytes(b"x" * 100)
    listed = module._files

    def racing(root):
        found = listed(root)
        gone = min(found["text"], key=lambda entry: entry.name)
        if os.path.exists(gone.path):
            os.unlink(gone.path)
        return found

    monkeypatch.setattr(module, "_files", racing)
    result, info = cache("info")
    assert result.exit_code == 0 and info["text"] == {"files": 2, "bytes": 100}, info
    (tmp_path / "text" / "ab" / ("ab" + "0" * 62 + ".npz")).write_bytes(b"x" * 100)  # listed, then gone again
    report = prune(0, tmp_path)
    assert report["removed"] == {"files": 1, "bytes": 100} and report["text"] == {"files": 0, "bytes": 0}, report
