"""Fuzz write failures: each command that writes (fuzz_kills' commands: images, cards, checkpoints, a workflow's
outputs; an eval's report; a composed and an imported card) runs where the kernel refuses its writes past a random
point — `fsize`, a file-size limit of a random number of bytes (`ulimit -f`: a write past it fails with EFBIG, in our
code, torch's and safetensors' alike), or `full`, its folder on a tmpfs of a random size and number of files
(ENOSPC; root only, where the kernel lets it mount one). The failed run must end as an error (exit 1, or 2 where a
refusal came first) or succeed where only a cache write failed — never a traceback — and leave no temporary and no
file that is not the uninterrupted run's, byte for byte (an eval report's rows, its timings set aside). Then, with the
limit lifted as a user would free the space, the same command finished (`--resume`, `--skip-existing`) must leave what
the uninterrupted run leaves.

Outcomes per round: `ok` (failed cleanly, then finished to the same files), `passed` (the command needed no more than
the limit let it write, or only a cache write failed: the same files without a rerun), and the failures the target is
zero of: `traceback` (either run's stderr), `exit` (neither 0, 1 nor 2, or a failure without an `error` line), `silent`
(exit 0 without every file the uninterrupted run writes: work lost unsaid), `stray`
(a temporary left by the failed run), `partial` (a file the failed run left that the uninterrupted run does not have
so: half an image, a card without its weights), `rerun_failed`, `differs` (after the rerun).

    python benchmarks/fuzz_disk.py --rounds 3 --seed 0 [--mode fsize|full|all] [--out fuzz-disk.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz_kills  # noqa: E402 - beside this script, not a package
from fuzz_kills import TIMEOUT, _run, report_and_exit  # noqa: E402

# fuzz_kills' commands; an eval that writes its report (and FID's reference features, its floors to the cache); the
# card writers that start from another's files, made unlimited first (`prepared`): a serving card composed of an
# adapter card, a card imported from diffusers' layout ({root}: the scratch folder)
COMMANDS = {**fuzz_kills.COMMANDS,
            "eval": (["eval", "tiny-base", "--steps", "1", "--steps", "2", "--steps", "4", "--per-class", "4",
                      "--judge", "tiny-judge", "--out", "report.json"], "--resume"),
            "compose": (["cards", "compose", "tiny-base", "tiny-rl-lora", "--id", "tiny-served", "--out", "served"],
                        None),
            "import": (["cards", "import", "{root}/tiny-hf", "--base", "tiny-base", "--id", "tiny-imported", "--out",
                        "imported"], None)}
_TIMING = ("images_per_second", "seconds")  # an eval report's, which no two runs share
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # where Debian's dataset-fashion-mnist puts it
BAD = ("traceback", "exit", "silent", "stray", "partial", "rerun_failed", "differs")
TEMPORARY_SUFFIX = ".tmp"


def _limited(size: int):
    """In the command's process: files no larger than `size` bytes, a write past it EFBIG rather than SIGXFSZ's
    death (a shell's `ulimit -f` with the signal ignored, as a batch system's limit is met)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


def _mount(where: Path, size: int, inodes: int) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes}", "tmpfs", str(where)], check=True,
                   capture_output=True)


def can_mount(scratch: Path) -> bool:
    """Whether this process may mount a tmpfs (root, with the capability a container may withhold)."""
    probe = scratch / "probe"
    probe.mkdir(exist_ok=True)
    try:
        _mount(probe, 1 << 20, 100)
    except (OSError, subprocess.CalledProcessError):
        return False
    subprocess.run(["umount", str(probe)], check=False, capture_output=True)
    return True


def prepared(root: Path, names: list[str]) -> Path:
    """fuzz_kills' example cards under `root/cards`, with what compose and import start from where `names` holds
    them: tiny-rl's LoRA on tiny-base among the cards, tiny-distilled in diffusers' layout beside them
    (`root/tiny-hf`)."""
    cards = fuzz_kills.example_cards(root)
    if not {"compose", "import"} & set(names):
        return cards
    env = {**os.environ, "CARDTOOL_PATH": str(cards), "CARDTOOL_CACHE": str(root / "cache")}
    for args in (["cards", "extract-lora", "tiny-base", "tiny-rl", "--rank", "4", "--id", "tiny-rl-lora", "--out",
                  str(cards / "tiny-rl-lora")],
                 ["cards", "export", "tiny-distilled", "--format", "hf", "--out", str(root / "tiny-hf")]):
        done = _run(args, root, env)
        if done.returncode:
            raise SystemExit(f"cannot prepare {args[:2]}: {done.stderr[-2000:]}")
    return cards


def arguments(name: str, root: Path) -> list[str]:
    """COMMANDS[name]'s arguments, {root} the scratch folder."""
    return [arg.replace("{root}", str(root)) for arg in COMMANDS[name][0]]


def runnable(name: str) -> bool:
    """Whether this machine can run COMMANDS[name]: an eval's real images are Fashion-MNIST's."""
    return name != "eval" or bool(os.environ.get("CARDTOOL_DATA")) or Path(FASHION_MNIST).is_dir()


def _files(folder: Path) -> dict[str, str]:
    """fuzz_kills' digests of the files under `folder`; an eval report's as `rows:` and a digest of each row less its
    timings (a resumed eval's report also counts the rows it kept)."""
    found = fuzz_kills._files(folder)
    if "report.json" in found:
        try:
            rows = json.loads((folder / "report.json").read_text())["rows"]
            found["report.json"] = "rows:" + ",".join(hashlib.sha256(json.dumps(
                {k: v for k, v in row.items() if k not in _TIMING}, sort_keys=True).encode()).hexdigest()[:16]
                for row in rows)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # not a report: its bytes' digest, which no report's equals
    return found


def _kept(name: str, digest: str, want: dict[str, str]) -> bool:
    """Whether a file a failed run left is one the unlimited run writes: the same bytes, or an eval report holding
    some of its rows (the report is written after each row, so a stopped eval keeps what it measured)."""
    if want.get(name) == digest:
        return True
    return digest.startswith("rows:") and want.get(name, "").startswith("rows:") and \
        set(filter(None, digest[5:].split(","))) <= set(want[name][5:].split(","))


def _sizes(folder: Path) -> tuple[int, int, int]:
    """The largest file under `folder`, all its files' bytes, and how many files and folders it holds."""
    largest = total = entries = 0
    for path in folder.rglob("*"):
        entries += 1
        if path.is_file():
            size = path.stat().st_size
            largest, total = max(largest, size), total + size
    return largest, total, entries


def _temporaries(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(f".*{TEMPORARY_SUFFIX}"))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(max(high, low + 1)))))


def _failed(args: list[str], where: Path, env: dict, preexec) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cardtool", *args], cwd=where, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, preexec_fn=preexec)


def judge(code: int, stderr: str, left: dict[str, str], want: dict[str, str], strays: list[str]) -> tuple[str, str]:
    """The outcome of the run whose writes failed, before any rerun: ("", "") when it failed as it should."""
    if "Traceback" in stderr or "Exception ignored" in stderr:
        return "traceback", stderr[-1500:]
    if code not in (0, 1, 2) or code and "error" not in stderr:
        return "exit", f"exit {code}: {stderr[-600:]}"
    if strays:
        return "stray", ", ".join(strays[:5])
    partial = sorted(f for f, digest in left.items() if not _kept(f, digest, want))
    if partial:
        return "partial", ", ".join(partial[:5])
    return "", ""


def fuzz(names: list[str], rounds: int, seed: int, modes: list[str], root: Path) -> dict:
    rng = random.Random(seed)
    cards = prepared(root, names)
    counts: dict[str, int] = {}
    details: list[dict] = []
    for name in names:
        args, finish = arguments(name, root), COMMANDS[name][1]
        if not runnable(name):
            continue
        reference = root / name / "reference"
        reference.mkdir(parents=True)
        env = {**os.environ, "CARDTOOL_PATH": str(cards), "CARDTOOL_CACHE": str(reference / "cache")}
        done = _run(args, reference, env)
        if done.returncode:
            raise SystemExit(f"{name}: the run without a limit failed ({done.returncode}): {done.stderr[-2000:]}")
        want = _files(reference)
        largest, total, entries = _sizes(reference)
        for k in range(rounds):
            mode = rng.choice(modes)
            where = root / name / str(k)
            where.mkdir()
            env["CARDTOOL_CACHE"] = str(where / "cache")
            if mode == "fsize":
                limit = _log_uniform(rng, 1, largest)
                preexec, shown = _limited(limit), f"files ≤ {limit} B"
            else:
                size, inodes = _log_uniform(rng, 4096, total + 8192), _log_uniform(rng, 2, entries + 8)
                _mount(where, size, inodes)
                preexec, shown = None, f"tmpfs of {size} B, {inodes} entries"
            started = time.perf_counter()
            try:
                failed = _failed(args, where, env, preexec)
                outcome, detail = judge(failed.returncode, failed.stderr, _files(where), want, _temporaries(where))
                if mode == "full":  # the user frees space: the same folder, room for all of it
                    subprocess.run(["mount", "-o", f"remount,size={4 * total + (64 << 20)},nr_inodes=0", str(where)],
                                   check=True, capture_output=True)
                if not outcome and not failed.returncode:  # a success must have written everything
                    missing = sorted(set(want) - set(_files(where)))
                    outcome, detail = ("silent", ", ".join(missing[:5])) if missing else ("passed", "")
                elif not outcome:
                    again, _ = fuzz_kills.finish_run(args, finish, where, env)
                    outcome, detail = fuzz_kills.judge_finished(again, where, want, _files)
            finally:
                if mode == "full":
                    subprocess.run(["umount", str(where)], check=False, capture_output=True)
            counts[outcome] = counts.get(outcome, 0) + 1
            row = {"command": name, "round": k, "mode": mode, "limit": shown, "failed_exit": failed.returncode,
                   "said": next((line[:300] for line in failed.stderr.splitlines() if line.startswith("error")), ""),
                   "outcome": outcome, "seconds": round(time.perf_counter() - started, 1)}
            if detail:
                row["detail"] = detail
            details.append(row)
            print(json.dumps(row, ensure_ascii=False), flush=True)
    return {"seed": seed, "rounds": rounds, "modes": modes, "counts": counts, "cases": details}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="Failed runs per command.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=["fsize", "full", "all"], default="all",
                        help="all: both where a tmpfs can be mounted, else fsize alone")
    parser.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        mountable = can_mount(Path(scratch))
        if args.mode == "full" and not mountable:
            raise SystemExit("--mode full mounts a tmpfs, which this process may not (it needs root and "
                             "CAP_SYS_ADMIN); use --mode fsize")
        modes = {"fsize": ["fsize"], "full": ["full"], "all": ["fsize", "full"] if mountable else ["fsize"]}[args.mode]
        report = fuzz(args.commands, args.rounds, args.seed, modes, Path(scratch))
    report_and_exit(report, args.out, BAD)


if __name__ == "__main__":
    main()
