"""cardtool train on tiny configs: cards written atomically, resume equals an uninterrupted run (after a kill, or
after Ctrl-C / SIGTERM, which checkpoint first), a NaN stops the run keeping the last good checkpoint, and what
pretraining writes is served by generate."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, fsynced, write_idx_folder
from safetensors.torch import load_file
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.data import load_split
from cardtool.core.interrupt import Interrupted
from cardtool.core.training.recipes import load_recipe
from cardtool.core.training.train import train
from cardtool.core.training.trainer import CHECKPOINT, TrainingDiverged, recipe_changes
from cardtool.errors import BadInput, RunFailed

RECIPES = REPO / "examples" / "recipes"
TINY_VAE = ["model.channels=[8, 16, 32]", "optim.steps=6", "optim.batch_size=8", "optim.warmup=2",
            "train.checkpoint_every=3", "train.log_every=1", "train.precision=float32"]


@pytest.fixture
def data(tmp_path):
    return write_idx_folder(tmp_path / "idx")


def tiny(name, extra=()):
    base = TINY_VAE if name == "fashion-vae" else []
    return load_recipe(RECIPES / f"{name}.yaml", [*base, *extra])


def weights(card, name):
    return load_file(str(card.weights_file(name)))


def test_the_held_out_flow_loss_is_the_mean_over_latents_whatever_their_count():
    """Chunks of 500 weighted by their size: 502 latents whose first 500 give loss 1 and last 2 give loss 2 average
    to 504/502, not to the chunks' mean 1.5."""
    from cardtool.core.training.methods.flow_matching import FlowMatchingTask

    task = object.__new__(FlowMatchingTask)
    task.dit, task.test_mean, task.test_labels = "trained", torch.zeros(502, 4, 1, 2, 2), torch.zeros(502)
    task._loss = lambda x0, labels, generator, dropout: torch.tensor(1.0 if len(x0) == 500 else 2.0)
    assert task.finish("ema") == {"test_flow_loss": round(504 / 502, 5)} and task.dit == "trained"


def test_the_flow_matching_loss_regresses_the_velocity_from_noise_to_the_data():
    """x_t = (1 − t)·x0 + t·ε at t·1000, target ε − x0 (SD3 / Wan2.1), t logit-normal in (0, 1), each row's text a
    phrasing of its own class, or the empty prompt where the condition is dropped. A model that solves x_t for ε
    with x0 known predicts the target exactly: the loss must be 0."""
    from cardtool.core.training.methods.flow_matching import FlowMatchingTask

    task = object.__new__(FlowMatchingTask)  # the loss alone, without a card, data or text encoder
    task.device, task.per_class, task.empty = torch.device("cpu"), 2, 6
    task.text, task.mask = torch.arange(7.0)[:, None, None].expand(7, 3, 4), torch.ones(7, 3, dtype=torch.bool)
    x0, labels, seen = torch.randn(8, 2, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), {}

    def dit(x_t, timesteps, text, mask):
        t = (timesteps / 1000).reshape(-1, 1, 1, 1, 1)
        seen["t"], seen["rows"] = t.flatten(), text[:, 0, 0].long()
        return (x_t - (1 - t) * x0) / t - x0

    task.dit = dit
    assert float(task._loss(x0, labels, torch.Generator().manual_seed(0), 0.0)) < 1e-8
    assert bool(((seen["t"] > 0) & (seen["t"] < 1)).all()) and len(set(seen["t"].tolist())) == 8
    assert torch.equal(seen["rows"] // 2, labels), "each row's text is one of its class's phrasings"
    task._loss(x0, labels, torch.Generator().manual_seed(0), 1.0)
    assert bool((seen["rows"] == 6).all()), "a dropped condition is the empty prompt"
    task.dit = lambda *args: dit(*args) + 2  # off by 2 everywhere: the mean squared error is 4
    assert float(task._loss(x0, labels, torch.Generator().manual_seed(0), 0.0)) == pytest.approx(4.0)


def test_a_card_continued_learns_on_its_own_text_encoders_features_and_a_finetune_keeps_it(examples, tmp_path, data):
    """tiny-base with another max_length: fine-tuning it, or training a LoRA on it, encodes the prompts as the card
    does; the fine-tuned card declares that encoder. One whose files are in its card's folder cannot be carried."""
    import shutil
    from types import SimpleNamespace

    from cardtool.backends.platform import Platform
    from cardtool.core.cards.schema import Component
    from cardtool.core.training.methods.adapters import adapter_task
    from cardtool.core.training.methods.flow_matching import FlowMatchingTask, _carried

    shutil.copytree(examples / "tiny-base", tmp_path / "short")
    manifest = tmp_path / "short" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("id: tiny-base", "id: short", 1)
                        .replace("config: {max_length: 16}", "config: {max_length: 12}", 1))
    splits = [load_split(part, str(data)) for part in ("train", "test")]
    platform = Platform.detect("cpu")
    tuned = FlowMatchingTask(tiny("fashion-base", ["method=finetune", f"parents=[{tmp_path / 'short'}]", "model={}"]),
                             platform, *splits)
    lora = adapter_task(load_recipe(RECIPES / "fashion-bold.yaml", [f"parents=[{tmp_path / 'short'}]"]), platform,
                        *splits)
    assert tuned.text.shape[1:] == lora.text.shape[1:] == (12, 384)
    assert tuned.card_components()["text_encoder"]["config"] == {"max_length": 12}
    inside = SimpleNamespace(id="own", manifest=SimpleNamespace(components={"te": Component(
        kind="text_encoder", impl="hf-encoder", source="encoder")}))
    with pytest.raises(BadInput, match="the text encoder of 'own' \\('te'\\) is in its folder"):
        _carried(inside, "te", "finetune")
    assert _carried(inside, "te", "lora")["source"] == "encoder", "an adapter card extends its parent's"


def test_a_pretrained_cards_loop_defaults_are_data_loop_over_the_built_in_ones():
    from cardtool.core.training.methods.flow_matching import loop_defaults

    assert loop_defaults(tiny("fashion-base", ["data={}"])) == {"steps": 20, "guidance": 4.0, "shift": 1.0,
                                                               "solver": "euler"}
    assert loop_defaults(tiny("fashion-base", ["data={loop: {steps: 8}}"]), {"steps": 4, "shift": 2.0}) == {
        "steps": 8, "guidance": 4.0, "shift": 2.0, "solver": "euler"}, "data.loop over the inherited over these"


def test_the_dropped_condition_is_the_empty_prompts_token_states(data):
    """CFG's null condition in training is the empty prompt's features — only the tokenizer's [CLS] and [SEP] — as
    the sampler's is, never a class prompt's."""
    from types import SimpleNamespace

    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.flow_matching import FlowMatchingTask

    task = object.__new__(FlowMatchingTask)
    task.config = SimpleNamespace(text_dim=384)
    task._text(Platform.detect("cpu"), load_split("train", str(data)), load_split("test", str(data)))
    tokens = task.mask.sum(1)
    assert int(tokens[task.empty]) == 2 and bool((tokens[:task.empty] > 2).all()) and task.empty == len(tokens) - 1
    assert float(task.text[task.empty, 2:].abs().max()) == 0.0, "zero beyond its tokens, as Wan pads"


def test_captions_past_one_encoder_part_each_get_their_own_token_states():
    """Captions are encoded 512 at a time: the 600 distinct ones of a folder each keep their own row."""
    from types import SimpleNamespace

    from cardtool.backends.platform import Platform
    from cardtool.backends.registry import COMPONENTS
    from cardtool.core.cards.loader import package_path
    from cardtool.core.data import Split
    from cardtool.core.prompts import TEXT_ENCODER
    from cardtool.core.training.methods.flow_matching import FlowMatchingTask

    captions = tuple(f"a bag number {i}" for i in range(600))
    split = Split(np.zeros((600, 28, 28), np.uint8), np.full(600, -1), captions=captions)
    task = object.__new__(FlowMatchingTask)
    task.config = SimpleNamespace(text_dim=384)
    platform = Platform.detect("cpu")
    task._text(platform, split, Split(split.images[:0], split.labels[:0], captions=()))
    assert task.text.shape[0] == 601 and task.empty == 600 and task.labels.tolist() == list(range(600))
    build = COMPONENTS.resolve(TEXT_ENCODER["impl"], platform)[1]
    encoder = build(TEXT_ENCODER["config"], None, package_path(TEXT_ENCODER["source"]), platform, "float32")
    for row in (0, 511, 512, 599):
        alone, _ = encoder([captions[row]])
        assert torch.allclose(task.text[row], alone[0], atol=1e-5), row


def test_vae_card_is_written_with_recipe_command_and_metrics(tmp_path, data):
    card = train(tiny("fashion-vae", ["loss={}"]), command="cardtool train …", out=tmp_path / "vae",
                 run_dir=tmp_path / "run", data=str(data))
    recipe = card.manifest.recipe
    assert recipe.method == "vae" and recipe.command == "cardtool train …"
    assert recipe.hyperparameters["loss"] == {"kl_weight": 1e-4}, "the default the recipe left out is recorded"
    assert recipe.data == {"dataset": "idx", "split": "train", "images": 64,  # not Fashion-MNIST: --data's images
                           "digest": load_split("train", data).digest()}
    assert {"test_psnr_db", "scaling_factor", "final_loss", "steps"} <= set(recipe.metrics)
    assert card.manifest.components["vae"].config["scaling_factor"] == recipe.metrics["scaling_factor"]
    seconds, pace = recipe.metrics["train_seconds"], recipe.metrics["samples_per_second"]  # both rounded to 0.1
    assert 48 / (seconds + 0.05) - 0.05 <= pace <= (48 / (seconds - 0.05) if seconds > 0.05 else math.inf) + 0.05
    assert load_card(tmp_path / "vae", checksums=True).id == "fashion-vae"
    assert weights(card, "vae")["encoder.conv_in.weight"].dtype == torch.float16, "the recipe stores float16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging folder is left"


def test_a_vae_whose_latents_collapsed_is_a_failed_run_keeping_its_checkpoint(tmp_path, data, monkeypatch):
    """A KL term that pushed every posterior mean to 0 leaves no spread to scale: the run says so (exit 1), where
    it wrote a card whose scaling factor 1/0 could not validate."""
    from cardtool.backends.conv_vae import ConvVAE
    from cardtool.core.training.methods.vae import psnr

    encode = ConvVAE.encode

    def collapsed(self, x):
        mean, logvar = encode(self, x)
        return mean * 1e-7, logvar

    monkeypatch.setattr(ConvVAE, "encode", collapsed)
    message = r"latents have no spread \(standard deviation [\d.]+e-0[78]\).*kl_weight \(now 0.0001"
    with pytest.raises(RunFailed, match=message):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data))
    assert not (tmp_path / "vae").exists() and (tmp_path / "run" / CHECKPOINT).is_file()
    blank = torch.tensor([-1.0, 1.0, -1.0, -1.0]).reshape(1, 1, 2, 2)  # black and white
    assert psnr(blank, blank) == 100.0 and psnr(blank * 3, blank) == 100.0, "exact after the clamp: 100 dB"
    assert psnr(torch.zeros_like(blank), blank) == pytest.approx(10 * math.log10(4)), "every pixel off by 1/2"


def test_the_checkpoint_and_the_card_reach_the_disk_before_they_are_renamed_into_place(tmp_path, data, monkeypatch):
    flushed = fsynced(monkeypatch)
    train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data))
    names = [p.rsplit("/", 1)[-1] for p in flushed]
    assert any(n.startswith(f".{CHECKPOINT}.{os.getpid()}-") for n in names) and "run" in names, \
        "each checkpoint, then its rename"
    staged = f".vae.tmp-{os.getpid()}"
    assert any(p.endswith(f"{staged}/card.yaml") for p in flushed) and staged in names, "the card's files and folder"
    assert flushed[-1] == str(tmp_path), "and the rename that puts the card in place"


def test_what_a_run_killed_while_writing_its_card_left_is_cleared_and_the_swapped_out_card_put_back(tmp_path, data):
    import shutil
    import subprocess

    from cardtool.core.cards.writer import _recover

    child = subprocess.Popen(["true"])
    child.wait()
    dead = child.pid  # a process that has ended: its leftovers are nobody's
    card = train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data))
    shutil.copytree(card.folder, tmp_path / f".vae.tmp-{dead}")
    os.replace(card.folder, tmp_path / f".vae.old-{dead}")  # killed between the swap's two renames
    shutil.copytree(tmp_path / f".vae.old-{dead}", tmp_path / f".vae.tmp-{os.getpid()}x")  # not a leftover's name
    _recover(tmp_path / "vae")
    assert load_card(tmp_path / "vae", checksums=True).id == "fashion-vae", "the card is back in place"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".vae")) == [f".vae.tmp-{os.getpid()}x"]
    shutil.copytree(card.folder, tmp_path / f".vae.tmp-{dead}")
    train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run2", data=str(data),
          overwrite=True)
    assert not (tmp_path / f".vae.tmp-{dead}").exists(), "the next card written there clears it"
    os.replace(tmp_path / "vae", tmp_path / f".vae.tmp-{dead}")  # a staging folder killed before its swap, no card
    _recover(tmp_path / "vae")
    assert not (tmp_path / "vae").exists() and not (tmp_path / f".vae.tmp-{dead}").exists(), "never put in place"


def test_progress_lines_say_the_time_spent_and_left(tmp_path, data):
    from cardtool.cli.output import clock, progress_line

    entries = []
    train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data),
          on_log=entries.append)
    assert [e["step"] for e in entries] == [1, 2, 3, 4, 5, 6]
    elapsed = [e["elapsed_seconds"] for e in entries]
    assert elapsed == sorted(elapsed) and entries[-1]["eta_seconds"] == 0
    pace = elapsed[2] / 3  # the time left is the steps left at the pace so far
    assert entries[2]["eta_seconds"] == pytest.approx(3 * pace, rel=0.05)
    line = progress_line("step", {**entries[2], "elapsed_seconds": 3725.4, "eta_seconds": 59.6})
    assert line.startswith("step 3/6  loss ") and line.endswith("1:02:05 elapsed, 1:00 left"), line
    assert "mse " in line and clock(0) == "0:00"


def test_the_learning_rate_warms_up_linearly_then_follows_a_cosine_down_to_a_tenth(tmp_path, data, monkeypatch):
    """AdamW's rate at step t (from 0) of S with W warmup steps: lr·(t + 1)/W while t < W, then
    lr·(0.1 + 0.45·(1 + cos(π·(t − W)/(S − W)))) — the rate each update used, and the one each progress line shows."""
    applied, real = [], torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        applied.append([group["lr"] for group in self.param_groups])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    recipe, entries = tiny("fashion-vae", ["optim.steps=8", "optim.warmup=3", "optim.lr=0.002"]), []
    train(recipe, command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data), on_log=entries.append)
    expected = [0.002 * (t + 1) / 3 if t < 3 else 0.002 * (0.1 + 0.45 * (1 + math.cos(math.pi * (t - 3) / 5)))
                for t in range(8)]
    assert applied == [[pytest.approx(rate, rel=1e-12)] for rate in expected]
    assert [e["lr"] for e in entries] == pytest.approx(expected, rel=1e-12)
    assert expected[2] == expected[3] == 0.002 and 0.002 * 0.1 < expected[-1] < expected[-2]


def test_every_log_every_steps_and_at_the_end_a_progress_entry_gives_that_steps_loss_and_the_windows_means(
        tmp_path, data, monkeypatch):
    import time

    from cardtool.core.training.methods.vae import VAETask

    losses, original = [], VAETask.loss

    def watched(self, indices, generator):
        loss, metrics = original(self, indices, generator)
        losses.append((float(loss.detach()), metrics))
        return loss, metrics

    monkeypatch.setattr(VAETask, "loss", watched)
    entries, began = [], time.perf_counter()
    result = train(tiny("fashion-vae", ["optim.steps=8", "train.log_every=3"]), command="c", out=tmp_path / "vae",
                   run_dir=tmp_path / "run", data=str(data), on_log=entries.append)
    wall = time.perf_counter() - began
    assert [e["step"] for e in entries] == [3, 6, 8]
    for entry, window in zip(entries, [(0, 3), (3, 6), (6, 8)], strict=True):
        assert entry["loss"] == pytest.approx(losses[window[1] - 1][0], rel=1e-6), "the logged step's own loss"
        for key in ("mse", "kl"):  # each of the method's metrics: its mean over the steps since the last entry
            mean = sum(metrics[key] for _, metrics in losses[window[0]:window[1]]) / (window[1] - window[0])
            assert entry[key] == pytest.approx(mean, rel=1e-6), key
        assert 0 < entry["elapsed_seconds"] <= wall
    assert result.manifest.recipe.metrics["final_loss"] == pytest.approx(losses[-1][0], abs=1e-6)


def test_a_step_split_into_micro_batches_updates_with_the_mean_of_their_gradients(tmp_path, data, monkeypatch):
    """--micro-batches M: each micro-batch's loss backpropagated over M, so the update's gradient (and the logged
    loss) is the mean over the step's micro-batches — one step of the whole batch, in M pieces of memory."""
    from cardtool.core.training.methods.vae import VAETask

    parts, original = [], VAETask.loss

    def watched(self, indices, generator):
        loss, metrics = original(self, indices, generator)
        params = [p for p in self.vae.parameters() if p.requires_grad]
        parts.append((float(loss.detach()), torch.autograd.grad(loss, params, retain_graph=True)))
        return loss, metrics

    grads, real = [], torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(VAETask, "loss", watched)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    entries = []
    train(tiny("fashion-vae", ["optim.steps=2", "optim.grad_clip=1e9"]), command="c", out=tmp_path / "vae",
          run_dir=tmp_path / "run", data=str(data), on_log=entries.append, micro_batches=2)
    assert len(parts) == 4 and len(grads) == 2
    for s, entry in enumerate(entries):
        (a, ga), (b, gb) = parts[2 * s], parts[2 * s + 1]
        assert a != b and entry["loss"] == pytest.approx((a + b) / 2, rel=1e-6)
        for mean, got in zip([(x + y) / 2 for x, y in zip(ga, gb, strict=True)], grads[s], strict=True):
            assert torch.allclose(got, mean, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("ema", [0.0, 0.75])
def test_the_card_holds_the_exponential_moving_average_of_the_weights(tmp_path, data, monkeypatch, ema):
    """train.ema = β keeps ē ← β·ē + (1 − β)·θ after each update, from ē = θ₀; the card holds ē (θ itself when
    β = 0). One update: ē = β·θ₀ + (1 − β)·θ₁, θ₁ the checkpoint's weights."""
    from cardtool.core.training.methods.vae import VAETask

    start, original = {}, VAETask.loss

    def watched(self, indices, generator):
        if not start:  # θ₀: the weights before the first update
            start.update({k: v.detach().clone() for k, v in self.vae.state_dict().items()})
        return original(self, indices, generator)

    monkeypatch.setattr(VAETask, "loss", watched)
    recipe = tiny("fashion-vae", ["optim.steps=1", "optim.warmup=1", "optim.lr=0.01", f"train.ema={ema}",
                                  "card.storage=float32"])
    card = train(recipe, command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data))
    updated = {k[len("model.vae."):]: v for k, v in load_file(str(tmp_path / "run" / CHECKPOINT)).items()
               if k.startswith("model.vae.")}
    stored = weights(card, "vae")
    moved = [k for k in start if start[k].is_floating_point() and not torch.equal(start[k], updated[k])]
    assert len(moved) > 10, "the update changed the weights"
    for k in moved:
        assert torch.allclose(stored[k], ema * start[k] + (1 - ema) * updated[k], rtol=1e-5, atol=1e-7), k


def test_a_full_disk_loses_no_finished_work(tmp_path, data, monkeypatch):
    import errno
    import os

    from cardtool.atomic import save_tensors
    from cardtool.core.cards import writer
    from cardtool.core.training import trainer

    def full_after(calls, code=errno.ENOSPC):
        def save(path, *args):
            calls.append(path)
            if len(calls) > 1:
                raise OSError(code, os.strerror(code), str(path))
            return save_tensors(path, *args)
        return save

    monkeypatch.setattr(trainer, "save_tensors", full_after([]))  # the checkpoint at step 3 fits, step 6's not
    with pytest.raises(RunFailed, match=r"checkpoint of step 6 .*No space left on device; the previous checkpoint is "
                                        r"kept — free space on its disk and continue with --resume"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data))
    monkeypatch.setattr(trainer, "save_tensors", save_tensors)
    monkeypatch.setattr(writer, "save_tensors", full_after([None], errno.EFBIG))  # now the card is over a limit
    with pytest.raises(RunFailed, match=r"cannot write the card to .*vae: File too large; the trained weights are "
                                        r"in .*checkpoint.safetensors — raise the file-size limit \(ulimit -f\) and "
                                        r"run the same command with --resume to write the card"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data),
              resume=True)
    assert not (tmp_path / "vae").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".vae")]
    monkeypatch.setattr(writer, "save_tensors", save_tensors)
    card = train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data),
                 resume=True)
    assert card.manifest.recipe.metrics["steps"] == 6 and card.manifest.recipe.metrics["samples_per_second"] > 0


def test_image_tasks_hold_the_dataset_as_its_bytes(data):
    """The VAE and the classifier convert a batch at a time: a dataset held as float32 takes 4× its bytes, and
    converting it whole took 12× at its peak (9.2 GB for 1.3 million images; 1.5 GB now)."""
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.classifier import ClassifierTask
    from cardtool.core.training.methods.vae import VAETask, to_unit

    train_split, test_split = load_split("train", data), load_split("test", data)
    cpu = Platform.detect("cpu")
    for task in (VAETask(tiny("fashion-vae"), cpu, train_split, test_split),
                 ClassifierTask(tiny("fashion-classifier"), cpu, train_split, test_split)):
        assert task.images.dtype == np.uint8 and task.images.nbytes == train_split.images.nbytes
    images = train_split.images[:5]
    assert torch.equal(to_unit(images), torch.from_numpy(images.astype(np.float32) / 127.5 - 1.0)[:, None])


def test_a_classifier_telling_fewer_classes_than_the_data_holds_is_refused_before_training(data):
    """cross-entropy raised an IndexError at the first batch holding a label past model.classes."""
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.classifier import ClassifierTask

    splits = load_split("train", data), load_split("test", data)
    recipe = tiny("fashion-classifier", ["model.classes=5", "model.width=8", "model.features=16"])
    with pytest.raises(BadInput, match="model.classes is 5, but the data's labels go up to 9: give at least 10"):
        ClassifierTask(recipe, Platform.detect("cpu"), *splits)


def test_the_classifier_trains_on_flipped_and_shifted_images_and_logs_its_accuracy(data):
    """ClassifierTask.loss (the docstring's recipe): each image flipped left-right with probability ½, the batch rolled
    by −2…2 pixels each way; the accuracy it logs is the share of the batch it classified right."""
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.classifier import ClassifierTask
    from cardtool.core.training.methods.vae import to_unit

    splits = load_split("train", data), load_split("test", data)
    task = ClassifierTask(tiny("fashion-classifier", ["model.width=8", "model.features=16"]), Platform.detect("cpu"),
                          *splits)
    seen, right = [], torch.arange(64) % 4 != 0

    def model(images):
        seen.append(images)
        labels = task.labels[:len(images)]  # right on three rows in four, wrong on the fourth
        return torch.nn.functional.one_hot(torch.where(right[:len(images)], labels, (labels + 1) % 10), 10).float()

    task.model = model
    plain, flips, shifts = to_unit(task.images[:64]), [], set()
    for seed in range(8):
        _, metrics = task.loss(torch.arange(64), torch.Generator().manual_seed(seed))
        assert metrics["accuracy"] == 0.75
        matched = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                   if all(torch.equal(seen[-1][i], torch.roll(plain[i], (dy, dx), (1, 2))) or
                          torch.equal(seen[-1][i], torch.roll(plain[i].flip(-1), (dy, dx), (1, 2))) for i in range(64))]
        assert matched, "each image is itself or its mirror image, rolled by the batch's one shift"
        dy, dx = matched[0]
        flips.append(sum(not torch.equal(seen[-1][i], torch.roll(plain[i], (dy, dx), (1, 2))) for i in range(64)))
        shifts.add((dy, dx))
    assert 16 < sum(flips) / len(flips) < 48, flips  # about half of each batch mirrored
    assert any(dy != dx for dy, dx in shifts) and {abs(d) for shift in shifts for d in shift} == {0, 1, 2}
    task.test_images, task.test_labels = task.images[:64], task.labels[:64]
    assert task.finish(model) == {"test_accuracy": 0.75}, "the share of the test split it classifies right"


def test_a_run_resumed_on_other_data_is_refused(tmp_path, data):
    """The checkpoint records a digest of the training examples: a resume reading another --data folder would train
    the rest of the run on it without a word."""
    recipe = tiny("fashion-classifier", ["model.width=8", "model.features=16", "optim.steps=2",
                                          "train.precision=float32"])
    train(recipe, command="c", out=tmp_path / "one", run_dir=tmp_path / "run", data=str(data))
    other = write_idx_folder(tmp_path / "other", seed=1)
    with pytest.raises(BadInput, match="was trained on other data than this run reads"):
        train(recipe, command="c", out=tmp_path / "two", run_dir=tmp_path / "run", data=str(other), resume=True)
    assert train(recipe, command="c", out=tmp_path / "two", run_dir=tmp_path / "run", data=str(data),
                 resume=True).manifest.recipe.metrics["steps"] == 2


def test_a_folder_taken_during_the_run_keeps_the_trained_weights(tmp_path, data):
    """--out is checked before training; another process may still make the folder before the card is written."""
    def take_the_folder(entry):
        (tmp_path / "vae").mkdir(exist_ok=True)

    with pytest.raises(BadInput, match=r"vae already exists; .*--overwrite to replace it. The trained weights are in "
                                       r".*checkpoint.safetensors: the same command with --resume and the change"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data),
              on_log=take_the_folder)
    card = train(tiny("fashion-vae"), command="c", out=tmp_path / "other", run_dir=tmp_path / "run", data=str(data),
                 resume=True, on_log=lambda entry: pytest.fail("trained again"))
    assert card.manifest.recipe.metrics["steps"] == 6


def test_a_run_folder_removed_mid_run_is_made_again_with_its_lock(tmp_path, data):
    """Someone removes a training run's folder: the next checkpoint makes it again — and the run's lock with it, so a
    second run started there is still refused; a second run that took the folder meanwhile stops this one."""
    import fcntl
    import shutil

    from cardtool.core.training.run_lock import LOCK, run_claimed
    from cardtool.errors import RunFailed

    run_dir, seen = tmp_path / "run", []

    def held_by_another(path):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def remove_at_step_2(entry):
        if entry["step"] == 2:
            shutil.rmtree(run_dir)
        if entry["step"] == 4:  # the checkpoints of steps 2 and 3 made it again
            seen.append(((run_dir / LOCK).read_text().strip(), held_by_another(run_dir / LOCK)))
            with pytest.raises(BadInput, match="is in use by another run"), run_claimed(run_dir):
                pass

    recipe = tiny("fashion-vae", ["train.checkpoint_every=1", "train.log_every=1"])
    card = train(recipe, command="c", out=tmp_path / "vae", run_dir=run_dir, data=str(data), on_log=remove_at_step_2)
    assert card.manifest.recipe.metrics["steps"] == 6 and seen == [(str(os.getpid()), True)]

    other, claims = tmp_path / "other", []

    def taken_at_step_2(entry):
        if entry["step"] == 2:  # another run's claim (its own open file: flock holds it against this run's)
            shutil.rmtree(other)
            other.mkdir()
            claims.append(os.open(other / LOCK, os.O_RDWR | os.O_CREAT))
            fcntl.flock(claims[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(claims[-1], b"4242\n")

    try:
        with pytest.raises(RunFailed, match=r"is in use by another run \(process 4242\) \(its folder was removed and "
                                            r"made again during this run\)"):
            train(recipe, command="c", out=tmp_path / "vae2", run_dir=other, data=str(data), on_log=taken_at_step_2)
    finally:
        for fd in claims:
            os.close(fd)


def test_resume_after_a_kill_gives_the_same_final_weights(tmp_path, data):
    uninterrupted = train(tiny("fashion-vae"), command="c", out=tmp_path / "a", run_dir=tmp_path / "ra",
                          data=str(data))

    def kill_after_step_4(entry):
        if entry["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(data),
              on_log=kill_after_step_4)
    assert not (tmp_path / "b").exists() and (tmp_path / "rb" / CHECKPOINT).exists()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "rb" / CHECKPOINT), framework="pt") as f:
        trained_before = float(f.metadata()["seconds"])
    assert trained_before > 0
    with pytest.raises(BadInput, match="already holds a run; continue it with --resume"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(data))
    other = write_idx_folder(tmp_path / "other", seed=1)  # --resume would refuse either: not what to advise
    for changed, folder in ((tiny("fashion-vae", ["optim.lr=2e-3"]), data), (tiny("fashion-vae"), other)):
        with pytest.raises(BadInput, match=r"rb already holds the run of another recipe, other data or other "
                                           r"parents.*; give this run another --run-dir, or remove") as refused:
            train(changed, command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(folder))
        assert ("optim.lr was 0.001, now 0.002" in str(refused.value)) == (folder == data)
    entries = []
    resumed = train(tiny("fashion-vae"), command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(data),
                    resume=True, on_log=entries.append)
    assert [e["step"] for e in entries] == [4, 5, 6], "from the step-3 checkpoint"
    session = entries[0]["elapsed_seconds"] - trained_before  # this process's pace: one step of 8 samples so far
    assert entries[0]["eta_seconds"] == pytest.approx(session * (6 - 4) / (4 - 3), rel=1e-6)
    assert entries[0]["samples_per_second"] == pytest.approx(8 / session, rel=1e-6)
    a, b = weights(uninterrupted, "vae"), weights(resumed, "vae")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the card's training time counts the session the kill ended too
    assert resumed.manifest.recipe.metrics["train_seconds"] >= round(trained_before, 1)


def test_an_altered_optimizer_state_is_refused_on_resume_and_its_hyperparameters_are_the_recipes(tmp_path, data):
    """torch loads optimizer state of any shape or kind and fails only at the next step — or trains on NaN from a
    negative second moment — so resume checks it against the optimizer first. The groups' hyperparameters are the
    recipe's (the checkpoint's fingerprint says they match): ones altered in the file change nothing."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    uninterrupted = train(tiny("fashion-vae"), command="c", out=tmp_path / "a", run_dir=tmp_path / "ra",
                          data=str(data))

    def kill_after_step_4(entry):
        if entry["step"] == 4:
            raise KeyboardInterrupt

    def resume():
        return train(tiny("fashion-vae"), command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(data),
                     resume=True)

    with pytest.raises(KeyboardInterrupt):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(data),
              on_log=kill_after_step_4)
    checkpoint = tmp_path / "rb" / CHECKPOINT
    with safe_open(str(checkpoint), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    first, second = tensors["optim.0.exp_avg"], tensors["optim.0.exp_avg_sq"]
    damaged = [("'optim.0.exp_avg' is float32 [1]", {"optim.0.exp_avg": first.reshape(-1)[:1].clone()}),
               ("'optim.0.exp_avg' is int64", {"optim.0.exp_avg": first.long()}),
               ("negative second moments", {"optim.0.exp_avg_sq": -second - 1}),
               ("names no parameter", {"optim.99999.exp_avg": first.clone()}),
               ("not a count of steps", {"optim.0.step": torch.tensor(2.5)}),
               ("not a count of steps", {"optim.0.step": torch.tensor(True)})]
    for says, change in damaged:
        save_file({**tensors, **change}, str(checkpoint), metadata=metadata)
        with pytest.raises(BadInput, match="does not fit this run's training state") as error:
            resume()
        assert says in str(error.value)
    save_file({k: v for k, v in tensors.items() if k != "optim.0.exp_avg"}, str(checkpoint), metadata=metadata)
    with pytest.raises(BadInput, match=r"the state of parameter 0 holds \['exp_avg_sq', 'step'\]"):
        resume()
    for groups in ("null", "[]", "[{}]"):
        save_file(tensors, str(checkpoint), metadata={**metadata, "param_groups": groups})
        with pytest.raises(BadInput, match="param_groups"):
            resume()
    assert not (tmp_path / "b").exists()
    altered = json.loads(metadata["param_groups"])
    for group in altered:
        group.update(betas=[0.5, 0.5], eps="x", weight_decay=1e30, lr=None)
    save_file(tensors, str(checkpoint), metadata={**metadata, "param_groups": json.dumps(altered)})
    a, b = weights(uninterrupted, "vae"), weights(resume(), "vae")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGXCPU, signal.SIGUSR1])
def test_ctrl_c_sigterm_or_a_closed_terminal_checkpoint_the_finished_steps_and_a_resume_continues_them(
        tmp_path, data, signum, interactive_signals):
    from safetensors import safe_open

    uninterrupted = train(tiny("fashion-vae"), command="c", out=tmp_path / "a", run_dir=tmp_path / "ra",
                          data=str(data))
    previous = signal.getsignal(signum)

    def signal_at_step_4(entry):
        if entry["step"] == 4:  # checkpoint_every is 3: the periodic checkpoint holds step 3 only
            os.kill(os.getpid(), signum)

    with pytest.raises(Interrupted, match="after step 4 of 6") as stopped:
        train(tiny("fashion-vae"), command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(data),
              on_log=signal_at_step_4)
    # past a CPU-time limit (SIGXCPU) the next second's warning would end the process: it stays ignored
    kept = signal.SIG_IGN if signum == signal.SIGXCPU else previous
    assert stopped.value.exit_code == 128 + signum and signal.getsignal(signum) is kept
    with safe_open(str(tmp_path / "rb" / CHECKPOINT), framework="pt") as f:
        assert f.metadata()["step"] == "4"
    resumed = train(tiny("fashion-vae"), command="c", out=tmp_path / "b", run_dir=tmp_path / "rb", data=str(data),
                    resume=True)
    a, b = weights(uninterrupted, "vae"), weights(resumed, "vae")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_interrupted_run_says_so_in_its_exit_code_and_json(tmp_path, data, monkeypatch, interactive_signals):
    from cardtool.core.training import trainer

    real_save, pressed = trainer._save, []

    def save_then_ctrl_c(*args, **kwargs):  # the first periodic checkpoint, then the user presses Ctrl-C once
        real_save(*args, **kwargs)
        if not pressed:
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(trainer, "_save", save_then_ctrl_c)
    result = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"),
                                      *(f"--set={s}" for s in TINY_VAE), "--data", str(data), "--out",
                                      str(tmp_path / "v"), "--run-dir", str(tmp_path / "r"), "--json"])
    assert result.exit_code == 130, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "interrupted" and "SIGINT after step 4 of 6" in error["message"]
    assert "--resume" in error["message"] and not (tmp_path / "v").exists()
    assert error["partial"] == {"step": 4, "steps": 6, "checkpoint": str(tmp_path / "r" / CHECKPOINT)}


def test_resume_with_another_recipe_is_refused_naming_what_changed(tmp_path, data):
    train(tiny("fashion-vae"), command="c", out=tmp_path / "a", run_dir=tmp_path / "r", data=str(data))
    lr = tiny("fashion-vae").optim.lr
    with pytest.raises(BadInput, match=rf"different recipe \(optim.lr was {lr}, now 0.01\); resume with the same"):
        train(tiny("fashion-vae", ["optim.lr=1e-2"]), command="c", out=tmp_path / "b", run_dir=tmp_path / "r",
              data=str(data), resume=True)
    with pytest.raises(BadInput, match=r"\(loss.kl_weight was .*, now 0.5; optim.lr was .*, now 0.01; .* and 1 more\)"):
        train(tiny("fashion-vae", ["optim.lr=1e-2", "loss.kl_weight=0.5", "optim.warmup=3", "optim.steps=9",
                                   "train.seed=4"]), command="c", out=tmp_path / "b", run_dir=tmp_path / "r",
              data=str(data), resume=True)
    assert recipe_changes(None, {"a": 1}) == recipe_changes("not json", {"a": 1}) == ""  # an older checkpoint
    changed = recipe_changes('{"a": {"b": 1}}', {"a": {}, "c": [1]})
    assert changed == " (a was (unset), now {}; a.b was 1, now (unset); c was (unset), now [1])"
    was = json.dumps({str(k): -1 for k in range(5)})  # four changes shown in full; past four, how many more
    assert recipe_changes(was, {str(k): k for k in range(4)} | {"4": -1}) == \
        " (0 was -1, now 0; 1 was -1, now 1; 2 was -1, now 2; 3 was -1, now 3)"
    assert recipe_changes(was, {str(k): k for k in range(5)}).endswith("3 was -1, now 3 and 1 more)")


def test_a_damaged_checkpoint_is_bad_input_on_resume(tmp_path, data):
    """Checkpoints are written atomically, but a disk or a hand can still damage one: --resume then says what is
    wrong and what to do, never a traceback."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    train(tiny("fashion-vae"), command="c", out=tmp_path / "a", run_dir=tmp_path / "r", data=str(data))
    checkpoint = tmp_path / "r" / CHECKPOINT
    whole = checkpoint.read_bytes()
    with safe_open(str(checkpoint), framework="pt") as f:
        metadata = f.metadata()
    damaged = {"truncated": whole[: len(whole) // 2], "header bytes": whole[:8] + b"\xff" * 8 + whole[16:]}
    for step in ("-3", "many", "999"):
        save_file(load_file(str(checkpoint)), str(tmp_path / "x"), metadata={**metadata, "step": step})
        damaged[f"step {step}"] = (tmp_path / "x").read_bytes()
    for seconds in ("-1", "nan", "inf"):
        save_file(load_file(str(checkpoint)), str(tmp_path / "x"), metadata={**metadata, "seconds": seconds})
        damaged[f"seconds {seconds}"] = (tmp_path / "x").read_bytes()
    tensors = load_file(str(checkpoint))
    weight = next(k for k in tensors if k.startswith("model."))
    save_file({**tensors, weight: tensors[weight] * float("nan")}, str(tmp_path / "x"), metadata=metadata)
    damaged["NaN"] = (tmp_path / "x").read_bytes()  # resumed, a finished run would write a card of NaN weights
    save_file({**tensors, weight: tensors[weight].long()}, str(tmp_path / "x"), metadata=metadata)
    damaged["integers"] = (tmp_path / "x").read_bytes()  # torch would load them, rounding the weights
    for name, content in damaged.items():
        checkpoint.write_bytes(content)
        with pytest.raises(BadInput, match="is not a checkpoint this run can read") as error:
            train(tiny("fashion-vae"), command="c", out=tmp_path / name, run_dir=tmp_path / "r", data=str(data),
                  resume=True)
        assert name != "NaN" or "holds NaN or inf in model." in str(error.value)
        assert name != "integers" or "are not floating point" in str(error.value)
        assert not (tmp_path / name).exists()
    older = {k: v for k, v in metadata.items() if k != "seconds"}  # before checkpoints recorded the time: 0 s
    checkpoint.write_bytes(whole)  # (loaded tensors map the file: clones, before it is written over)
    save_file({k: v.clone() for k, v in load_file(str(checkpoint)).items()}, str(checkpoint), metadata=older)
    assert train(tiny("fashion-vae"), command="c", out=tmp_path / "older", run_dir=tmp_path / "r", data=str(data),
                 resume=True).id == "fashion-vae"
    for name, make in (("pipe", os.mkfifo), ("device", lambda p: p.symlink_to("/dev/zero")), ("folder", Path.mkdir)):
        checkpoint.rmdir() if checkpoint.is_dir() and not checkpoint.is_symlink() else checkpoint.unlink()
        make(checkpoint)  # a pipe was read for ever: --resume hung
        with pytest.raises(BadInput, match="is not a checkpoint this run can read \\(it is not a regular file\\)"):
            train(tiny("fashion-vae"), command="c", out=tmp_path / name, run_dir=tmp_path / "r", data=str(data),
                  resume=True)


def test_a_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(tmp_path, data, monkeypatch):
    from cardtool.core.training.methods.vae import VAETask

    original = VAETask.loss
    calls = []

    def poisoned(self, indices, generator):
        loss, metrics = original(self, indices, generator)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 5 else loss), metrics

    monkeypatch.setattr(VAETask, "loss", poisoned)
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 4; the last good checkpoint is .*checkpoint"
                       r".*Lower optim.lr or raise optim.warmup and start the run again in a new --run-dir"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data))
    with pytest.raises(BadInput, match=r"made by a different recipe \(optim.lr was"):  # why the advice is not --resume
        train(tiny("fashion-vae", ["optim.lr=1e-5"]), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run",
              data=str(data), resume=True)
    assert not (tmp_path / "vae").exists()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / CHECKPOINT), framework="pt") as f:
        assert f.metadata()["step"] == "3"
    calls.clear()
    calls.extend([1] * 4)  # NaN at once on resuming: the checkpoint resumed from is not a good one
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 3; the checkpoint it resumed from, .*"
                       r"checkpoint.safetensors, already gives it \(the run diverged before it was written, or the file"
                       r" was changed since\). Lower optim.lr"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data),
              resume=True)
    calls.clear()
    calls.extend([1] * 4)  # the first loss is NaN: no update has been made, so the learning rate is not to blame
    with pytest.raises(TrainingDiverged, match="at step 0, before any update; none was written yet. The starting"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run0", data=str(data))


def test_an_existing_card_is_not_overwritten_unless_asked(tmp_path, data):
    (tmp_path / "vae").mkdir()
    with pytest.raises(BadInput, match="already exists"):
        train(tiny("fashion-vae"), command="c", out=tmp_path / "vae", run_dir=tmp_path / "run", data=str(data))


def test_a_card_id_another_card_on_the_search_path_holds_is_refused_before_training(examples, tmp_path, data,
                                                                                    monkeypatch):
    """`distill fashion-base` run outside this repository wrote cards/fashion-base-2step beside the built-in one:
    every later lookup of the id was ambiguous, the new card's own lineage included."""
    import json

    from typer.testing import CliRunner

    from cardtool.cli import app
    from cardtool.core.cards import discovery

    monkeypatch.setattr(discovery, "builtin_dir", lambda: examples)  # built-in cards: tiny-base, tiny-rl, …
    monkeypatch.chdir(tmp_path)  # ./cards is searched: a card written there joins the search path
    recipe = tiny("fashion-vae", ["card.id=tiny-base"])
    with pytest.raises(BadInput, match=r"card id 'tiny-base' is already the id of .*tiny-base \(builtin\).*"
                                       r"another id \(--set card.id=NAME\)"):
        train(recipe, command="c", run_dir=tmp_path / "run", data=str(data))
    assert not (tmp_path / "cards").exists() and not (tmp_path / "run").exists(), "refused before any work"
    result = CliRunner().invoke(app, ["cards", "export", "tiny-distilled", "--format", "hf", "--out",
                                      "cards/tiny-distilled-hf", "--json"])  # the export's manifest keeps its id
    assert result.exit_code == 2 and "already the id of" in json.loads(result.stdout)["error"]["message"]
    assert not (tmp_path / "cards").exists()
    card = train(recipe, command="c", out=tmp_path / "mine" / "vae", run_dir=tmp_path / "run", data=str(data))
    assert card.id == "tiny-base", "off the search path the id is the user's to choose"


def test_classifier_pretrain_and_generate_from_what_training_wrote(tmp_path, data, monkeypatch):
    """The whole family on tiny configs: VAE → classifier → pretrained text-to-image card → generate."""
    monkeypatch.chdir(tmp_path)
    train(tiny("fashion-vae"), command="c", out=tmp_path / "cards" / "fashion-vae", run_dir=tmp_path / "r1",
          data=str(data))
    judge = train(tiny("fashion-classifier", ["model.width=8", "model.features=16", "optim.steps=4",
                                              "optim.batch_size=8", "train.precision=float32"]),
                  command="c", out=tmp_path / "cards" / "fashion-classifier", run_dir=tmp_path / "r2", data=str(data))
    assert set(judge.manifest.components) == {"classifier", "text_encoder"}
    assert 0 <= judge.manifest.recipe.metrics["test_accuracy"] <= 1
    base = train(tiny("fashion-base", ["model.dim=32", "model.depth=1", "model.heads=2", "model.ffn_dim=64",
                                       "optim.steps=3", "optim.batch_size=8", "train.precision=float32",
                                       "train.checkpoint_every=2"]),
                 command="c", out=tmp_path / "cards" / "fashion-base", run_dir=tmp_path / "r3", data=str(data))
    assert base.manifest.recipe.parents == ["fashion-vae"] and base.manifest.recipe.assumes.loop == "denoise"
    assert base.manifest.loops["denoise"].defaults["guidance_interval"] == [0.0, 0.4], "the recipe's loop defaults"
    parent_vae = tmp_path / "cards" / "fashion-vae" / "vae.safetensors"
    assert base.weights_file("vae").read_bytes() == parent_vae.read_bytes(), "the VAE is carried over as is"
    result = CliRunner().invoke(app, ["generate", "fashion-base", "-p", "an ankle boot", "--steps", "2", "--json",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["images"][0]["card"] == "fashion-base"
    lineage = CliRunner().invoke(app, ["cards", "lineage", "fashion-base", "--json"])
    assert json.loads(lineage.stdout)["lineage"]["parents"][0]["id"] == "fashion-vae"
    evaluation = CliRunner().invoke(app, ["eval", "fashion-base", "--per-class", "2", "--steps", "1", "--steps", "2",
                                          "--data", str(data), "--json", "--record"])
    assert evaluation.exit_code == 0, evaluation.output
    report = json.loads(evaluation.stdout)
    assert [r["steps"] for r in report["rows"]] == [1, 2] and report["rows"][0]["images"] == 20
    assert report["rows"][0]["guidance"] == 4.0 and report["rows"][0]["guidance_interval"] == [0.0, 0.4]
    assert set(report["floors"]) == set(report["kid_floors"]) == {"train_vs_test", "vae_reconstruction"}
    assert all(r["kid_std"] >= 0 and isinstance(r["kid"], float) for r in report["rows"])
    assert "KID" in report["warnings"][0], "20 images are too few for FID to mean much, and the report says so"
    summary = load_card("fashion-base", checksums=True).manifest.recipe.metrics["eval"]
    full = (base.folder / summary["report"]).read_bytes()
    assert json.loads(full)["rows"] == report["rows"] and summary["sha256"] == hashlib.sha256(full).hexdigest()
    assert summary["rows_in_report"] == 2 and summary["rows"] == report["rows"], "no row at the 20-step default"
    tuned = train(tiny("fashion-base", ["method=finetune", "parents=[fashion-base]", "card.id=fashion-tuned",
                                        "model={}", "loss={}", "data={loop: {steps: 7}}", "optim.steps=2",
                                        "optim.batch_size=8", "train.ema=0", "train.precision=float32"]),
                  command="c", out=tmp_path / "cards" / "fashion-tuned", run_dir=tmp_path / "r4", data=str(data))
    assert tuned.manifest.recipe.method == "finetune" and tuned.manifest.recipe.parents == ["fashion-base"]
    assert tuned.manifest.recipe.hyperparameters["loss"] == {"condition_dropout": 0.1}, "its default, recorded"
    assert base.manifest.recipe.hyperparameters["loss"] == {"condition_dropout": 0.1}, "as the recipe gave it"
    assert tuned.manifest.loops["denoise"].defaults == {**base.manifest.loops["denoise"].defaults, "steps": 7}, \
        "it samples as the card it continues, less what data.loop changes"
    assert tuned.manifest.components["transformer"].config == base.manifest.components["transformer"].config
    before, after = weights(base, "transformer"), weights(tuned, "transformer")
    assert any(not torch.equal(before[k], after[k]) for k in before), "fine-tuning moved the weights"


def test_train_cli(tmp_path, data):
    sets = [arg for override in TINY_VAE for arg in ("--set", override)]
    result = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), *sets, "--data",
                                      str(data), "--out", str(tmp_path / "vae"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["card"], report["method"], report["parents"], report["extends"]) == ("fashion-vae", "vae", [], None)
    assert report["metrics"] == load_card(tmp_path / "vae").manifest.recipe.metrics and "psnr" in str(report["metrics"])
    assert (tmp_path / "runs" / "fashion-vae" / CHECKPOINT).is_file(), "the run's folder defaults to runs/ID"
    assert "step 6/6  loss " in result.stderr, "a script's stdout holds the document, a person still sees progress"
    command = load_card(tmp_path / "vae").manifest.recipe.command  # rebuilt here (not typed): every override kept
    assert command.startswith("cardtool train --recipe ") and all(f"--set={o}" in command for o in TINY_VAE), command
    again = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), *sets, "--data",
                                     str(data), "--out", str(tmp_path / "vae"), "--run-dir", str(tmp_path / "again")])
    assert again.exit_code == 2 and "already exists" in again.stderr and "--overwrite" in again.stderr, again.output
    shown = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), *sets, "--data",
                                     str(data), "--out", str(tmp_path / "vae"), "--run-dir", str(tmp_path / "again"),
                                     "--force"])  # replaced, and said for people
    assert shown.exit_code == 0 and shown.stdout.startswith("wrote card fashion-vae to vae\nmetrics: test_psnr_db=")
    bracketed = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), *sets, "--data",
                                         str(data), "--out", str(tmp_path / "[red]vae"), "--run-dir",
                                         str(tmp_path / "b")])
    assert bracketed.stdout.startswith("wrote card fashion-vae to [red]vae\n"), "a path is printed, not read as markup"
    bad = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), "--set", "optim.lrr=1"])
    assert bad.exit_code == 2 and "optim.lrr" in bad.stderr
    for parts in ("0", "-1"):
        bad = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), *sets, "--data",
                                       str(data), "--micro-batches", parts, "--run-dir", str(tmp_path / "never")])
        assert bad.exit_code == 2 and f"--micro-batches must be at least 1, got {parts}" in bad.stderr


def test_a_distill_or_rl_recipe_is_refused_by_train_naming_the_command_that_runs_it(tmp_path):
    from cardtool.core.training.rl import rl_recipe

    cli = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-dmd2.yaml")])
    assert cli.exit_code == 2 and "`cardtool distill TEACHER --recipe FILE` does" in cli.stderr, cli.output
    with pytest.raises(BadInput, match="diffusion_nft is not a `cardtool train` method: `cardtool rl CARD --reward"):
        train(rl_recipe("tiny-base", "tiny-judge"), command="c", out=tmp_path / "x")
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def test_bfloat16_training_is_refused_where_the_platform_has_no_bf16_compute(tmp_path, data, monkeypatch):
    from cardtool.backends.platform import Platform

    monkeypatch.setattr(Platform, "supports_bf16", property(lambda self: False))
    sets = [arg for override in [*TINY_VAE, "train.precision=bfloat16"] for arg in ("--set", override)]
    result = CliRunner().invoke(app, ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), *sets, "--data",
                                      str(data), "--out", str(tmp_path / "vae"), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "train.precision=float32" in result.stderr
    assert not (tmp_path / "vae").exists() and not (tmp_path / "run" / CHECKPOINT).exists()


def test_judge_scores_prompts_by_class_names_and_free_text(tmp_path, data):
    train(tiny("fashion-classifier", ["model.width=8", "model.features=16", "optim.steps=2", "optim.batch_size=8",
                                      "train.precision=float32"]),
          command="c", out=tmp_path / "judge", run_dir=tmp_path / "r", data=str(data))
    from cardtool.backends.platform import Platform
    from cardtool.core.evaluation.reward import FashionJudge
    from cardtool.core.sampling.instance import ModelInstance

    judge = FashionJudge(ModelInstance(load_card(tmp_path / "judge"), Platform("cpu", "generic")))
    assert judge.prompt_classes(["an ankle boot", "A pair of JEANS", "a handbag", "a warm winter jacket for snow"]
                                ).tolist() == [9, 1, 8, 4]
    # naming no class (nor a word for one): the class whose prompt the text encoder puts nearest
    assert judge.prompt_classes(["a leather purse", "something warm for winter", "jeans"]).tolist() == [8, 4, 1]
    assert judge.prompt_classes(["a red t-shirt", "a shirt"]).tolist() == [0, 6], "the longest name found wins"
    # of two names as long the later, a compound's head (a dress shirt is a shirt); plurals are names too
    assert judge.prompt_classes(["a dress shirt", "a shirt dress", "high-top sneakers", "winter boots", "two dresses",
                                 "tops"]).tolist() == [6, 3, 7, 9, 3, 0]
    # nearest among every class's training phrasings, not its one canonical prompt (which puts both at class 9)
    assert judge.prompt_classes(["a tennis shoe", "sports shoes"]).tolist() == [7, 7]
    # the nearest class by cosine of mean-pooled token states (padding left out)
    encoder = judge.instance.component("text_encoder")
    states, mask = (judge.instance.arrays.to_numpy(t) for t in encoder(["a b", "something warm for winter"]))
    pooled = np.stack([states[i, mask[i] > 0].mean(0) for i in range(2)])
    np.testing.assert_allclose(judge._embed(["a b", "something warm for winter"]),
                               pooled / np.linalg.norm(pooled, axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    many = np.random.default_rng(1).integers(0, 255, (300, 28, 28), dtype=np.uint8)
    sizes = []
    hook = judge._model().register_forward_pre_hook(lambda module, args: sizes.append(len(args[0])))
    probabilities = judge.probabilities(many)
    hook.remove()
    assert sizes == [128, 128, 44], "classified 128 at a time: 13 MB of activations a call, not 100 MB"
    np.testing.assert_allclose(probabilities, judge._batches(many, lambda m, x: (m(x).softmax(-1),), size=300)[0],
                               atol=1e-6)
    features, judged = judge.judged(many)  # one pass below the head: the same bits as the two calls
    assert np.array_equal(features, judge.features(many)) and np.array_equal(judged, probabilities)
    assert features.shape == (300, judge._model().head[-1].in_features)
    images = np.random.default_rng(0).integers(0, 255, (4, 28, 28), dtype=np.uint8)
    scores = judge.score(images, ["a bag", "a coat", "a dress", "a sneaker"])
    probabilities = judge.probabilities(images)
    assert np.allclose(probabilities.sum(1), 1, atol=1e-5)
    assert np.allclose(scores, probabilities[np.arange(4), [8, 4, 3, 7]])
    assert judge.features(images).shape == (4, 16)
    bare = FashionJudge(ModelInstance(load_card(REPO / "examples" / "cards" / "tiny-judge"),
                                      Platform("cpu", "generic")))
    assert bare.prompt_classes(["a bag", "a pair of jeans"]).tolist() == [8, 1], "class words need no text encoder"
    with pytest.raises(BadInput, match="cannot tell which class 'something warm' asks for: the prompt names"):
        bare.prompt_classes(["a bag", "something warm", "something warm"])
    for unmatched, shown in [(["warm", "cosy", "soft"], "'warm', 'cosy', 'soft' asks"),
                             (["warm", "cosy", "soft", "light"], "'warm', 'cosy', 'soft' … asks")]:
        with pytest.raises(BadInput, match=f"which class {shown} for"):
            bare.prompt_classes(unmatched)
    with pytest.raises(BadInput, match="score: 4 images but 3 prompts"):
        bare.score(images, ["a bag", "a coat", "a dress"])
    none = np.zeros((0, 28, 28), np.uint8)  # an empty batch keeps the result's shape
    assert bare.probabilities(none).shape == (0, 10) and bare.score(none, []).shape == (0,)
    with pytest.raises(BadInput, match="card 'tiny-base' has no classifier component to judge with"):
        FashionJudge(ModelInstance(load_card(REPO / "examples" / "cards" / "tiny-base"), Platform("cpu", "generic")))


def test_lora_and_controlnet_training_write_adapter_cards_that_generate_serves(examples, tmp_path, data):
    from safetensors import safe_open

    common = ["optim.steps=2", "optim.batch_size=8", "train.precision=float32", "optim.lr=1e-2",
              f"parents=[{examples / 'tiny-base'}]"]
    lora = train(load_recipe(RECIPES / "fashion-bold.yaml", [*common, "card.id=tiny-bold", "model.rank=2"]),
                 command="c", out=examples / "tiny-bold", run_dir=tmp_path / "r1", data=str(data))
    m = lora.manifest
    assert m.extends == "tiny-base" and m.recipe.method == "lora" and m.recipe.parents == ["tiny-base"]
    assert (m.adapters["bold"].rank, m.adapters["bold"].alpha) == (2, 8), "alpha as the recipe sets it"
    assert m.loops["denoise"].defaults["adapters"] == {"bold": 1.0} and "invert" in m.adapters
    assert lora.weights_file("transformer").resolve() == (examples / "tiny-base" / "transformer.safetensors").resolve()
    with safe_open(str(lora.weights_file("bold")), "pt") as f:
        assert (f.metadata()["rank"], f.metadata()["alpha"]) == ("2", "8.0")
        assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in f.keys())
        assert any(f.get_tensor(k).abs().max() > 0 for k in f.keys() if k.endswith("lora_B.weight"))
    # fine-tuning a LoRA card continues the DiT its loop serves: the base's with the LoRA merged
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.frozen import FrozenCard

    tuned = train(tiny("fashion-base", ["method=finetune", f"parents=[{examples / 'tiny-bold'}]", "model={}",
                                        "card.id=tiny-bold-tuned", "card.storage=float32", "optim.steps=1",
                                        "optim.lr=1e-12", "optim.batch_size=8", "train.ema=0",
                                        "train.precision=float32", "data={}"]),
                  command="c", out=tmp_path / "tuned", run_dir=tmp_path / "r0", data=str(data))
    served = FrozenCard(lora, Platform.detect("cpu"), "parent", "finetune").module.state_dict()
    base, after = (load_file(str(c.weights_file("transformer"))) for c in (load_card(examples / "tiny-base"), tuned))
    assert max(float((after[k] - served[k]).abs().max()) for k in after) < 1e-6
    assert any(not torch.equal(base[k], after[k]) for k in after), "the LoRA is in the weights"
    assert tuned.manifest.loops["denoise"].defaults == {k: v for k, v in m.loops["denoise"].defaults.items()
                                                        if k != "adapters"}
    net = train(load_recipe(RECIPES / "fashion-silhouette.yaml", [*common, "card.id=tiny-outline", "model.blocks=1",
                                                                  "model.adapter=outline"]),
                command="c", out=examples / "tiny-outline", run_dir=tmp_path / "r2", data=str(data))
    spec = net.manifest.adapters["outline"]
    assert spec.kind == "controlnet" and spec.control == "silhouette" and spec.config == {"blocks": 1}
    weights = load_file(str(net.weights_file("outline")))
    assert weights["controlnet_blocks.0.weight"].abs().max() > 0, "the zero-initialised output trained"
    shape = np.zeros((28, 28), np.uint8)
    shape[4:24, 6:22] = 255
    from cardtool.core.sampling.images import save_png

    save_png(tmp_path / "shape.png", shape)
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-outline"), "-p", "a bag", "--steps", "2",
                                      "--control", str(tmp_path / "shape.png"), "--json", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    image = json.loads(result.stdout)["images"][0]
    assert image["adapters"][0]["name"] == "outline" and image["control"]["preprocessor"] == "silhouette"
    with pytest.raises(BadInput, match="unknown model.rank"):
        train(load_recipe(RECIPES / "fashion-silhouette.yaml", [*common, "model.rank=2"]), command="c",
              out=tmp_path / "x", run_dir=tmp_path / "r3", data=str(data))


@pytest.fixture
def no_encoding(monkeypatch):
    """Training images encoded (the VAE's latents of more than one image: minutes on Fashion-MNIST) fail the test:
    what the recipe or the parent's manifest can say is wrong is refused before."""
    from cardtool.core.training.methods import flow_matching

    real = flow_matching.latents

    def one_at_most(vae, images, device):
        assert len(images) <= 1, "the training images were encoded before the recipe was refused"
        return real(vae, images, device)

    monkeypatch.setattr(flow_matching, "latents", one_at_most)


def test_adapter_recipes_defaults_bounds_and_targets(examples, tmp_path, data, request):
    """A lora recipe's rank defaults to 8 (1–1024) and its `model.targets` choose the layers it trains (recorded in
    the card when not the default ones; an empty list is refused, not read as the default); a controlnet's blocks
    default to 2 and may copy every block of the base, and its control is a named preprocessor other than none.
    Each is refused before the training images are encoded (minutes on Fashion-MNIST), not after."""
    common = ["optim.steps=1", "optim.batch_size=4", "train.precision=float32", f"parents=[{examples / 'tiny-base'}]"]

    def lora(out, *extra):
        recipe = load_recipe(RECIPES / "fashion-bold.yaml", [*common, "card.id=tiny-bold", *extra])
        return train(recipe, command="c", out=out, run_dir=tmp_path / f"run-{out.name}", data=str(data))

    def controlnet(out, *extra):
        recipe = load_recipe(RECIPES / "fashion-silhouette.yaml", [*common, "card.id=tiny-outline", *extra])
        return train(recipe, command="c", out=out, run_dir=tmp_path / f"run-{out.name}", data=str(data))

    plain = load_recipe(RECIPES / "fashion-bold.yaml", [*common, "card.id=tiny-bold"])
    plain.model.pop("rank"), plain.model.pop("alpha")
    card = train(plain, command="c", out=tmp_path / "default", run_dir=tmp_path / "run-default", data=str(data))
    assert (card.manifest.adapters["bold"].rank, card.manifest.adapters["bold"].alpha) == (8, 8.0)
    assert card.manifest.adapters["bold"].targets is None, "the default targets are not written out"
    card = lora(tmp_path / "q", "model.rank=1", "model.targets=[blocks.*.attn1.to_q]")
    assert card.manifest.adapters["bold"].targets == ["blocks.*.attn1.to_q"]
    assert sorted(weights(card, "bold")) == [f"blocks.{b}.attn1.to_q.lora_{m}.weight" for b in (0, 1) for m in "AB"]
    net = controlnet(tmp_path / "net", "model.adapter=outline", "model.blocks=2")
    assert net.manifest.adapters["outline"].config == {"blocks": 2}
    assert {k.split(".")[1] for k in weights(net, "outline") if k.startswith("blocks.")} == {"0", "1"}
    plain = load_recipe(RECIPES / "fashion-silhouette.yaml", [*common, "card.id=tiny-outline"])
    assert plain.model.pop("blocks") == 2
    assert train(plain, command="c", out=tmp_path / "net2", run_dir=tmp_path / "run-net2",
                 data=str(data)).manifest.adapters["silhouette"].config == {"blocks": 2}
    request.getfixturevalue("no_encoding")  # the cards above were trained; the refusals below must encode nothing
    for method, extra, message in [
            (lora, "model.rank=0", "model.rank: Input should be greater than or equal to 1"),
            (lora, "model.rank=1025", "model.rank: Input should be less than or equal to 1024"),
            (lora, "model.targets=[]", "model.targets: .*at least 1 item"),
            (lora, "model.targets=[head.*]", r"no linear layer of 'tiny-base' matches the LoRA targets \['head.\*'\]"),
            (lora, "model.targets=[blocks.*.norm_q]", "no linear layer of 'tiny-base' matches"),  # a norm's weight
            (lora, "loss.scales=[0.5, 2]", r"loss.scales must be a list of numbers in \(0, 1\]"),
            (lora, "model.adapter=invert", "'tiny-base' already declares an adapter 'invert'"),
            (controlnet, "model.blocks=3", "model.blocks 3 exceeds the 2 blocks of 'tiny-base'"),
            (controlnet, "model.blocks=0", "model.blocks: Input should be greater than or equal to 1"),
            (controlnet, "model.control=none", "model.control: Input should be 'silhouette' or 'edges'"),
            (controlnet, "model.control=blur", "model.control: Input should be 'silhouette' or 'edges'")]:
        with pytest.raises(BadInput, match=message):
            method(tmp_path / "x", extra)
    assert not (tmp_path / "x").exists()


def test_a_trainable_lora_starts_as_peft_does_and_adds_alpha_over_r_times_b_a_x():
    """At init A ~ U(±1/√in) and B = 0 (the model unchanged); then y + (α/r)·B·A·x on the targeted layers only."""
    from cardtool.backends.lora import TrainableLora

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"q": torch.nn.Linear(400, 3), "k": torch.nn.Linear(400, 3)})
    lora = TrainableLora(model, ["q"], 4, 2.0)
    a, b = lora.lora_A["q"], lora.lora_B["q"]
    assert lora.names == ["q"] and a.shape == (4, 400) and b.shape == (3, 4) and not b.any()
    assert -1 / 20 <= float(a.detach().min()) < -0.9 / 20 and 0.9 / 20 < float(a.detach().max()) <= 1 / 20, "1/√400"
    with torch.no_grad():
        b.normal_()
    x, y = torch.randn(2, 400), torch.randn(2, 3)
    torch.testing.assert_close(lora("q", x, y), y + 0.5 * x @ a.T @ b.T)
    assert torch.equal(lora("k", x, y), y)
    with pytest.raises(ValueError, match="no linear layer matches"):
        TrainableLora(model, ["v"], 4, 2.0)


def test_lora_scales_train_each_row_at_its_own_scale_on_a_mixture(examples, tmp_path, data):
    """`loss.scales`: a row at scale s adds s times the LoRA's delta (0 adds nothing), and a run drawing its rows'
    scales from the list trains a LoRA card as usual."""
    from cardtool.backends.lora import TrainableLora
    from cardtool.backends.platform import Platform
    from cardtool.backends.wan_config import WanDiTConfig
    from cardtool.backends.wan_dit import WanDiT

    torch.manual_seed(0)
    config = WanDiTConfig(dim=16, depth=1, heads=2, ffn_dim=32, text_dim=8, freq_dim=16)
    dit = WanDiT(config, Platform("cpu", "generic"))
    lora = TrainableLora(dit, ["blocks.0.attn1.to_q"], 2, 4.0)
    torch.nn.init.normal_(lora.lora_B["blocks__0__attn1__to_q"])
    x, y = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    delta = lora("blocks.0.attn1.to_q", x, y) - y
    scaled = lora.at(torch.tensor([0.0, 0.5, 1.0]))("blocks.0.attn1.to_q", x, y)
    assert torch.equal(scaled[0], y[0])
    torch.testing.assert_close(scaled[1] - y[1], 0.5 * delta[1])
    torch.testing.assert_close(scaled[2], y[2] + delta[2])

    common = ["optim.steps=2", "optim.batch_size=8", "train.precision=float32", "optim.lr=1e-2", "model.rank=2",
              f"parents=[{examples / 'tiny-base'}]", "card.id=tiny-mirror"]
    card = train(load_recipe(RECIPES / "fashion-mirror.yaml", [*common, "loss.scales=[0.5, 1]"]),
                 command="c", out=tmp_path / "tiny-mirror", run_dir=tmp_path / "r", data=str(data))
    assert card.manifest.recipe.hyperparameters["loss"]["scales"] == [0.5, 1]
    assert any(t.abs().max() > 0 for k, t in weights(card, "mirror").items() if k.endswith("lora_B.weight"))
    # each row trains on its transformed image with probability s, the plain one otherwise, at scale s
    from cardtool.core.training.methods.adapters import LoraTask

    recipe = load_recipe(RECIPES / "fashion-mirror.yaml", [*common, "loss.scales=[0.25, 1]", "data.transform=invert"])
    task = LoraTask(recipe, Platform.detect("cpu"), load_split("train", str(data)), load_split("test", str(data)))
    seen = []
    task._loss = lambda x0, labels, generator, dropout, lora: seen.append((x0, lora)) or torch.zeros(())
    indices = np.arange(64)
    task.loss(indices, torch.Generator().manual_seed(0))
    x0, lora = seen[0]
    nearer = ((x0 - task.mean[indices]).abs().mean((1, 2, 3, 4))
              < (x0 - task.plain_mean[indices]).abs().mean((1, 2, 3, 4)))
    row_scales = lora.keywords["scales"]
    assert set(row_scales.tolist()) == {0.25, 1.0}
    assert nearer[row_scales == 1].all(), "every row at scale 1 trains on its transformed image"
    low = nearer[row_scales == 0.25].float()
    assert 0 < low.mean() < 0.6, "rows at scale 0.25 mostly keep the plain image"
    for bad in ("loss.scales=[0]", "loss.scales=[1.5]", "loss.scales=oops", "loss.scales=[]"):
        with pytest.raises(BadInput, match="loss.scales"):
            train(load_recipe(RECIPES / "fashion-mirror.yaml", [*common, bad]), command="c",
                  out=tmp_path / "x", run_dir=tmp_path / "r2", data=str(data))
    with pytest.raises(BadInput, match="set data.transform"):
        train(load_recipe(RECIPES / "fashion-mirror.yaml", [*common, "loss.scales=[0.5]", "data.transform=none"]),
              command="c", out=tmp_path / "x", run_dir=tmp_path / "r3", data=str(data))


@pytest.mark.parametrize("recipe_name, override, message", [
    ("fashion-bold", "loss.condition_droput=0.2", "unknown loss.condition_droput; its settings: condition_dropout, sc"),
    ("fashion-silhouette", "loss.scales=[0.5]", "unknown loss.scales; its settings: condition_dropout"),
    ("fashion-bold", "loss.condition_dropout=2", r"loss.condition_dropout must be a finite number in \[0, 1\]"),
    ("fashion-vae", "loss.kl_wieght=1", "unknown loss.kl_wieght; its settings: kl_weight"),
    ("fashion-vae", "loss.kl_weight=much", "loss.kl_weight must be a finite number"),
    ("fashion-classifier", "loss.label_smoothing=0.1", "unknown loss.label_smoothing; its settings: none"),
    ("fashion-bold", "data.transfrom=mirror", "unknown data.transfrom; its settings: folder, transform"),
    ("fashion-bold", "data.loop={steps: 2}", "unknown data.loop"),  # an adapter card keeps its base's loop
    ("fashion-vae", "data.transform=mirror", "unknown data.transform; its settings: folder"),
    # what would fail only when the card is written, or in the first step: refused before any training
    ("fashion-base", "data.loop.steps=0", "data.loop.steps: Input should be greater than or equal to 1"),
    ("fashion-base", "data.loop=0.5", "data.loop must map loop settings"),
    ("fashion-base", "model.text_dim=32", "model.text_dim is 32, but the text encoder gives 384-wide token states"),
    ("fashion-base", "model.out_channels=7", "model.out_channels is 7, but the VAE of 'fashion-vae' makes 4-channel"),
    ("fashion-base", "model.patch=[2, 2, 2]", r"model.patch \[2, 2, 2\] does not tile the VAE's latents"),
    ("fashion-vae", "model.image_size=24", "train images are 28×28 pixels; the components take 24×24"),
    ("fashion-bold", "model.adapter=1e-3", "model.adapter: Input should be a valid string"),  # a key the card refuses
    ("fashion-bold", "model.targets=true", "model.targets: Input should be a valid tuple"),
    ("fashion-silhouette", "model.control=[edges]", "model.control: Input should be 'silhouette' or 'edges'"),
    ("fashion-silhouette", "model.blocks=0", "model.blocks: Input should be greater than or equal to 1"),
    ("fashion-base", "data.transform=[1, 0]", r"unknown data.transform \[1, 0\]"),
    # parents the method cannot start from (EX: the tiny example cards; FV: the built-in VAE card)
    ("fashion-base", "parents=[]", "pretrain needs exactly one parent card"),
    ("fashion-base", "parents=[EX/tiny-base, EX/tiny-judge]", "pretrain needs exactly one parent card"),
    ("fashion-base", "parents=[EX/tiny-judge]", "parent card 'tiny-judge' has no VAE component"),
    ("fashion-base", "method=finetune", "finetune: parent card 'fashion-vae' has no transformer to continue"),
    ("fashion-bold", "parents=[FV]", "lora: parent card 'fashion-vae' has no transformer to continue"),
    ("fashion-silhouette", "parents=[FV]", "controlnet: parent card 'fashion-vae' has no transformer to continue"),
    ("fashion-base", "{method: finetune, parents: [EX/tiny-base], model: {dim: 32, heads: 4}}",
     r"finetune keeps the architecture of 'tiny-base'; the recipe changes model\.heads \(leave model: empty\)"),
])
def test_a_recipe_the_method_cannot_run_is_refused_before_training(examples, tmp_path, data, recipe_name, override,
                                                                   message, no_encoding):
    """A misspelt or foreign loss: or data: key would otherwise train with the default, silently; a loop default
    or a DiT shape that cannot work would otherwise cost the run."""
    extra = [f"parents=[{examples / 'tiny-base'}]"] if recipe_name in ("fashion-bold", "fashion-silhouette") else []
    if recipe_name == "fashion-base":
        extra = [f"parents=[{REPO / 'cards' / 'fashion-vae'}]", "model.dim=32", "model.heads=2", "model.depth=1"]
    override = override.replace("EX", str(examples)).replace("FV", str(REPO / "cards" / "fashion-vae"))
    sets = [f"{k}={v}" for k, v in yaml.safe_load(override).items()] if override.startswith("{") else [override]
    recipe = tiny(recipe_name, [*extra, *sets])
    with pytest.raises(BadInput, match=message):
        train(recipe, command="c", out=tmp_path / "x", run_dir=tmp_path / "r", data=str(data))
    assert not (tmp_path / "x").exists()


def test_latents_refuse_images_of_another_size_than_the_vae_takes():
    """A hand-made VAE card of another image size under a pretrain on Fashion-MNIST: a clear error, not a conv one."""
    from cardtool.backends.conv_vae import ConvVAE
    from cardtool.backends.vae_config import ConvVAEConfig
    from cardtool.core.training.methods.vae import latents

    vae = ConvVAE(ConvVAEConfig(image_size=24, channels=(8, 16, 32)))
    with pytest.raises(BadInput, match="the VAE takes 24×24 images, the data are 28×28"):
        latents(vae, np.zeros((2, 28, 28), dtype=np.uint8), "cpu")
    assert latents(vae, np.zeros((2, 24, 24), dtype=np.uint8), "cpu")[0].shape == (2, 4, 1, 8, 8)


def test_latents_are_the_posterior_mean_and_std_times_the_scaling_factor_in_batches(monkeypatch):
    from cardtool.backends.conv_vae import ConvVAE
    from cardtool.backends.vae_config import ConvVAEConfig
    from cardtool.core.training.methods import vae as methods

    torch.manual_seed(0)
    model = ConvVAE(ConvVAEConfig(channels=(8, 16, 32), scaling_factor=2.5)).eval()
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    monkeypatch.setattr(methods, "ENCODE_BATCH", 2)  # three batches, the last of one image
    mean, std = methods.latents(model, images, "cpu")
    with torch.no_grad():
        mu, logvar = model.encode(methods.to_unit(images))
    torch.testing.assert_close(mean, 2.5 * mu[:, :, None], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(std, 2.5 * (0.5 * logvar).exp()[:, :, None], rtol=1e-4, atol=1e-5)


def test_the_vae_loss_is_mse_plus_the_weighted_gaussian_kl(data):
    """KL(N(μ, σ²) ‖ N(0, 1)) = ½(μ² + σ² − 1 − log σ²), averaged over latent elements (Kingma & Welling 2014)."""
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.vae import VAETask

    task = VAETask(tiny("fashion-vae", ["loss.kl_weight=0.25"]), Platform.detect("cpu"), load_split("train", data),
                   load_split("test", data))
    mean, logvar = torch.tensor([[1.0, 0.0], [2.0, -1.0]]), torch.log(torch.tensor([[1.0, 4.0], [0.5, 1.0]]))
    images = task.images[:2]
    task.vae = lambda x, generator: (torch.zeros_like(x), mean, logvar)
    loss, parts = task.loss(np.arange(2), None)
    kl = 0.5 * (1 + 0 + (4 - 1 - np.log(4)) + (4 + 0.5 - 1 - np.log(0.5)) + 1) / 4
    mse = float((torch.from_numpy(images.astype(np.float32)) / 127.5 - 1).pow(2).mean())
    assert parts["kl"] == pytest.approx(kl, rel=1e-6) and parts["mse"] == pytest.approx(mse, rel=1e-6)
    assert float(loss) == pytest.approx(mse + 0.25 * kl, rel=1e-6)


def test_the_scaling_factor_is_one_over_the_std_of_the_training_latents(data):
    """So the denoiser sees latents of unit spread (Rombach et al. 2022, the LDM's scale factor)."""
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.vae import VAETask, to_unit

    task = VAETask(tiny("fashion-vae"), Platform.detect("cpu"), load_split("train", data), load_split("test", data))
    with torch.no_grad():
        config, metrics = task.finish(task.vae.eval())
        spread = float(task.vae.encode(to_unit(task.images[:10000]))[0].std())
    assert config.scaling_factor == metrics["scaling_factor"] == pytest.approx(1 / spread, abs=2e-6)
    assert 0 < metrics["test_psnr_db"] < 100


def test_latents_spread_past_any_scaling_factor_fail_and_a_small_factor_keeps_its_significant_digits(data,
                                                                                                       monkeypatch):
    """The scaling factor 1/spread lies in [1e-6, 1e6]: latents spreading past 1e6 are a failed run naming the KL
    weight, not a card that fails validation; a factor like 2e-4 keeps its digits (rounding to 6 decimals kept 3)."""
    from cardtool.backends.conv_vae import ConvVAE
    from cardtool.backends.platform import Platform
    from cardtool.core.training.methods.vae import VAETask, to_unit

    encode, scale = ConvVAE.encode, {"by": 1e8}

    def spread_out(self, x):
        mean, logvar = encode(self, x)
        return mean * scale["by"], logvar

    monkeypatch.setattr(ConvVAE, "encode", spread_out)
    task = VAETask(tiny("fashion-vae"), Platform.detect("cpu"), load_split("train", data), load_split("test", data))
    with torch.no_grad():
        with pytest.raises(RunFailed, match=r"standard deviation of [\d.]+e\+0[6-9], beyond the 1e6 .* raise "
                                             r"loss.kl_weight \(now 0.0001\)"):
            task.finish(task.vae.eval())
        scale["by"] = 1e4
        config, metrics = task.finish(task.vae.eval())
        spread = float(task.vae.encode(to_unit(task.images[:10000]))[0].std())
    assert 1e-5 < config.scaling_factor < 1e-2 and config.scaling_factor == metrics["scaling_factor"]
    assert config.scaling_factor == pytest.approx(1 / spread, rel=1e-5)
    assert config.scaling_factor == float(f"{config.scaling_factor:.8g}")


def test_a_run_lock_that_is_a_link_or_not_a_file_is_refused_and_its_target_left_alone(tmp_path):
    """The lock file is truncated and rewritten with the holder's process id: through a link it would clobber the
    file the link names (run as root, any file), so the lock is never opened through one."""
    from cardtool.core.training.run_lock import LOCK, run_claimed

    precious = tmp_path / "precious"
    precious.write_text("keep me")
    for name, make, says in (("link", lambda p: p.symlink_to(precious), "is a link"),
                             ("dangling", lambda p: p.symlink_to(tmp_path / "none"), "is a link"),
                             ("folder", lambda p: p.mkdir(), "cannot open"),
                             ("pipe", lambda p: os.mkfifo(p), "is not a regular file")):
        (tmp_path / name).mkdir()
        make(tmp_path / name / LOCK)
        with pytest.raises(BadInput, match=says), run_claimed(tmp_path / name):
            pass
    assert precious.read_text() == "keep me" and not (tmp_path / "none").exists()
    with run_claimed(tmp_path / "plain"):
        assert (tmp_path / "plain" / LOCK).read_text() == f"{os.getpid()}\n"
    umask = os.umask(0o022)
    try:
        with run_claimed(tmp_path / "moded"):
            assert (tmp_path / "moded" / LOCK).stat().st_mode & 0o7777 == 0o644
    finally:
        os.umask(umask)


def test_a_run_folder_another_process_is_training_in_is_refused_until_that_process_ends(tmp_path, data):
    """Two runs on one folder would interleave their checkpoints: the second is refused, naming the first's process;
    the lock goes with its process, so a run killed with -9 leaves nothing to clear by hand."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from cardtool.core.training.run_lock import run_claimed; "
         "held = run_claimed(sys.argv[1]); held.__enter__(); print('held', flush=True); sys.stdin.read()",
         str(tmp_path / "r")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        command = ["train", "--recipe", str(RECIPES / "fashion-vae.yaml"), *(f"--set={s}" for s in TINY_VAE),
                   "--data", str(data), "--out", str(tmp_path / "v"), "--run-dir", str(tmp_path / "r"), "--json"]
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        message = json.loads(result.stdout)["error"]["message"]
        assert f"is in use by another run (process {holder.pid})" in message
        assert not (tmp_path / "r" / CHECKPOINT).exists() and not (tmp_path / "v").exists()
    finally:
        holder.kill()
        holder.wait()
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert load_card(tmp_path / "v").id == "fashion-vae"


@pytest.mark.parametrize("command", ["train", "distill", "rl"])
def test_a_run_folder_or_batch_split_that_refuses_a_run_is_said_before_its_task_is_made(command, examples, tmp_path,
                                                                                        data, monkeypatch):
    """The run folder (in use, holding another run, holding none to resume or one of another recipe, other data or
    another split) and the batch's split into micro-batches were checked only as training began: after the task had
    encoded the dataset or the teacher had sampled (two minutes for a ControlNet recipe on Fashion-MNIST)."""
    from safetensors.torch import save_file

    from cardtool.core.training import rl as rl_module
    from cardtool.core.training.distill import distill, distill_recipe
    from cardtool.core.training.methods import dmd2, vae
    from cardtool.core.training.run_lock import run_claimed

    def made(*args):
        pytest.fail("the task was made before the refusal")

    small = ["optim.batch_size=4", "train.precision=float32"]
    if command == "train":
        monkeypatch.setattr(vae, "VAETask", made)
        recipe = tiny("fashion-vae", small)
        start = train
    elif command == "distill":
        monkeypatch.setattr(dmd2, "DMD2Task", made)
        recipe = distill_recipe(str(examples / "tiny-base"), None, small, 2)
        start = distill
    else:
        monkeypatch.setattr(rl_module, "make_task", made)
        recipe = rl_module.rl_recipe(str(examples / "tiny-base"), str(examples / "tiny-judge"), "diffusion_nft", None,
                                     [*small, "loss.group_size=2"])
        start = rl_module.rl

    def run(run_dir, **kwargs):
        where = {"data": str(data)} if command == "train" else {"evaluate": False}
        return start(recipe, command="c", out=tmp_path / "out", run_dir=run_dir, **where, **kwargs)

    def held(name, **metadata):
        (tmp_path / name).mkdir()
        save_file({"x": torch.zeros(1)}, str(tmp_path / name / CHECKPOINT), metadata={"step": "1", **metadata})
        return tmp_path / name

    ours = {"fingerprint": recipe.fingerprint()}
    cases = [(tmp_path / "r", {"micro_batches": 3}, r"optim.batch_size 4 must split into 1 process\(es\) × 3"),
             (tmp_path / "r", {"resume": True}, "nothing to resume"),
             (held("held"), {}, "already holds the run of another recipe, other data or other parents"),
             (held("other"), {"resume": True}, "was made by a different recipe"),
             (held("split", **ours, micro_batches="2"), {"resume": True}, r"split into 2 micro-batch\(es\)")]
    if command != "distill":  # a distillation without the GAN term reads no data
        cases.append((held("data", **ours, data="0" * 64), {"resume": True}, "was trained on other data"))
    for run_dir, kwargs, message in cases:
        with pytest.raises(BadInput, match=message):
            run(run_dir, **kwargs)
    busy = f"in use by another run \\(process {os.getpid()}\\)"
    with run_claimed(tmp_path / "busy"), pytest.raises(BadInput, match=busy):
        run(tmp_path / "busy")
    assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists(), "a refused run makes no folders"


def test_a_run_resumed_after_its_parent_card_changed_is_refused(examples, tmp_path, data):
    """A base retrained in place (or the flywheel's rl card replaced under --force) between a run's checkpoint and its
    resume: the run would finish against other weights than it started on, and the card would name them as its
    parent. The checkpoint records its parents by content, as the card's fingerprint does."""
    import shutil

    import yaml
    from safetensors.torch import save_file

    from cardtool.core.cards.weight_files import sha256_file

    base = shutil.copytree(examples / "tiny-base", tmp_path / "base")
    recipe = load_recipe(RECIPES / "fashion-bold.yaml", [
        "optim.steps=4", "optim.batch_size=4", "train.precision=float32", "train.checkpoint_every=2",
        "train.log_every=1", f"parents=[{base}]", "card.id=tiny-bold"])

    def stop_at_step_3(entry):
        if entry["step"] == 3:
            raise KeyboardInterrupt

    def run(**kwargs):
        return train(recipe, command="c", out=tmp_path / "o", run_dir=tmp_path / "r", data=str(data), **kwargs)

    with pytest.raises(KeyboardInterrupt):
        run(on_log=stop_at_step_3)
    manifest = base / "card.yaml"
    before = yaml.safe_load(manifest.read_text())["components"]["transformer"]["sha256"]
    weights = base / "transformer.safetensors"
    save_file({k: v + 0.01 for k, v in load_file(str(weights)).items()}, str(weights))  # a valid card, other weights
    manifest.write_text(manifest.read_text().replace(before, sha256_file(weights)))
    assert load_card(base).id == "tiny-base"
    with pytest.raises(BadInput, match=r"was trained from parent cards that have changed since \(.*base\)"):
        run(resume=True)
    with pytest.raises(BadInput, match="already holds the run of another recipe, other data or other parents"):
        run()
