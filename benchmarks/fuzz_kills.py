"""Fuzz interruptions: each command that writes (images, cards, checkpoints, a workflow's outputs) is stopped at a
random moment — SIGKILL (an OOM kill, a lost node), SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C), SIGHUP (the
terminal closed), SIGXCPU (a CPU-time limit's warning) or SIGUSR1 (Slurm's warning, where a job asks for one) — then
run again as a user would finish it (`--resume` for a training run, `--skip-existing` for
images), and what it leaves must be what an uninterrupted run leaves, file for file, with no temporary left behind.

Every run of a command works in a folder of its own with the same relative paths, so the cards' recorded commands
match; a card's recorded timings (`*seconds`, `*per_second`) and `text_cache_hit_rate` (the stopped run filled the
cache the finishing one reads) are the only lines set aside. Outcomes per round: `ok` (the same
files), `restarted` (killed before a training run had started — `--resume` refuses a folder no run started in —, run
again without it: the same files), and the failures the target is zero of: `differs`, `stray` (a temporary left),
`rerun_failed` (the run to finish it exited non-zero), `traceback` (on either run's stderr), `exit` (the stopped run
exited with neither 0, the signal's death, nor 128 + the signal).

    python benchmarks/fuzz_kills.py --rounds 3 --seed 0 [--signal kill|term|int|hup|xcpu|usr1|all] [--out F.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600
SMALL = ["--set", "train.precision=float32", "--no-eval"]
COMMANDS = {  # name: (arguments, how a user finishes it after a stop)
    "generate": (["generate", "tiny-base", "-p", "an ankle boot", "-p", "a bag", "-n", "3", "--steps", "8", "--grid",
                  "--out", "images"], "--skip-existing"),
    "generate-one": (["generate", "tiny-base", "-p", "a bag", "--steps", "8", "--adapter", "invert=0.5", "--out",
                      "one.png"], "--skip-existing"),
    "best-of": (["generate", "tiny-base", "-p", "a bag", "-n", "2", "--steps", "4", "--best-of", "4", "--reward",
                 "tiny-judge", "--out", "best"], "--skip-existing"),
    "workflow": (["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml"), "--out", "flow"],
                 "--skip-existing"),
    "merge": (["cards", "merge", "tiny-base=0.5", "tiny-rl=0.5", "--id", "tiny-soup", "--out", "soup"], None),
    "extract-lora": (["cards", "extract-lora", "tiny-base", "tiny-rl", "--rank", "4", "--id", "tiny-rl-lora", "--out",
                      "lora"], None),
    "export": (["cards", "export", "tiny-distilled", "--format", "hf", "--out", "hf"], None),
    "distill": (["distill", "tiny-base", "--steps", "2", "--set", "optim.steps=6", "--set", "optim.batch_size=8",
                 "--set", "train.checkpoint_every=2", *SMALL, "--out", "student", "--run-dir", "run"], "--resume"),
    "rl": (["rl", "tiny-base", "--reward", "tiny-judge", "--set", "optim.steps=4", "--set", "optim.batch_size=2",
            "--set", "loss.group_size=4", "--set", "train.checkpoint_every=1", *SMALL, "--out", "tuned", "--run-dir",
            "run"], "--resume"),
    "train": (["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-bold.yaml"), "--data",
               str(REPO / "examples" / "images"), "--set", "parents=[tiny-base]", "--set", "data.transform=none",
               "--set", "model.adapter=mine", "--set", "card.id=tiny-mine", "--set", "optim.steps=60", "--set",
               "optim.batch_size=4", "--set", "train.checkpoint_every=5", "--set", "train.precision=float32", "--out",
               "mine", "--run-dir", "run"], "--resume"),
    "flywheel": (["flywheel", "tiny-base", "--reward", "tiny-judge", "--steps", "1", "--set", "rl.optim.steps=2",
                  "--set", "rl.optim.batch_size=2", "--set", "rl.loss.group_size=4", "--set",
                  "rl.train.precision=float32", "--set", "distill.optim.steps=2", "--set", "distill.optim.batch_size=4",
                  "--set", "distill.train.precision=float32", "--stop-after", "distill", "--out-dir", "fw",
                  "--run-dir", "run"], "--resume"),
}
BAD = ("differs", "stray", "rerun_failed", "traceback", "exit")
# a card's recorded training time and pace, and its text cache's hit rate (the stopped run filled the cache)
_SECONDS = re.compile(rb"^\s*(\w*seconds|\w*per_second|text_cache_hit_rate): .*$", re.MULTILINE)


def _files(folder: Path) -> dict[str, str]:
    """Every file under `folder` but the run folder and the cache, by a digest of its bytes (a card's recorded
    timings and text cache hit rate set aside); temporaries too, which the comparison then names."""
    found = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if relative.parts[0] in ("run", "cache") or path.is_dir():
            continue
        data = path.read_bytes()
        if path.name == "card.yaml":
            data = _SECONDS.sub(b"", data)
        found[str(relative)] = hashlib.sha256(data).hexdigest()[:16]
    return found


def _run(args: list[str], where: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cardtool", *args], cwd=where, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


def finish_run(args: list[str], finish: str | None, where: Path, env: dict) -> tuple[subprocess.CompletedProcess, bool]:
    """The command run again as a user finishes it (`finish`: --resume, --skip-existing), and whether it had to start
    over: `--resume` refuses a folder no run started in (stopped before it began), which the same command without it
    then runs. A card the first run wrote before it stopped is refused as existing: nothing left to do."""
    again = _run([*args, finish] if finish else args, where, env)
    if again.returncode == 2 and finish == "--resume" and "no run has started" in again.stderr:
        return _run(args, where, env), True
    if again.returncode == 2 and "already exists" in again.stderr:  # written before the signal came
        return subprocess.CompletedProcess(again.args, 0, "", ""), False
    return again, False


def judge_finished(again: subprocess.CompletedProcess, where: Path, want: dict[str, str], files,
                   done: str = "ok") -> tuple[str, str]:
    """(outcome, detail) of the run that finished a stopped or failed one: `done` where it left the uninterrupted
    run's files (`files(where)` against `want`), else traceback, rerun_failed, stray (a temporary left) or differs."""
    if "Traceback" in again.stderr:
        return "traceback", again.stderr[-1500:]
    if again.returncode:
        return "rerun_failed", f"exit {again.returncode}: {again.stderr[-600:]}"
    got = files(where)
    stray = sorted(f for f in got if f not in want and any(p.startswith(".") for p in Path(f).parts))
    differing = sorted({f for f in {*want, *got} if want.get(f) != got.get(f)} - set(stray))
    if stray:
        return "stray", ", ".join(stray[:5])
    if differing:
        return "differs", ", ".join(differing[:5])
    return done, ""


def _heeding() -> None:
    """In the command's process: SIGINT and SIGHUP as a terminal's job gets them. A fuzzer started in the background
    (`nohup … &`) passes them on ignored, and the command rightly keeps them so: no stop would be tried. No core file:
    a SIGXCPU before the command's handlers are in place dumps one, which is not a file the command writes."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _stopped(args: list[str], where: Path, env: dict, delay: float, signum: int) -> tuple[int, str]:
    """Start the command, send `signum` after `delay` seconds (if it is still running); its exit code and stderr."""
    process = subprocess.Popen([sys.executable, "-m", "cardtool", *args], cwd=where, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_heeding)
    try:
        process.wait(delay)
    except subprocess.TimeoutExpired:
        process.send_signal(signum)
    _, stderr = process.communicate(timeout=TIMEOUT)
    return process.returncode, stderr


def example_cards(root: Path) -> Path:
    """The tiny example cards copied to `root/cards`, the folder the commands find them in (CARDTOOL_PATH)."""
    cards = root / "cards"
    shutil.copytree(REPO / "examples" / "cards", cards, ignore=shutil.ignore_patterns("*.py"))
    return cards


def fuzz(names: list[str], rounds: int, seed: int, signals: list[int], root: Path) -> dict:
    rng = random.Random(seed)
    cards = example_cards(root)
    counts: dict[str, int] = {}
    details: list[dict] = []
    for name in names:
        args, finish = COMMANDS[name]
        reference = root / name / "reference"
        reference.mkdir(parents=True)
        env = {**os.environ, "CARDTOOL_PATH": str(cards), "CARDTOOL_CACHE": str(reference / "cache")}
        started = time.perf_counter()
        done = _run(args, reference, env)
        seconds = time.perf_counter() - started
        if done.returncode:
            raise SystemExit(f"{name}: the uninterrupted run failed ({done.returncode}): {done.stderr[-2000:]}")
        want = _files(reference)
        for k in range(rounds):
            signum = rng.choice(signals)
            where = root / name / str(k)
            where.mkdir()
            env["CARDTOOL_CACHE"] = str(where / "cache")
            delay = rng.uniform(0.05, seconds)
            code, stderr = _stopped(args, where, env, delay, signum)
            outcome, detail = "ok", ""
            if code not in (0, -signum, 128 + signum):
                outcome, detail = "exit", f"exit {code}: {stderr[-600:]}"
            elif "Traceback" in stderr:
                outcome, detail = "traceback", stderr[-1200:]
            else:
                again, restarted = finish_run(args, finish, where, env)
                outcome, detail = judge_finished(again, where, want, _files, "restarted" if restarted else "ok")
            counts[outcome] = counts.get(outcome, 0) + 1
            row = {"command": name, "round": k, "signal": signal.Signals(signum).name, "after_s": round(delay, 2),
                   "of_s": round(seconds, 2), "stopped_exit": code, "outcome": outcome}
            if detail:
                row["detail"] = detail
            details.append(row)
            print(json.dumps(row), flush=True)
    return {"seed": seed, "rounds": rounds, "counts": counts, "cases": details}


def report_and_exit(report: dict, out: Path | None, bad: tuple[str, ...]) -> None:
    """A fuzzer's end: its counts printed, its report written to `out` (atomically), exit 1 if any `bad` outcome."""
    print(json.dumps(report["counts"]))
    if out:
        from cardtool.atomic import write_atomic

        write_atomic(out, (json.dumps(report, indent=1, ensure_ascii=False) + "\n").encode())
    if any(report["counts"].get(kind) for kind in bad):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="Stops per command.")
    parser.add_argument("--seed", type=int, default=0)
    signals = {"kill": [signal.SIGKILL], "term": [signal.SIGTERM], "int": [signal.SIGINT], "hup": [signal.SIGHUP],
               "xcpu": [signal.SIGXCPU], "usr1": [signal.SIGUSR1]}
    signals["all"] = [s for kind in signals.values() for s in kind]
    parser.add_argument("--signal", choices=list(signals), default="all")
    parser.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report = fuzz(args.commands, args.rounds, args.seed, signals[args.signal], Path(scratch))
    report_and_exit(report, args.out, BAD)


if __name__ == "__main__":
    main()
