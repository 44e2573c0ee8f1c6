"""The `cardtool` command line. Thin: parse, call core, render. Heavy imports happen inside commands."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from cardtool import __version__
from cardtool.cli import cache, cards, distill, evaluate, flywheel, generate, parity, platform, rl, train, workflow
from cardtool.thread_pools import fit_thread_pools

_UsageError = typer.BadParameter.__base__  # click's UsageError, from the click that typer carries


class _Root(TyperGroup):
    """The root group: a usage error (an unknown option, a value of the wrong type, a missing argument) under
    `--json` also prints the JSON error document, so a script reading stdout always gets one. Every path option takes a
    leading ~ as the home folder (`_home_in_paths`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _home_in_paths(self)

    def make_context(self, info_name, args, parent=None, **extra):
        self._argv = list(args)
        return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        try:
            try:
                return super().invoke(ctx)
            except ValueError as error:  # a NUL byte in an argument a path option stats (only a caller, not a shell,
                if "null byte" not in str(error):  # can pass one)
                    raise
                raise _UsageError(f"an argument holds a NUL byte: {error}", ctx) from None
        except _UsageError as error:
            if "--json" in getattr(self, "_argv", ()):
                from cardtool.cli.output import emit_json

                emit_json({"error": {"kind": "bad_input", "message": error.format_message(), "problems": []}})
            raise  # and the usual message on stderr, exit 2


def is_path_type(kind) -> bool:
    """Whether a parameter type is click's Path: typer's own TyperPath since it carries click, click.Path before."""
    return all(hasattr(kind, name) for name in ("file_okay", "dir_okay", "resolve_path", "convert"))


def _home_in_paths(command) -> None:
    """Give every path option of `command` and its subcommands `paths.home_expanded`: bash leaves `--out=~/x` as
    written, and click would make a folder named ~ of it."""
    from cardtool.paths import home_expanded

    def expanding(convert):
        return lambda value, param, ctx: convert(home_expanded(value) if isinstance(value, str) else value, param, ctx)

    for param in command.params:
        if is_path_type(param.type):
            param.type.convert = expanding(param.type.convert)
    for sub in getattr(command, "commands", {}).values():
        _home_in_paths(sub)


app = typer.Typer(
    cls=_Root,
    name="cardtool",
    help="Diffusion model cards: the recipe and the runtime as one versioned object, and the tool that runs them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(cards.app, name="cards")
app.add_typer(platform.app, name="platform")
app.add_typer(workflow.app, name="workflow")
app.add_typer(cache.app, name="cache")
app.command("generate")(generate.generate_command)
app.command("train")(train.train_command)
app.command("distill")(distill.distill_command)
app.command("rl")(rl.rl_command)
app.command("flywheel")(flywheel.flywheel_command)
app.command("eval")(evaluate.eval_command)
app.command("parity")(parity.parity_command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cardtool {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Diffusion model cards: the recipe and the runtime as one versioned object."""


class _Output:
    """stdout or stderr for a command whose readers and disks may fail it. A reader that stops reading (`cardtool
    generate … | head -1`): once the pipe is closed, the rest goes to /dev/null and the command finishes its work and
    its exit status as if it had been read — not exit 1 with the summary on stderr lost, as click makes of the broken
    pipe. A stream that cannot be written (a full disk under `> report.json`, an I/O error) goes to /dev/null too and
    the error is kept for `main`: a warning that cannot be shown must not end a training run or a generation midway
    with a traceback, but a command whose `--json` document was lost did not do what it was asked (exit 1); so did
    one whose caller closed its stdout (`>&-`), once it has something to write there."""

    def __init__(self, stream, closed: bool = False):
        self._stream, self.failed, self._closed = stream, None, closed

    def _gone(self, error: OSError | None = None) -> None:
        import os

        if error is not None and self.failed is None:
            self.failed = error.strerror or str(error)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def write(self, text: str) -> int:
        if self._closed and text and self.failed is None:
            self.failed = "it is closed"
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
        except OSError as error:
            self._gone(error)
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()
        except OSError as error:
            self._gone(error)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _working_folder_exists() -> None:
    """Refuse to start in a working folder that was removed after the shell entered it: every relative path fails
    there with a bare "No such file or directory", and torch's first import dies in MKL's loader (exit 2, no
    reason given) — a command would fail midway either way."""
    import os
    import sys

    try:
        os.getcwd()
    except FileNotFoundError:
        message = "the working folder no longer exists (it was removed after the shell entered it); cd to one that does"
        if "--json" in sys.argv:
            from cardtool.cli.output import emit_json

            emit_json({"error": {"kind": "bad_input", "message": message, "problems": []}})
        sys.stderr.write(f"error {message}\n")
        raise SystemExit(2) from None


def _reopened(fd: int):
    """A text stream on `fd`, which the caller closed (`>&-`; Python then sets sys.stdout to None), made /dev/null:
    left free, the number would go to the next file opened — a PNG, a checkpoint — and receive what C code writes
    to it."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != fd:
        os.dup2(devnull, fd)
        os.close(devnull)
    return open(fd, "w", encoding="utf-8", closefd=False)


def _interrupted(error: BaseException) -> bool:
    """Whether a Ctrl-C caused `error`: Python 3.11 turns one that lands while a class is made (a dataclass field's
    `__set_name__`, inside a lazy import) into a RuntimeError whose cause is the KeyboardInterrupt."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _machine_refused(error: Exception):
    """`error` as cardtool's error where it is the machine's (`as_cardtool_error`: an open-file limit, memory), else
    None. Said without Rich: what failed to load may be Rich's own import."""
    from cardtool.errors import CardtoolError, as_cardtool_error

    try:
        with as_cardtool_error():
            raise error
    except CardtoolError as said:
        return said if isinstance(error, (OSError, MemoryError, ImportError, SystemError)) else None
    except Exception:  # noqa: BLE001 - not the machine's: raised as it is by the caller
        return None


def _one_blas_thread_under_a_memory_limit() -> None:
    """Under an address-space limit (`ulimit -v`) an OpenBLAS that cannot start its threads spins for ever — scipy's,
    which transformers imports with the text encoder, hung `generate` at 1,000 MiB. One thread each starts none; the
    numpy and scipy work cardtool does is small. A count the user set is kept."""
    import os

    from cardtool.errors import address_space_limit

    if address_space_limit() is not None:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> None:
    import sys

    _one_blas_thread_under_a_memory_limit()
    fit_thread_pools()
    closed = sys.stdout is None
    if closed:
        sys.stdout = _reopened(1)
    if sys.stderr is None:
        sys.stderr = _reopened(2)
    for stream in (sys.stdout, sys.stderr):  # an encoding that cannot show a prompt's é or an arrow escapes it
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    out = sys.stdout = _Output(sys.stdout, closed) if hasattr(sys.stdout, "fileno") else sys.stdout
    if hasattr(sys.stderr, "fileno"):
        sys.stderr = _Output(sys.stderr)
    code = 0
    try:
        from cardtool.cli import output
        from cardtool.core.interrupt import end_warned_outside_work, hold_ctrl_c_in_imports

        output.OUT_OF_MEMORY = False  # this command's to set, not an earlier one's in the same process (a test's)
        output.keep_plausible_terminal_sizes()
        hold_ctrl_c_in_imports("torch")
        end_warned_outside_work()
        _working_folder_exists()
        app()
    except SystemExit as done:
        code = done.code
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling: the exit a shell gives, no traceback
        code = 130
    except Exception as error:
        if _interrupted(error):
            code = 130
        else:  # before a command's own handling: an import the machine refused (no file handle, no memory)
            failed = _machine_refused(error)
            if failed is None:
                raise
            sys.stderr.write(f"error {failed}\n")
            code = failed.exit_code
    except BaseException as error:  # a Rust library's panic (pyo3's PanicException): one that is a refused thread
        from cardtool.errors import threads_refused

        refused = threads_refused(error)
        if refused is None:
            raise
        sys.stderr.write(f"error {refused}\n")
        code = refused.exit_code
    sys.stdout.flush()  # a --json document is still buffered: its write error shows only now
    if getattr(out, "failed", None) is not None:
        sys.stderr.write(f"error cannot write standard output: {out.failed}\n")
        code = code if code not in (0, None) else 1
    if "torch.distributed" in sys.modules:
        from cardtool.core.distributed import end_process

        end_process(code)
    if getattr(sys.modules.get("cardtool.cli.output"), "OUT_OF_MEMORY", False):
        # memory ran out and was said: the interpreter's teardown would find no room either, and print hundreds of
        # "Exception ignored … MemoryError" after the message
        import os

        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    raise SystemExit(code)

