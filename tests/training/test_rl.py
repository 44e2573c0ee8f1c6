"""`cardtool rl` (DiffusionNFT, Flow-GRPO) on the tiny example card: the losses against hand-computed values, the
log-probability identity, a toy reward that a few updates must raise, resume, the tuned card, and bad input."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, reading_judge, tiny_referee, write_idx_folder, write_vae_only_card
from safetensors.torch import load_file
from typer.testing import CliRunner

from cardtool.backends.platform import Platform
from cardtool.cli import app
from cardtool.core.cards.lineage import lineage
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, Request, shifted_sigmas
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.core.training.methods.grpo import GRPO_DEFAULTS, clipped_objective, transition_log_probs
from cardtool.core.training.methods.nft import NFT_DEFAULTS, nft_loss, old_policy_decay
from cardtool.core.training.methods.rollouts import Rollouts, group_advantages
from cardtool.core.training.rl import check_recipe, make_task, rl, rl_recipe, serving_loop
from cardtool.core.training.trainer import CHECKPOINT, train_loop
from cardtool.errors import BadInput

TINY = ["optim.batch_size=2", "loss.group_size=8", "loss.rollout_steps=3", "train.precision=float32",
        "train.checkpoint_every=2", "train.log_every=1", "card.storage=float32"]
CPU = Platform("cpu", "generic")


class Brightness:
    """A toy reward: mean brightness of the image in [0, 1]."""

    card_id = "brightness"

    def score(self, images, prompts):
        return images.reshape(len(images), -1).mean(1) / 255.0


def recipe(base, method="diffusion_nft", extra=(), reward="tiny-judge"):
    return rl_recipe(str(base), str(reward), method, None, [*TINY, *extra])


def test_nft_loss_matches_a_hand_computed_case():
    x0, x_t, t = torch.tensor([[1.0, -1.0]]), torch.tensor([[0.5, 0.5]]), torch.tensor([0.5])
    v, v_old = torch.tensor([[1.0, 2.0]], requires_grad=True), torch.tensor([[0.0, 1.0]])
    # β = 1: v⁺ = v = (1, 2), v⁻ = 2·v_old − v = (−1, 0); x̂0⁺ = (0, −0.5), x̂0⁻ = (1, 0.5)
    # errors (−1, 0.5) and (0, 1.5); weights mean|·| = 0.75 and 0.75; ℓ⁺ = (1 + 0.25)/2/0.75, ℓ⁻ = 2.25/2/0.75
    l_pos, l_neg = 1.25 / 2 / 0.75, 2.25 / 2 / 0.75
    for advantage, r in ((5.0, 1.0), (-5.0, 0.0), (2.5, 0.75), (40.0, 1.0)):
        loss, parts = nft_loss(v, v_old, x_t, x0, t, torch.tensor([advantage]))
        expected = 5 * (r * l_pos + (1 - r) * l_neg)
        assert float(loss.detach()) == pytest.approx(expected), f"advantage {advantage} → r = {r}"
        assert parts["positive_loss"] == pytest.approx(l_pos) and parts["negative_loss"] == pytest.approx(l_neg)
    # β = 0.5: v⁺ = ½v + ½v_old = (0.5, 1.5), v⁻ = 1.5·v_old − ½v = (−0.5, 0.5); x̂0⁺ = (0.25, −0.25), x̂0⁻ =
    # (0.75, 0.25); errors (−0.75, 0.75) and (−0.25, 1.25), weights 0.75 both; the sum divided by β
    l_pos, l_neg = 0.5625 / 0.75, (0.0625 + 1.5625) / 2 / 0.75
    loss, parts = nft_loss(v, v_old, x_t, x0, t, torch.tensor([2.5]), beta=0.5)
    assert float(loss.detach()) == pytest.approx(5 * (0.75 * l_pos + 0.25 * l_neg) / 0.5)
    assert parts["positive_loss"] == pytest.approx(l_pos) and parts["negative_loss"] == pytest.approx(l_neg)
    loss, _ = nft_loss(v, v_old, x_t, x0, t, torch.tensor([5.0]))
    loss.backward()
    # a fully positive sample pulls v⁺ = v to make x̂0 = x0: the gradient is 5·2·t·(x̂0⁺ − x0)·(−1)… sign-checked:
    assert v.grad[0, 0] > 0 and v.grad[0, 1] < 0, "descending moves x̂0⁺ = x_t − t·v toward x0"


def test_old_policy_decay_follows_the_papers_schedule():
    assert [old_policy_decay(k) for k in (0, 1, 250, 500, 900)] == [0.0, 0.001, 0.25, 0.5, 0.5]


def test_the_old_policy_holds_through_a_rollout_and_then_follows_the_current_one(examples):
    """θ_old samples a rollout and is the v_old of all its updates; between rollouts θ_old ← d·θ_old + (1 − d)·θ."""
    base = examples / "tiny-base"
    task = make_task(recipe(base, extra=["loss.updates_per_rollout=2", "loss.decay_rate=0.25"], reward=base), CPU,
                     load_card(base), Brightness(), ["a bag", "a coat"])
    old, new = (next(m.parameters()) for m in (task.sampler(), task.policy))

    def moved():
        with torch.no_grad():
            new.add_(1.0)
        return old.detach().clone(), new.detach().clone()

    before, _ = moved()
    task.prepare(1)  # the rollout's second update
    assert torch.equal(old, before), "v_old stays the rollout's sampler"
    _, current = moved()
    task.prepare(2)  # the second rollout: d = 0.25·0
    assert torch.equal(old, current)
    previous, current = moved()
    task.prepare(3)
    assert torch.equal(old, previous)
    task.prepare(4)  # the third rollout: d = 0.25·1
    torch.testing.assert_close(old, 0.25 * previous + 0.75 * current)
    one = make_task(recipe(base, reward=base), CPU, load_card(base), Brightness(), ["a bag"])  # one update a rollout
    old, new = (next(m.parameters()) for m in (one.sampler(), one.policy))
    _, current = moved()
    one.prepare(1)  # the second rollout follows the first update at once
    assert torch.equal(old, current)


def test_diffusion_nft_trains_on_the_clean_samples_at_one_t_for_both_policies_with_a_squared_kl(examples, monkeypatch):
    from cardtool.core.training.methods import nft

    base = examples / "tiny-base"
    task = make_task(recipe(base, extra=["loss.kl=1", "loss.timesteps=1"], reward=base), CPU, load_card(base),
                     Brightness(), ["a bag", "a coat"])
    task.prepare(0)
    task.micro_batch(0, 1, np.arange(2), torch.Generator().manual_seed(0))
    _moved(task.policy)
    seen, real = {}, nft.nft_loss
    for name in ("policy", "old"):
        getattr(task, name).register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[1]))
    monkeypatch.setattr(nft, "nft_loss", lambda v, v_old, x_t, x0, t, *a, **k: (
        seen.update(v=v.detach(), x_t=x_t, x0=x0, t=t), real(v, v_old, x_t, x0, t, *a, **k))[1])
    _, metrics = task.loss(np.arange(2), torch.Generator().manual_seed(1))
    buffer, rows = task.batch()
    assert torch.equal(seen["x0"], buffer.latents[-1][rows]), "the rollouts' clean samples, not a step before"
    assert torch.equal(seen["policy"], seen["old"]) and torch.equal(seen["policy"], seen["t"] * 1000)
    text, mask = task.text(buffer.prompts[rows])
    with torch.no_grad():
        v_ref = task.reference_velocity(seen["x_t"], seen["t"], text, mask).float()
    assert metrics["kl"] == pytest.approx(float((seen["v"] - v_ref).pow(2).mean()), rel=1e-5)


def test_a_rollout_buffer_serves_its_updates_and_micro_batches_and_is_sampled_once(examples):
    """`updates_per_rollout=2`: a step's first micro-batch samples the buffer on a rollout's first update only; the
    two updates take disjoint halves of its rows, each micro-batch every `parts`-th row of its update's half."""
    base = examples / "tiny-base"
    task = make_task(recipe(base, extra=["loss.updates_per_rollout=2"], reward=base), CPU, load_card(base),
                     Brightness(), ["a bag", "a coat"])
    shared, batch, buffers, halves = torch.Generator().manual_seed(0), np.array([0, 1]), [], []
    for step in range(4):
        task.prepare(step)
        for part in range(2):
            task.micro_batch(part, 2, batch, shared)
            buffers.append(task.buffer)
            halves.append(task.batch()[1])
    assert [b is buffers[0] for b in buffers] == [True] * 4 + [False] * 4
    assert all(b is buffers[4] for b in buffers[4:]) and len(task.reward_history) == 2
    first = torch.cat(halves[:4])
    assert sorted(first.tolist()) == list(range(16)), "the rollout's two updates × two micro-batches: every row once"
    torch.testing.assert_close(halves[0], buffers[0].order[:8][0::2])
    torch.testing.assert_close(halves[3], buffers[0].order[8:][1::2])
    assert task.reward_history[0] == pytest.approx(float(buffers[0].rewards.mean()))
    task.text(buffers[0].prompts)
    rate = task.metrics(buffers[0])["text_cache_hit_rate"]
    assert 0 < rate < 1 and rate == task.cache.hits / (task.cache.hits + task.cache.misses)


@pytest.mark.parametrize("method", ["diffusion_nft", "flow_grpo"])
def test_the_loss_sections_smallest_settings_are_accepted_and_below_them_refused(examples, method):
    base = examples / "tiny-base"
    least = ["loss.group_size=2", "loss.rollout_steps=1", "loss.updates_per_rollout=1", "loss.kl=0", "loss.kl_start=0",
             "loss.advantage_clip=0.01", "loss.shift=0.01", "loss.reference_guidance=1"]
    settings = make_task(recipe(base, method, least, reward=base), CPU, load_card(base), Brightness(),
                         ["a bag"]).settings
    assert (settings.group_size, settings.rollout_steps, settings.kl_start, settings.advantage_clip,
            settings.shift) == (2, 1, 0, 0.01, 0.01)
    for below in ("loss.group_size=1", "loss.rollout_steps=0", "loss.updates_per_rollout=0", "loss.kl=-0.1",
                  "loss.kl_start=-0.1", "loss.advantage_clip=0", "loss.shift=0.005", "loss.reference_guidance=0.9"):
        with pytest.raises(BadInput, match=below.split("=")[0].replace(".", r"\.")):
            make_task(recipe(base, method, [below], reward=base), CPU, load_card(base), Brightness(), ["a bag"])


def test_advantages_and_clipping_match_hand_computed_values():
    rewards = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]])
    per_group = group_advantages(rewards, global_std=False)
    np.testing.assert_allclose(per_group[0], np.array([-1, 0, 1]) / (np.sqrt(2 / 3) + 1e-4))
    np.testing.assert_allclose(per_group[1], np.array([-1, -1, 2]) / (np.sqrt(2) + 1e-4))
    everyone = group_advantages(rewards, global_std=True)
    np.testing.assert_allclose(everyone, (rewards - rewards.mean(1, keepdims=True)) / (rewards.std() + 1e-4))
    from types import SimpleNamespace

    from cardtool.core.training.methods.grpo import GRPOTask
    from cardtool.core.training.methods.nft import NFTTask

    methods = {task: task.advantages(SimpleNamespace(settings=SimpleNamespace(advantage_clip=1.2)), rewards)
               for task in (GRPOTask, NFTTask)}  # Flow-GRPO: its group's std, clipped; DiffusionNFT: the batch's
    np.testing.assert_allclose(methods[GRPOTask], np.clip(per_group, -1.2, 1.2))
    np.testing.assert_allclose(methods[NFTTask], everyone)
    log_probs = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    loss, ratio = clipped_objective(log_probs, torch.zeros(3), torch.tensor([1.0, -2.0, 3.0]), 0.2)
    # ρ = 1.5 with A = 1: max(−1.5, −1.2) = −1.2; ρ = 0.5 with A = −2: max(1.0, 1.6) = 1.6; ρ = 1: −3
    assert float(loss) == pytest.approx((-1.2 + 1.6 - 3.0) / 3)
    torch.testing.assert_close(ratio, torch.tensor([1.5, 0.5, 1.0]))


def test_a_reward_that_scores_nan_or_inf_stops_the_run_naming_the_reward(examples):
    """A non-finite score would become a NaN advantage for its whole group and a NaN loss: said at the rollout."""
    class Broken(Brightness):
        card_id = "broken"

        def score(self, images, prompts):
            scores = super().score(images, prompts)
            scores[3] = np.inf
            return scores

    base = examples / "tiny-base"
    task = make_task(recipe(base, reward=base), CPU, load_card(base), Broken(), ["a bag", "a coat"])
    with pytest.raises(BadInput, match="reward 'broken' returned a non-finite score"):
        task.collect(np.array([0, 1]), torch.Generator().manual_seed(0))


def test_grpo_log_probabilities_recomputed_from_the_capture_equal_the_captured_ones(examples):
    """The parity ladder's C2: the rollout's own weights give back each captured step's log-probability, so the
    first update's policy ratio is 1."""
    task = make_task(recipe(examples / "tiny-base", "flow_grpo", reward=examples / "tiny-base"), CPU,
                     load_card(examples / "tiny-base"), Brightness(), ["a bag", "a coat"])
    buffer = task.collect(np.array([0, 1]), torch.Generator().manual_seed(0))
    assert buffer.log_probs.shape == (3, 16) and buffer.latents.shape[:2] == (4, 16)
    text, mask = task.text(buffer.prompts)
    log_probs, _, _ = transition_log_probs(task.loop.sde, task.policy, buffer.latents, shifted_sigmas(3, 1.0),
                                           [0, 1, 2], text, mask, eta=0.7)
    log_probs = log_probs.detach()
    assert float((log_probs - buffer.log_probs.reshape(-1)).abs().max()) <= 1e-5
    _, ratio = clipped_objective(log_probs, buffer.log_probs.reshape(-1), torch.ones(48), 1e-4)
    assert float((ratio - 1).abs().max()) <= 1e-4


def test_flow_grpo_trains_as_many_of_a_rollouts_transitions_as_asked(examples, tmp_path, monkeypatch):
    """`loss.train_timesteps=K`: each update recomputes K distinct transitions of the rollout, in order."""
    from cardtool.core.training.methods import grpo

    seen, original = [], grpo.transition_log_probs

    def recording(sde, model, latents, sigmas, steps, *args, **kwargs):
        seen.append(list(steps))
        return original(sde, model, latents, sigmas, steps, *args, **kwargs)

    monkeypatch.setattr(grpo, "transition_log_probs", recording)
    base = examples / "tiny-base"
    for count, expected in ((2, 2), (None, 3)):
        seen.clear()
        extra = ["optim.steps=2", "loss.kl=0", *([f"loss.train_timesteps={count}"] if count else [])]
        r = recipe(base, "flow_grpo", extra, reward=base)
        train_loop(make_task(r, CPU, load_card(base), Brightness(), ["a bag", "a coat"]), r, CPU,
                   tmp_path / str(count))
        assert len(seen) == 2 and all(len(set(s)) == expected and s == sorted(s) for s in seen), (count, seen)


class Darkness(Brightness):
    def score(self, images, prompts):
        return -super().score(images, prompts)


def _mean_brightness(base, policy, seeds=range(8)) -> float:
    instance = ModelInstance(load_card(base), CPU, "float32")
    instance.use("transformer", policy)
    loop = DenoiseLoop(instance, cache=TextFeatureCache(disk=False))
    requests = [Request(p, seed=s, steps=3, guidance=1.0) for p in ("a bag", "a coat") for s in seeds]
    return float(Brightness().score(loop.finalize(sample(loop, requests)), None).mean())


@pytest.mark.parametrize("method", ["diffusion_nft", "flow_grpo"])
def test_a_few_updates_move_the_images_the_way_the_reward_asks(examples, tmp_path, method):
    """Would fail with the advantage's sign flipped: a brightness reward makes the tiny card's images brighter,
    its negation darker (its random VAE leaves a narrow range of brightness to move in)."""
    base = examples / "tiny-base"
    extra = ["optim.lr=3e-2", "optim.steps=10", "loss.kl=0",
             *(["loss.clip_range=0.2"] if method == "flow_grpo" else [])]
    r = recipe(base, method, extra, reward=base)
    moved = {}
    for reward in (Brightness(), Darkness()):
        task = make_task(r, CPU, load_card(base), reward, ["a bag", "a coat"])
        before = _mean_brightness(base, task.policy)
        train_loop(task, r, CPU, tmp_path / type(reward).__name__)
        moved[type(reward).__name__] = _mean_brightness(base, task.policy) - before
    assert moved["Brightness"] > 0.003 and moved["Darkness"] < -0.003, moved


@pytest.mark.parametrize("method", ["diffusion_nft", "flow_grpo"])
def test_resume_between_two_updates_of_a_rollout_equals_an_uninterrupted_run(examples, tmp_path, method):
    base = examples / "tiny-base"
    extra = ["optim.steps=4", "loss.updates_per_rollout=2", "train.checkpoint_every=1"]

    def go(out, **kwargs):
        return rl(recipe(base, method, extra, reward=examples / "tiny-judge"), command="cardtool rl …", out=out,
                  run_dir=tmp_path / f"run-{out.name}", evaluate=False, **kwargs)

    whole = go(examples / "whole")

    def stop_after_3(entry):
        if entry["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        go(examples / "cut", on_log=stop_after_3)
    assert (tmp_path / "run-cut" / CHECKPOINT).exists() and not (examples / "cut").exists()
    resumed = go(examples / "cut", resume=True)
    a, b = (load_file(str(c.weights_file("transformer"))) for c in (whole, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.manifest.recipe.metrics["reward_curve"] == resumed.manifest.recipe.metrics["reward_curve"]


def test_a_restored_buffer_may_index_every_prompt_and_none_past_them():
    def buffer(prompts):
        return {"prompts": torch.tensor(prompts), "rewards": torch.zeros(2, dtype=torch.float64),
                "advantages": torch.zeros(2, dtype=torch.float64), "latents": torch.zeros(2, 2, 1),
                "order": torch.tensor([1, 0])}

    def restored(prompts):
        return Rollouts.restored(buffer(prompts), rows=2, steps=1, latent=(1,), prompts=3, log_probs=False)

    assert restored([0, 2]).prompts.tolist() == [0, 2]
    for wrong in ([-1, 0], [0, 3]):
        with pytest.raises(ValueError, match="index past the run's 3"):
            restored(wrong)


@pytest.mark.parametrize("method", ["diffusion_nft", "flow_grpo"])
def test_a_checkpoint_whose_rollout_buffer_was_altered_is_refused_on_resume(examples, tmp_path, method):
    """Between two updates of a rollout the resumed run trains on the buffer the checkpoint holds: a buffer whose
    tensors lost their shape, kind or meaning (prompt indices past the run's prompts, an order that is not a
    permutation of its rows) is refused up front, not a traceback at the next update or training on garbage."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    base = examples / "tiny-base"
    extra = ["optim.steps=4", "loss.updates_per_rollout=2", "train.checkpoint_every=1"]

    def go(out, **kwargs):
        return rl(recipe(base, method, extra, reward=examples / "tiny-judge"), command="c", out=out,
                  run_dir=tmp_path / "run", evaluate=False, **kwargs)

    def stop_after_3(entry):
        if entry["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        go(tmp_path / "cut", on_log=stop_after_3)
    checkpoint = tmp_path / "run" / CHECKPOINT
    with safe_open(str(checkpoint), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    buffer = {k: v for k, v in tensors.items() if k.startswith("task.buffer.")}
    assert {"task.buffer.prompts", "task.buffer.order", "task.buffer.latents"} <= set(buffer)
    assert ("task.buffer.log_probs" in buffer) == (method == "flow_grpo")
    latents, prompts, order = (tensors[f"task.buffer.{n}"] for n in ("latents", "prompts", "order"))
    damaged = {"latents cut": {"task.buffer.latents": latents[:, :1].clone()},
               "latents of another size": {"task.buffer.latents": latents[..., :2].clone()},
               "prompts past the run's": {"task.buffer.prompts": prompts + 100},
               "prompts as floats": {"task.buffer.prompts": prompts.double()},
               "order repeated": {"task.buffer.order": torch.zeros_like(order)},
               "a field added": {"task.buffer.extra": torch.zeros(2)},
               "reward history as a matrix": {"task.reward_history": torch.zeros(2, 2, dtype=torch.float64)}}
    for name, change in damaged.items():
        save_file({**tensors, **change}, str(checkpoint), metadata=metadata)
        with pytest.raises(BadInput, match="does not fit this run's training state") as error:
            go(tmp_path / "cut", resume=True)
        assert ("rollout buffer" if "reward history" not in name else "reward_history") in str(error.value), name
    dropped = {k: v for k, v in tensors.items() if k != "task.buffer.order"}
    save_file(dropped, str(checkpoint), metadata=metadata)
    with pytest.raises(BadInput, match="the rollout buffer holds"):
        go(tmp_path / "cut", resume=True)
    save_file(tensors, str(checkpoint), metadata=metadata)  # the checkpoint as written resumes
    assert go(tmp_path / "cut", resume=True).id == "tiny-base-" + ("nft" if method == "diffusion_nft" else "grpo")


def test_the_tuned_card_extends_the_base_samples_without_cfg_and_traces_to_base_and_reward(examples, tmp_path):
    base = examples / "tiny-base"
    result = CliRunner().invoke(app, ["rl", str(base), "--reward", str(examples / "tiny-judge"), "--no-eval",
                                      "--out", str(examples / "tiny-base-nft"), "--run-dir", str(tmp_path / "r"),
                                      "--json", *(f"--set={o}" for o in [*TINY, "optim.steps=2"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["card"] == "tiny-base-nft" and report["method"] == "diffusion_nft"
    card = load_card(examples / "tiny-base-nft", checksums=True)
    m = card.manifest
    assert m.extends == "tiny-base" and m.recipe.parents == ["tiny-base", "tiny-judge"]
    defaults = m.loops["denoise"].defaults
    assert (defaults["steps"], defaults["guidance"], defaults["solver"]) == (30, 1.0, "euler"), "base's steps, no CFG"
    assert card.weights_file("vae").resolve() == (base / "vae.safetensors").resolve(), "VAE by reference"
    assert card.weights_file("transformer").stat().st_mode & 0o777 == 0o644, "readable by others, as the manifest is"
    metrics = m.recipe.metrics
    assert metrics["updates"] == 2 and metrics["rollouts"] == 2 and metrics["samples"] == 32
    assert len(metrics["reward_curve"]) == 2 and 0 <= metrics["text_cache_hit_rate"] <= 1
    roots = {node.id for node in lineage(card).parents}
    assert roots == {"tiny-base", "tiny-judge"} and not any(node.missing for node in lineage(card).parents)
    assert "cardtool rl" in m.recipe.command and m.recipe.hyperparameters["loss"]["group_size"] == 8
    assert metrics["prompts"]["count"] == 130, "the class prompts with their synonyms and templates"
    assert m.description == "tiny-base reward-tuned with diffusion_nft on tiny-judge; samples without CFG"
    from cardtool.core.cards.loops import FlowDenoiseDefaults

    served, own = serving_loop(load_card(base)), FlowDenoiseDefaults.model_validate(defaults)
    assert served == {k: getattr(own, k) for k in served}, "what --watch-every samples is what the card serves"


def test_the_cli_evaluates_the_tuned_card_under_the_judge_and_the_held_out_judge(examples, tmp_path):
    """The eval row under --judge and, beside it, the accuracy under --held-out-judge: tiny-judge's weights here, so
    the same 30 images (--per-class 3) judged twice must give the same accuracy. The reward card itself is no
    held-out judge."""
    data = write_idx_folder(tmp_path / "idx")
    args = ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"), "--judge",
            str(examples / "tiny-judge"), "--data", str(data), "--out", str(tmp_path / "o"), "--run-dir",
            str(tmp_path / "r"), "--json", "--per-class", "3", *(f"--set={o}" for o in [*TINY, "optim.steps=1"])]
    copy = shutil.copytree(examples / "tiny-judge", tmp_path / "judge-copy")  # the same id, in another folder
    for reward in (examples / "tiny-judge", "tiny-judge", copy):  # its folder, its id on the search path, a copy
        refused = CliRunner().invoke(app, [*args, "--held-out-judge", str(reward)],
                                     env={"CARDTOOL_PATH": str(examples)})
        assert refused.exit_code == 2 and json.loads(refused.stdout)["error"]["message"].startswith(
            f"--held-out-judge {reward} is the reward card 'tiny-judge': a held-out judge is one the policy is not "
            "trained on"), refused.output
        assert not (tmp_path / "r").exists(), "refused before the run"
    referee = tiny_referee(examples)
    judged = [*args[:4], "--judge", str(referee), *args[6:]]  # the eval's judge held out too: the same eval twice
    refused = CliRunner().invoke(app, [*judged, "--held-out-judge", str(referee / "card.yaml")])
    assert refused.exit_code == 2 and json.loads(refused.stdout)["error"]["message"] == (
        f"--held-out-judge {referee / 'card.yaml'} is the --judge card 'tiny-referee': its accuracy would be the "
        "eval's again; give a second judge, or '' for none")
    assert not (tmp_path / "r").exists(), "refused before the run"
    result = CliRunner().invoke(app, [*args, "--held-out-judge", str(tiny_referee(examples))])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    [row] = metrics["eval"]["rows"]
    assert metrics["held_out_judge"] == {"card": "tiny-referee", "images": 30,
                                         "class_accuracy": row["class_accuracy"]} and row["images"] == 30
    assert load_card(tmp_path / "o").manifest.recipe.metrics["held_out_judge"] == metrics["held_out_judge"]
    assert result.stderr.count("eval (tiny-judge) at 30 steps, guidance 1: accuracy") == 1
    assert result.stderr.count("eval (tiny-referee) at 30 steps, guidance 1: accuracy") == 1
    alone = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                     "--judge", str(examples / "tiny-judge"), "--held-out-judge", "", "--data",
                                     str(data), "--out", str(tmp_path / "o2"), "--run-dir", str(tmp_path / "r2"),
                                     "--json", "--per-class", "3", *(f"--set={o}" for o in [*TINY, "optim.steps=1"])])
    assert alone.exit_code == 0, alone.output
    assert "held_out_judge" not in json.loads(alone.stdout)["metrics"] and alone.stderr.count("eval (") == 1


def test_a_prompts_file_is_what_the_run_trains_on(examples, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # without --out and --run-dir: cards/ID and runs/ID here
    (tmp_path / "prompts.txt").write_text("# two garments\na bag\n\n  a red coat  \n")
    result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--prompts", str(tmp_path / "prompts.txt"), "--no-eval", "--json",
                                      *(f"--set={o}" for o in [*TINY, "optim.steps=1"])])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"] == "cards/tiny-base-nft"
    assert (tmp_path / "runs" / "tiny-base-nft" / CHECKPOINT).is_file()
    prompts = json.loads(result.stdout)["metrics"]["prompts"]
    assert prompts == {"count": 2, "sha256": hashlib.sha256(b"a bag\na red coat").hexdigest()}
    assert "warning" not in result.stderr
    long = "a dark grey pullover with long sleeves and a round neck on a white background"
    (tmp_path / "long.txt").write_text(f"a bag\n{long}\n")
    cut = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                   "--prompts", str(tmp_path / "long.txt"), "--no-eval", "--out", "o3", "--run-dir",
                                   "r3", *(f"--set={o}" for o in [*TINY, "optim.steps=1"])])
    assert cut.exit_code == 0 and "warning a prompt fills all 16 tokens the text encoder reads" in cut.stderr
    assert cut.stderr.index("warning") < cut.stderr.index("update 1/"), "said before the run"
    assert cut.stdout == "wrote diffusion_nft card tiny-base-nft to o3\n", "for people: one line on stdout"
    fingerprints = {load_card(tmp_path / f).manifest.recipe.fingerprint for f in ("cards/tiny-base-nft", "o3")}
    assert len(fingerprints) == 2, "one recipe on other prompts makes another card"
    recorded = load_card(tmp_path / "o3").manifest.recipe.command
    assert f"--prompts {tmp_path / 'long.txt'}" in recorded and "--lora" not in recorded, recorded
    kept = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                    "--no-eval", "--out", "o3", "--run-dir", "r4"])
    assert kept.exit_code == 2 and "o3 already exists" in kept.stderr and "--force" in kept.stderr, kept.output
    (tmp_path / "others.txt").write_text("a shirt\n")  # a resume on other prompts would train on those
    again = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                     "--prompts", str(tmp_path / "others.txt"), "--no-eval", "--out",
                                     str(tmp_path / "o2"), "--run-dir", "runs/tiny-base-nft", "--resume",
                                     *(f"--set={o}" for o in [*TINY, "optim.steps=1"])])
    assert again.exit_code == 2 and "was trained on other data than this run reads" in again.output, again.output
    # a prompt naming no garment is rewarded for the class the reward reads it as: said before the run
    (tmp_path / "free.txt").write_text("a bag\na camisole\ntwo coats\n")
    free = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(reading_judge(examples)),
                                    "--prompts", str(tmp_path / "free.txt"), "--no-eval", "--out", "o5", "--run-dir",
                                    "r5", *(f"--set={o}" for o in [*TINY, "optim.steps=1"])])
    assert free.exit_code == 0, free.output
    said = ("warning 1 prompt(s) name no garment, and reward 'tiny-reader' reads them by the nearest phrasing it "
            "knows: 'a camisole' as coat; name the garment where that is not the one meant")
    assert said in free.stderr and free.stderr.index(said) < free.stderr.index("update 1/"), free.stderr


def test_a_prompts_file_is_read_as_generate_reads_one(tmp_path):
    """One reader for both: a byte-order mark is not part of the first prompt (rl's own reader kept it, so the
    recorded prompts differed from the same file's without one), a pipe is read, and the limit is 1 MiB."""
    import os
    import threading

    from cardtool.core.training.rl import read_prompts

    (tmp_path / "bom.txt").write_bytes("\ufeffa bag\r\na coat\r\n".encode())
    assert read_prompts(tmp_path / "bom.txt") == ["a bag", "a coat"]
    for size, refused in ((1 << 20, False), ((1 << 20) + 1, True)):
        r, w = os.pipe()
        writer = threading.Thread(target=lambda w=w, size=size: (os.write(w, b"a bag\n" + b"x" * (size - 6)),
                                                                 os.close(w)))
        writer.start()
        try:
            if refused:
                with pytest.raises(BadInput, match=f"/dev/fd/{r} is larger than {1 << 20} bytes"):
                    read_prompts(f"/dev/fd/{r}")
            else:
                assert read_prompts(f"/dev/fd/{r}")[0] == "a bag"
        finally:
            os.close(r)
            writer.join()


def test_the_example_recipes_spell_out_the_defaults():
    for name, defaults in (("fashion-nft.yaml", NFT_DEFAULTS), ("fashion-grpo.yaml", GRPO_DEFAULTS)):
        assert yaml.safe_load((REPO / "examples" / "recipes" / name).read_text()) == defaults, name


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "loss.group_size=1"], "loss.group_size"),
    (["--set", "loss.advantage_clip=1e308"], "loss.advantage_clip"),  # was a RuntimeError in torch's clamp
    (["--method", "ppo"], "unknown rl method 'ppo'"),
    (["--set", "loss.no_such_knob=1"], "loss.no_such_knob"),
    (["--method", "flow_grpo", "--set", "loss.beta=1"], "loss.beta"),
    (["--prompts", "empty.txt"], "holds no prompts"),
    (["--prompts", "missing.txt"], "missing.txt does not exist"),
    (["--prompts", "/dev/zero"], "/dev/zero is not a regular file"),
    (["--prompts-file", "latin1.txt"], "latin1.txt is not UTF-8 text"),  # generate's spelling of the option
    (["--set", "data.folder=x"], "unknown data.folder; its settings: none"),
    (["--recipe", "listed.yaml"], "unknown rl method ['diffusion_nft']"),  # a list where the method's name goes
    (["--recipe", "broken.yaml"], "cannot read recipe: "),
    (["--set", "model.dim=8"], "tiny-base'; the recipe's model: may only hold lora: (got model.dim)"),
    (["--lora", "0"], "--lora must be a whole number from 1 to 1024, got 0"),  # said of --lora, not of a --set
    (["--lora", "2", "--set", "model.lora.rank=3"], "--lora 2 and a --set of model.lora.rank (3) give it two values"),
    (["--device", "numpy"], "the numpy platform has no torch device, which this needs (training, a classifier)"),
    (["--lora", str(10**22)], f"--lora must be a whole number from 1 to 1024, got {10**22}"),
])
def test_bad_input_is_a_clear_error(examples, tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("\n# only a comment\n   \n")
    (tmp_path / "listed.yaml").write_text("method: [diffusion_nft]\n")
    (tmp_path / "broken.yaml").write_text("method: [diffusion_nft\n")
    (tmp_path / "latin1.txt").write_bytes("a béret".encode("latin-1"))
    args = [str(tmp_path / a) if a.endswith((".yaml", ".txt")) else a for a in args]
    result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--no-eval", *args, "--out", str(tmp_path / "o"), "--run-dir",
                                      str(tmp_path / "r")])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_loss_key_a_recipe_leaves_out_takes_the_papers_value():
    """A recipe written by hand with a partial `loss:` trains with these (ALGORITHMS.md: advantages clipped to ±5,
    10 sampling steps in training; no KL term unless asked, against the plain base)."""
    from cardtool.core.training.methods.grpo import GRPOSettings
    from cardtool.core.training.methods.nft import NFTSettings

    for settings in (NFTSettings.from_recipe({}), GRPOSettings.from_recipe({})):
        assert (settings.group_size, settings.rollout_steps, settings.updates_per_rollout, settings.kl,
                settings.kl_start, settings.reference_guidance, settings.reference_interval, settings.advantage_clip,
                settings.reward_cap, settings.shift) == (16, 10, 1, 0.0, None, 1.0, None, 5.0, None, None)
    nft, grpo = NFTSettings.from_recipe({}), GRPOSettings.from_recipe({})  # ALGORITHMS.md's β, d and a, ε
    assert (nft.beta, nft.timesteps, nft.t_range, nft.decay_rate, nft.decay_max, nft.rollout_solver) == (
        1.0, 2, (0.0, 1.0), 1e-3, 0.5, "euler")
    assert (grpo.eta, grpo.clip_range, grpo.train_timesteps) == (0.7, 1e-4, None)


@pytest.mark.parametrize("command", ["rl", "distill"])
@pytest.mark.parametrize("card", ["foo", "[1]", "7"])
def test_a_recipe_whose_card_is_no_mapping_is_refused_by_its_field_not_given_an_id(examples, tmp_path, command,
                                                                                   card):
    """The default id goes into the recipe's `card:` only when that is a mapping without one: into a string it
    would be a TypeError (a traceback), and its own error is the field's."""
    file = tmp_path / "r.yaml"
    file.write_text(f"method: {'dmd2' if command == 'distill' else 'diffusion_nft'}\ncard: {card}\n")
    args = [command, str(examples / "tiny-base"), *(["--reward", str(examples / "tiny-judge")] if command == "rl"
                                                    else []), "--recipe", str(file), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout)["error"]["message"] == \
        f"recipe {file}: card: Input should be a valid dictionary or instance of CardSpec"


def test_each_method_starts_from_its_own_defaults_and_the_api_refuses_another_methods_recipe(examples, tmp_path):
    nft, grpo = rl_recipe("tiny-base", "tiny-judge"), rl_recipe("tiny-base", "tiny-judge", "flow_grpo")
    assert (nft.method, nft.optim.steps, nft.train.precision, nft.card.storage) == ("diffusion_nft", 600, "bfloat16",
                                                                                     "float16")
    assert (nft.loss["kl"], nft.loss["timesteps"]) == (5.0, 2) and nft.card.id == "tiny-base-nft"
    assert (grpo.optim.steps, grpo.train.precision, grpo.loss["kl"], grpo.loss["updates_per_rollout"]) == (
        300, "float32", 0.04, 2) and grpo.card.id == "tiny-base-grpo" and grpo.parents == ["tiny-base", "tiny-judge"]
    from cardtool.core.training.distill import distill_recipe

    one = recipe(examples / "tiny-base").model_copy(update={"parents": ["tiny-base"]})
    for wrong in (distill_recipe("tiny-base"), one):
        with pytest.raises(BadInput, match=r"rl runs a diffusion_nft or flow_grpo recipe whose parents are \[BASE"):
            rl(wrong, command="c", out=tmp_path / "o", run_dir=tmp_path / "r", evaluate=False)
    with pytest.raises(BadInput, match="no prompts to train on"):  # an empty list is no list: not the class prompts
        rl(recipe(examples / "tiny-base", reward=examples / "tiny-judge"), command="c", prompts=[], out=tmp_path / "o",
           run_dir=tmp_path / "r", evaluate=False)
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def test_a_reward_that_is_not_a_reward_and_a_base_without_a_loop_are_refused(examples, tmp_path):
    result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-base"),
                                      "--no-eval", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "is not a reward" in result.output
    for judge in ("--judge", "--held-out-judge"):  # checked before the training, not after it
        result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                          "--judge", str(examples / "tiny-judge"), "--held-out-judge",
                                          str(examples / "tiny-judge"), judge, str(examples / "tiny-base"),
                                          "--out", str(tmp_path / "o"),
                                          "--run-dir", str(tmp_path / "r"), *(f"--set={o}" for o in TINY)])
        assert result.exit_code == 2 and "is not a reward" in result.output, judge
        assert not (tmp_path / "r" / CHECKPOINT).exists() and not (tmp_path / "o").exists(), judge
    damaged = shutil.copytree(examples / "tiny-judge", tmp_path / "damaged")  # its weights not the manifest's
    weights = bytearray((damaged / "classifier.safetensors").read_bytes())
    weights[-100] ^= 0xFF
    (damaged / "classifier.safetensors").write_bytes(bytes(weights))
    result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--judge", str(damaged), "--held-out-judge", "", "--out", str(tmp_path / "o"),
                                      "--run-dir", str(tmp_path / "r"), *(f"--set={o}" for o in TINY)])
    assert result.exit_code == 1 and "sha256 of 'classifier.safetensors' is" in result.output, result.output
    assert not (tmp_path / "r" / CHECKPOINT).exists() and not (tmp_path / "o").exists(), "refused before the run"
    vae_only = write_vae_only_card(tmp_path / "vae-only")
    result = CliRunner().invoke(app, ["rl", str(vae_only), "--reward", str(examples / "tiny-judge"), "--no-eval",
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "has no denoise loop" in result.output
    write_idx_folder(tmp_path / "small")  # 64 training images: too few for the eval's 1,000 a row
    for data, message in (("", "--data '' names no folder"), ("nowhere", "no Fashion-MNIST data at"),
                          ("small", "the eval after rl (--no-eval skips it): --per-class 100 asks for 1000 images, "
                                    "more than the 64 training images")):
        result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                          "--judge", str(examples / "tiny-judge"), "--held-out-judge", "",
                                          "--data", data and str(tmp_path / data), "--out", str(tmp_path / "o"),
                                          "--run-dir", str(tmp_path / "r"), *(f"--set={o}" for o in TINY)])
        assert result.exit_code == 2 and message in result.output, data  # what the eval after it reads: now
        assert not (tmp_path / "r" / CHECKPOINT).exists() and not (tmp_path / "o").exists(), data
    result = CliRunner().invoke(app, ["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-nft.yaml")])
    assert result.exit_code == 2 and "cardtool rl" in result.output


def test_the_classes_a_reward_tells_are_its_classifiers_whatever_comes_before_it():
    from types import SimpleNamespace as Spec

    from cardtool.core.evaluation.reward import not_a_reward

    def card(classes):
        components = {"text_encoder": Spec(kind="text_encoder", config={"dim": 384}),
                      "classifier": Spec(kind="classifier", config={"width": 8, **classes})}
        return Spec(id="judge", manifest=Spec(components=components))

    assert not_a_reward(card({})) is None and not_a_reward(card({"classes": 10})) is None
    assert "its classifier tells 5 classes, not the 10" in not_a_reward(card({"classes": 5}))
    assert "its classifier tells 1 class, not the 10" in not_a_reward(card({"classes": 1}))


def test_watching_logs_both_judges_accuracy_and_fid_of_the_live_policy(examples, tmp_path):
    referee = tiny_referee(examples)
    entries = []
    judge = examples / "tiny-judge"
    rl(recipe(examples / "tiny-base", extra=["optim.steps=4", "train.log_every=2"], reward=judge),
       command="cardtool rl …", out=examples / "watched", run_dir=tmp_path / "run", evaluate=False, judge=str(judge),
       held_out_judge=str(referee), watch_every=3, data=str(write_idx_folder(tmp_path / "idx")),
       on_log=entries.append)
    assert [(e["step"], "watch_fid" in e) for e in entries] == [(2, False), (4, True)], \
        "watched at the first progress line at or past every third update"
    watched = entries[1]
    assert 0 <= watched["watch_accuracy"] <= 1 and 0 <= watched["watch_accuracy_tiny-referee"] <= 1
    assert np.isfinite(watched["watch_fid"])
    with pytest.raises(BadInput, match="measures FID against the test images, and there is 1"):
        rl(recipe(examples / "tiny-base", extra=["optim.steps=4"], reward=judge), command="cardtool rl …",
           out=examples / "watched-1", run_dir=tmp_path / "run-1", evaluate=False, judge=str(judge),
           held_out_judge=None, watch_every=3, data=str(write_idx_folder(tmp_path / "one", test=1)))


def test_the_guided_reference_applies_cfg_on_the_guidance_interval_only():
    from cardtool.backends.torch_ops import cfg_combine
    from cardtool.core.training.methods.frozen import GuidedVelocity

    def model(x, timesteps, text, mask):  # v = the text's first value: 1 for the prompt, 0 for the null condition
        return text[:, 0, 0].reshape(-1, 1, 1, 1, 1).expand_as(x)

    empty = (np.zeros((3, 2), dtype=np.float32), np.ones(3, dtype=bool))
    guided = GuidedVelocity(model, cfg_combine, empty, 4.0, (0.0, 0.4), "cpu")
    x, text = torch.zeros(2, 1, 1, 2, 2), torch.ones(2, 3, 2)
    v = guided(x, torch.tensor([0.2, 0.8]), text, torch.ones(2, 3, dtype=torch.bool))
    assert v[0].unique().tolist() == [4.0] and v[1].unique().tolist() == [1.0], "0 + 4·(1 − 0) inside, 1 outside"


def test_the_reference_takes_its_own_scale_and_interval_or_the_cards(examples):
    base = examples / "tiny-base"
    card = load_card(base)
    chosen = make_task(recipe(base, extra=["loss.reference_guidance=6", "loss.reference_interval=[0, 0.3]"]), CPU,
                       card, Brightness(), ["a bag"]).reference_velocity
    assert (chosen.guidance, tuple(chosen.interval)) == (6.0, (0.0, 0.3))
    served = make_task(recipe(base, extra=["loss.reference_guidance=null"]), CPU, card, Brightness(),
                       ["a bag"]).reference_velocity
    defaults = card.manifest.loops["denoise"].defaults
    assert (served.guidance, tuple(served.interval)) == (defaults["guidance"], (0.0, 1.0))
    with pytest.raises(BadInput, match="reference_interval must be"):
        make_task(recipe(base, extra=["loss.reference_interval=[0.5, 0.1]"]), CPU, card, Brightness(), ["a bag"])


def test_rl_with_lora_trains_an_adapter_on_the_frozen_base(examples, tmp_path):
    base = examples / "tiny-base"
    result = CliRunner().invoke(app, ["rl", str(base), "--reward", str(examples / "tiny-judge"), "--no-eval",
                                      "--lora", "2", "--out", str(examples / "tiny-nft-lora"), "--run-dir",
                                      str(tmp_path / "r"), *(f"--set={o}" for o in [*TINY, "optim.steps=2",
                                                                                    "optim.lr=1e-2"])])
    assert result.exit_code == 0, result.output
    card = load_card(examples / "tiny-nft-lora", checksums=True)
    m = card.manifest
    assert m.adapters["nft"].rank == 2 and m.loops["denoise"].defaults["adapters"] == {"nft": 1.0}
    assert "--lora 2" in m.recipe.command and "None" not in m.recipe.command, "the command that made it, whole"
    assert "invert" in m.adapters, "the base's adapters still fit: its transformer is unchanged"
    assert card.weights_file("transformer").resolve() == (base / "transformer.safetensors").resolve()
    lora = load_file(str(card.weights_file("nft")))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    loop = DenoiseLoop(ModelInstance(card, CPU), cache=TextFeatureCache(disk=False))
    tuned, plain = sample(loop, [Request("a bag", seed=1, steps=3, guidance=1.0, adapters=(("nft", 1.0),)),
                                 Request("a bag", seed=1, steps=3, guidance=1.0)])
    assert (tuned.latents - plain.latents).abs().max() > 1e-4, "the LoRA changes what the card samples"
    # a LoRA card as the base of another run is served as its loop serves it: its LoRA merged into the frozen DiT
    from cardtool.backends.lora import LoraPlan
    from cardtool.core.training.methods.frozen import FrozenCard

    frozen = FrozenCard(card, CPU, "card", "test")
    instance = ModelInstance(card, CPU)
    plain_dit, lora = instance.component("transformer"), instance.adapters.get("nft").value
    generator = torch.Generator().manual_seed(0)
    x, t, text = torch.randn(2, 4, 1, 8, 8, generator=generator), torch.tensor([500.0, 90.0]), torch.randn(2, 16, 384)
    with torch.no_grad():
        served = plain_dit(x, t, text, lora=LoraPlan([((lora, 1.0),)], [0, 0], plain_dit.ops.lora_bgmv, "cpu"))
        assert (frozen.module(x, t, text) - served).abs().max() <= 1e-5
        assert (plain_dit(x, t, text) - served).abs().max() > 1e-5


def _moved(module: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


class Constant(Brightness):
    def score(self, images, prompts):
        return np.full(len(images), 0.5)


@pytest.mark.parametrize("method", ["diffusion_nft", "flow_grpo"])
def test_a_rising_kl_weight_moves_linearly_from_kl_start_to_kl_and_weighs_the_term(examples, method):
    base = examples / "tiny-base"
    r = recipe(base, method, ["optim.steps=5", "loss.kl_start=1", "loss.kl=3"], reward=examples / "tiny-judge")
    task = make_task(r, CPU, load_card(base), Brightness(), ["a bag", "a coat"])
    weights = []
    for step in range(5):
        task.prepare(step)
        weights.append(task.kl)
    assert weights == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0])
    two = make_task(recipe(base, method, ["optim.steps=2", "loss.kl_start=1", "loss.kl=3"], reward=base), CPU,
                    load_card(base), Brightness(), ["a bag"])
    two.prepare(1)
    assert two.kl == 3.0, "the last update's weight is `kl`"
    task.micro_batch(0, 1, np.arange(2), torch.Generator().manual_seed(0))
    _moved(task.policy)  # a policy away from the reference: a KL term large enough to weigh
    losses = {}
    for kl in (1.0, 3.0):
        task.kl = kl
        loss, metrics = task.loss(np.arange(2), torch.Generator().manual_seed(1))
        losses[kl] = (float(loss.detach()), metrics["kl"])
    assert losses[1.0][1] > 1e-3 and losses[3.0][1] == pytest.approx(losses[1.0][1])
    assert losses[3.0][0] - losses[1.0][0] == pytest.approx(2.0 * losses[1.0][1], rel=1e-3)


def test_flow_grpos_ratio_metrics_are_the_largest_deviation_and_the_share_clipped(examples):
    base = examples / "tiny-base"
    task = make_task(recipe(base, "flow_grpo", reward=base), CPU, load_card(base), Brightness(), ["a bag", "a coat"])
    task.prepare(0)
    task.micro_batch(0, 1, np.arange(2), torch.Generator().manual_seed(0))
    _, fresh = task.loss(np.arange(2), torch.Generator().manual_seed(1))
    assert fresh["ratio_deviation"] <= 1e-5 and fresh["clip_fraction"] == 0.0, "the rollout's own weights: ρ = 1"
    _moved(task.policy)
    _, moved = task.loss(np.arange(2), torch.Generator().manual_seed(1))
    settings, (buffer, rows) = task.settings, task.batch()
    text, mask = task.text(buffer.prompts[rows])
    with torch.no_grad():  # every step trained (train_timesteps unset), in order
        log_probs, _, _ = transition_log_probs(task.loop.sde, task.policy, buffer.latents[:, rows],
                                               shifted_sigmas(settings.rollout_steps, task.shift),
                                               list(range(settings.rollout_steps)), text, mask, settings.eta)
    deviation = (torch.exp(log_probs - buffer.log_probs[:, rows].reshape(-1)) - 1).abs()
    assert moved["ratio_deviation"] == pytest.approx(float(deviation.max()), rel=1e-4)
    assert moved["clip_fraction"] == pytest.approx(float((deviation > settings.clip_range).float().mean()))
    assert moved["clip_fraction"] > 0


def test_flow_grpos_kl_is_the_step_means_squared_gap_over_twice_the_noise_scale_squared(examples):
    """ALGORITHMS.md (and Flow-GRPO's code): mean((μ_θ − μ_ref)²) / (2s²), s = a·√(σ/(1 − σ)) — not over the step's
    variance s²·|Δt|, which made β = 0.04 ten times the paper's on a 10-step grid."""
    base = examples / "tiny-base"
    task = make_task(recipe(base, "flow_grpo", ["loss.kl=1", "loss.train_timesteps=2"], reward=base), CPU,
                     load_card(base), Brightness(), ["a bag", "a coat"])
    task.prepare(0)
    task.micro_batch(0, 1, np.arange(2), torch.Generator().manual_seed(0))
    _moved(task.policy)
    _, metrics = task.loss(np.arange(2), torch.Generator().manual_seed(1))
    settings, (buffer, rows) = task.settings, task.batch()
    sigmas = shifted_sigmas(settings.rollout_steps, task.shift)
    steps = sorted(torch.randperm(settings.rollout_steps, generator=torch.Generator().manual_seed(1))[:2].tolist())
    text, mask = task.text(buffer.prompts[rows])
    with torch.no_grad():
        means = [transition_log_probs(task.loop.sde, model, buffer.latents[:, rows], sigmas, steps, text, mask,
                                      settings.eta)[1] for model in (task.policy, task.reference_model)]
    sigma = np.repeat(sigmas[steps], len(rows))
    noise = settings.eta * np.sqrt(sigma / (1 - np.where(sigma == 1, sigmas[1], sigma)))
    gaps = (means[0] - means[1]).pow(2).flatten(1).mean(1).double().numpy()
    assert metrics["kl"] > 1e-6 and metrics["kl"] == pytest.approx(float(np.mean(gaps / (2 * noise**2))), rel=1e-4)


@pytest.mark.parametrize("method", ["diffusion_nft", "flow_grpo"])
def test_the_kl_term_pulls_a_moved_policy_back_to_the_reference(examples, tmp_path, method):
    """A reward that rates every sample alike gives zero advantages: only the KL term trains, and it must shrink."""
    base = examples / "tiny-base"
    r = recipe(base, method, ["optim.steps=6", "optim.lr=3e-3", "loss.kl=1", "loss.reference_guidance=1"],
               reward=base)
    task = make_task(r, CPU, load_card(base), Constant(), ["a bag", "a coat"])
    task.micro_batch(0, 1, np.arange(2), torch.Generator().manual_seed(0))
    assert task.loss(np.arange(2), torch.Generator().manual_seed(1))[1]["kl"] < 1e-12, "the base is its own reference"
    task = make_task(r, CPU, load_card(base), Constant(), ["a bag", "a coat"])
    _moved(task.policy)
    logged = []
    train_loop(task, r, CPU, tmp_path / "run", on_log=logged.append)
    kl = [entry["kl"] for entry in logged]
    assert kl[-1] < 0.5 * kl[0], kl


def test_a_reward_cap_levels_the_advantages_of_samples_rated_above_it(examples):
    base = examples / "tiny-base"
    plain = make_task(recipe(base, extra=["loss.kl=0"]), CPU, load_card(base), Brightness(), ["a bag", "a coat"])
    rewards = plain.collect(np.array([0, 1]), torch.Generator().manual_seed(0)).rewards.numpy()
    cap = float(np.median(rewards))
    capped = make_task(recipe(base, extra=["loss.kl=0", f"loss.reward_cap={cap}"]), CPU, load_card(base),
                       Brightness(), ["a bag", "a coat"])
    buffer = capped.collect(np.array([0, 1]), torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(buffer.rewards.numpy(), rewards)  # recorded as scored
    advantages = buffer.advantages.numpy().reshape(2, 8)
    np.testing.assert_allclose(advantages, group_advantages(np.minimum(rewards, cap).reshape(2, 8), global_std=True))
    above = rewards.reshape(2, 8) >= cap
    for group in range(2):
        assert np.ptp(advantages[group][above[group]]) == 0, "every sample at or above the cap is as good"
        assert above[group].any() and not above[group].all()


def test_nft_rollouts_take_the_solver_the_recipe_names(examples):
    """loss.rollout_solver=dpmpp_2m: the old policy's samples are the denoise loop's dpmpp_2m samples of the same
    requests (the old policy is the base at the first rollout), which the Euler rollout's are not."""
    from cardtool.core.sampling.denoise import DenoiseLoop
    from cardtool.core.sampling.instance import ModelInstance
    from cardtool.core.sampling.sampler import sample

    base = examples / "tiny-base"
    made = {}
    for solver in ("euler", "dpmpp_2m"):
        task = make_task(recipe(base, extra=[f"loss.rollout_solver={solver}", "loss.rollout_steps=4"]), CPU,
                         load_card(base), Brightness(), ["a bag", "a coat"])
        requests = task.requests(np.array([0, 1]), torch.Generator().manual_seed(0))
        assert {r.solver for r in requests} == {solver}
        made[solver] = task.collect(np.array([0, 1]), torch.Generator().manual_seed(0)).latents[-1]
    loop = DenoiseLoop(ModelInstance(load_card(base), CPU))
    alone = torch.cat([s.latents for s in sample(loop, requests)])
    assert (made["dpmpp_2m"].reshape(alone.shape) - alone).abs().max() <= 1e-5
    assert (made["euler"] - made["dpmpp_2m"]).abs().max() > 1e-3
    with pytest.raises(BadInput, match="rollout_solver"):  # Flow-GRPO's rollouts are its SDE's
        check_recipe(recipe(base, method="flow_grpo", extra=["loss.rollout_solver=dpmpp_2m"]))
