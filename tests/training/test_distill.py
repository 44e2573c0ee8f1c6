"""`cardtool distill` (DMD2) on the tiny example card: the pieces against hand-computed values, a few iterations
that move generator and critic and leave the teacher alone, resume, the student card, train ≡ serve, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, tiny_referee, write_idx_folder, write_vae_only_card
from safetensors.torch import load_file
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.core.training.distill import distill, distill_recipe
from cardtool.core.training.methods.dmd2 import DEFAULTS, DMD2Task, GANHead, critic_loss, dm_gradient, generator_turn
from cardtool.core.training.trainer import CHECKPOINT, TrainingDiverged
from cardtool.errors import BadInput

TINY = ["optim.steps=6", "optim.batch_size=4", "train.precision=float32", "train.checkpoint_every=3",
        "train.log_every=1", "card.storage=float32"]


def recipe(teacher, steps=2, extra=()):
    return distill_recipe(str(teacher), None, [*TINY, *extra], steps)


def run(teacher, out, run_dir, steps=2, **kwargs):
    return distill(recipe(teacher, steps), command="cardtool distill …", out=out, run_dir=run_dir, evaluate=False,
                   **kwargs)


def test_the_distribution_matching_gradient_is_normalised_per_sample():
    x = torch.tensor([[1.0, 2.0], [0.0, 4.0]])
    real = torch.tensor([[0.0, 0.0], [2.0, 2.0]])  # mean |x − x̂_real|: 1.5 and 2
    fake = torch.tensor([[3.0, 0.0], [1.0, 5.0]])
    expected = torch.tensor([[3.0 / 1.5, 0.0], [-1.0 / 2, 3.0 / 2]])
    torch.testing.assert_close(dm_gradient(x, real, fake), expected)
    assert torch.isfinite(dm_gradient(x, x, fake)).all(), "x̂_real = x: a zero normaliser never gives NaN or inf"


def test_the_generators_step_follows_the_distribution_matching_gradient(examples):
    """The generator's term is ½·mean‖x − sg(x − g)‖²: its gradient on the student's sample is g / N, so descent moves
    x toward the real score's x̂0 and away from the fake score's (DMD eq. 7–8); the critic's loss, which holds x
    constant, adds nothing to it. Scores that predict fixed clean images make g independent of the t and ε drawn."""
    teacher = examples / "tiny-base"
    task = DMD2Task(recipe(teacher), _platform(), load_card(teacher))
    x = torch.randn(2, 4, 1, 3, 3, requires_grad=True)
    real, fake = torch.randn(2, 4, 1, 3, 3), torch.randn(2, 4, 1, 3, 3)
    task.rollout = lambda prompts, seeds, depth, grad: (x, None, None)
    levels = []

    def score(clean):
        def velocity(x_t, t):
            levels.append(t)
            return (x_t - clean) / t.reshape(-1, 1, 1, 1, 1)
        return velocity

    real_score, fake_score = score(real), score(fake)
    task.real_velocity = lambda x_t, t, text, mask: real_score(x_t, t)
    task.critic = lambda x_t, timesteps, text, mask: fake_score(x_t, timesteps / 1000)
    task.prepare(0)
    loss, metrics = task.loss([0, 1], torch.Generator().manual_seed(0))
    loss.backward()
    g = dm_gradient(x.detach(), real, fake)
    torch.testing.assert_close(x.grad, g / x.numel())
    assert metrics["dm_loss"] == pytest.approx(0.5 * float(g.pow(2).mean()), rel=1e-6)
    drawn = torch.cat(levels)  # the critic's own t, then the DM term's for both scores
    assert len(drawn) == 6 and bool(((drawn >= 0.02) & (drawn <= 0.98)).all()), "t is drawn in loss.t_range"


def test_the_loss_is_the_weighted_sum_of_the_terms_it_logs(examples, tmp_path):
    """critic + λ_D·d_loss + dm + λ_G·g_loss + λ_reg·reg, each term as logged; the discriminator's loss is
    softplus(fake logit) + softplus(−real logit) and the generator's softplus(−fake logit) — the logits in the order
    the step computes them (fake, real, then the generator's fake)."""
    import torch.nn.functional as F

    from cardtool.core.data import load_split

    teacher = examples / "tiny-base"
    r = recipe(teacher, extra=["loss.gan=true", "loss.gan_critic_weight=0.3", "loss.gan_generator_weight=0.7",
                               "loss.regression=0.25", "loss.teacher_samples=3"])
    task = DMD2Task(r, _platform(), load_card(teacher), load_split("train", write_idx_folder(tmp_path / "idx")))
    logits, forward = [], task.head.forward
    task.head.forward = lambda features: logits.append(forward(features)) or logits[-1]
    task.prepare(0)
    loss, m = task.loss([0, 1], torch.Generator().manual_seed(0))
    expected = m["critic_loss"] + 0.3 * m["d_loss"] + m["dm_loss"] + 0.7 * m["g_loss"] + 0.25 * m["reg_loss"]
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5) and min(m.values()) > 0
    fake, real, generators = (logit.detach() for logit in logits)
    assert m["d_loss"] == pytest.approx(float(F.softplus(fake).mean() + F.softplus(-real).mean()), rel=1e-5)
    assert m["g_loss"] == pytest.approx(float(F.softplus(-generators).mean()), rel=1e-5)


def test_the_critic_regresses_the_velocity_of_the_generators_samples():
    x, noise, t = torch.tensor([[2.0, -1.0]]), torch.tensor([[0.5, 1.0]]), torch.tensor([0.25])
    seen = {}

    def critic(x_t, timesteps, text, mask):
        seen["x_t"], seen["t"] = x_t, timesteps
        return torch.full_like(x_t, 0.5)

    loss = critic_loss(critic, x.requires_grad_(), t, noise, None, None)
    torch.testing.assert_close(seen["x_t"], torch.tensor([[0.75 * 2 + 0.25 * 0.5, 0.75 * -1 + 0.25 * 1.0]]))
    assert float(seen["t"]) == 250.0
    # target ε − x = (−1.5, 2.0): errors 2.0 and −1.5
    assert float(loss) == pytest.approx((2.0**2 + 1.5**2) / 2)
    assert not loss.requires_grad, "the generator's samples are held constant in the critic's loss"


def test_two_time_scale_updates_move_the_generator_every_fifth_iteration():
    assert [s for s in range(12) if generator_turn(s, 5)] == [0, 5, 10]
    assert all(generator_turn(s, 1) for s in range(4))


def test_a_few_iterations_move_generator_and_critic_and_leave_the_teacher(examples, tmp_path):
    teacher = examples / "tiny-base"
    before = (teacher / "transformer.safetensors").read_bytes()
    task = DMD2Task(recipe(teacher), _platform(), load_card(teacher))
    original = {k: v.clone() for k, v in task.real.state_dict().items()}
    from cardtool.core.training.trainer import train_loop

    train_loop(task, recipe(teacher), _platform(), tmp_path / "run")
    moved = {name: max(float((m.state_dict()[k] - original[k]).abs().max()) for k in original)
             for name, m in task.modules().items()}
    assert moved["transformer"] > 0 and moved["critic"] > 0
    assert all(torch.equal(task.real.state_dict()[k], v) for k, v in original.items()), "the teacher is frozen"
    assert (teacher / "transformer.safetensors").read_bytes() == before


def test_resume_after_an_interruption_gives_the_same_student(examples, tmp_path):
    teacher = examples / "tiny-base"
    whole = run(teacher, tmp_path / "a", tmp_path / "ra")

    def stop_after_4(entry):
        if entry["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(teacher, tmp_path / "b", tmp_path / "rb", on_log=stop_after_4)
    assert (tmp_path / "rb" / CHECKPOINT).exists() and not (tmp_path / "b").exists()
    resumed = run(teacher, tmp_path / "b", tmp_path / "rb", resume=True)
    a, b = (load_file(str(c.weights_file("transformer"))) for c in (whole, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_student_card_extends_its_teacher_and_samples_as_it_was_trained(examples, tmp_path):
    teacher = examples / "tiny-base"
    student = run(teacher, examples / "tiny-2step", tmp_path / "run")
    card = load_card(examples / "tiny-2step", checksums=True)
    m = card.manifest
    assert m.extends == "tiny-base" and m.recipe.method == "dmd2" and m.recipe.parents == ["tiny-base"]
    assert m.recipe.assumes.steps == 2 and m.loops["denoise"].defaults["solver"] == "renoise"
    assert m.loops["denoise"].defaults["steps"] == 2 and m.loops["denoise"].defaults["guidance"] == 1.0
    assert card.weights_file("vae").resolve() == (teacher / "vae.safetensors").resolve(), "VAE by reference"
    assert "invert" not in m.adapters, "the teacher's LoRA was trained for the teacher's transformer"
    assert student.manifest.recipe.metrics["iterations"] == 6 and m.description == "2-step DMD2 student of tiny-base"
    assert student.manifest.recipe.metrics["generator_updates"] == 2, "iterations 0 and 5 of 6 (every fifth)"
    # train ≡ serve: the training rollout (the generator's last step) equals the student card's sampling
    task = DMD2Task(recipe(teacher), _platform(), load_card(teacher))
    task.generator.load_state_dict(load_file(str(card.weights_file("transformer"))))
    with torch.no_grad():
        x0 = task.rollout(["a bag", "a coat"], [3, 4], depth=1, grad=False)[0]
    served = DenoiseLoop(ModelInstance(card, _platform()), cache=TextFeatureCache(disk=False))
    requests = [Request(p, seed=s, steps=2, guidance=1.0, solver="renoise") for p, s in (("a bag", 3), ("a coat", 4))]
    latents = torch.cat([st.latents for st in sample(served, requests)])
    assert float((x0 - latents).abs().max()) <= 1e-5
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-2step"), "-p", "a bag", "--out",
                                      str(tmp_path / "one.png"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["images"][0]["steps"] == "2" and not json.loads(result.stdout)["warnings"]


def test_the_cli_writes_the_student_and_reports_json(examples, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # without --out and --run-dir: cards/ID and runs/ID here
    result = CliRunner().invoke(app, ["distill", str(examples / "tiny-base"), "--steps", "1", "--no-eval", "--json",
                                      *(f"--set={o}" for o in TINY)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["card"] == "tiny-base-1step" and report["steps"] == 1
    assert (report["method"], report["parents"]) == ("dmd2", ["tiny-base"])
    assert (tmp_path / report["path"] / report["extends"]).resolve() == (examples / "tiny-base").resolve()
    assert report["path"] == "cards/tiny-base-1step" and (tmp_path / "runs" / "tiny-base-1step" / CHECKPOINT).is_file()
    assert "cardtool distill" in load_card(tmp_path / "cards" / "tiny-base-1step").manifest.recipe.command
    assert "iteration 1/" in result.stderr, "a script's stdout holds the document, a person still sees progress"
    again = CliRunner().invoke(app, ["distill", str(examples / "tiny-base"), "--steps", "1", "--no-eval", "--force",
                                     "--run-dir", "runs/again", *(f"--set={o}" for o in TINY)])  # for people
    assert again.stdout == "wrote student card tiny-base-1step (1 step) to cards/tiny-base-1step\n", again.output


def test_the_cli_evaluates_the_student_at_its_own_steps_and_records_the_eval_in_it(examples, tmp_path):
    from helpers import write_idx_folder

    data = write_idx_folder(tmp_path / "idx")
    args = ["distill", str(examples / "tiny-base"), "--steps", "1", "--judge", str(examples / "tiny-judge"), "--data",
            str(data), "--out", str(tmp_path / "s1"), "--run-dir", str(tmp_path / "r"), "--json",
            *(f"--set={o}" for o in TINY)]
    # 1,000 images a row by default: their floors need as many
    refused = CliRunner().invoke(app, [*args, "--held-out-judge", ""])
    assert refused.exit_code == 2 and "--per-class 100 asks for 1000 images, more than the 64 training" in \
        json.loads(refused.stdout)["error"]["message"] and not (tmp_path / "r").exists(), "refused before the run"
    referee = tiny_referee(examples)  # tiny-judge's weights: the same images judged twice, the same accuracy
    refused = CliRunner().invoke(app, [*args, "--per-class", "3", "--held-out-judge", str(examples / "tiny-judge")])
    assert refused.exit_code == 2 and json.loads(refused.stdout)["error"]["message"].startswith(
        f"--held-out-judge {examples / 'tiny-judge'} is the --judge card 'tiny-judge'")
    assert not (tmp_path / "r").exists(), "refused before the run"
    result = CliRunner().invoke(app, [*args, "--per-class", "3", "--held-out-judge", str(referee)])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    [row] = metrics["eval"]["rows"]
    assert row["steps"] == 1 and 0 <= row["class_accuracy"] <= 1 and row["images"] == 30
    assert metrics["held_out_judge"] == {"card": "tiny-referee", "images": 30, "class_accuracy": row["class_accuracy"]}
    assert result.stderr.count("eval (tiny-judge) at 1 step: accuracy") == 1
    assert result.stderr.count("eval (tiny-referee) at 1 step: accuracy") == 1
    recorded = load_card(tmp_path / "s1").manifest.recipe.metrics
    assert recorded["eval"]["rows"] == [row] and (tmp_path / "s1" / "eval.json").is_file()
    assert recorded["held_out_judge"] == metrics["held_out_judge"]
    alone = CliRunner().invoke(app, [*args, "--per-class", "3", "--held-out-judge", "", "--out", str(tmp_path / "s2"),
                                     "--run-dir", str(tmp_path / "r2")])
    assert alone.exit_code == 0, alone.output
    assert "held_out_judge" not in json.loads(alone.stdout)["metrics"] and alone.stderr.count("eval (") == 1


def test_the_example_recipe_spells_out_the_defaults():
    data = yaml.safe_load((REPO / "examples" / "recipes" / "fashion-dmd2.yaml").read_text())
    assert data == DEFAULTS


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "--steps must be a whole number from 1 to 1000, got 0"),
    (["--steps", "1001"], "--steps must be a whole number from 1 to 1000, got 1001"),
    (["--steps", str(2**64)], f"--steps must be a whole number from 1 to 1000, got {2**64}"),  # not a --set's error
    (["--lora", "1025"], "--lora must be a whole number from 1 to 1024, got 1025"),
    (["--steps", "1", "--set", "loss.student_steps=3"], "--steps 1 and a --set of loss.student_steps (3) give it two"),
    (["--lora", "2", "--set", "model.lora.rank=4"], "--lora 2 and a --set of model.lora.rank (4) give it two values"),
    (["--set", "loss.no_such_knob=1"], "loss.no_such_knob"),
    (["--set", "optim.nope=1"], "optim.nope"),
    (["--set", "data.foldr=x"], "unknown data.foldr; its settings: folder"),
    (["--set", "loss.gan_generator_weight=.nan"], "loss.gan_generator_weight: a non-finite number (nan)"),
    (["--set", "loss.gan_t_range=[0.3, 0.1]"], "gan_t_range must be [LO, HI]"),
    (["--set", "loss.gan_real=noise"], "loss.gan_real"),
])
def test_bad_input_is_a_clear_error(examples, tmp_path, args, message):
    result = CliRunner().invoke(app, ["distill", str(examples / "tiny-base"), "--no-eval", *args,
                                      "--out", str(tmp_path / "s"), "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("data", "message"), [
    ("", "--data '' names no folder"), ("nowhere", "no Fashion-MNIST data at")])
def test_data_the_eval_after_distilling_cannot_read_is_refused_before_training(examples, tmp_path, data, message):
    result = CliRunner().invoke(app, ["distill", str(examples / "tiny-base"), "--data", data and str(tmp_path / data),
                                      "--judge", str(examples / "tiny-judge"), "--held-out-judge", "", "--out",
                                      str(tmp_path / "s"), "--run-dir", str(tmp_path / "r"),
                                      *(f"--set={o}" for o in TINY)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "r" / CHECKPOINT).exists() and not (tmp_path / "s").exists()


def test_the_api_refuses_a_recipe_of_another_method_or_parents_before_loading_anything(examples, tmp_path):
    """distill() takes any Recipe: one made for rl, or a dmd2 recipe given a second parent, is refused at once."""
    from cardtool.core.training.rl import rl_recipe

    two = recipe(examples / "tiny-base").model_copy(update={"parents": ["tiny-base", "tiny-judge"]})
    for wrong in (rl_recipe("no-such-base", "tiny-judge"), two):
        with pytest.raises(BadInput, match="distill runs a dmd2 recipe with exactly one parent, the teacher"):
            distill(wrong, command="c", out=tmp_path / "s", run_dir=tmp_path / "r", evaluate=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "r").exists()


def test_a_teacher_without_a_denoise_loop_and_an_existing_output_are_refused(examples, tmp_path):
    vae_only = write_vae_only_card(tmp_path / "vae-only")
    result = CliRunner().invoke(app, ["distill", str(vae_only), "--no-eval", "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "has no denoise loop" in result.output
    (tmp_path / "taken").mkdir()
    result = CliRunner().invoke(app, ["distill", str(examples / "tiny-base"), "--no-eval", "--out",
                                      str(tmp_path / "taken")])
    assert result.exit_code == 2 and "already exists" in result.output and "--force" in result.output
    result = CliRunner().invoke(app, ["distill", str(examples / "tiny-base"), "--judge", str(examples / "tiny-base"),
                                      "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "is not a reward" in result.output, "the judge is checked before the training"


def _platform():
    from cardtool.backends.platform import Platform

    return Platform("cpu", "generic")


def test_a_gan_run_resumed_on_other_real_images_is_refused(examples, tmp_path):
    """The GAN term's real images are the run's data: its checkpoint records their digest, as `train`'s does."""
    gan = recipe(examples / "tiny-base", extra=["loss.gan=true", "optim.steps=1"])
    data, other = write_idx_folder(tmp_path / "idx"), write_idx_folder(tmp_path / "other", seed=1)
    options = dict(command="c", run_dir=tmp_path / "run", evaluate=False)
    card = distill(gan, out=tmp_path / "one", data=str(data), **options)
    from cardtool.core.data import load_split

    assert card.manifest.recipe.data == {"dataset": "idx", "split": "train", "images": 64,  # the card says which
                                         "digest": load_split("train", data).digest()}
    with pytest.raises(BadInput, match="was trained on other data than this run reads"):
        distill(gan, out=tmp_path / "two", data=str(other), resume=True, **options)


def test_the_gan_term_trains_a_head_on_the_critic_and_moves_the_generator(examples, tmp_path):
    from cardtool.core.data import load_split
    from cardtool.core.training.trainer import train_loop

    teacher = examples / "tiny-base"
    gan = recipe(teacher, extra=["loss.gan=true", "loss.generator_every=1", "optim.steps=3", "loss.critic_lr_scale=3"])
    split = load_split("train", write_idx_folder(tmp_path / "idx"))
    task = DMD2Task(gan, _platform(), load_card(teacher), split)
    assert not hasattr(task, "pairs"), "no teacher samples made (minutes on a real card) that nothing uses"
    # a row's real at t = 0 is the VAE's posterior mean (not its spread) of a training image of the prompt's class
    from cardtool.core.training.methods.vae import to_unit

    with torch.no_grad():
        mean, _ = task.loop.instance.component(task.loop.vae).encode(to_unit(split.images))
    images = mean[:, :, None] * task.loop.instance.component(task.loop.vae).config.scaling_factor
    shoe = 7 * task.per_class  # the first phrasing of class 7's prompt
    real = task._real([shoe], torch.zeros(1), torch.Generator().manual_seed(0))[0]
    assert any(torch.allclose(real, images[j], atol=1e-6) for j in np.flatnonzero(split.labels == 7))
    head = {k: v.clone() for k, v in task.head.state_dict().items()}
    logged, timesteps = [], []
    task.critic.register_forward_pre_hook(lambda module, args: timesteps.append(args[1].clone()))
    train_loop(task, gan, _platform(), tmp_path / "run", on_log=logged.append)
    assert set(task.modules()) == {"transformer", "critic", "gan_head"}
    # per iteration: the critic's loss, the head's real (its fake is the critic's forward), the DM term, G's GAN term —
    # without gan_t_range the head's terms take the t of the critic's and the DM term's forward
    assert len(timesteps) == 12 and all(torch.equal(timesteps[i], timesteps[i + 1]) for i in range(0, 12, 2))
    assert any(not torch.equal(v, task.head.state_dict()[k]) for k, v in head.items())
    assert all({"d_loss", "g_loss", "dm_loss"} <= set(entry) for entry in logged)
    assert all(p.requires_grad for p in task.critic.parameters()), "the critic is trainable again after G's term"
    last = []  # the head reads the critic's last block, DMD2's bottleneck features
    task.critic.blocks[-1].register_forward_hook(lambda module, inputs, output: last.append(output))
    x, text, mask = task.rollout(task.prompts[:2], [0, 1], 0, grad=False)
    task.critic(x, torch.full((2,), 500.0), text, mask)
    assert task._features is last[-1]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / CHECKPOINT), framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    assert [g["lr_scale"] for g in groups] == [1.0, 3.0, 50.0], "the critic at its scale, the fresh head 50x"
    assert groups[2]["lr"] == pytest.approx(50 * groups[0]["lr"])
    # FSDP2 cannot follow the critic frozen in place mid-step: refused with the reason, before any collective
    from cardtool.core.distributed import Ranks
    from cardtool.core.training.parallel import Parallel

    with pytest.raises(BadInput, match="loss.gan's generator term .* use train.parallel ddp"):
        Parallel("fsdp", Ranks(0, 2, 0), task, task.modules(), "cpu")
    with pytest.raises(BadInput, match="needs the training images"):
        DMD2Task(gan, _platform(), load_card(teacher))
    few = load_split("train", write_idx_folder(tmp_path / "few", train=8))  # classes 0…7: no bag, no ankle boot
    with pytest.raises(BadInput, match="the training images hold none of: bag, ankle boot"):
        DMD2Task(gan, _platform(), load_card(teacher), few)


def test_what_the_gan_term_needs_is_checked_before_the_teacher_loads_or_samples(examples, tmp_path, monkeypatch):
    """A GAN run without the images it needs, or with fewer teacher samples than prompts, was refused only after the
    teacher had made its samples (minutes) or the training images were encoded."""
    from cardtool.core.data import load_split
    from cardtool.core.training.methods import dmd2

    teacher = load_card(examples / "tiny-base")
    few = load_split("train", write_idx_folder(tmp_path / "few", train=8))  # classes 0…7: no bag, no ankle boot
    monkeypatch.setattr(dmd2, "FrozenCard", lambda *args: pytest.fail("the teacher loaded before the refusal"))
    for extra, train, message in [
            (["loss.gan=true"], None, "needs the training images"),
            (["loss.gan=true"], few, "the training images hold none of: bag, ankle boot"),
            (["loss.gan=true", "loss.gan_real=teacher", "loss.teacher_samples=129"], few,
             "loss.gan_real=teacher needs loss.teacher_samples ≥ 130 .*, got 129")]:
        with pytest.raises(BadInput, match=message):
            DMD2Task(recipe(examples / "tiny-base", extra=extra), _platform(), teacher, train)


def test_the_gan_head_gives_one_logit_per_row_from_the_mean_of_its_tokens():
    head, features = GANHead(8), torch.randn(3, 5, 8)
    logits = head(features)
    assert logits.shape == (3,)
    assert torch.allclose(head(features[:, torch.randperm(5)]), logits, atol=1e-6), "the tokens' order is no matter"
    assert torch.allclose(head(features.mean(dim=1, keepdim=True)), logits, atol=1e-6)


def test_frozen_modules_take_no_gradient_inside_the_block_and_are_as_they_were_after_it():
    from cardtool.core.training.methods.dmd2 import _frozen

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.bias.requires_grad_(False)  # frozen before: stays frozen after
    x = torch.ones(1, 2, requires_grad=True)
    with _frozen(a, b):
        assert not any(p.requires_grad for p in [*a.parameters(), *b.parameters()])
        b(a(x)).sum().backward()
    assert x.grad is not None and a.weight.grad is None, "the graph through the input remains, the weights take none"
    assert a.weight.requires_grad and a.bias.requires_grad and b.weight.requires_grad and not b.bias.requires_grad


def test_the_gan_term_can_call_the_teachers_samples_of_the_same_prompt_real(examples, tmp_path):
    """`gan_real: teacher`: no training images needed; each row's real latent is one of the teacher's samples for
    that row's own prompt, noised to its t."""
    teacher = examples / "tiny-base"
    gan = recipe(teacher, extra=["loss.gan=true", "loss.gan_real=teacher", "loss.teacher_samples=140",
                                 "loss.generator_every=1", "optim.steps=2", "loss.t_range=[0.9, 0.98]",
                                 "loss.gan_t_range=[0.02, 0.3]"])
    task = DMD2Task(gan, _platform(), load_card(teacher))
    prompts, _, samples = task.pairs
    n = len(task.prompts)
    assert [list(r) for r in task.real_rows[:12]] == [[i, i + n] if i < 140 - n else [i] for i in range(12)]
    assert all(prompts[j] == task.prompts[i] for i, rows in enumerate(task.real_rows) for j in rows)
    assert all(len(rows) for rows in task.real_rows), "a prompt phrased twice still finds its samples"
    noised = task._real([11, 11], torch.zeros(2), torch.Generator().manual_seed(0))  # t = 0: its one sample
    assert torch.equal(noised, samples[[11, 11]])
    from cardtool.core.training.trainer import train_loop

    timesteps = []
    task.critic.register_forward_pre_hook(lambda module, args: timesteps.append(args[1].clone()))
    logged = []
    train_loop(task, gan, _platform(), tmp_path / "run", on_log=logged.append)
    assert all({"d_loss", "g_loss"} <= set(entry) for entry in logged)
    # per iteration: the critic's loss and the DM term at t ≥ 0.9; the head's fake, real and generator terms ≤ 0.3
    assert [bool((t <= 300).all()) for t in timesteps] == [False, True, True, False, True] * 2
    assert all(bool((t >= 900).all()) or bool(((t >= 20) & (t <= 300)).all()) for t in timesteps)
    assert all(torch.equal(timesteps[i + 1], timesteps[i + 2]) for i in (0, 5)), "the head's fake and real at one t"
    sets = ["loss.gan=true", "loss.gan_real=teacher", f"loss.teacher_samples={n}", "optim.steps=1",
            "optim.batch_size=4", "train.precision=float32"]  # bfloat16 is refused where the CPU lacks bf16 compute
    result = CliRunner().invoke(app, ["distill", str(teacher), "--no-eval", "--data", str(tmp_path / "no-data"),
                                      *[a for o in sets for a in ("--set", o)], "--out", str(tmp_path / "s"),
                                      "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 0, "teacher samples as the real side read no training images"
    few = recipe(teacher, extra=["loss.gan=true", "loss.gan_real=teacher", f"loss.teacher_samples={n - 1}"])
    with pytest.raises(BadInput, match="teacher_samples ≥"):
        DMD2Task(few, _platform(), load_card(teacher))


def test_the_regression_term_pairs_noise_with_the_teachers_own_samples(examples, tmp_path):
    """DMD's regression loss: each pair is what `generate` makes from the teacher at its defaults for that seed, and
    the term is the MSE of the student's first clean estimate from the same noise against it."""
    import torch.nn.functional as F

    from cardtool.core.training.methods.dmd2 import PAIR_SEEDS
    from cardtool.core.training.trainer import train_loop

    teacher = examples / "tiny-base"
    reg = recipe(teacher, extra=["loss.regression=0.5", "loss.teacher_samples=3", "loss.generator_every=1",
                                 "optim.steps=2"])
    task = DMD2Task(reg, _platform(), load_card(teacher))
    prompts, seeds, targets = task.pairs
    assert seeds == [PAIR_SEEDS, PAIR_SEEDS + 1, PAIR_SEEDS + 2] and prompts == task.prompts[:3]
    loop = DenoiseLoop(ModelInstance(load_card(teacher), _platform(), "float32"), cache=TextFeatureCache(disk=False))
    d = load_card(teacher).manifest.loops["denoise"].defaults
    served = sample(loop, [Request(prompts[1], seed=seeds[1], steps=d["steps"], guidance=d["guidance"],
                                   guidance_interval=tuple(d.get("guidance_interval", (0.0, 1.0))))])
    assert torch.allclose(targets[1:2], served[0].latents, atol=1e-6)
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    x, _, _ = task.rollout([prompts[i] for i in picks], [seeds[i] for i in picks], 0, grad=False)
    expected = float(F.mse_loss(x, targets[picks]))
    assert float(task._regression(4, generator).detach()) == pytest.approx(expected, rel=1e-5)
    logged = []
    train_loop(task, reg, _platform(), tmp_path / "run", on_log=logged.append)
    assert all(entry["reg_loss"] > 0 for entry in logged)


def test_a_real_score_fit_to_the_teachers_samples_trains_beside_the_critic(examples, tmp_path):
    """`real: sampler`: the real score is a third network, initialised from the teacher (its conditional velocity,
    no CFG) and trained on the teacher's samples; the DM gradient reads it."""
    from cardtool.core.training.trainer import train_loop

    teacher = examples / "tiny-base"
    real = recipe(teacher, extra=["loss.real=sampler", "loss.teacher_samples=4", "loss.generator_every=1",
                                  "optim.steps=2"])
    task = DMD2Task(real, _platform(), load_card(teacher))
    assert set(task.modules()) == {"transformer", "critic", "real_critic"}
    x, t = torch.randn(2, *task.pairs[2].shape[1:]), torch.tensor([0.3, 0.7])
    text, mask = (a[:2] for a in task.pair_text)
    with torch.no_grad():
        assert torch.equal(task.real_velocity(x, t, text, mask), task.real(x, t * 1000, text, mask))
    before = {k: v.clone() for k, v in task.real_critic.state_dict().items()}
    logged = []
    train_loop(task, real, _platform(), tmp_path / "run", on_log=logged.append)
    assert all(entry["real_critic_loss"] > 0 and "dm_loss" in entry for entry in logged)
    assert any(not torch.equal(v, task.real_critic.state_dict()[k]) for k, v in before.items())
    with torch.no_grad():
        assert not torch.equal(task.real_velocity(x, t, text, mask), task.real(x, t * 1000, text, mask))


def test_progress_lines_average_the_generators_losses_over_the_window(examples, tmp_path):
    """With the generator moving every 2nd iteration and a line every 2nd, each logged iteration is the critic's
    own; the line still shows the generator's loss, the mean over the window's iterations that computed it."""
    from cardtool.core.training.trainer import train_loop

    teacher = examples / "tiny-base"
    spaced = recipe(teacher, extra=["loss.generator_every=2", "train.log_every=2", "optim.steps=4"])
    logged = []
    train_loop(DMD2Task(spaced, _platform(), load_card(teacher)), spaced, _platform(), tmp_path / "run",
               on_log=logged.append)
    assert [entry["step"] for entry in logged] == [2, 4]
    assert all(entry["dm_loss"] > 0 and entry["critic_loss"] > 0 for entry in logged)


def test_a_lora_student_trains_only_its_lora_and_serves_as_it_was_trained(examples, tmp_path):
    teacher = examples / "tiny-base"
    result = CliRunner().invoke(app, ["distill", str(teacher), "--steps", "2", "--lora", "4", "--no-eval",
                                      "--out", str(examples / "tiny-lora-2step"), "--run-dir", str(tmp_path / "r"),
                                      *(f"--set={o}" for o in TINY)])
    assert result.exit_code == 0, result.output
    card = load_card(examples / "tiny-lora-2step", checksums=True)
    m = card.manifest
    assert m.adapters["dmd2"].rank == 4 and m.loops["denoise"].defaults["adapters"] == {"dmd2": 1.0}
    assert card.weights_file("transformer").resolve() == (teacher / "transformer.safetensors").resolve(), \
        "the transformer is the teacher's, by reference"
    assert "--lora 4" in m.recipe.command and m.recipe.hyperparameters["model"] == {"lora": {"rank": 4}}
    lora = load_file(str(card.weights_file("dmd2")))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items()), "B moved from zero"
    # train ≡ serve: the generator (frozen DiT + LoRA) rolls out what the card samples with its default stack
    task = DMD2Task(recipe(teacher, extra=["model.lora.rank=4"]), _platform(), load_card(teacher))
    a, b = (lambda w: ({k[:-len(".lora_A.weight")]: v for k, v in w.items() if k.endswith("lora_A.weight")},
                       {k[:-len(".lora_B.weight")]: v for k, v in w.items() if k.endswith("lora_B.weight")}))(lora)
    with torch.no_grad():
        for module in a:
            task.generator.lora.lora_A[module.replace(".", "__")].copy_(a[module])
            task.generator.lora.lora_B[module.replace(".", "__")].copy_(b[module])
        x0 = task.rollout(["a bag", "a coat"], [3, 4], depth=1, grad=False)[0]
    served = DenoiseLoop(ModelInstance(card, _platform()), cache=TextFeatureCache(disk=False))
    requests = [Request(p, seed=s, steps=2, guidance=1.0, solver="renoise", adapters=(("dmd2", 1.0),))
                for p, s in (("a bag", 3), ("a coat", 4))]
    latents = torch.cat([st.latents for st in sample(served, requests)])
    assert float((x0 - latents).abs().max()) <= 1e-5
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-lora-2step"), "-p", "a bag", "--json",
                                      "--out", str(tmp_path / "o")])
    assert json.loads(result.stdout)["images"][0]["adapters"][0]["name"] == "dmd2", "the card applies its LoRA"


def test_an_eval_that_fails_after_the_card_is_written_keeps_its_kind(examples, monkeypatch):
    from cardtool.core.evaluation import evaluate as evaluate_module
    from cardtool.core.sampling.denoise import NonFiniteImages
    from cardtool.core.training.derived import evaluate_output, held_out_output
    from cardtool.errors import RunFailed

    card = load_card(examples / "tiny-base")
    for raised, kind in ((NonFiniteImages("tiny-base", [Request("a bag")], 1), RunFailed),
                         (BadInput("no such judge"), BadInput)):
        def failing(*args, error=raised, **kwargs):
            raise error

        monkeypatch.setattr(evaluate_module, "evaluate", failing)
        with pytest.raises(kind, match="was written, but its eval failed") as info:
            evaluate_output(card, "tiny-judge", None, data="my data")
        assert type(info.value) is kind, "a run that failed is not reported as bad input, nor the other way"
        # the eval to run again is the run's own, its judge and data (not eval's defaults), quoted for a shell
        assert str(info.value).endswith(f"run `cardtool eval {card.folder} --judge tiny-judge --data 'my data' "
                                        "--record` once it can")
        with pytest.raises(kind, match="--data 'my data' --per-class 7 --record` once it can"):
            evaluate_output(card, "tiny-judge", None, data="my data", per_class=7)
        with pytest.raises(kind, match="was written and its eval recorded, but the held-out judge's eval failed") \
                as info:  # the held-out judge's eval after it (rl, distill): the same
            held_out_output(card, "tiny-referee", None, data="my data", on_eval=None, per_class=7)
        assert type(info.value) is kind and str(info.value).endswith(
            f"`cardtool eval {card.folder} --judge tiny-referee --data 'my data' --per-class 7` measures it once it "
            "can")


def test_lora_targets_that_name_no_layer_are_bad_input(examples):
    """rl and distill's --lora with targets matching none of the transformer's layers raised a ValueError."""
    with pytest.raises(BadInput, match=r"model.lora.targets: no linear layer matches the LoRA targets \['nope'\]"):
        DMD2Task(recipe(examples / "tiny-base", extra=["model.lora.rank=2", "model.lora.targets=[nope]"]), _platform(),
                 load_card(examples / "tiny-base"))


def test_watching_logs_the_students_accuracy_and_fid_and_changes_nothing_it_trains(examples, tmp_path):
    """--watch-every samples the live student at its own steps and judges it; the watched run's student is the
    unwatched run's, bit for bit (the watch reads the weights and draws only from its requests' seeds)."""
    teacher, judge = examples / "tiny-base", str(examples / "tiny-judge")
    data = str(write_idx_folder(tmp_path / "idx"))
    entries = []
    watched = run(teacher, tmp_path / "w", tmp_path / "rw", on_log=entries.append, watch_every=4, judge=judge,
                  watch_judges=[judge, str(tiny_referee(examples))], data=data)  # tiny-judge's weights: its numbers
    plain = run(teacher, tmp_path / "p", tmp_path / "rp")
    assert [e["step"] for e in entries if "watch_fid" in e] == [4], "the first progress line at or past each 4th"
    seen = next(e for e in entries if "watch_fid" in e)
    assert 0 <= seen["watch_accuracy"] <= 1 and seen["watch_accuracy_tiny-referee"] == seen["watch_accuracy"]
    assert seen["watch_fid"] > 0
    a, b = (load_file(str(c.weights_file("transformer"))) for c in (watched, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)
    result = CliRunner().invoke(app, ["distill", str(teacher), "--no-eval", "--watch-every", "-1",
                                      "--out", str(tmp_path / "x"), *(f"--set={o}" for o in TINY)])
    assert result.exit_code == 2 and "--watch-every must be 0 (off) or a positive whole number" in result.output
    result = CliRunner().invoke(app, ["distill", str(teacher), "--no-eval", "--watch-every", "2", "--judge", judge,
                                      "--held-out-judge", str(examples / "tiny-base"), "--out", str(tmp_path / "y"),
                                      "--run-dir", str(tmp_path / "ry"), *(f"--set={o}" for o in TINY)])
    assert result.exit_code == 2 and "is not a reward" in result.output
    assert not (tmp_path / "ry" / CHECKPOINT).exists(), "a judge that is not one is found before the run"


def test_the_watch_samples_what_the_student_card_serves(examples, tmp_path):
    """The watch's images are the written card's own: the same requests through `generate`."""
    from cardtool.backends.platform import Platform
    from cardtool.core.training.watch import Watch

    teacher, judge = examples / "tiny-base", str(examples / "tiny-judge")
    student = run(teacher, tmp_path / "s", tmp_path / "rs")
    task = DMD2Task(recipe(teacher), Platform.detect("cpu"), load_card(teacher))
    task.generator.load_state_dict(load_file(str(student.weights_file("transformer"))))
    loop = dict(student.manifest.loops["denoise"].defaults)
    watch = Watch(task.teacher, task.name, task.generator, task.cache, loop, [judge], Platform.detect("cpu"),
                  "float32", per_class=1, data=str(write_idx_folder(tmp_path / "idx")))
    watched = watch.loop.finalize(sample(watch.loop, watch.requests))
    served = DenoiseLoop(ModelInstance(student, Platform.detect("cpu")), cache=TextFeatureCache(disk=False))
    assert (watched == served.finalize(sample(served, watch.requests))).all()


def test_a_run_that_diverges_names_the_learning_rate_scale_it_ran_with(examples, tmp_path):
    """The advice to lower optim.lr names the loss: section's scale when one multiplies it (a critic at 1e30×)."""
    scaled = recipe(examples / "tiny-base", 1, ["loss.critic_lr_scale=1e30"])
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 1; .* Lower optim.lr \(the loss: section "
                                               r"scales it by 1e\+30 for the critic\) or raise optim.warmup"):
        distill(scaled, command="c", out=tmp_path / "s", run_dir=tmp_path / "r", evaluate=False)
