"""cardtool's own errors. Every problem with a card names its file, line, column, field and a fix."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

try:  # imported with this module: once memory has run out, an import may find no room to load it
    import resource
except ImportError:  # not a POSIX system
    resource = None

__all__ = ["CardtoolError", "BadInput", "RunFailed", "OutOfMemory", "CardNotFound", "AmbiguousCard", "Problem",
           "CardValidationError", "as_cardtool_error", "disk_said", "escaped_surrogates", "raise_if_the_machines",
           "said_as_cardtool_errors", "write_remedy"]


class CardtoolError(Exception):
    """Base of every error cardtool raises on purpose; the CLI turns these into messages, not tracebacks."""

    exit_code = 2
    kind = "bad_input"  # the `--json` error document's kind
    partial: dict | None = None  # the finished work a failed or interrupted command keeps, for `--json`

    def __str__(self) -> str:
        """The message with each lone surrogate it quotes — a byte of a path that is not UTF-8 (U+DC80–U+DCFF), or
        what a Python caller passed — as the text `\\udcXX`, as the command line prints it: text any stream can
        write (`print(error)` to a UTF-8 stdout raised UnicodeEncodeError)."""
        return escaped_surrogates(super().__str__())


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def escaped_surrogates(text: str, pattern: re.Pattern = LONE_SURROGATE) -> str:
    """`text` with each character `pattern` matches (lone surrogates) written as the text `\\udXXX`."""
    return pattern.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class RunFailed(CardtoolError):
    """The input was accepted, but the work did not produce a result (exit code 1): a training run diverged, a
    model sampled NaN."""

    exit_code = 1
    kind = "failed"

    def __init__(self, message: str, partial: dict | None = None):
        super().__init__(message)
        self.partial = partial


class OutOfMemory(RunFailed):
    """An allocation failed — Python's MemoryError, torch's CPU allocator's or CUDA's: too much was asked at once."""

    ADVICE = ("ask for less at once: a lower --max-batch for generate, eval and workflows, a smaller optim.batch_size "
              "or more --micro-batches for training (--resume continues from its last checkpoint)")

    # torch's allocator's, ENOMEM's, CUDA's, C++'s (torch's extensions re-raise it as an ImportError or MemoryError)
    SIGNS = ("can't allocate memory", "cannot allocate memory", "out of memory", "std::bad_alloc")
    # what an allocation refused by an address-space limit (`ulimit -v`, as shared clusters set) looks like besides:
    # torch's library not mapped at import, oneDNN's kernel not made, a thread without room for its stack, a weights
    # file safetensors could not map
    LIMIT_SIGNS = ("failed to map segment from shared object", "could not create a primitive", "can't start new thread",
                   "unable to mmap")

    @classmethod
    def of(cls, error: BaseException, kept: str = "", partial: dict | None = None) -> OutOfMemory | None:
        """The error `error` is, when it is an allocation that failed (`kept`: what the work keeps), else None."""
        text = str(error)
        limit = address_space_limit()
        signs = cls.SIGNS + (cls.LIMIT_SIGNS if limit is not None else ())
        # CPython's SystemError ("error return without exception set") is what an import starved by a limit can raise
        starved = isinstance(error, MemoryError) or limit is not None and isinstance(error, SystemError)
        if not (starved or any(sign in text.lower() for sign in signs)):
            return None
        detail = text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__
        if limit is not None:
            return cls(f"out of memory ({detail}) within this process's memory limit of {limit >> 20:,} MiB (ulimit "
                       f"-v): raise the limit, or {cls.ADVICE}{kept}", partial)
        return cls(f"out of memory ({detail}); {cls.ADVICE}{kept}", partial)

    @classmethod
    @contextlib.contextmanager
    def raised(cls, kept: str = "", partial: dict | None = None) -> Iterator[None]:
        """Within the block, an allocation that fails is raised as OutOfMemory (saying `kept`, with `partial`); any
        other error as it is."""
        try:
            yield
        except (MemoryError, RuntimeError, ImportError, SystemError) as error:
            failed = cls.of(error, kept, partial)
            if failed is None:
                raise
            raise failed from None


# the errnos of a disk that refuses more writes (full, over quota, past the file-size limit, mounted read-only): the
# user can do something about each, which the message says (`disk_said`)
WRITES_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
# the errnos of a process that may open no more files (its own limit, `ulimit -n`; the system's table)
FILES_REFUSED = (errno.EMFILE, errno.ENFILE)


def disk_said(error: OSError) -> str:
    """`error`'s reason as a message says it: its text, and for a disk that refuses writes or a process that may open
    no more files what to do about it (`write_remedy`) — 'No space left on device — free space on its disk'."""
    reason = error.strerror or str(error)
    return f"{reason} — {write_remedy(error)}" if error.errno in WRITES_REFUSED + FILES_REFUSED else reason


def creating_said(error: OSError, folder: Path) -> str:
    """`disk_said` for a failure to create a file or folder in `folder`, except that "No such file or directory"
    where the folder (or the nearest of its parents that exists) is there says what happened: its file system creates
    nothing (/proc answers every new name with ENOENT)."""
    if error.errno == errno.ENOENT:
        there = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if there is not None and there.is_dir():
            return f"{error.strerror} — nothing new can be made in {there}: choose a folder on another file system"
    return disk_said(error)


def threads_refused(error: BaseException, doing: str = "") -> RunFailed | None:
    """RunFailed saying that the machine refused a thread (`doing`: in what), where `error` is that refusal —
    Python's `can't start new thread`, or the panic of a Rust thread pool that could not start (pyo3's
    PanicException, which is not an Exception) — else None. Under a limit on tasks, not the request's fault."""
    text = str(error)
    python = isinstance(error, RuntimeError) and "can't start new thread" in text
    rust = type(error).__name__ == "PanicException" and ("ThreadPoolBuildError" in text or "Resource temporarily"
                                                         in text)
    if not (python or rust):
        return None
    detail = "can't start new thread" if python else "Resource temporarily unavailable"
    return RunFailed(f"{doing}the machine refused a new thread ({detail}) — raise its limit on processes and threads "
                     "(ulimit -u; a container's --pids-limit), or start fewer: OMP_NUM_THREADS=1")


def raise_if_the_machines(error: OSError) -> None:
    """Raise `error` again where the machine refused it — no more files may be opened, no memory to map — not the
    file it was reading, which a caller that says why a file is unusable (a card invalid, bad input) would blame; the
    CLI then says the machine's error with its remedy (exit 1)."""
    if error.errno in (*FILES_REFUSED, errno.ENOMEM):
        raise error


def address_space_limit() -> int | None:
    """The bytes of address space this process may map (`ulimit -v`), None where it is unlimited."""
    if resource is None:
        return None
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def write_remedy(error: OSError) -> str:
    """What to do about a write that failed with `error`, by its errno: free space for a full disk, raise the
    file-size limit for EFBIG, make the folder writable for a refusal, raise the open-file limit — else look at the
    disk."""
    if error.errno == errno.EMFILE:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource is not None else None
        now = f", now {limit:,}" if limit is not None and limit != resource.RLIM_INFINITY else ""
        return f"raise the open-file limit (ulimit -n{now})"
    return {errno.ENFILE: "close files elsewhere: the system's table of open files is full",
            errno.ENOSPC: "free space on its disk", errno.EDQUOT: "free space within your disk quota",
            errno.EFBIG: "raise the file-size limit (ulimit -f)", errno.EACCES: "make its folder writable",
            errno.EPERM: "make its folder writable", errno.EROFS: "put it on a writable file system"}.get(
        error.errno, "fix the disk")


class BadInput(CardtoolError):
    """The user asked for something that cannot be done as asked (exit code 2)."""


class CardNotFound(BadInput):
    """No card answers to a name."""


class AmbiguousCard(BadInput):
    """More than one card answers to a name."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest, located as `file:line:column: field`."""

    file: str
    line: int
    column: int
    field: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        text = f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"
        return f"{text} (fix: {self.fix})" if self.fix else text

    def to_json(self) -> dict:
        return asdict(self)


class CardValidationError(CardtoolError):
    """A card failed validation (exit code 1). Holds every problem found, not just the first."""

    exit_code = 1

    def __init__(self, problems: list[Problem]):
        if not problems:
            raise ValueError("CardValidationError needs at least one problem")
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    @classmethod
    def at(cls, file: Path | str, line: int, column: int, field: str, message: str, fix: str = ""):
        return cls([Problem(str(file), line, column, field, message, fix)])


@contextlib.contextmanager
def as_cardtool_error() -> Iterator[None]:
    """Within the block, the machine's errors as cardtool's own, each with its message: a path no file system holds,
    whose links go round in a circle or that holds a NUL byte or a lone surrogate is the request's (BadInput); any
    other OSError the disk's (RunFailed: full, read-only, a path that vanished mid-run); an allocation that failed —
    a library a memory limit left no room to load too — OutOfMemory. Anything else as it is."""
    try:
        yield
    except OSError as error:
        starved = OutOfMemory.of(error) if error.errno == errno.ENOMEM else None
        raise (starved or _os_failure(error)) from error
    except UnicodeEncodeError as error:  # Python's file calls, given a path with a lone surrogate in it
        if not isinstance(error.object, str) or not 0xD800 <= ord(error.object[error.start]) <= 0xDFFF:
            raise
        raise BadInput(f"{error.object[:200]!r} holds {error.object[error.start]!r}, a lone surrogate, which no file "
                       "name or UTF-8 text can") from error
    except ValueError as error:
        if str(error) != "embedded null byte":  # Python's file calls, given a path with a NUL in it
            raise
        raise BadInput("a path holds a NUL byte, which no file name can") from error
    # ImportError and SystemError: an import a memory limit (ulimit -v) starved, as torch's can be
    except (MemoryError, RuntimeError, ImportError, SystemError) as error:
        loop = _symlink_loop(error)
        if loop is not None:
            raise _os_failure(loop) from error
        failed = OutOfMemory.of(error) or threads_refused(error)
        if failed is None:
            raise
        raise failed from error


def said_as_cardtool_errors(call):
    """`call` (an entry point of the Python API) with the machine's errors in it raised as cardtool's own — a path
    too long for the file system, a full disk, memory — with the message its command prints (`as_cardtool_error`)."""
    @functools.wraps(call)
    def said(*args, **kwargs):
        with as_cardtool_error():
            return call(*args, **kwargs)

    return said


def _os_failure(error: OSError) -> CardtoolError:
    where = f"{error.filename}: " if error.filename else ""
    failure = BadInput if error.errno in (errno.ENAMETOOLONG, errno.ELOOP) else RunFailed
    return failure(f"{where}{disk_said(error)}")


def _symlink_loop(error: BaseException) -> OSError | None:
    """Path.resolve's RuntimeError for a symlink loop (before Python 3.13, which raises OSError ELOOP) as that
    OSError, naming the path; None for any other error."""
    import ast

    prefix = "Symlink loop from "
    if not (isinstance(error, RuntimeError) and str(error).startswith(prefix)):
        return None
    try:
        path = ast.literal_eval(str(error)[len(prefix):])
    except (ValueError, SyntaxError):
        path = str(error)[len(prefix):]
    return OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
