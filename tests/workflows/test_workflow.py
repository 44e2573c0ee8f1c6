"""Workflow manifests on the tiny example cards: each step kind, the merged order of a fan-out, best-of-N's argmax,
SDEdit refinement, and bad workflows as located errors (never tracebacks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.sampling.generate import LoadedCard

HEAD = "schema: cardtool/v1\nkind: workflow\nid: w\nsteps:\n"


WORKFLOWS = Path(__file__).resolve().parents[2] / "examples" / "workflows"


def write(tmp_path, examples, steps: str, name="w.yaml"):
    text = HEAD + steps.replace("EX", str(examples))
    path = tmp_path / name
    path.write_text(text)
    return path


def run(path, tmp_path, *extra):
    return CliRunner().invoke(app, ["workflow", "run", str(path), "--out", str(tmp_path / "out"), "--json", *extra])


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image), dict(image.text)


def test_the_example_workflow_runs_every_step_kind_and_names_workflow_and_step(tmp_path, monkeypatch):
    from helpers import REPO

    result = run(REPO / "examples" / "workflows" / "tiny-tour.yaml", tmp_path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(s["step"], s["kind"], len(s["images"])) for s in report["steps"]] == [
        ("draft", "generate", 2), ("refine", "chain", 2), ("compare", "parallel", 2), ("pick", "best_of_n", 1)]
    for step in report["steps"]:
        for image in step["images"]:
            _, text = pixels(image["path"])
            assert text["workflow"] == "tiny-tour" and text["step"] == step["step"]
            assert text["step_kind"] == step["kind"]
    assert [i["input"] for i in report["steps"][1]["images"]] == ["draft/0", "draft/1"]
    # generate --like makes each step's image again — a refined one from its input, found where the workflow wrote it
    monkeypatch.setenv("CARDTOOL_PATH", str(REPO / "examples" / "cards"))
    for step, image in ((s["step"], s["images"][0]) for s in report["steps"]):
        again = CliRunner().invoke(app, ["generate", "--like", image["path"], "--out", str(tmp_path / step), "--json"])
        assert again.exit_code == 0, again.output
        made = json.loads(again.stdout)
        assert np.array_equal(pixels(made["images"][0]["path"])[0], pixels(image["path"])[0]), step
        assert made["warnings"] == [], made["warnings"]
    refined = Path(report["steps"][1]["images"][1]["path"])
    Path(report["steps"][0]["images"][1]["path"]).unlink()  # its input gone: said, not guessed
    gone = CliRunner().invoke(app, ["generate", "--like", str(refined), "--out", str(tmp_path / "gone"), "--json"])
    assert gone.exit_code == 2 and "made by refining an image of step 'draft'" in gone.stdout \
        and "which is not beside it" in gone.stdout


def test_parallel_merges_card_by_card_in_order_each_as_its_own_generate(examples, tmp_path):
    path = write(tmp_path, examples, "  fan:\n    parallel: {cards: [EX/tiny-rl, EX/tiny-base], "
                                     "prompts: [a bag, a coat], steps: 3, seed: 5, negative_prompt: a shirt}\n")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    images = json.loads(result.stdout)["steps"][0]["images"]
    assert [(i["card"], i["prompt"]) for i in images] == [("tiny-rl", "a bag"), ("tiny-rl", "a coat"),
                                                          ("tiny-base", "a bag"), ("tiny-base", "a coat")]
    for image in images:
        alone = LoadedCard(str(examples / image["card"])).generate(
            [image["prompt"]], seed=5, steps=3, negative_prompt="a shirt", out=tmp_path / "alone.png")
        assert np.array_equal(pixels(alone.images[0].path)[0], pixels(image["path"])[0])


def test_best_of_n_returns_the_argmax_of_its_recorded_scores(examples, tmp_path):
    path = write(tmp_path, examples, "  pick:\n    best_of_n: {card: EX/tiny-base, reward: EX/tiny-judge, n: 5, "
                                     "prompts: [a bag, a shirt], num: 2, steps: 3}\n")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    images = json.loads(result.stdout)["steps"][0]["images"]
    assert len(images) == 4
    for image in images:
        assert len(image["scores"]) == 5 and int(image["candidate"]) == int(np.argmax(image["scores"]))


def test_a_chain_keeps_more_of_its_input_the_lower_its_strength(examples, tmp_path, monkeypatch):
    # the built-in cards: SDEdit needs a VAE that reconstructs (the tiny cards' is untrained)
    from helpers import REPO

    from cardtool.core.cards import discovery

    monkeypatch.setattr(discovery, "builtin_dir", lambda: REPO / "cards")
    steps = ("  draft:\n    generate: {card: fashion-base, prompts: [a bag, a dress, a sneaker], steps: 20}\n"
             "  light:\n    chain: {input: draft, card: fashion-base-nft, strength: 0.1, seed: 100}\n"
             "  heavy:\n    chain: {input: draft, card: fashion-base-nft, strength: 0.9, seed: 100}\n"
             "  full:\n    chain: {input: draft, card: fashion-base-nft, strength: 1.0}\n"
             "  fresh:\n    generate: {card: fashion-base-nft, prompts: [a bag]}\n")
    result = run(write(tmp_path, examples, steps), tmp_path)
    assert result.exit_code == 0, result.output
    out = {s["step"]: [pixels(i["path"])[0].astype(float) for i in s["images"]]
           for s in json.loads(result.stdout)["steps"]}

    def distance(name):
        return np.mean([np.abs(a - b).mean() for a, b in zip(out[name], out["draft"], strict=True)])

    assert distance("light") < 0.5 * distance("heavy"), (distance("light"), distance("heavy"))
    # strength 1 forgets the input: plain sampling of the same prompt and seed (the first chained image, seed 0)
    assert np.array_equal(out["full"][0], out["fresh"][0])


BAD = {
    "unknown step kind": ("  a:\n    upscale: {card: EX/tiny-base}\n", 6, "steps.a.upscale", "unknown key"),
    "missing output": ("  a:\n    chain: {input: nowhere, card: EX/tiny-base}\n", 6, "steps.a.chain.input",
                       "which no step makes"),
    "cycle": ("  a:\n    chain: {input: b, card: EX/tiny-base}\n  b:\n    chain: {input: a, card: EX/tiny-base}\n",
              8, "steps.b.chain.input", "form a cycle"),
    "n below 1": ("  a:\n    best_of_n: {card: EX/tiny-base, reward: EX/tiny-judge, n: 0, prompts: [a bag]}\n", 6,
                  "steps.a.best_of_n.n", "greater than or equal to 1"),
    "reward not a reward": ("  a:\n    best_of_n:\n      card: EX/tiny-base\n      reward: EX/tiny-base\n      n: 2\n"
                            "      prompts: [a bag]\n", 8, "steps.a.best_of_n.reward", "is not a reward"),
    "two kinds": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x]}\n    chain: {input: a, card: EX/tiny-base}\n",
                  6, "steps.a", "exactly one kind"),
    "no kind": ("  a: {}\n", 5, "steps.a",
                "a step has exactly one kind (generate, chain, parallel, best_of_n); this one has none"),
    "self input": ("  a:\n    chain: {input: a, card: EX/tiny-base}\n", 6, "steps.a.chain.input", "a → a form a cycle"),
    "too many images": ("  a:\n    best_of_n: {card: EX/tiny-base, reward: EX/tiny-judge, n: 1000, prompts: [a, b],"
                        " num: 10}\n", 6, "steps.a.best_of_n", "at most 10,000"),
    "prompts and input": ("  a:\n    parallel: {cards: [EX/tiny-base], prompts: [a], input: a}\n", 6,
                          "steps.a.parallel", "either prompts or an input step"),
    "a card without a loop": ("  a:\n    generate: {card: EX/tiny-judge, prompts: [x]}\n", 6, "steps.a.generate.card",
                              "card 'tiny-judge' has no denoise loop to sample with"),
    "missing card": ("  a:\n    generate: {card: EX/no-such-card, prompts: [x]}\n", 6, "steps.a.generate.card",
                     "cannot be used"),
    # caught before any step runs, not after the steps before it
    "steps beyond the loop's": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], steps: 100000}\n", 6,
                                "steps.a.generate.steps", "less than or equal to 1000"),
    # as strictly as cards: what YAML reads as text or as a boolean is not taken for a number
    "a step count written as text": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], steps: '3'}\n", 6,
                                     "steps.a.generate.steps", "Input should be a valid integer, got '3'"),
    "a boolean for a count": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], num: true}\n", 6,
                              "steps.a.generate.num", "Input should be a valid integer, got True"),
    "unknown solver": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], solver: heun}\n", 6,
                       "steps.a.generate.solver", "'euler', 'dpmpp_2m', 'sde' or 'renoise'"),
    "an interval out of order": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], guidance_interval: [0.5, 0.2]}"
                                 "\n", 6, "steps.a.generate", "must be [LO, HI] with 0 ≤ LO ≤ HI ≤ 1"),
    # generation refuses such a scale (its products run in float32): validation does, where it is written
    "an adapter scale past float32": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], adapters: "
                                      "{invert: 1.0e+39}}\n", 6, "steps.a.generate.adapters.invert",
                                      "a scale of 1e+39 is beyond float32's"),
    "a control scale past float32": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], control: v.png, "
                                     "control_scale: -1.0e+39}\n", 6, "steps.a.generate.control_scale",
                                     "a scale of -1e+39 is beyond float32's range (±3.4e38)"),
    # seeds seed … seed + num − 1 (per prompt) or seed + k (per input image): generate refuses one past 2⁶³ − 1
    "seeds past 2⁶³ by num": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x, y], num: 3, "
                              "seed: 9223372036854775806}\n", 6, "steps.a.generate.seed",
                              "numbers the step's images up to seed 9,223,372,036,854,775,808, past 2⁶³ − 1"),
    "seeds past 2⁶³ by inputs": ("  a:\n    parallel: {cards: [EX/tiny-base, EX/tiny-rl], prompts: [x]}\n  b:\n    "
                                 "chain: {input: a, card: EX/tiny-base, seed: 9223372036854775807}\n", 8,
                                 "steps.b.chain.seed", "up to seed 9,223,372,036,854,775,808, past 2⁶³ − 1"),
    # generate refuses a prompt past 65,536 characters when the step runs: validation does, where it is written
    "a prompt past generate's length": ("  a:\n    parallel: {cards: [EX/tiny-base], prompts: [a, "
                                        + "x" * 65537 + "]}\n", 6, "steps.a.parallel.prompts.1",
                                        "at most 65536 characters"),
    "a negative prompt past its length": ("  a:\n    generate: {card: EX/tiny-base, prompts: [a], negative_prompt: "
                                          + "x" * 65537 + "}\n", 6, "steps.a.generate.negative_prompt",
                                          "at most 65536 characters"),
    # counted through the input: 2 cards × the 6,000 images of step a
    "too many images from an input": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x, y], num: 3000}\n  b:\n"
                                      "    parallel: {cards: [EX/tiny-base, EX/tiny-rl], input: a}\n", 8,
                                      "steps.b.parallel.input", "2 card(s) × the 6,000 images of step 'a' = 12,000 "
                                      "images; a step samples at most 10,000"),
    "a control scale without control": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], control_scale: 0.5}\n",
                                        6, "steps.a.generate", "give control too"),
    "an unknown precision": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], precision: int8}\n", 6,
                             "steps.a.generate.precision", "'float64', 'float32', 'bfloat16' or 'float16'"),
    "control without a ControlNet": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], control: v.png}\n", 6,
                                     "steps.a.generate.control", "has no ControlNet"),
    "control from no input": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], control: input}\n", 6,
                              "steps.a.generate.control", "has no input image to take as its control"),
    "a control image not there": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], control: gone.png}\n", 6,
                                  "steps.a.generate.control", "gone.png is not a file"),
    "an unknown preprocessor": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], control: 'w.yaml:blur'}\n", 6,
                                "steps.a.generate.control", "unknown preprocessor 'blur'"),
    "a mask with no image": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], mask: w.yaml}\n", 6,
                             "steps.a.generate", "mask applies to an image to start from; give image too"),
    "strength 1 with no mask": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], image: w.yaml, strength: 1}"
                                "\n", 6, "steps.a.generate", "strength 1 re-noises the image away entirely"),
    "an image that is not one": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], image: w.yaml}\n", 6,
                                 "steps.a.generate.image", "cannot read image w.yaml: UnidentifiedImageError"),
    "a control image that is not one": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], control: w.yaml}\n",
                                        6, "steps.a.generate.control", "cannot read control image w.yaml"),
    "an image not there": ("  a:\n    generate: {card: EX/tiny-base, prompts: [x], image: gone.png}\n", 6,
                           "steps.a.generate.image", "image gone.png is not a file"),
    "a class the reward cannot read": ("  a:\n    best_of_n:\n      card: EX/tiny-base\n      reward: EX/tiny-judge\n"
                                       "      n: 2\n      prompts: [a bag, something warm]\n", 10,
                                       "steps.a.best_of_n.prompts.1", "'something warm' names no class"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_workflows_are_located_errors_not_tracebacks(examples, tmp_path, case):
    steps, line, field, message = BAD[case]
    path = write(tmp_path, examples, steps)
    for command in (["workflow", "validate", str(path), "--json"], ["workflow", "run", str(path), "--json"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        problems = json.loads(result.stdout)["error"]["problems"]
        hit = next((p for p in problems if p["field"] == field and message in p["message"]), None)
        assert hit is not None, problems
        assert hit["file"].endswith("w.yaml") and hit["line"] == line


def test_the_seed_a_step_past_2_63_is_told_to_give_validates(tmp_path):
    from cardtool.core.workflows.manifest import load_workflow
    from cardtool.errors import CardValidationError

    path = tmp_path / "w.yaml"
    path.write_text(f"{HEAD}  a:\n    generate: {{card: c, prompts: [x, y], num: 3, seed: {2**63 - 2}}}\n")
    with pytest.raises(CardValidationError) as error:
        load_workflow(path, check_cards=False)
    [problem] = error.value.problems
    assert problem.fix == "give a seed of at most 9,223,372,036,854,775,805"
    path.write_text(path.read_text().replace(str(2**63 - 2), str(2**63 - 3)))
    load_workflow(path, check_cards=False)


def test_a_chain_longer_than_pythons_recursion_limit_validates_in_order_and_its_cycle_is_located(examples, tmp_path):
    # written last step first: finding the order walks the whole chain from its end (it once recursed per step)
    chain = [f"  s{i}:\n    chain: {{input: s{i - 1}, card: EX/tiny-base}}\n" for i in range(1, 1500)]
    head = "  s0:\n    generate: {card: EX/tiny-base, prompts: [x]}\n"
    path = write(tmp_path, examples, "".join(chain[::-1]) + head)
    result = CliRunner().invoke(app, ["workflow", "validate", str(path), "--json"])
    assert result.exit_code == 0, result.output[-2000:]
    assert json.loads(result.stdout)["order"] == [f"s{i}" for i in range(1500)]
    plain = CliRunner().invoke(app, ["workflow", "validate", str(path)], env={"COLUMNS": "1000"})
    named = ", ".join(f"s{i} (chain)" for i in range(1499, 1487, -1))
    assert plain.exit_code == 0 and plain.stdout == f"ok      w  (1500 steps: {named}, … 1488 more)\n", plain.stdout
    looped = head.replace("generate: {card: EX/tiny-base, prompts: [x]}", "chain: {input: s1499, card: EX/tiny-base}")
    result = CliRunner().invoke(app, ["workflow", "validate", str(write(tmp_path, examples, "".join(chain) + looped)),
                                      "--json"])
    assert result.exit_code == 1, result.output[-2000:]
    (problem,) = json.loads(result.stdout)["error"]["problems"]
    # the walk starts at the file's first step, s1, and closes the loop at s2's input
    assert problem["field"] == "steps.s2.chain.input" and problem["line"] == 8
    assert problem["message"] == f"steps {' → '.join(f's{i}' for i in [1, 0, *range(1499, 0, -1)])} form a cycle"


EDGES = [  # (step, accepted): a setting at its bound validates, one past it is refused at its field
    ("generate: {card: c, prompts: [a, b], num: 5000}", True),  # prompts × num = 10,000 images: the most a step takes
    ("generate: {card: c, prompts: [a, b], num: 5001}", "steps.s.generate"),
    ("parallel: {cards: [c, d], prompts: [a], num: 5000}", True),
    ("parallel: {cards: [c, d], prompts: [a], num: 5001}", "steps.s.parallel"),
    ("parallel: {cards: [c], prompts: [a, b], num: 5001}", "steps.s.parallel"),
    ("best_of_n: {card: c, reward: r, n: 1000, prompts: [a], num: 10}", True),
    ("best_of_n: {card: c, reward: r, n: 1024, prompts: [a]}", True),
    ("best_of_n: {card: c, reward: r, n: 1025, prompts: [a]}", "steps.s.best_of_n.n"),
    ("generate: {card: c, prompts: [a], guidance: -100, steps: 1000, shift: 0.01}", True),
    ("generate: {card: c, prompts: [a], guidance: 100, shift: 100, guidance_interval: [0, 1]}", True),
    ("generate: {card: c, prompts: [a], guidance: -100.5}", "steps.s.generate.guidance"),
    ("generate: {card: c, prompts: [a], guidance_interval: [0.3, 0.3]}", True),  # CFG at σ = 0.3 alone
    ("generate: {card: c, prompts: [a], guidance_interval: [-0.01, 0.5]}", "steps.s.generate"),
    ("generate: {card: c, prompts: [a], guidance_interval: [0.5]}", "steps.s.generate.guidance_interval"),
    ("generate: {card: c, prompts: [a], guidance_interval: [0.5, 1.01]}", "steps.s.generate"),
    ("generate: {card: c, prompts: [a], guidance_interval: [0, 0.5, 1]}", "steps.s.generate.guidance_interval"),
    ("generate: {card: c, prompts: [a], image: i.png, strength: 0.001, mask: m}", True),
    ("generate: {card: c, prompts: [a], image: i.png, strength: 1, mask: m.png}", True),
    ("generate: {card: c, prompts: [a], image: i.png, strength: 1.01, mask: m.png}", "steps.s.generate.strength"),
    ("generate: {card: c, prompts: [a], image: i.png, strength: 0}", "steps.s.generate.strength"),
    ("chain: {input: t, card: c, strength: 1}", True),
    ("chain: {input: t, card: c, strength: 1.01}", "steps.s.chain.strength"),
    ("parallel: {input: t, cards: [c], strength: 1}", True),
    ("parallel: {input: t, cards: [c], strength: 1.01}", "steps.s.parallel.strength"),
    ("parallel: {input: t, cards: []}", "steps.s.parallel.cards"),
    ("generate: {card: c, prompts: [a], num: 1, image: i, mask: m, control: x}", True),  # one character a name
    ("generate: {card: c, prompts: [a], num: 0}", "steps.s.generate.num"),
    ("generate: {card: c, prompts: [a], num: '4'}", "steps.s.generate.num"),  # strict: text is not a number
    ("generate: {card: c, prompts: [a], image: ''}", "steps.s.generate.image"),
    ("parallel: {cards: [c], prompts: [a], num: 1}", True),
    ("parallel: {cards: [c], prompts: [a], num: 0}", "steps.s.parallel.num"),
]


@pytest.mark.parametrize("step, accepted", EDGES)
def test_a_steps_settings_are_accepted_up_to_their_bounds_and_refused_past_them(tmp_path, step, accepted):
    from cardtool.core.workflows.manifest import load_workflow
    from cardtool.errors import CardValidationError

    path = tmp_path / "w.yaml"
    path.write_text(f"{HEAD}  t:\n    generate: {{card: c, prompts: [a]}}\n  s:\n    {step}\n")
    if accepted is True:
        load_workflow(path, check_cards=False)
        return
    with pytest.raises(CardValidationError) as error:
        load_workflow(path, check_cards=False)
    assert [p.field for p in error.value.problems] == [accepted]


def test_a_steps_defaults_and_card_paths_relative_to_the_workflow(examples, tmp_path, monkeypatch):
    """Unset, a step makes one image a prompt and a chain or parallel refinement re-noises to σ = 0.5; a card named by
    a path (`cards/tiny-base`, `./cards/tiny-base`) is found beside the workflow, wherever it is run from."""
    from cardtool.core.workflows.manifest import load_workflow

    folder = tmp_path / "flows"
    (folder / "cards").mkdir(parents=True)
    (folder / "cards" / "tiny-base").symlink_to(examples / "tiny-base")
    path = folder / "w.yaml"
    path.write_text(f"{HEAD}  t:\n    generate: {{card: cards/tiny-base, prompts: [a bag]}}\n"
                    "  c:\n    chain: {input: t, card: ./cards/tiny-base}\n"
                    "  p:\n    parallel: {input: t, cards: [cards/tiny-base]}\n")
    monkeypatch.chdir(tmp_path)
    steps = load_workflow(path).manifest.steps
    assert (steps["t"].generate.num, steps["t"].generate.guidance, steps["t"].generate.seed) == (1, None, 0)
    assert steps["c"].chain.strength == 0.5 and steps["p"].parallel.strength == 0.5 and steps["p"].parallel.num == 1


def test_a_card_and_an_image_named_from_the_home_folder(examples, tmp_path, monkeypatch):
    """`card: ~/cards/tiny-base` was looked for in a folder named ~ beside the workflow, as was `image: ~/start.png`."""
    home = tmp_path / "home"
    (home / "cards").mkdir(parents=True)
    (home / "cards" / "tiny-base").symlink_to(examples / "tiny-base")
    LoadedCard(str(examples / "tiny-base")).generate("a boot", steps=2, out=home / "start.png")
    monkeypatch.setenv("HOME", str(home))
    path = write(tmp_path, examples, "  t:\n    generate: {card: ~/cards/tiny-base, prompts: [a bag], steps: 2, "
                 "image: ~/start.png, strength: 0.5}\n")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    (made,) = json.loads(result.stdout)["steps"][0]["images"]
    assert made["card"] == "tiny-base" and made["image"]["source"] == str(home / "start.png")


def test_an_adapter_a_card_does_not_declare_is_refused_naming_the_loras_it_does(examples, tmp_path):
    from cardtool.core.workflows.manifest import load_workflow
    from cardtool.errors import CardValidationError

    path = write(tmp_path, examples, "  a:\n    generate: {card: EX/tiny-base, prompts: [x], adapters: {nope: 1}}\n")
    with pytest.raises(CardValidationError) as error:
        load_workflow(path)
    hit = next(p for p in error.value.problems if p.field == "steps.a.generate.adapters.nope")
    assert hit.message == "card 'tiny-base' declares no LoRA 'nope'" and hit.fix == "name one of its LoRAs: invert"


def test_an_unknown_key_in_a_step_lists_the_keys_of_its_kind(examples, tmp_path):
    """A chain takes its prompts from its input: `prompts` there is refused with what a chain does take."""
    from cardtool.core.workflows.manifest import load_workflow
    from cardtool.errors import CardValidationError

    path = write(tmp_path, examples, "  a:\n    generate: {card: EX/tiny-base, prompts: [x]}\n"
                                     "  b:\n    chain: {input: a, card: EX/tiny-base, prompts: [y]}\n")
    with pytest.raises(CardValidationError) as error:
        load_workflow(path)
    [problem] = error.value.problems
    assert (problem.field, problem.message) == ("steps.b.chain.prompts", "unknown key")
    assert problem.fix.startswith("remove it; allowed here: steps, guidance,") and problem.fix.endswith(
        "input, card, strength")


def test_a_toml_workflow_and_a_set_override(examples, tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(f'schema = "cardtool/v1"\nkind = "workflow"\nid = "t"\n[steps.one.generate]\n'
                    f'card = "{examples}/tiny-base"\nprompts = ["a bag"]\nsteps = 2\n')
    result = run(path, tmp_path, "--set", "steps.one.generate.num=3")
    assert result.exit_code == 0, result.output
    assert [i["seed"] for i in json.loads(result.stdout)["steps"][0]["images"]] == ["0", "1", "2"]
    other = run(path, tmp_path, "--set", "steps.one.generate.steps=3")
    assert other.exit_code == 0, other.output
    assert len(list((tmp_path / "out" / "t" / "one").glob("*.png"))) == 4, "a run with other settings keeps the first's"
    bad = run(path, tmp_path, "--set", "steps.one.generate.num=0")
    assert bad.exit_code == 1 and json.loads(bad.stdout)["error"]["problems"][0]["field"] == "steps.one.generate.num"


def test_a_chain_over_images_of_another_size_is_a_located_error(examples, tmp_path):
    """A card taking 20×20 images cannot refine (or take as its control) a step's 28×28 ones: its VAE re-encodes
    them, which failed in the re-noising after the steps before had run. The loop refuses them too (the API's way)."""
    import shutil

    from cardtool.errors import BadInput

    small = shutil.copytree(examples / "tiny-base", examples / "tiny-small")
    text = (small / "card.yaml").read_text().replace("id: tiny-base", "id: tiny-small")
    (small / "card.yaml").write_text(text.replace("{latent_channels: 4,", "{latent_channels: 4, image_size: 20,"))
    path = write(tmp_path, examples, "  a:\n    generate: {card: EX/tiny-base, prompts: [x], steps: 2}\n"
                                     "  b:\n    chain: {input: a, card: EX/tiny-small, steps: 2}\n")
    result = CliRunner().invoke(app, ["workflow", "validate", str(path), "--json"])
    problem = json.loads(result.stdout)["error"]["problems"][0]
    assert result.exit_code == 1 and (problem["field"], problem["line"]) == ("steps.b.chain.input", 8)
    assert problem["message"] == (f"card '{small}' takes 20×20 images; step 'a' makes 28×28 ones "
                                  f"(card '{examples}/tiny-base')")
    with pytest.raises(BadInput, match="card 'tiny-small' takes 20×20 images, got 28×28"):
        LoadedCard(str(small)).loop().encode(np.zeros((1, 28, 28), np.uint8))


def test_a_step_takes_an_adapter_stack_and_its_images_record_it(tmp_path, examples):
    steps = """  plain:
    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 2}
  tuned:
    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 2, adapters: {invert: 0.5}}
"""
    result = run(write(tmp_path, examples, steps), tmp_path)
    assert result.exit_code == 0, result.output
    plain, tuned = (json.loads(result.stdout)["steps"][i]["images"][0] for i in (0, 1))
    (a, _), (b, text) = pixels(plain["path"]), pixels(tuned["path"])
    assert [(x["name"], x["scale"]) for x in json.loads(text["adapters"])] == [("invert", 0.5)]
    assert not np.array_equal(a, b)
    bad = write(tmp_path, examples, steps.replace("invert: 0.5", "outline: 1"), name="bad.yaml")
    checked = CliRunner().invoke(app, ["workflow", "validate", str(bad)])
    assert checked.exit_code == 1 and "steps.tuned.generate.adapters.outline" in checked.output
    assert "declares no LoRA 'outline'" in checked.output


def test_a_disk_failing_at_a_later_step_keeps_the_finished_steps_listed(examples, tmp_path, monkeypatch):
    import errno

    from cardtool.core.sampling import outputs

    real = outputs.save_png

    def full_at_step_two(path, *args, **kwargs):
        if "/two/" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(outputs, "save_png", full_at_step_two)
    path = write(tmp_path, examples, """  one:
    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 2}
  two:
    chain: {input: one, card: EX/tiny-base, strength: 0.5, steps: 2}
""")
    result = run(path, tmp_path)
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed" and "No space left on device" in error["message"]
    [finished] = error["partial"]["steps"]
    assert finished["step"] == "one" and all(Path(i["path"]).is_file() for i in finished["images"])

    # failing inside a step, after a wave: the images it wrote are listed
    written = []

    def full_after_one(path, *args, **kwargs):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(outputs, "save_png", full_after_one)
    result = run(path, tmp_path / "again", "--max-batch", "1", "--set", "steps.one.generate.num=2")
    assert result.exit_code == 1, result.output
    [stopped] = json.loads(result.stdout)["error"]["partial"]["steps"]
    assert [Path(i["path"]) for i in stopped["images"]] == written

    # failing at the first image: nothing to list
    monkeypatch.setattr(outputs, "save_png", lambda path, *args, **kwargs: full_at_step_two(
        Path(str(path).replace("/one/", "/two/")), *args, **kwargs))
    result = run(path, tmp_path / "third")
    assert result.exit_code == 1, result.output
    assert "partial" not in json.loads(result.stdout)["error"], result.stdout


def test_a_rerun_whose_input_step_changed_writes_its_refined_images_beside_the_old_ones(examples, tmp_path):
    """A chain's image is named by a tag that takes its input's: other drafts are other refinements, not overwrites."""
    steps = """  draft:
    generate: {card: EX/tiny-base, prompts: ["a bag", "a coat"], steps: 2, seed: SEED}
  refine:
    chain: {input: draft, card: EX/tiny-base, strength: 0.5, steps: 2}
"""
    reports = []
    for seed in (0, 1):
        result = run(write(tmp_path, examples, steps.replace("SEED", str(seed))), tmp_path)
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.stdout)["steps"])
    for draft, refine in reports:
        for source, refined in zip(draft["images"], refine["images"], strict=True):
            assert pixels(refined["path"])[1]["input_tag"] == pixels(source["path"])[1]["tag"]
    assert len(list((tmp_path / "out" / "w" / "refine").glob("*.png"))) == 4, "both runs' refinements are kept"


def test_skip_existing_keeps_each_image_written_with_its_settings_and_makes_only_the_others(examples, tmp_path):
    """A best-of image is named by its request, N and reward, not by its pick: known before sampling, so kept too."""
    path = write(tmp_path, examples, """  draft:
    generate: {card: EX/tiny-base, prompts: ["a bag", "a coat"], steps: 2}
  refine:
    chain: {input: draft, card: EX/tiny-base, strength: 0.5, steps: 2}
  pick:
    best_of_n: {card: EX/tiny-base, reward: EX/tiny-judge, n: 3, prompts: ["a sneaker", "a dress"], steps: 2}
""")
    first = json.loads(run(path, tmp_path).stdout)["steps"]
    files = {s["step"]: [Path(i["path"]) for i in s["images"]] for s in first}
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for paths in files.values() for p in paths}
    files["refine"][1].unlink()
    files["pick"][0].unlink()
    files["draft"][0].write_bytes(files["draft"][1].read_bytes())  # another image under its name: not kept
    again = run(path, tmp_path, "--skip-existing")
    assert again.exit_code == 0, again.output
    steps = json.loads(again.stdout)["steps"]
    assert [s["kept"] for s in steps] == [1, 1, 1]
    assert steps == [{**s, "seconds": a["seconds"], "kept": a["kept"]} for s, a in zip(first, steps, strict=True)]
    for p, (data, _) in before.items():
        assert p.read_bytes() == data, p
    kept = [files["draft"][1], files["refine"][0], files["pick"][1]]
    assert all(p.stat().st_mtime_ns == before[p][1] for p in kept), "kept images are not written again"

    # the draft made again under other settings: its refinements are other images; n is part of best-of's name
    other = run(path, tmp_path, "--skip-existing", "--set", "steps.draft.generate.seed=5",
                "--set", "steps.pick.best_of_n.n=2")
    assert [s["kept"] for s in json.loads(other.stdout)["steps"]] == [0, 0, 0]
    plain = run(path, tmp_path)
    assert [s["kept"] for s in json.loads(plain.stdout)["steps"]] == [0, 0, 0], "without the flag all are made"
    from cardtool.core.workflows.run import run_workflow

    assert [s["kept"] for s in run_workflow(path, out=tmp_path / "out").steps] == [0, 0, 0], "nor by the API's default"


def test_a_step_samples_as_generate_does_with_a_precision_an_interval_and_a_control_image(examples, tmp_path):
    """A ControlNet card in a workflow: a control image beside the workflow, or each input image (its silhouette) as
    the control of its own output — the draft's shape kept, the rest sampled anew (strength 1)."""
    from helpers import write_control_card

    from cardtool.core.sampling.control import ControlImage
    from cardtool.core.sampling.images import save_png

    card = write_control_card(tmp_path / "tiny-control", str(examples / "tiny-base"))
    shape = np.zeros((28, 28), np.uint8)
    shape[4:24, 8:20] = 200
    save_png(tmp_path / "shape.png", shape)
    steps = f"""  draft:
    generate: {{card: EX/tiny-base, prompts: ["a bag"], num: 2, steps: 2, precision: bfloat16,
                guidance_interval: [0, 0.5]}}
  shaped:
    generate: {{card: {card}, prompts: ["a coat"], steps: 2, control: shape.png, control_scale: 0.5}}
  unshaped:
    generate: {{card: {card}, prompts: ["a coat"], steps: 2, control: shape.png, control_scale: 0}}
  restyled:
    chain: {{input: draft, card: {card}, steps: 2, strength: 1, control: "input:edges"}}
"""
    result = run(write(tmp_path, examples, steps), tmp_path)
    assert result.exit_code == 0, result.output
    made = {s["step"]: [pixels(i["path"]) for i in s["images"]] for s in json.loads(result.stdout)["steps"]}
    draft = made["draft"]
    assert [(m["precision"], m["guidance_interval"]) for _, m in draft] == [("bfloat16", "0.0,0.5")] * 2
    control = json.loads(made["shaped"][0][1]["control"])
    assert control["sha256"] == ControlImage.make(shape, "silhouette").digest
    assert json.loads(made["shaped"][0][1]["adapters"])[0]["scale"] == 0.5
    assert not np.array_equal(made["shaped"][0][0], made["unshaped"][0][0]), "the control image changed the image"
    for (source, _), (_, metadata) in zip(draft, made["restyled"], strict=True):
        control = json.loads(metadata["control"])
        assert (control["preprocessor"], control["sha256"]) == ("edges", ControlImage.make(source, "edges").digest)
    # --like makes a restyled image again: its input, found beside it, is its control image (strength 1: no start)
    restyled = json.loads(result.stdout)["steps"][3]["images"][1]["path"]
    again = CliRunner().invoke(app, ["generate", str(card), "--like", restyled, "--out", str(tmp_path / "again.png")])
    assert again.exit_code == 0 and "not made again" not in again.output, again.output
    assert np.array_equal(pixels(tmp_path / "again.png")[0], pixels(restyled)[0])


def test_a_generate_step_starts_from_an_image_file_or_inpaints_it_as_generate_does(examples, tmp_path):
    from cardtool.core.sampling.images import save_png

    loaded = LoadedCard(str(examples / "tiny-base"))
    start = loaded.generate("a boot", steps=2, out=tmp_path / "start.png").images[0]
    mask = np.zeros((28, 28), np.uint8)
    mask[14:] = 255
    save_png(tmp_path / "bottom.png", mask)
    steps = """  refined:
    generate: {card: EX/tiny-base, prompts: ["a bag", "a coat"], steps: 3, image: start.png, strength: 0.6}
  inpainted:
    generate: {card: EX/tiny-base, prompts: ["a bag"], num: 2, steps: 3, image: start.png, mask: bottom.png}
  again:
    chain: {input: inpainted, card: EX/tiny-base, steps: 3, strength: 0.5}
"""
    result = run(write(tmp_path, examples, steps), tmp_path)
    assert result.exit_code == 0, result.output
    made = {s["step"]: s["images"] for s in json.loads(result.stdout)["steps"]}
    assert [i["strength"] for i in made["refined"]] == ["0.6", "0.6"] and "strength" not in made["inpainted"][0]
    assert made["inpainted"][0]["mask"]["source"] == str(tmp_path / "bottom.png")
    for name, options, prompts, num in (("refined", {"strength": 0.6}, ["a bag", "a coat"], 1),
                                        ("inpainted", {"mask": mask}, ["a bag"], 2)):
        alone = loaded.generate(prompts, num=num, steps=3, image=start.pixels, out=None, **options).images
        assert all(np.array_equal(pixels(i["path"])[0], a.pixels) for i, a in zip(made[name], alone, strict=True)), \
            f"step '{name}' makes what generate makes from the same image"
    like = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "--like", made["inpainted"][1]["path"],
                                    "--out", str(tmp_path / "like.png")])
    assert like.exit_code == 0 and np.array_equal(pixels(tmp_path / "like.png")[0],
                                                  pixels(made["inpainted"][1]["path"])[0]), like.output
    assert len(made["again"]) == 2


def test_a_run_says_what_generate_would_warn_of_once_each(examples, tmp_path):
    """A step count the card does not assume (tiny-distilled assumes 4), said once though two steps sample so."""
    path = write(tmp_path, examples, """  one:
    generate: {card: EX/tiny-distilled, prompts: ["a bag"], steps: 2}
  two:
    generate: {card: EX/tiny-distilled, prompts: ["a coat"], steps: 2}
  three:
    generate: {card: EX/tiny-distilled, prompts: ["a coat"]}
""")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warnings"] == [
        "card 'tiny-distilled' assumes 4 steps; sampling with 2 may give poor images"]
    assert "warning card 'tiny-distilled' assumes 4 steps" in result.stderr


def test_a_best_of_n_prompt_naming_no_garment_is_warned_of_with_the_class_the_reward_reads(examples, tmp_path):
    from helpers import reading_judge

    reading_judge(examples)
    path = write(tmp_path, examples, """  pick:
    best_of_n: {card: EX/tiny-base, reward: EX/tiny-reader, n: 2, prompts: ["flip-flops", "a bag"], steps: 2}
""")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warnings"] == [
        "1 prompt(s) name no garment, and reward 'tiny-reader' reads them by the nearest phrasing it knows: "
        "'flip-flops' as sandal; name the garment where that is not the one meant"]


def test_a_chain_whose_start_lies_below_its_guidance_interval_is_warned_of_as_generate_does(examples, tmp_path):
    """At 4 steps (σ 1, 0.75, 0.5, 0.25) the interval 0.7,0.8 guides the draft's second step, but a chain at
    strength 0.5 runs only the last two: its guidance applies to none — said once, with where it started."""
    path = write(tmp_path, examples, """  draft:
    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 4, guidance: 4, guidance_interval: [0.7, 0.8]}
  refine:
    chain: {input: draft, card: EX/tiny-base, strength: 0.5, steps: 4, guidance: 4, guidance_interval: [0.7, 0.8]}
""")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warnings"] == [
        "no step's σ lies in the guidance interval 0.7,0.8 (4 steps on shift 1, from σ 0.5 at strength 0.5): guidance "
        "4 applies to none, and the images are those of guidance 1; widen the interval"]


def test_repeated_prompts_and_a_card_named_twice_in_parallel_are_warned_of(examples, tmp_path):
    """The same prompt twice, or one card twice in a fan-out (by folder and by manifest), makes the same images."""
    path = write(tmp_path, examples, """  fan:
    parallel: {cards: [EX/tiny-base, EX/tiny-rl, EX/tiny-base/card.yaml], prompts: ["a bag", "a bag"], steps: 2}
""")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warnings"] == [
        f"step 'fan': card {examples}/tiny-base/card.yaml is in its cards twice; the same requests make the same "
        "images again",
        "prompt 'a bag' is given 2 times: each time with seed 0, so its images repeat bit for bit; -n/--num N makes N "
        "images of a prompt from N seeds"]


def test_a_run_for_people_lists_each_image_and_says_its_progress_on_stderr(examples, tmp_path):
    path = write(tmp_path, examples, """  draft:
    generate: {card: EX/tiny-base, prompts: ["a bag"], num: 2, steps: 1}
  pick:
    best_of_n: {card: EX/tiny-base, reward: EX/tiny-judge, n: 2, prompts: ["a sneaker"], steps: 1}
""")
    result = CliRunner().invoke(app, ["workflow", "run", str(path), "--out", str(tmp_path / "out"), "--max-batch",
                                      "1"])  # two waves of one image
    assert result.exit_code == 0, result.output
    *lines, picked = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.endswith(f"  (draft: 'a bag', seed {seed})") for line, seed in zip(
        lines, (0, 1), strict=True)) and all(Path(line.split("  (")[0]).is_file() for line in lines), lines
    assert "  (pick: 'a sneaker', seed 0, best of 2: " in picked, picked
    assert "step draft: 1 of 2 images" in result.stderr and "step draft (generate): 2 images in " in result.stderr


def test_a_prompt_past_the_text_encoders_tokens_is_warned_of_with_its_step(examples, tmp_path):
    long = "a dark grey pullover with long sleeves and a round neck on a white background"
    path = write(tmp_path, examples, f"""  draft:
    generate: {{card: EX/tiny-base, prompts: ["a bag", "{long}"], steps: 1}}
  again:
    parallel: {{cards: [EX/tiny-rl], prompts: ["{long}"], steps: 1}}
  negative:
    generate: {{card: EX/tiny-base, prompts: ["a coat"], negative_prompt: "{long}", guidance: 3, steps: 1}}
  unguided:
    generate: {{card: EX/tiny-base, prompts: ["a coat"], negative_prompt: "{long}", guidance: 1, steps: 1}}
""")
    result = run(path, tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warnings"] == [
        f"step '{step}': a prompt fills all 16 tokens the text encoder reads (its max_length): words past them do not "
        f"reach the model — {long[:59] + '…'!r}; shorten it" for step in ("draft", "again", "negative")] + [
        "a negative prompt conditions CFG's unconditional branch; with guidance 1 (no CFG) it changes nothing"], \
        "a negative prompt is read where guidance uses it"


def test_validation_loads_each_card_once_however_many_steps_name_it(examples, tmp_path, monkeypatch):
    """6,000 chained steps on one card loaded it 6,000 times (11 s); once is enough."""
    from cardtool.core.cards import loader

    calls, real = [], loader.load_card
    monkeypatch.setattr(loader, "load_card", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    steps = '  s0:\n    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 1}\n' + "".join(
        f"  s{i}:\n    chain: {{input: s{i - 1}, card: EX/tiny-base, strength: 0.5, steps: 1}}\n" for i in range(1, 50))
    result = CliRunner().invoke(app, ["workflow", "validate", str(write(tmp_path, examples, steps)), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"], result.output
    assert len(calls) == 1, calls[:3]


def fail_wave(monkeypatch, wave: int, error: Exception) -> None:
    """workflow run's sampling raises `error` at its `wave`-th call and samples as it does at the others."""
    from cardtool.core.workflows import run as workflow_run

    real, calls = workflow_run.sample, []

    def sample(*args, **kwargs):
        calls.append(1)
        if len(calls) == wave:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(workflow_run, "sample", sample)


def test_memory_running_out_mid_step_is_a_failed_run_listing_the_images_written(examples, tmp_path, monkeypatch):
    fail_wave(monkeypatch, 2, RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                           "163840000 bytes"))
    path = write(tmp_path, examples, '  one:\n    generate: {card: EX/tiny-base, prompts: ["a bag"], num: 4, '
                                     'steps: 1}\n')
    result = run(path, tmp_path, "--max-batch", "2")
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed" and error["message"].startswith("out of memory (")
    [step] = error["partial"]["steps"]
    assert len(step["images"]) == 2 and all(Path(i["path"]).is_file() for i in step["images"])


NUMPY_RUNS = {
    "chain": "    chain: {input: one, card: EX/tiny-base, strength: 0.5, steps: 2}",
    "best_of_n": '    best_of_n: {card: EX/tiny-base, reward: EX/tiny-judge, n: 2, prompts: ["a bag"], steps: 2}',
    # inpainting at strength 1 still encodes the image it keeps part of
    "inpaint": f'    generate: {{card: EX/tiny-base, prompts: ["a bag"], steps: 2, image: {WORKFLOWS}/dress.png, '
               f'mask: {WORKFLOWS}/bottom-half.png, strength: 1}}',
    "lora": '    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 2, adapters: {invert: 0.5}}'}


@pytest.mark.parametrize("kind", list(NUMPY_RUNS))
def test_numpy_runs_a_step_that_encodes_an_image_or_judges_as_torch_does(examples, tmp_path, kind):
    """numpy has the VAE's encoder, the judge's classifier and the DiT's adapters (their reference forwards): a
    chain, an inpainting step, best-of-N and a LoRA run there and make torch's images."""
    workflow = write(tmp_path, examples, '  one:\n    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 2}\n'
                                         f"  two:\n{NUMPY_RUNS[kind]}\n")
    made = {}
    for device in ("cpu", "numpy"):  # cpu first: numpy reads the prompts' features from the cache it fills
        result = run(workflow, tmp_path / device, "--device", device)
        assert result.exit_code == 0 and json.loads(result.stdout)["platform"].startswith(device), result.output
        images = [image for step in json.loads(result.stdout)["steps"] for image in step["images"]]
        made[device] = [np.asarray(Image.open(image["path"]), dtype=int) for image in images]
    assert len(made["numpy"]) == len(made["cpu"]) == 2
    assert all(np.abs(a - b).max() <= 1 for a, b in zip(made["cpu"], made["numpy"], strict=True))


@pytest.mark.parametrize("step, said", [
    # a text encoder numpy cannot run (its is BERT's; another kind simulated): the prompts come from the cache, and
    # the advice is an option every command takes (`workflow run` has no --precision)
    ('    generate: {card: EX/tiny-base, prompts: ["a coat"], steps: 2}', "the numpy platform runs no text encoder of "
     "this kind and reads encoded prompts from the cache, which holds none of 'a coat'; run the same command once with "
     "--device cpu to encode them (at float32), then again on numpy"),
])
def test_a_step_the_platform_cannot_run_is_refused_before_the_first_image(examples, tmp_path, monkeypatch, step, said):
    from cardtool.backends import numpy_hf_encoder
    from cardtool.backends.registry import NoCellAvailable

    def other_kind(self, folder, max_length, dtype):
        raise NoCellAvailable(f"numpy's text encoder is BERT's; {folder} holds 'roberta'")

    monkeypatch.setattr(numpy_hf_encoder.NumpyBertEncoder, "__init__", other_kind)
    one = '  one:\n    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 2}\n'
    encoded = run(write(tmp_path, examples, one, "encode.yaml"), tmp_path / "cpu", "--device", "cpu")
    assert encoded.exit_code == 0, encoded.output  # numpy reads the prompts' features from the cache
    path = write(tmp_path, examples, f"{one}  two:\n{step}\n")
    result = run(path, tmp_path, "--device", "numpy")
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert error["message"].startswith(f"step 'two': {said}"), error["message"]
    assert "partial" not in error and not list((tmp_path / "out").rglob("*.png"))
    alone = run(write(tmp_path, examples, one, "alone.yaml"), tmp_path, "--device", "numpy")
    assert alone.exit_code == 0, alone.output  # what numpy can run, it runs


def test_a_request_refused_mid_step_names_the_step_and_lists_the_images_written(examples, tmp_path, monkeypatch):
    from cardtool.errors import BadInput

    fail_wave(monkeypatch, 3, BadInput("not this one"))
    path = write(tmp_path, examples, '  one:\n    generate: {card: EX/tiny-base, prompts: ["a bag"], steps: 1}\n'
                                     '  two:\n    generate: {card: EX/tiny-base, prompts: ["a bag"], num: 4, '
                                     'steps: 1}\n')
    result = run(path, tmp_path, "--max-batch", "2")
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert error["message"] == "step 'two': not this one"
    one, two = error["partial"]["steps"]
    assert (one["step"], len(one["images"]), two["step"], len(two["images"])) == ("one", 1, "two", 2)
    assert all(Path(i["path"]).is_file() for step in (one, two) for i in step["images"])
