"""`cardtool generate CARD -p PROMPT …` — sample images with the card's own loop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import UNDECODED, LateProgress, counted, emit_json, handled, quoted_prompt, say, warn
from cardtool.errors import BadInput


def generate_command(
    card: Annotated[str | None, typer.Argument(
        help="A card id, card folder or manifest file (default with --like: the image's card).")] = None,
    prompt: Annotated[list[str] | None, typer.Option("-p", "--prompt", help="A prompt; repeat for more.")] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompts-file",
                                                      help="One prompt a line; - reads standard input.")] = None,
    negative_prompt: Annotated[str | None, typer.Option(
        "--negative-prompt", help="What the images should not be: CFG steers away from it instead of from the "
        "empty prompt.")] = None,
    num: Annotated[int, typer.Option("-n", "--num", help="Images per prompt (seeds seed, seed+1, …).")] = 1,
    seed: Annotated[int | None, typer.Option("--seed", help="The first seed (default 0).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Sampling steps (default: the card's).")] = None,
    guidance: Annotated[float | None, typer.Option("--guidance", help="CFG scale; 1 turns CFG off.")] = None,
    guidance_interval: Annotated[str | None, typer.Option(
        "--guidance-interval", metavar="LO,HI", help="σ range of the steps using CFG (default: the card's).")] = None,
    shift: Annotated[float | None, typer.Option("--shift", help="σ-grid shift (SD3 / Wan).")] = None,
    solver: Annotated[str | None, typer.Option(
        "--solver", help="euler (ODE), dpmpp_2m (the ODE, second order: DPM-Solver++ 2M), sde "
        "(Flow-GRPO SDE) or renoise (DMD2 few-step: x̂0, re-noised).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="Override the device (cuda, cpu, numpy).")] = None,
    precision: Annotated[str | None, typer.Option(
        "--precision", help="float32, bfloat16 or float16 (mixed: float32 weights, low-precision products), "
        "float64 (default: the card's).")] = None,
    best_of: Annotated[int | None, typer.Option("--best-of", help="Sample N candidates per image and keep the one "
                                                "the --reward card scores highest (all scores go in the metadata).")
                       ] = None,
    reward: Annotated[str | None, typer.Option("--reward", help="The reward card that scores best-of-N candidates "
                                               "(fashion-classifier).")] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        "--adapter", metavar="NAME[=SCALE]", help="An adapter the card declares, at SCALE (default 1); repeat to "
        "compose LoRAs. Replaces the card's default stack; NAME=0 turns one off.")] = None,
    fuse: Annotated[bool, typer.Option("--fuse", help="Merge the stack's LoRAs into the base weights for this run "
                                       "(restored after); faster when every image shares the stack.")] = False,
    control: Annotated[str | None, typer.Option(
        "--control", metavar="IMAGE[:PREPROCESSOR]", help="A control image for the card's ControlNet; "
        "PREPROCESSOR is silhouette, edges or none (default: the ControlNet's own).")] = None,
    control_scale: Annotated[float | None, typer.Option(
        "--control-scale", help="The ControlNet's conditioning scale (default 1).")] = None,
    init: Annotated[list[Path] | None, typer.Option(
        "--image", metavar="IMAGE", help="Start from this image (image-to-image, SDEdit): re-noised to --strength, "
        "then denoised toward the prompt; repeat to give each prompt its own, in order.")] = None,
    strength: Annotated[float | None, typer.Option(
        "--strength", help="The σ --image is re-noised to, in (0, 1): lower keeps more of it (default 0.8; with "
        "--mask up to 1, the default).")] = None,
    mask: Annotated[list[Path] | None, typer.Option(
        "--mask", metavar="MASK", help="Inpaint --image: the mask's white part is generated anew, its black part "
        "kept; repeat to give each prompt its own.")] = None,
    max_batch: Annotated[int, typer.Option(
        "--max-batch", help="Model rows per forward (a guided request takes two), and requests per written wave; "
        "lower it to save memory.")] = 128,
    out: Annotated[Path, typer.Option("--out", help="Output folder, or NAME.png for one image.")] = Path("outputs"),
    grid: Annotated[bool, typer.Option("--grid", help="Also write a labelled grid of all images.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Refuse a step count the card does not assume.")] = False,
    like: Annotated[Path | None, typer.Option(
        "--like", metavar="IMAGE", help="Make an image cardtool made again: its card, prompt, seed and settings, "
        "each option given here changing one (--seed, -p …); another CARD keeps only the prompt and seed.")] = None,
    skip_existing: Annotated[bool, typer.Option(
        "--skip-existing", help="Keep each image already in --out with this call's settings (an interrupted run's) "
        "and make only the others.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")] = False,
) -> None:
    """Generate images; each PNG carries its card, weights versions, prompt, seed and settings."""
    from cardtool.core.sampling.adapters import parse_adapter
    from cardtool.core.sampling.control import parse_control
    from cardtool.core.sampling.generate import generate
    from cardtool.core.sampling.planning import parse_interval, read_prompts_file

    with handled(json_):
        prompts = [typed(p) for p in prompt or []] + (read_prompts_file(prompts_file) if prompts_file else [])
        negative_prompt = typed(negative_prompt) if negative_prompt is not None else None
        shown = {"enabled": not json_ or not sys.stderr.isatty(), "terminal": sys.stderr.isatty()}
        progress, encoding = LateProgress(**shown), LateProgress(**shown, what="encoding prompts", unit="prompts")
        try:
            asked = {"seed": seed, "negative_prompt": negative_prompt, "steps": steps, "guidance": guidance,
                     "shift": shift, "solver": solver, "precision": precision, "best_of": best_of, "reward": reward,
                     "guidance_interval": parse_interval(guidance_interval) if guidance_interval is not None else None,
                     "adapters": [parse_adapter(a) for a in adapter] if adapter else None, "strength": strength}
            image, preprocessor = parse_control(control) if control is not None else (None, None)
            model, start, keep = None, init, mask
            if like is not None:
                model, card, prompts, recorded, image, preprocessor, start, keep = _like(
                    like, card, prompts, image, preprocessor, init, mask)
                asked = {**recorded, **{k: v for k, v in asked.items() if v is not None}}
                fuse = asked.pop("fuse", False) or fuse  # popped whatever --fuse says: passed once below
            if card is None:
                raise BadInput("give a CARD to generate with (or --like IMAGE, whose card it reuses)")
            report = generate(card, prompts, num=num, device=device, max_batch=max_batch, out=out, grid=grid,
                              control=image, preprocessor=preprocessor, control_scale=control_scale, fuse=fuse,
                              image=_one_or_each(start), mask=_one_or_each(keep),
                              strict=strict, on_step=progress, on_encode=encoding, skip_existing=skip_existing,
                              **{**_DEFAULTS, **{k: v for k, v in asked.items() if v is not None}})
        finally:
            encoding.stop()
            progress.stop()
    if report.rank != 0:  # under torchrun rank 0 reports for every rank
        return
    if model is not None and report.images and report.card == model.card:
        from cardtool.core.sampling.like import unlike

        given = {"control": control, "image": init, "mask": mask}  # a file given here in place of the recorded one
        differ = [d for d in unlike(model, report.images[0].metadata) if given.get(d) is None]
        if differ:
            report.warnings.append(f"{model.path.name} and this run differ in {'; '.join(differ)}: its image is not "
                                   "made again bit for bit")
    for warning in report.warnings:
        warn(warning)
    if json_:
        emit_json(report.to_json())
        return
    for image in report.images:
        scored = f", best of {image.metadata['best_of']} by {image.metadata['reward']}" if "reward" in image.metadata \
            else ""
        say(f"{image.path}  ({quoted_prompt(image.metadata['prompt'])}, seed {image.metadata['seed']}{scored})")
    if report.grid:
        say(f"{report.grid}  (grid)")
    count = counted(len(report.images), "image") + (f" ({report.skipped} already there)" if report.skipped else "")
    made = len(report.images) - report.skipped
    rate = f"{made / report.seconds:.1f} images/s" if made and report.seconds else "none made"
    loading = f"; {report.load_seconds:.2f}s loading the card" if report.load_seconds >= 0.005 else ""
    say(f"{count} from {report.card} on {report.platform} in {report.seconds:.2f}s ({rate}{loading})", stderr=True)


def typed(text: str) -> str:
    """A prompt as it was typed. Where Python decodes the command line as ASCII (the C locale with its coercion to
    UTF-8 turned off) it keeps each byte past 127 as a lone surrogate (PEP 383): `-p "a café"` arrives as
    'a caf\\udcc3\\udca9'. Those bytes, where they are UTF-8 (as a prompts file is read), are the prompt; others stay
    as they came, for the prompt's check to refuse."""
    if not UNDECODED.search(text):
        return text
    import os

    try:
        return os.fsencode(text).decode("utf-8")
    except UnicodeError:
        return text


_DEFAULTS = {"seed": 0, "best_of": 1}  # None above means "not given" (for --like); these are the defaults


def _one_or_each(paths: list[Path] | None):
    """One file for every prompt, or a list of one per prompt (None: not given)."""
    return paths[0] if paths and len(paths) == 1 else paths


def _like(path: Path, card, prompts, image, preprocessor, init, mask):
    """The --like image's request, and what it gives where the command gives nothing: the card, the prompts, the
    seed, and — on its own card only — the settings, the control image, and the image it started from with its
    mask (another card samples with its own)."""
    from cardtool.core.cards.discovery import locate
    from cardtool.core.cards.loader import load_card
    from cardtool.core.sampling.like import read_like
    from cardtool.errors import CardNotFound

    model = read_like(path)
    if card is None:
        try:
            locate(model.card)
        except CardNotFound as e:  # made from a card folder off the search path: the PNG records only its id
            import shlex

            raise CardNotFound(f"{path.name} was made by card '{model.card}': give its folder as CARD (cardtool "
                               f"generate FOLDER --like {shlex.quote(str(path))}) — {e}") from None
    same = card is None or load_card(card).id == model.card
    recorded = {"seed": model.seed, "negative_prompt": model.negative_prompt, **(model.settings if same else {})}
    if same and image is None and model.control is not None:
        image, preprocessor = model.control
        if not image.is_file():
            raise BadInput(f"{path.name} was made with the control image {image}, which is not there; give it "
                           "with --control IMAGE")
    if same and init is None and model.image is not None:
        init = _recorded(path, model.image, "image", "--image IMAGE")
    if same and mask is None and model.mask is not None:
        mask = _recorded(path, model.mask, "mask", "--mask MASK")
    return model, card or model.card, prompts or [model.prompt], recorded, image, preprocessor, init, mask


def _recorded(path: Path, source: str, what: str, option: str) -> list[Path]:
    """The file an image recorded as its start image or mask, as a one-file option; BadInput where there is none."""
    if not source:
        raise BadInput(f"{path.name} was made with its {what} given as an array, not a file; give it with {option}")
    if not Path(source).is_file():
        raise BadInput(f"{path.name} was made from the {what} {source}, which is not there; give it with {option}")
    return [Path(source)]
