"""Under torchrun: the same command on two processes (gloo) makes the same files as on one, rank 0 writing them;
a misconfigured launch is a clear error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import EXAMPLE_CARDS, TINY_RUNS
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core import distributed
from cardtool.errors import BadInput

GENERATE = ["generate", "tiny-base", "-p", "a bag", "-p", "a coat", "-n", "3", "--steps", "4", "--grid", "--json"]


def launch_env(cwd) -> dict:
    """The example cards on the path, and the temporary folder in the test's own: torchrun's agent makes a
    `torchelastic_*` folder there that it never removes."""
    scratch = Path(cwd) / ".tmp"
    scratch.mkdir(exist_ok=True)
    return {**os.environ, "CARDTOOL_PATH": str(EXAMPLE_CARDS), "TMPDIR": str(scratch)}


def torchrun(args: list[str], cwd, processes: int = 2) -> subprocess.CompletedProcess:
    """The asserts on its result show the last 8,000 characters of stderr: a failed rank's own error comes before
    torchrun's summary, which alone fills 2,000."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), "-m", "cardtool", *args], cwd=cwd, env=launch_env(cwd), capture_output=True,
                          text=True, timeout=300)


def test_generate_on_two_processes_writes_the_same_pngs_as_on_one(tmp_path, monkeypatch):
    result = torchrun([*GENERATE, "--out", "two", "--max-batch", "2"], tmp_path)  # two waves, the last split 1 + 1
    assert result.returncode == 0, result.stderr[-8000:]
    report = json.loads(result.stdout)  # rank 0 alone reports, once
    assert len(report["images"]) == 6 and report["grid"]
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    single = CliRunner().invoke(app, [*GENERATE, "--out", str(tmp_path / "one")])
    assert single.exit_code == 0, single.output
    one, two = sorted((tmp_path / "one").glob("*.png")), sorted((tmp_path / "two").glob("*.png"))
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 7
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two, strict=True)), "bit-identical PNGs"
    for gone in (two[1], two[4]):  # an interrupted run's: rank 0's folder decides what every rank skips
        gone.unlink()
    resumed = torchrun([*GENERATE, "--out", "two", "--max-batch", "2", "--skip-existing"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-8000:]
    assert json.loads(resumed.stdout)["skipped"] == 4
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, sorted((tmp_path / "two").glob("*.png")),
                                                                  strict=True))


def test_a_launch_without_torchrun_variables_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(app, [*GENERATE, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "launch with torchrun" in result.output
    assert "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set" in result.output


@pytest.mark.parametrize(("changed", "message"), [
    ({"RANK": "5"}, "RANK=5 is not below WORLD_SIZE=2: ranks are 0 … 1"),  # waited out the rendezvous before
    ({"RANK": "-1"}, "RANK='-1': each must be a whole number"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x': each must be a whole number"),  # a ValueError traceback before
    ({"RANK": "²"}, "RANK='²': each must be a whole number"),  # a digit to str.isdigit, no number to int()
    ({"WORLD_SIZE": "²"}, "WORLD_SIZE must be a positive whole number, got '²'"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc': each must be a whole number"),
    ({"WORLD_SIZE": "9" * 5000}, "WORLD_SIZE must be a positive whole number, got '9999"),  # int() passed its limit
    ({"RANK": "9" * 5000}, f"RANK='{'9' * 40}': each must be a whole number"),
])
def test_launch_variables_that_cannot_be_are_a_clear_error_before_joining(tmp_path, monkeypatch, changed, message):
    launch = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29599"}
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    for name, value in {**launch, **changed}.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, [*GENERATE, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and message in json.loads(result.stdout)["error"]["message"], result.output


@pytest.mark.parametrize("ends_after, says", [(1.0, True), (0.0, False)])
def test_a_rank_waiting_for_its_group_says_so_once_and_not_when_the_wait_ends_first(monkeypatch, capfd, ends_after,
                                                                                     says):
    """The rendezvous waits up to 30 minutes, in C++, for every rank to start: a rank whose peers never came (a node
    not started, a wrong MASTER_ADDR) sat silent all that time."""
    import time

    import torch.distributed as dist

    from cardtool.core import distributed
    from cardtool.errors import BadInput

    def rendezvous(*args, **kwargs):
        time.sleep(ends_after)
        raise RuntimeError("the store timed out")

    launch = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29599"}
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "SAY_WAITING_AFTER", 0.1)
    monkeypatch.setattr(dist, "init_process_group", rendezvous)
    with pytest.raises(BadInput, match=r"cannot join the torchrun process group \(10.0.0.9:29599, rank 0 of 2\)"):
        distributed.ranks()
    time.sleep(0.3)  # a timer left running would say it now
    waiting = "waiting for the torchrun group's other ranks (10.0.0.9:29599, rank 0 of 2); it waits up to 30 minutes"
    assert capfd.readouterr().err.count(waiting) == says


@pytest.mark.parametrize(("visible", "message"), [
    (1, "LOCAL_RANK=1, but this process sees 1 CUDA device (one per process): start at most 1 per node (torchrun "
        "--nproc-per-node 1), or run on the CPU with --device cpu"),
    (0, "LOCAL_RANK=1, but this process sees no CUDA devices (one per process): run on the CPU with --device cpu"),
])
def test_more_processes_on_a_node_than_it_has_gpus_is_a_clear_error_before_joining(monkeypatch, visible, message):
    """torchrun --nproc-per-node 2 on a one-GPU machine: rank 1 asked CUDA for device 1 before, whose "invalid device
    ordinal" is a RuntimeError, not a message."""
    import torch

    from cardtool.core import distributed
    from cardtool.errors import BadInput

    launch = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29599"}
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("asked CUDA for a device it lacks"))
    with pytest.raises(BadInput) as caught:
        distributed.ranks("cuda")
    assert str(caught.value) == message


@pytest.mark.parametrize(("environment", "reports"), [
    ({}, True), ({"RANK": "1"}, True), ({"RANK": "1", "WORLD_SIZE": "1"}, True),
    ({"RANK": "0", "WORLD_SIZE": "2"}, True), ({"RANK": "1", "WORLD_SIZE": "2"}, False),
    ({"RANK": "x", "WORLD_SIZE": "2"}, True),  # ranks() refuses it, and that is said
    ({"RANK": "9" * 5000, "WORLD_SIZE": "2"}, True), ({"RANK": "1", "WORLD_SIZE": "9" * 5000}, True),  # int() raised
])
def test_only_a_torchrun_rank_other_than_0_keeps_quiet(monkeypatch, environment, reports):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert distributed.reporting() is reports


WORKFLOW = Path(__file__).resolve().parents[1] / "examples" / "workflows" / "tiny-tour.yaml"


@pytest.mark.parametrize("command", [*TINY_RUNS.values(), ["workflow", "run", str(WORKFLOW)]])
def test_a_rank_the_shell_holds_without_torchrun_silences_no_command(tmp_path, monkeypatch, command):
    """A RANK left in the environment by another tool, with no WORLD_SIZE: every process is rank 0 to the work, but
    the commands read RANK alone for whether to speak — a training run showed no progress and `--json` printed
    nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = CliRunner().invoke(app, [*command, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document.get("card") or document.get("stages") or document.get("steps"), document
    if command[0] != "workflow":
        assert re.search(r"(step|iteration|update|rl) 1/1  loss ", result.stderr), result.stderr


def test_a_rank_that_fails_alone_ends_the_run_instead_of_waiting_for_its_peers(tmp_path):
    """A refusal only one rank meets (a race on a shared folder, say) while its peer is inside a collective: the
    failing rank's exit barrier waited for a peer that never came, and the run hung for the group's timeout (30
    minutes). A failing rank now leaves without waiting; its peer's collective ends with it, and torchrun reports the
    rank's own exit code."""
    script = tmp_path / "lone.py"
    script.write_text("from cardtool.core.distributed import end_process, ranks\n\ngroup = ranks()\n"
                      "if group.rank == 1:\n    end_process(2)\ngroup.all_gather('rank 0 waits in a collective')\n")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script)], cwd=tmp_path, env=launch_env(tmp_path), capture_output=True, text=True,
                            timeout=120)  # a hang is a TimeoutExpired
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-4000:]


def test_ranks_sum_in_float64_on_the_groups_device(monkeypatch):
    """One process: the values themselves. Several: one all_reduce of a float64 tensor on the group's device (nccl
    takes no CPU tensor: a GPU training run's loss summed on the CPU would fail its first step; found by reading)."""
    import torch
    import torch.distributed as dist

    from cardtool.core.distributed import Ranks

    assert Ranks().sum([1.5, 2.0]) == [1.5, 2.0]
    seen = []

    def two_ranks(tensor):
        seen.append((tensor.dtype, tensor.device))
        tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", two_ranks)
    assert Ranks(1, 2, 1, "cpu").sum([0.1, 1e300]) == [0.2, 2e300]
    assert seen == [(torch.float64, torch.device("cpu"))]
    made = []
    monkeypatch.setattr(torch, "tensor", lambda values, **options: made.append(options) or torch.zeros(0))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: None)
    Ranks(1, 2, 1, "cuda:1").sum([1.0])
    assert made == [{"dtype": torch.float64, "device": "cuda:1"}]


def test_eval_on_two_processes_measures_what_one_process_measures(tmp_path, monkeypatch):
    from helpers import write_idx_folder

    data = write_idx_folder(tmp_path / "idx")
    args = ["eval", "tiny-base", "--judge", "tiny-judge", "--per-class", "2", "--steps", "2", "--steps", "3",
            "--data", str(data), "--json"]
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    one = json.loads(CliRunner().invoke(app, args).stdout)["rows"]  # first: its encoded prompts spare the ranks
    result = torchrun(args, tmp_path)
    assert result.returncode == 0, result.stderr[-8000:]
    two = json.loads(result.stdout)["rows"]
    assert [r["steps"] for r in two] == [2, 3] and all(r["images"] == 20 for r in two)
    for a, b in zip(one, two, strict=True):
        assert {k: v for k, v in a.items() if k != "images_per_second"} == \
            {k: v for k, v in b.items() if k != "images_per_second"}


FINETUNE = ["method=finetune", f"parents=[{EXAMPLE_CARDS / 'tiny-base'}]", "card.id=tiny-tuned", "model={}",
            "optim.steps=3", "optim.batch_size=8", "optim.lr=1e-2", "optim.warmup=0", "train.precision=float32",
            "train.checkpoint_every=2", "card.storage=float32"]


def finetune_args(tmp_path, sets: list[str]) -> list[str]:
    from helpers import REPO, write_idx_folder

    return ["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-base.yaml"), "--data",
            str(write_idx_folder(tmp_path / "idx")), *(f"--set={s}" for s in sets)]


def killed_then_resumed_on_two(tmp_path, sets: list[str], args: list[str]) -> dict:
    """One process with 2 micro-batches, killed after its step-2 checkpoint, resumed on 2 processes: its weights."""
    from helpers import REPO
    from safetensors.torch import load_file

    from cardtool.core.training.recipes import load_recipe
    from cardtool.core.training.train import train

    def kill_at_step_3(entry):
        if entry["step"] == 3:
            raise KeyboardInterrupt

    try:
        train(load_recipe(REPO / "examples" / "recipes" / "fashion-base.yaml", sets), command="c",
              out=tmp_path / "killed", run_dir=tmp_path / "rk", data=str(tmp_path / "idx"), micro_batches=2,
              on_log=kill_at_step_3)
    except KeyboardInterrupt:
        pass
    result = torchrun([*args, "--out", "resumed", "--run-dir", "rk", "--resume"], tmp_path)
    assert result.returncode == 0, result.stderr[-8000:]
    return load_file(str(tmp_path / "resumed" / "transformer.safetensors"))


def on_own_disks(args: list[str], cwd) -> subprocess.CompletedProcess:
    """`cardtool args` on 2 processes as on two nodes with their own disks: rank R works in `nodeR/`, so a relative
    path names a different folder on each rank."""
    for rank in (0, 1):
        (Path(cwd) / f"node{rank}").mkdir(exist_ok=True)
    script = Path(cwd) / "nodes.py"
    script.write_text("import os, runpy, sys\n\nos.chdir(f\"node{os.environ['RANK']}\")\nsys.argv[0] = 'cardtool'\n"
                      "runpy.run_module('cardtool', run_name='__main__')\n")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *args], cwd=cwd, env=launch_env(cwd), capture_output=True, text=True,
                          timeout=300)


def test_a_run_folder_or_out_on_each_nodes_own_disk_is_refused_on_every_rank(tmp_path):
    """Rank 0 writes the card and checkpoints and its peers read them back: on a disk only rank 0 sees, rank 1 said
    "nothing to resume" or "no such card folder" alone, and rank 0 failed on the lost connection. Every rank now says
    which ranks see the path and which option must be on a shared file system."""
    args = finetune_args(tmp_path, FINETUNE)
    result = on_own_disks([*args, "--out", "card", "--run-dir", str(tmp_path / "shared-run")], tmp_path)
    assert result.returncode != 0 and (tmp_path / "node0" / "card" / "card.yaml").is_file()
    said = "rank 0 sees card/card.yaml and rank 1 does not: under torchrun on several nodes, --out (the flywheel's " \
           "--out-dir) must be on a file system every node shares"
    assert result.stderr.count(said) == 2, result.stderr[-8000:]  # each rank, and no lost-connection error
    (tmp_path / "node0" / "run").mkdir()
    (tmp_path / "shared-run" / "checkpoint.safetensors").rename(tmp_path / "node0" / "run" / "checkpoint.safetensors")
    result = on_own_disks([*args, "--out", str(tmp_path / "card"), "--run-dir", "run", "--resume"], tmp_path)
    said = "rank 0 sees run/checkpoint.safetensors and rank 1 does not: under torchrun on several nodes, --run-dir must"
    assert result.returncode != 0 and result.stderr.count(said) == 2, result.stderr[-8000:]
    assert not (tmp_path / "card").exists()


def test_training_data_that_differs_between_nodes_is_refused_on_every_rank(tmp_path):
    """Each rank trains on its share of the images it read itself: from copies that differ, the run would mix two
    datasets while the card records rank 0's."""
    from helpers import write_idx_folder

    for rank in (0, 1):
        write_idx_folder(tmp_path / f"node{rank}" / "idx", seed=rank)
    args = [a if a != str(tmp_path / "idx") else "idx" for a in finetune_args(tmp_path, FINETUNE)]
    result = on_own_disks([*args, "--out", str(tmp_path / "card"), "--run-dir", str(tmp_path / "run")], tmp_path)
    said = "under torchrun on several nodes, --data must hold the same images on every node"
    assert result.returncode != 0 and result.stderr.count(said) == 2, result.stderr[-8000:]
    assert "the ranks read different training data (rank 0 " in result.stderr
    assert not (tmp_path / "card").exists() and not (tmp_path / "run" / "checkpoint.safetensors").exists()


def test_a_resumed_eval_keeps_on_every_rank_the_rows_rank_0s_report_holds(tmp_path, monkeypatch):
    """The rows --resume keeps are the rows no rank samples: rank 0's report decides, read once. A rank that read its
    own (here none, on its own disk) sampled the kept row while rank 0 waited for it in the next one's gather."""
    from helpers import write_idx_folder

    args = ["eval", "tiny-base", "--judge", "tiny-judge", "--per-class", "2", "--steps", "2", "--data",
            str(write_idx_folder(tmp_path / "idx")), "--json"]
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    (tmp_path / "node0").mkdir()
    assert CliRunner().invoke(app, [*args, "--out", str(tmp_path / "node0" / "r.json")]).exit_code == 0
    result = on_own_disks([*args, "--steps", "3", "--out", "r.json", "--resume"], tmp_path)
    assert result.returncode == 0, result.stderr[-8000:]
    report = json.loads(result.stdout)
    assert [r["steps"] for r in report["rows"]] == [2, 3] and report["kept_rows"] == 1
    assert report["rows"][1]["images"] == 20 and not (tmp_path / "node1" / "r.json").exists()


def test_a_report_rank_0_cannot_resume_from_is_refused_on_every_rank(tmp_path):
    """Rank 0 reads --out for every rank; its refusal is every rank's, not a peer's traceback or wait."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "r.json").write_text("{}")
    result = on_own_disks(["eval", "tiny-base", "--judge", "tiny-judge", "--per-class", "1", "--steps", "2", "--out",
                           "r.json", "--resume"], tmp_path)
    said = "error cannot resume from r.json: it is not an eval report written by eval --out"
    assert result.returncode != 0 and result.stderr.count(said) == 2, result.stderr[-8000:]  # each rank says it


@dataclass(frozen=True)
class _Disagreeing(distributed.Ranks):
    """Rank 0 of two whose peer finds the path of the `at`-th check the other way round."""

    at: int = 0
    checks: list = field(default_factory=list)

    def all_gather(self, value) -> list:
        assert isinstance(value, bool), "no collective but sees() is expected before the refusal"
        self.checks.append(value)
        return [value, value != (len(self.checks) - 1 == self.at)]

    def barrier(self) -> None:
        pass


def test_sees_names_the_ranks_on_each_side_and_agreement_is_the_answer(tmp_path):
    @dataclass(frozen=True)
    class Gathered(distributed.Ranks):
        seen: tuple = ()

        def all_gather(self, value) -> list:
            return [value, *self.seen[1:]]

    path = tmp_path / "run"
    for seen, said in (((False, True, True), "ranks 1, 2 see {} and rank 0 does not"),
                       ((True, False, False), "rank 0 sees {} and ranks 1, 2 do not"),
                       ((True, False, True), "ranks 0, 2 see {} and rank 1 does not")):
        path.mkdir(exist_ok=True) if seen[0] else shutil.rmtree(path, ignore_errors=True)
        with pytest.raises(BadInput, match=f"^{re.escape(said.format(path))}: under torchrun on several nodes, --x "
                                           "must be on a file system every node shares$"):
            Gathered(world=3, seen=seen).sees(path, "--x")
    assert Gathered(world=3, seen=(True, True, True)).sees(path, "--x") is True
    shutil.rmtree(path)
    assert Gathered(world=2, seen=(False, False)).sees(path, "--x") is False


@pytest.mark.parametrize(("made", "option", "at"), [(None, "--out-dir", 0), ("cards/tiny-base-nft", "--out-dir", 0),
                                                    ("run/rl/checkpoint.safetensors", "--run-dir", 1)])
def test_a_flywheel_stage_seen_differently_by_the_ranks_is_refused_before_it_runs(tmp_path, monkeypatch, made,
                                                                                   option, at):
    """Whether a stage's card or checkpoint is there decides whether it runs, is skipped or resumes: ranks that see
    it differently would take different paths and wait on each other."""
    from helpers import write_idx_folder

    from cardtool.core.workflows.flywheel import flywheel, flywheel_recipe

    peer = _Disagreeing(world=2, at=at)
    monkeypatch.setattr(distributed, "ranks", lambda device="cpu": peer)
    if made:
        (tmp_path / made).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / made).mkdir() if option == "--out-dir" else (tmp_path / made).write_bytes(b"")
    recipe = flywheel_recipe(str(EXAMPLE_CARDS / "tiny-base"), str(EXAMPLE_CARDS / "tiny-judge"), steps=1,
                             overrides=["rl.optim.batch_size=2", "rl.loss.group_size=4"], out_dir=tmp_path / "cards")
    seen, unseen = ("rank 0", "rank 1") if made else ("rank 1", "rank 0")
    path = re.escape(str(tmp_path / (made or "cards/tiny-base-nft")))
    with pytest.raises(BadInput, match=f"^{seen} sees {path} and {unseen} does not: under torchrun on several nodes, "
                                       f"{option} must be on a file system every node shares$"):
        flywheel(recipe, command="c", out_dir=tmp_path / "cards", run_dir=tmp_path / "run",
                 judge=str(EXAMPLE_CARDS / "tiny-judge"), held_out_judge=None,
                 data=str(write_idx_folder(tmp_path / "idx")), per_class=2)
    assert len(peer.checks) == at + 1 and not (tmp_path / "run" / "rl" / ".lock").exists()  # before the stage began


def test_train_on_two_processes_equals_one_process_with_two_micro_batches(tmp_path, monkeypatch):
    sets = [*FINETUNE, "train.ema=0"]
    args = finetune_args(tmp_path, sets)
    difference, one = two_processes_against_one(tmp_path, monkeypatch, args, moved=1e-3)
    assert difference <= 1e-6  # measured: 0.0 (gloo sums two ranks' gradients in the order one process adds them)
    resumed = killed_then_resumed_on_two(tmp_path, sets, args)
    assert max(float((one[k] - resumed[k]).abs().max()) for k in one) <= 1e-6
    # a run split one way resumes only split the same way: the randomness of a step depends on the split
    resumed = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "three"), "--run-dir", str(tmp_path / "r1"),
                                       "--resume", "--overwrite"])
    assert resumed.exit_code == 2 and "split into 2 micro-batch(es)" in resumed.output


def test_fsdp_training_equals_one_process_and_its_checkpoints_cross_modes(tmp_path, monkeypatch):
    """train.parallel fsdp: FSDP2 shards the DiT (each block, then the model), its optimizer state and its EMA over
    two ranks. The weights equal one process's; the checkpoint holds full tensors in the one-process layout, and a
    one-process checkpoint resumes sharded to the same weights."""
    from safetensors.torch import load_file

    sets = [*FINETUNE, "train.ema=0.5", "train.parallel=fsdp"]
    args = finetune_args(tmp_path, sets)
    difference, one = two_processes_against_one(tmp_path, monkeypatch, args, moved=1e-3)
    assert difference <= 1e-5  # measured: 7.5e-7 (the reduce-scatter sums the ranks' gradients in its own order)
    sharded, whole = (load_file(str(tmp_path / run / "checkpoint.safetensors")) for run in ("r2", "r1"))
    assert sharded.keys() == whole.keys() and any(k.startswith("ema.") for k in whole)
    # the same reduction-order bound as the weights': 1.7e-6 measured on a Zen 5 EPYC
    assert max(float((sharded[k].double() - whole[k].double()).abs().max()) for k in whole) <= 1e-5
    resumed = killed_then_resumed_on_two(tmp_path, sets, args)
    assert max(float((one[k] - resumed[k]).abs().max()) for k in one) <= 1e-6


@pytest.mark.parametrize("command", ["distill", "diffusion_nft", "flow_grpo"])
def test_fsdp_distill_and_rl_equal_one_process(tmp_path, monkeypatch, command):
    """Ranks that run the sharded networks a different number of times (DMD2's rollout depths, RL's rollout shares)
    gather each block once a step: the weights still equal one process's."""
    if command == "distill":
        sets = ["optim.steps=6", "optim.batch_size=4", "optim.lr=1e-3", "loss.generator_every=2", "train.ema=0.5"]
        args = ["distill", "tiny-base", "--steps", "2"]
    else:
        sets = ["optim.steps=4", "optim.batch_size=2", "loss.group_size=4", "loss.rollout_steps=3", "optim.lr=1e-2",
                "loss.updates_per_rollout=2", "train.ema=0.5"]
        args = ["rl", "tiny-base", "--reward", "tiny-judge", "--method", command]
    sets += ["train.precision=float32", "card.storage=float32", "train.parallel=fsdp"]
    args += ["--no-eval", *(f"--set={s}" for s in sets)]
    assert two_processes_against_one(tmp_path, monkeypatch, args)[0] <= 1e-5


def test_fsdp_is_refused_for_a_lora_with_the_reason(tmp_path):
    """(and for DMD2's GAN term: tests/training/test_distill.py)"""
    sets = ["optim.steps=2", "optim.batch_size=4", "train.precision=float32", "train.parallel=fsdp"]
    result = torchrun(["distill", "tiny-base", "--steps", "2", "--lora", "4", "--no-eval",
                       *(f"--set={s}" for s in sets), "--out", "card", "--run-dir", "run"], tmp_path)
    output = result.stderr + result.stdout
    assert result.returncode != 0 and "an adapter's weights are used inside the frozen base's forward" in output
    assert "use train.parallel ddp" in output and not (tmp_path / "card").exists()  # torchrun exits 1 for a rank's 2


def two_processes_against_one(tmp_path, monkeypatch, args: list[str], moved: float = 1e-4) -> tuple[float, dict]:
    """Run `args` on 2 gloo processes and on 1 process with --micro-batches 2; the largest difference of the written
    transformers (after checking that training moved them by more than `moved`) and the one-process weights."""
    from safetensors.torch import load_file

    result = torchrun([*args, "--out", "two", "--run-dir", "r2"], tmp_path)
    assert result.returncode == 0, result.stderr[-8000:]
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    single = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "one"), "--run-dir", str(tmp_path / "r1"),
                                      "--micro-batches", "2"])
    assert single.exit_code == 0, single.output
    one, two = (load_file(str(tmp_path / name / "transformer.safetensors")) for name in ("one", "two"))
    base = load_file(str(EXAMPLE_CARDS / "tiny-base" / "transformer.safetensors"))
    assert max(float((one[k] - base[k].float()).abs().max()) for k in one) > moved, "training moved the weights"
    return max(float((one[k] - two[k]).abs().max()) for k in one), one


def test_distill_on_two_processes_equals_one_process_with_two_micro_batches(tmp_path, monkeypatch):
    """DDP over modules that take turns (the generator every other step, the GAN head's term through a frozen
    critic): the parameters a step leaves out keep no gradient, as in one process."""
    from helpers import write_idx_folder

    data = write_idx_folder(tmp_path / "idx")
    sets = ["optim.steps=6", "optim.batch_size=4", "train.precision=float32", "train.checkpoint_every=3",
            "card.storage=float32", "optim.lr=1e-3", "loss.gan=true"]
    args = ["distill", "tiny-base", "--steps", "2", "--no-eval", "--data", str(data), *(f"--set={s}" for s in sets)]
    assert two_processes_against_one(tmp_path, monkeypatch, args)[0] <= 1e-5


def test_rl_on_two_processes_equals_one_process_with_two_micro_batches(tmp_path, monkeypatch):
    """The ranks share each rollout's sampling and every rank holds the whole buffer: a rollout from the same
    weights is the one-process run's, whatever the split; each update's rows are split between the micro-batches."""
    import yaml

    sets = ["optim.steps=4", "optim.batch_size=2", "loss.group_size=4", "loss.rollout_steps=3", "optim.lr=1e-2",
            "loss.updates_per_rollout=2", "train.precision=float32", "card.storage=float32"]
    args = ["rl", "tiny-base", "--reward", "tiny-judge", "--no-eval", *(f"--set={s}" for s in sets)]
    assert two_processes_against_one(tmp_path, monkeypatch, args)[0] <= 1e-5
    single = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "whole"), "--run-dir", str(tmp_path / "rw")])
    assert single.exit_code == 0, single.output
    curves = [yaml.safe_load((tmp_path / name / "card.yaml").read_text())["recipe"]["metrics"]["reward_curve"]
              for name in ("two", "one", "whole")]
    # the first rollout is the unsplit run's exactly; later ones follow weights that the split's draws moved
    assert len(curves[0]) == 2 and curves[0] == curves[1] and curves[0][0] == curves[2][0]


def test_the_flywheel_on_two_processes_makes_the_cards_one_process_makes(tmp_path, monkeypatch):
    sets = ["rl.optim.steps=2", "rl.optim.batch_size=2", "rl.loss.group_size=4", "rl.train.precision=float32",
            "rl.card.storage=float32", "distill.optim.steps=2", "distill.optim.batch_size=4",
            "distill.train.precision=float32", "distill.card.storage=float32"]
    args = ["flywheel", "tiny-base", "--reward", "tiny-judge", "--steps", "1", "--stop-after", "distill",
            "--judge", "tiny-judge", "--held-out-judge", "", *(f"--set={s}" for s in sets)]
    result = torchrun([*args, "--out-dir", "two", "--run-dir", "r2"], tmp_path)
    assert result.returncode == 0, result.stderr[-8000:]
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    single = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "one"), "--run-dir", str(tmp_path / "r1"),
                                      "--micro-batches", "2"])
    assert single.exit_code == 0, single.output
    from safetensors.torch import load_file

    for card in ("tiny-base-nft", "tiny-base-nft-1step"):
        one, two = (load_file(str(tmp_path / side / card / "transformer.safetensors")) for side in ("one", "two"))
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5, card
    assert (tmp_path / "r2" / "flywheel.json").is_file()


def test_a_workflow_on_two_processes_writes_the_files_of_one(tmp_path, monkeypatch):
    from helpers import REPO

    workflow = str(REPO / "examples" / "workflows" / "tiny-tour.yaml")
    result = torchrun(["workflow", "run", workflow, "--out", "two", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-8000:]
    assert [s["step"] for s in json.loads(result.stdout)["steps"]] == ["draft", "refine", "compare", "pick"]
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    single = CliRunner().invoke(app, ["workflow", "run", workflow, "--out", str(tmp_path / "one")])
    assert single.exit_code == 0, single.output
    one, two = sorted((tmp_path / "one").rglob("*.png")), sorted((tmp_path / "two").rglob("*.png"))
    assert [p.relative_to(tmp_path / "one") for p in one] == [p.relative_to(tmp_path / "two") for p in two]
    assert len(one) == 7 and all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two, strict=True))
    # resumed on two processes: rank 0's files decide what is kept, and every rank refines the kept draft
    for gone in (*sorted((tmp_path / "two").glob("*/draft/*.png"))[:1], *(tmp_path / "two").glob("*/pick/*.png")):
        gone.unlink()
    resumed = torchrun(["workflow", "run", workflow, "--out", "two", "--json", "--skip-existing"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-8000:]
    assert [s["kept"] for s in json.loads(resumed.stdout)["steps"]] == [1, 2, 2, 0]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two, strict=True))


def test_a_rank_killed_mid_run_leaves_no_card_and_a_checkpoint_that_resumes(tmp_path, monkeypatch):
    """SIGKILL one rank of a 2-process distill: torchrun fails the job, no output card appears (rank 0 writes it
    only at the end, atomically), and the last checkpoint resumes on one process with 2 micro-batches."""
    import signal
    import time
    from pathlib import Path

    from safetensors import safe_open

    sets = ["optim.steps=40", "optim.batch_size=4", "train.precision=float32", "train.checkpoint_every=2",
            "card.storage=float32", "optim.lr=1e-3"]
    args = ["distill", "tiny-base", "--steps", "2", "--no-eval", *(f"--set={s}" for s in sets)]
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "cardtool", *args, "--out", "card", "--run-dir", "run"], cwd=tmp_path,
                           env=launch_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoint = tmp_path / "run" / "checkpoint.safetensors"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert checkpoint.exists(), "the run wrote no checkpoint"

    def rank(pid: int) -> str | None:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)

    children = [int(p) for p in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]
    [victim] = [pid for pid in children if rank(pid) == "1"]
    os.kill(victim, signal.SIGKILL)
    _, stderr = job.communicate(timeout=180)
    assert job.returncode != 0
    assert "exitcode" in stderr and "-9" in stderr  # torchrun names the rank that died and how
    assert not (tmp_path / "card").exists()
    with safe_open(str(checkpoint), framework="pt") as f:
        step = int(f.metadata()["step"])
    assert 2 <= step < 40 and step % 2 == 0
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    monkeypatch.chdir(tmp_path)
    resumed = CliRunner().invoke(app, [*args, "--out", "card", "--run-dir", "run", "--resume", "--micro-batches", "2"])
    assert resumed.exit_code == 0, resumed.output
    assert (tmp_path / "card" / "card.yaml").exists()
