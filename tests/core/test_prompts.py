"""The Fashion family's prompts: each class's canonical prompt (what eval and the judges ask for) and the phrasings
text-to-image training draws from."""

from __future__ import annotations

from helpers import REPO

from cardtool.core.cards.loader import load_card
from cardtool.core.prompts import SYNONYMS, TEXT_ENCODER, class_prompt, training_prompts


def test_each_class_is_asked_for_by_its_name_with_its_article():
    assert [class_prompt(label) for label in range(10)] == [
        "a T-shirt/top", "a trouser", "a pullover", "a dress", "a coat", "a sandal", "a shirt", "a sneaker", "a bag",
        "an ankle boot"]


def test_training_draws_each_class_from_its_name_and_synonyms_in_every_template():
    prompts = training_prompts()
    assert len(prompts) == 10 and all(len(options) == 1 + 3 * 4 for options in prompts)
    assert [options[0] for options in prompts] == [class_prompt(label) for label in range(10)]
    boots = prompts[9]
    assert {"an ankle boot", "ankle boot", "a photo of a leather boot", "a picture of a boot"} <= set(boots)
    assert "a picture of an ankle boot" in boots and "a photo of a ankle boot" not in boots
    assert all(any(synonym in p for p in prompts[label][1:]) for label, synonyms in enumerate(SYNONYMS.values())
               for synonym in synonyms)


def test_a_pretrained_card_declares_the_text_encoder_of_the_built_in_family():
    """A pretrain run writes TEXT_ENCODER into its card: the built-in fashion-base was made that way."""
    declared = load_card(REPO / "cards" / "fashion-base").manifest.components["text_encoder"]
    assert declared.model_dump(exclude_none=True) == TEXT_ENCODER
