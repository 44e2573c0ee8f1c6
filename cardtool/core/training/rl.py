"""`cardtool rl CARD --reward REWARD_CARD`: reward fine-tuning (DiffusionNFT by default, Flow-GRPO as the
likelihood-based baseline) through the shared trainer, then the tuned card — it `extends` the base (text encoder and
VAE by reference), replaces the transformer, samples without CFG (`guidance: 1`, the base's steps), and records
`recipe: {method, parents: [BASE, REWARD], hyperparameters, command, metrics}` with the reward curve and, unless asked
not to, its eval under the judge and the accuracy under a held-out judge that was never the reward."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.loops import FlowDenoiseDefaults
from cardtool.core.prompts import training_prompts
from cardtool.core.sampling.planning import read_prompts_file
from cardtool.core.training.derived import (
    check_eval_data,
    default_id,
    evaluate_output,
    extends_reference,
    held_out_output,
    parents_digest,
    recipe_fingerprint,
    trained_parts,
    write_output,
)
from cardtool.core.training.recipes import Recipe, only_keys
from cardtool.core.training.trainer import check_start, train_loop, writable_outputs
from cardtool.core.training.watch import Watch, check_every, watched
from cardtool.errors import BadInput

__all__ = ["METHODS", "check_recipe", "rl", "rl_recipe", "read_prompts", "default_prompts", "make_task",
           "serving_loop"]

METHODS = {"diffusion_nft": "nft", "flow_grpo": "grpo"}  # method → the suffix of the tuned card's id
MAX_PROMPTS_BYTES = 1 << 20


def default_prompts() -> list[str]:
    """Every class's canonical prompt, synonyms and templates: what the base was trained on."""
    return [p for options in training_prompts() for p in options]


def read_prompts(path: Path) -> list[str]:
    """`generate --prompts-file`'s reader (planning.py) at most MAX_PROMPTS_BYTES: one prompt a line."""
    prompts = read_prompts_file(path, limit=MAX_PROMPTS_BYTES)
    if not prompts:
        raise BadInput(f"{path}: the prompts file holds no prompts (one per line)")
    return prompts


def _defaults(method: str) -> dict:
    from cardtool.core.training.methods.grpo import GRPO_DEFAULTS
    from cardtool.core.training.methods.nft import NFT_DEFAULTS

    return {"diffusion_nft": NFT_DEFAULTS, "flow_grpo": GRPO_DEFAULTS}[method]


def rl_recipe(base: str, reward: str, method: str | None = None, path: Path | None = None,
              overrides: list[str] = (), section: dict | None = None, label: str | None = None,
              set_prefix: str = "") -> Recipe:
    """The recipe `cardtool rl` runs: the file (or `section`, or the method's defaults) with `--set` applied, parents
    [BASE, REWARD], and the card id `BASE-nft` / `BASE-grpo` unless the recipe names one. Without --method, the
    file's method, else diffusion_nft."""
    from cardtool.core.cards.source import read_source
    from cardtool.core.training.recipes import load_recipe
    from cardtool.errors import CardValidationError

    if method is None and path is not None:
        try:
            method = read_source(Path(path)).data.get("method")
        except CardValidationError as e:
            raise BadInput(f"cannot read recipe: {e}") from None
    if method is None:  # an empty --method is refused below, not taken as the default
        method = (section or {}).get("method") or "diffusion_nft"
    if not isinstance(method, str) or method not in METHODS:
        raise BadInput(f"unknown rl method {method!r}; choose one of: {', '.join(METHODS)}")

    def complete(data: dict) -> None:
        data["parents"] = [base, reward]
        card = data.setdefault("card", {})
        if isinstance(card, dict) and "id" not in card:
            card["id"] = default_id(base, METHODS[method])

    return load_recipe(path, list(overrides), method, defaults=_defaults(method), complete=complete, section=section,
                       label=label, set_prefix=set_prefix)


def check_recipe(recipe: Recipe) -> None:
    """What `rl` refuses in a recipe, found without loading a card — before a run that precedes it (the flywheel)."""
    from cardtool.core.training.lora_settings import lora_settings
    from cardtool.core.training.methods.grpo import GRPOSettings
    from cardtool.core.training.methods.nft import NFTSettings

    if recipe.method not in METHODS or len(recipe.parents) != 2:
        raise BadInput("rl runs a diffusion_nft or flow_grpo recipe whose parents are [BASE, REWARD_CARD]")
    only_keys(recipe, "data", ())  # the data come from --data; a data: section would change nothing
    (GRPOSettings if recipe.method == "flow_grpo" else NFTSettings).from_recipe(recipe.loss)
    lora_settings(recipe, "tuned", recipe.parents[0])


def make_task(recipe: Recipe, platform: Platform, base: Card, reward, prompts: list[str]):
    if recipe.method == "flow_grpo":
        from cardtool.core.training.methods.grpo import GRPOTask

        return GRPOTask(recipe, platform, base, reward, prompts)
    from cardtool.core.training.methods.nft import NFTTask

    return NFTTask(recipe, platform, base, reward, prompts)


def rl(recipe: Recipe, *, command: str, prompts: list[str] | None = None, out: Path | None = None,
       run_dir: Path | None = None, resume: bool = False, device: str | None = None, data: str | None = None,
       force: bool = False, evaluate: bool = True, judge: str = "fashion-classifier",
       held_out_judge: str | None = "fashion-referee", watch_every: int = 0,
       on_log: Callable[[dict], None] | None = None, on_eval: Callable[[dict], None] | None = None,
       micro_batches: int = 1, on_warning: Callable[[str], None] | None = None, per_class: int = 100) -> Card:
    from cardtool.core.evaluation.evaluate import checked_per_class
    from cardtool.core.evaluation.reward import check_held_out, load_reward, reward_card

    check_recipe(recipe)
    check_every(watch_every)
    per_class = checked_per_class(per_class)
    platform = Platform.detect(device)
    platform.torch_device  # noqa: B018 - a device to train on, before the reward is loaded
    base = load_card(locate(recipe.parents[0]))
    reward = load_reward(recipe.parents[1], platform, scores=base)
    out = Path(out or Path("cards") / recipe.card.id)
    run_dir = Path(run_dir or Path("runs") / recipe.card.id)
    writable_outputs(out, run_dir, replace=force, flag="--force", card_id=recipe.card.id,
                     parents=[base, reward_card(recipe.parents[1])[0]], extends=base)
    judges = [judge, *([held_out_judge] if held_out_judge else [])]
    if evaluate or watch_every:
        for name in judges:
            reward_card(name, scores=base)  # before the run, not after
        check_held_out(held_out_judge, recipe.parents[1], judge)
    if evaluate:
        check_eval_data(data, "the eval after rl (--no-eval skips it)", per_class)
    given, prompts = prompts is not None, prompts if prompts is not None else default_prompts()
    # what it trains on is its prompts: a resume given others (--prompts) would train the rest of the run on them
    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    parents = parents_digest(recipe)
    check_start(recipe, platform, run_dir, resume=resume, micro_batches=micro_batches, data=digest, parents=parents)
    task = make_task(recipe, platform, base, reward, prompts)
    task.data, task.parents = digest, parents
    if given and on_warning is not None:  # a prompts file's lines cut at the encoder's length, or naming no garment
        from cardtool.core.evaluation.reward import free_text_reading
        from cardtool.core.sampling.text_cache import filled_prompts

        filled = filled_prompts(task.loop.instance, task.prompts, task.cache, task.loop.text_encoder)
        for warning in (filled, free_text_reading(reward, task.prompts)):
            if warning:
                on_warning(warning)
    if task.cache.problem and on_warning is not None:  # the cache cannot be written: the run goes on, in memory
        on_warning(task.cache.problem)
    watch = Watch(task.base, task.name, task.policy, task.cache, serving_loop(base), judges, platform,
                  recipe.train.precision, data=data) if watch_every else None
    result = train_loop(task, recipe, platform, run_dir, resume=resume, on_log=watched(on_log, watch, watch_every),
                        micro_batches=micro_batches)
    parts, weights, metadata, defaults = trained_parts(result.modules["transformer"], task.name, task.lora,
                                                       METHODS[recipe.method], base)
    manifest = _manifest(recipe, task, base, reward.card_id, out, command, result, platform, parts, defaults)
    card = write_output(out, manifest, weights, run_dir, storage=recipe.card.storage, overwrite=force,
                        metadata=metadata)
    if evaluate:
        card = evaluate_output(card, judge, device, data, on_eval, per_class)
        if held_out_judge:
            card = held_out_output(card, held_out_judge, device, data, on_eval, per_class)
    return card


def serving_loop(base: Card) -> dict:
    """How the tuned card samples (its manifest's loop, below): the base's steps and shift, Euler, without CFG."""
    d = FlowDenoiseDefaults.model_validate(base.manifest.loops["denoise"].defaults)
    return {"steps": d.steps, "guidance": 1.0, "shift": d.shift, "solver": "euler"}


def _manifest(recipe: Recipe, task, base: Card, reward_id: str, out: Path, command: str, result, platform,
              parts: dict, defaults: dict) -> dict:
    s = task.settings
    history = task.reward_history
    windows = np.array_split(np.asarray(history), min(len(history), 20)) if history else []
    rows = recipe.optim.batch_size * s.group_size
    metrics = {"updates": result.steps, "rollouts": len(history), "samples": len(history) * rows,
               "train_seconds": round(result.seconds, 1), "final_loss": round(result.final_loss, 6),
               "reward_first": round(history[0], 4) if history else None,
               "reward_last": round(history[-1], 4) if history else None,
               "reward_curve": [round(float(w.mean()), 4) for w in windows],  # the mean reward over each 5% of rollouts
               "prompts": {"count": len(task.prompts),  # what was trained on, checkable against a --prompts file
                           "sha256": task.data},
               "text_cache_hit_rate": round(task.cache.hits / max(1, task.cache.hits + task.cache.misses), 4),
               "platform": f"{platform.device}/{platform.arch}"}
    steps = FlowDenoiseDefaults.model_validate(base.manifest.loops["denoise"].defaults).steps
    return {
        "schema": "cardtool/v1", "id": recipe.card.id,
        "description": recipe.card.description or f"{base.id} reward-tuned with {recipe.method} on {reward_id}; "
                                                   "samples without CFG",
        "extends": extends_reference(base, out),
        **parts,
        "loops": {"denoise": {"defaults": {"steps": steps, "guidance": 1.0, "solver": "euler", **defaults}}},
        "recipe": {"method": recipe.method, "parents": [base.id, reward_id],
                   "assumes": {"loop": "denoise", "steps": steps}, "command": command,
                   "fingerprint": recipe_fingerprint(recipe, task.data if task.prompts != default_prompts() else None),
                   "hyperparameters": recipe.hyperparameters(),
                   "metrics": metrics},
        "parity": {"consistency": "C1"},
    }
