"""cardtool: a diffusion model's recipe and runtime as one versioned card, and the tool that runs it.

The Python API, for scripts (each name is imported on first use, so `import cardtool` stays light):

    import cardtool

    card = cardtool.LoadedCard("fashion-adapters")    # load once, generate many times
    report = card.generate(["a sneaker", "a bag"], num=4, adapters=[("mirror", 0.5)], out="outputs")
    for image in report.images:
        print(image.path, image.metadata["seed"])
    held = card.generate("a bag", out=None).images[0].pixels   # write nothing: the image as a uint8 array
    card.generate("a coat", image=held, strength=0.6)          # image-to-image (mask=…: inpaint)
    cardtool.generate("fashion-base", "a dress")       # one call: load, generate, done
    cardtool.evaluate("fashion-base", steps=[20], per_class=10).rows
    cardtool.compare("fashion-base-2step", "fashion-base-nft-2step").differences   # paired: same prompts, seeds
    cardtool.load_card("fashion-base").manifest.recipe.parents
    cardtool.run_workflow("examples/workflows/tiny-tour.yaml", out="outputs", skip_existing=True).steps
    student = cardtool.distill("fashion-base", steps=2, overrides=["optim.steps=500"], on_log=print)   # a Card
    tuned = cardtool.rl("fashion-base", reward="fashion-classifier", prompts=["a bag", "a coat"])
    cardtool.train("examples/recipes/fashion-bold.yaml", overrides=["optim.steps=100"])
    cardtool.flywheel("fashion-base", reward="fashion-classifier", steps=2).to_json()    # the --json document
    cardtool.merge([("fashion-base", 0.5), ("fashion-base-nft", 0.5)], card_id="soup")   # as `cardtool cards …`
    cardtool.extract_lora("fashion-base", "fashion-base-nft", rank=8, card_id="nft-lora")
    cardtool.export("fashion-base", "exports/fashion-base")   # also compose, import_diffusers
    cardtool.diff("fashion-base", "fashion-base-nft")["weights"]   # what one card changes of another
    cardtool.parity("fashion-base").ok   # every kernel cell here, and the card, against the numpy reference

Errors the caller can act on are `cardtool.BadInput` (the request), `cardtool.CardValidationError` (the card,
with located `problems`) and `cardtool.RunFailed` (the work), all `cardtool.CardtoolError`.
"""

__version__ = "0.1.0"

_API = {
    "LoadedCard": "cardtool.core.sampling.generate",
    "generate": "cardtool.core.sampling.generate",
    "evaluate": "cardtool.core.evaluation.evaluate",
    "compare": "cardtool.core.evaluation.versus",
    "load_card": "cardtool.core.cards.loader",
    "run_workflow": "cardtool.core.workflows.run",
    "train": "cardtool.core.training.calls",
    "distill": "cardtool.core.training.calls",
    "rl": "cardtool.core.training.calls",
    "flywheel": "cardtool.core.training.calls",
    "merge": "cardtool.core.cards.calls",
    "compose": "cardtool.core.cards.calls",
    "extract_lora": "cardtool.core.cards.calls",
    "export": "cardtool.core.cards.calls",
    "import_diffusers": "cardtool.core.cards.calls",
    "diff": "cardtool.core.cards.calls",
    "parity": "cardtool.core.evaluation.parity_report",
    "CardtoolError": "cardtool.errors",
    "BadInput": "cardtool.errors",
    "CardValidationError": "cardtool.errors",
    "RunFailed": "cardtool.errors",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'cardtool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
