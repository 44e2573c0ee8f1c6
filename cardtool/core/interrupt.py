"""Ctrl-C, SIGTERM and SIGHUP during long work: the unit in flight finishes and is kept — a training step and its
checkpoint, a generation wave and its PNGs, an eval row, a workflow step — and the command stops with exit 128 + the
signal, instead of losing everything since the last thing it saved. (SIGHUP: the terminal or SSH session the command
ran in closed; a command started under `nohup` ignores it, and keeps ignoring it here.) So do the warnings a batch
system gives before it kills a job: SIGXCPU, a CPU-time limit's (`ulimit -t`; SGE's s_cpu, LSF's CPULIMIT), and
SIGUSR1, the one Slurm sends where a job asks for it (`--signal=USR1@120`)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from cardtool.errors import RunFailed

__all__ = ["Interrupted", "end_warned_outside_work", "hold_ctrl_c_in_imports", "stop_requests"]

# SIGHUP, SIGXCPU and SIGUSR1: none on Windows
SIGNALS = (signal.SIGINT, signal.SIGTERM, *(getattr(signal, name) for name in ("SIGHUP", "SIGXCPU", "SIGUSR1")
                                            if hasattr(signal, name)))
# the kernel sends SIGXCPU again for each CPU second past the soft limit, and SIGKILL at the hard one: its repeats are
# not a user's second request to stop at once
REPEATED = tuple(getattr(signal, name) for name in ("SIGXCPU",) if hasattr(signal, name))
# what a signal a user did not send by hand means, for the message
MEANING = {getattr(signal, name): meaning for name, meaning in (("SIGXCPU", "the CPU-time limit, ulimit -t"),
                                                                 ("SIGUSR1", "the batch system's warning"))
           if hasattr(signal, name)}


class Interrupted(RunFailed):
    """A signal stopped the work between two units; what the finished ones made is kept (the message says where)."""

    kind = "interrupted"

    def __init__(self, message: str, signum: int, partial: dict | None = None):
        super().__init__(message, partial)  # what the finished units made, for `--json`: rows, images, steps
        self.exit_code = 128 + signum  # what a shell reports for a process the signal ended

    @classmethod
    def after(cls, signum: int, done: str, partial: dict | None = None) -> Interrupted:
        """The stop a caught signal asked for, once `done` (e.g. "2 of 5 rows") is finished and kept."""
        meaning = f" ({MEANING[signum]})" if signum in MEANING else ""
        return cls(f"{signal.Signals(signum).name}{meaning} after {done}", signum, partial)


@contextmanager
def stop_requests(enabled: bool = True) -> Iterator[list[int]]:
    """A list that receives the number of each signal of SIGNALS that arrives inside the block, for the loop to act on
    at its next boundary (a step, a wave, a row). The first signal only asks: a second one acts at once, as it would
    have without this (the handlers in place before are restored on the first) — but for SIGXCPU's repeats (once
    caught, it stays ignored after the block: the process is past its soft limit). Off the main thread, where Python
    cannot install handlers, or with `enabled` false (under torchrun, whose ranks must stop together), nothing
    changes."""
    caught: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield caught
        return
    # a signal the process was told to ignore (SIGINT in a shell's background job) stays ignored
    previous = {s: h for s in SIGNALS if (h := signal.getsignal(s)) is not signal.SIG_IGN}

    def ask(signum, frame):
        caught.append(signum)
        for s, handler in previous.items():
            if s not in REPEATED:
                signal.signal(s, handler)

    for s in previous:
        signal.signal(s, ask)
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            # past the CPU-time limit the next second's SIGXCPU would kill the process (and dump core) while it says
            # what it kept: from then on, the hard limit's SIGKILL is the only end the kernel has left to give
            signal.signal(s, signal.SIG_IGN if s in REPEATED and s in caught else handler)


def end_warned_outside_work() -> None:
    """Outside long work a batch system's warning (SIGXCPU, SIGUSR1) ends the process as its default would, but said
    in one line, with the exit a shell gives (128 + the signal) and without SIGXCPU's core dump (a torch process's
    runs to gigabytes where `ulimit -c` allows it): nothing is in flight that a stop could keep — what was saved stays
    saved, and a write cut short is a temporary the next run clears. `stop_requests` takes the signals over inside
    long work. A signal the process was told to ignore stays ignored."""
    for signum in MEANING:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _end)


def _end(signum, frame) -> None:
    import os

    said = f"error {signal.Signals(signum).name} ({MEANING[signum]}) before the work reached a point it could stop " \
           "at; what was saved is kept\n"
    try:
        os.write(2, said.encode())
    except OSError:  # a closed standard error costs only the message
        pass
    os._exit(128 + signum)  # no unwinding: the signal's own end, said


class _Held:
    """A module's loader whose `exec_module` runs with SIGINT blocked; the rest is the loader's own."""

    def __init__(self, loader):
        self._loader = loader

    def exec_module(self, module) -> None:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._loader.exec_module(module)
        finally:  # a Ctrl-C that came meanwhile is raised now, in Python
            signal.pthread_sigmask(signal.SIG_SETMASK, before)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _HoldingFinder:
    """Finds `names` as the finders after it do, with a loader that holds Ctrl-C back while the module runs."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        for finder in sys.meta_path:
            found = None if finder is self else finder.find_spec(name, path, target)
            if found is not None:
                if hasattr(found.loader, "exec_module"):
                    found.loader = _Held(found.loader)
                return found
        return None


def hold_ctrl_c_in_imports(*names: str) -> None:
    """A Ctrl-C during the import of `names` (top-level modules) is raised once their code has run. torch's import
    runs C++ that calls back into Python, and a KeyboardInterrupt raised inside such a call aborts the process
    ("terminate called … what(): KeyboardInterrupt", SIGABRT) instead of letting the command exit 130. The import
    takes under a second. Where signals cannot be blocked (Windows), nothing changes."""
    if hasattr(signal, "pthread_sigmask") and not any(isinstance(f, _HoldingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HoldingFinder(names))
