"""`cardtool train`: run a recipe's method through the shared trainer and write the card it makes, its
recipe holding the method, parents, data, hyperparameters, the exact command and the measured metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.data import IMAGE_SIZE, load_split, provenance
from cardtool.core.prompts import TEXT_ENCODER
from cardtool.core.training.derived import extends_reference, parents_digest, write_output
from cardtool.core.training.recipes import RUN_BY, Recipe
from cardtool.core.training.trainer import check_start, train_loop, writable_outputs
from cardtool.errors import BadInput

__all__ = ["train"]


def train(recipe: Recipe, *, command: str, out: Path | None = None, run_dir: Path | None = None, resume: bool = False,
          data: str | None = None, device: str | None = None, overwrite: bool = False,
          on_log: Callable[[dict], None] | None = None, micro_batches: int = 1,
          on_warning: Callable[[str], None] | None = None) -> Card:
    """Run the recipe and write its card. Under torchrun every rank trains its share of each batch (see
    `train_loop`) and rank 0 writes the checkpoints and the card, which the other ranks then load. `on_warning`
    hears what the run trains on that it should know of before it starts (captions cut at the encoder's length)."""
    if recipe.method in RUN_BY:
        raise BadInput(f"{recipe.method} is not a `cardtool train` method: `{RUN_BY[recipe.method]}` runs it")
    platform = Platform.detect(device)
    out = Path(out or Path("cards") / recipe.card.id)
    run_dir = Path(run_dir or Path("runs") / recipe.card.id)
    made_from = [load_card(locate(ref)) for ref in recipe.parents]
    writable_outputs(out, run_dir, replace=overwrite, flag="--overwrite", card_id=recipe.card.id, parents=made_from,
                     extends=made_from[0] if recipe.method in ("lora", "controlnet") and made_from else None)
    folder = recipe.data.get("folder") if data is None else data
    method = recipe.method
    size = IMAGE_SIZE
    if method == "vae":  # the one component whose image size a recipe sets
        from cardtool.backends.vae_config import ConvVAEConfig

        size = ConvVAEConfig.from_card(recipe.model).image_size
    train_split, test_split = load_split("train", folder, size), load_split("test", folder, size)
    digest, parents = train_split.digest(), parents_digest(recipe)
    check_start(recipe, platform, run_dir, resume=resume, micro_batches=micro_batches, data=digest, parents=parents)
    if method == "vae":
        from cardtool.core.training.methods.vae import VAETask

        task = VAETask(recipe, platform, train_split, test_split)
    elif method == "classifier":
        from cardtool.core.training.methods.classifier import ClassifierTask

        task = ClassifierTask(recipe, platform, train_split, test_split)
    elif method in ("lora", "controlnet"):
        from cardtool.core.training.methods.adapters import adapter_task

        task = adapter_task(recipe, platform, train_split, test_split)
    else:
        from cardtool.core.training.methods.flow_matching import FlowMatchingTask

        task = FlowMatchingTask(recipe, platform, train_split, test_split)
    task.data, task.parents = digest, parents
    if on_warning is not None and getattr(task, "filled", None):
        on_warning(task.filled)
    result = train_loop(task, recipe, platform, run_dir, resume=resume, on_log=on_log, micro_batches=micro_batches)
    trained = {"steps": result.steps, "final_loss": round(result.final_loss, 6),
               "train_seconds": round(result.seconds, 1), "samples_per_second": round(result.samples_per_second, 1),
               "platform": f"{platform.device}/{platform.arch}"}
    recipe_block = {"method": method, "parents": list(recipe.parents), "command": command,
                    "data": provenance(train_split, "train"),
                    "hyperparameters": _hyperparameters(recipe, task)}
    storage, metadata, extends = recipe.card.storage, None, {}
    if method == "vae":
        config, metrics = task.finish(result.modules["vae"])
        components = {"vae": {"kind": "vae", "impl": "conv-vae", "config": config.to_card(),
                              "weights": "vae.safetensors"}}
        weights, copies, loops = {"vae.safetensors": result.modules["vae"].state_dict()}, {}, {}
    elif method == "classifier":
        metrics = task.finish(result.modules["classifier"])
        components = {"classifier": {"kind": "classifier", "impl": "fashion-cnn", "config": dict(recipe.model),
                                     "weights": "classifier.safetensors"},
                      "text_encoder": dict(TEXT_ENCODER)}
        weights, copies, loops = {"classifier.safetensors": result.modules["classifier"].state_dict()}, {}, {}
    elif method in ("lora", "controlnet"):
        [trained_adapter] = result.modules.values()
        metrics = task.finish(trained_adapter)
        adapters, weights, metadata = task.artifact(trained_adapter)
        components, copies = {}, {}
        # a LoRA card applies its LoRA unless a request names its own stack; a ControlNet joins with --control
        loops = {"denoise": {"defaults": {"adapters": {name: 1.0 for name in adapters}}}} if method == "lora" else {}
        extends = {"extends": extends_reference(task.parent, out), "adapters": adapters}
        recipe_block["assumes"] = {"loop": "denoise"}
        recipe_block["parents"] = [task.parent.id]
    else:
        metrics = task.finish(result.modules["transformer"])
        components = task.card_components()
        weights = {"transformer.safetensors": result.modules["transformer"].state_dict()}
        copies, loops = task.card_copies(), {"denoise": task.card_loop()}
        recipe_block["assumes"] = {"loop": "denoise"}
        recipe_block["parents"] = [task.parent.id]  # the id, also when the recipe named the parent by path
    manifest = {"schema": "cardtool/v1", "id": recipe.card.id, "description": recipe.card.description,
                **({"components": components} if components else {}), **({"loops": loops} if loops else {}), **extends,
                "recipe": {**recipe_block, "metrics": {**metrics, **trained}}, "parity": {"consistency": "C1"}}
    return write_output(out, manifest, weights, run_dir, copies=copies, storage=storage, overwrite=overwrite,
                        metadata=metadata)


def _hyperparameters(recipe: Recipe, task) -> dict:
    """The recipe's settings with the loss defaults the method filled in: a card says what it was trained with."""
    settings = recipe.hyperparameters()
    return {**settings, "loss": {**task.loss_settings(), **settings["loss"]}}
