"""Free text: how often a card draws the class a prompt names when the prompt is not one it was trained on.

The Fashion family trains on each class's name and two synonyms in four templates (`cardtool/core/prompts.py`).
People type other words: "a parka", "flip-flops", "a tote bag". Each class's canonical prompt and 60 phrasings outside
the training set are sampled at seeds 0…per_prompt−1 at the card's loop defaults and judged for class accuracy by the
reward's judge and by a held-out judge. Also measured: how often the reward reads the class a phrasing names
(`prompt_classes`, what `rl --prompts` and best-of-N score free text by).

    python benchmarks/free_text.py --card fashion-base --card fashion-base-nft --card fashion-base-2step \
        --card fashion-base-nft-2step --best-of 4 --out benchmarks/results/free_text.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic
from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.data import CLASS_NAMES
from cardtool.core.evaluation.reward import FashionJudge
from cardtool.core.prompts import class_prompt, training_prompts
from cardtool.core.sampling.best_of import best_of_n
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.planning import plan_requests
from cardtool.core.sampling.sampler import sample
from cardtool.errors import BadInput

# phrasings the training prompts do not hold, with the class each names: three per class first, then thirty more
# written later to check the reward's reading of free text on words it was not changed for
HELD_OUT = (("a short-sleeved t-shirt", 0), ("a cotton tee", 0), ("a plain white t-shirt", 0),
            ("a pair of slacks", 1), ("denim trousers", 1), ("long pants", 1),
            ("a knitted sweater", 2), ("a wool jumper", 2), ("a cozy pullover sweater", 2),
            ("an evening dress", 3), ("a long dress", 3), ("a sleeveless dress", 3),
            ("a warm parka", 4), ("a raincoat", 4), ("a long winter jacket", 4),
            ("open-toed sandals", 5), ("flip-flops", 5), ("strappy sandals", 5),
            ("a dress shirt", 6), ("a flannel shirt", 6), ("a long-sleeved button shirt", 6),
            ("sports shoes", 7), ("a tennis shoe", 7), ("athletic sneakers", 7),
            ("a tote bag", 8), ("a leather handbag", 8), ("a shoulder bag", 8),
            ("a chelsea boot", 9), ("winter boots", 9), ("a short boot with a heel", 9),
            ("a hoodie", 2), ("a turtleneck sweater", 2), ("a fleece", 2), ("chinos", 1), ("leggings", 1),
            ("cargo pants", 1), ("a blazer", 4), ("a trench coat", 4), ("a windbreaker", 4), ("a tank top", 0),
            ("a crop top", 0), ("a ball gown", 3), ("a sundress", 3), ("a cocktail dress", 3), ("beach sandals", 5),
            ("high-top sneakers", 7), ("canvas shoes", 7), ("a backpack", 8), ("a clutch", 8), ("a satchel", 8),
            ("hiking boots", 9), ("cowboy boots", 9), ("rain boots", 9), ("an oxford shirt", 6),
            ("a checked shirt", 6), ("a denim jacket", 4), ("a mini skirt dress", 3), ("a v-neck tee", 0),
            ("jogging bottoms", 1), ("a shopping bag", 8))


def prompts() -> list[tuple[str, int, str]]:
    """(prompt, class, kind): each class's canonical prompt, then the held-out phrasings."""
    trained = {p.lower() for group in training_prompts() for p in group}
    return [*((class_prompt(label), label, "canonical") for label in range(len(CLASS_NAMES))),
            *((p, label, "held_out") for p, label in HELD_OUT if p.lower() not in trained)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", action="append", required=True, help="A card to sample; repeat.")
    parser.add_argument("--reward", default="fashion-classifier")
    parser.add_argument("--held-out-judge", default="fashion-referee")
    parser.add_argument("--per-prompt", type=int, default=50)
    parser.add_argument("--best-of", type=int, default=0, help="Also sample best-of-N under the reward.")
    parser.add_argument("--device")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    platform = Platform.detect(args.device)
    judges = [FashionJudge(ModelInstance(load_card(locate(j)), platform, "float32"))
              for j in (args.reward, args.held_out_judge)]
    table = prompts()
    held_out = [(p, label) for p, label, kind in table if kind == "held_out"]
    try:
        read = judges[0].prompt_classes([p for p, _ in held_out])
        misread = [(p, CLASS_NAMES[int(c)]) for (p, label), c in zip(held_out, read, strict=True)
                   if c != label]
        reading = {"prompt_class_accuracy": round(1 - len(misread) / len(held_out), 4), "misread": misread}
    except BadInput as e:  # a reward card without a text encoder reads class words only
        reading = {"prompt_class_accuracy": None, "cannot": str(e)}
    print(json.dumps(reading), flush=True)
    labels = np.repeat([label for _, label, _ in table], args.per_prompt)
    cards = []
    for ref in args.card:
        loaded = LoadedCard(ref, device=args.device)
        requests = plan_requests(loaded.card, [p for p, _, _ in table], num=args.per_prompt)[0]
        for n in (1, args.best_of) if args.best_of > 1 else (1,):
            if n == 1:
                images = loaded.loop().finalize(sample(loaded.loop(), requests, max_batch=256))
            else:
                images = best_of_n(loaded.loop(), loaded.reward(args.reward), requests, n,
                                   max_batch=256).checked(loaded.card.id).images
            right = [(judge.probabilities(images).argmax(1) == labels).reshape(len(table), -1).mean(1)
                     for judge in judges]
            rows = [{"prompt": p, "class": CLASS_NAMES[label], "kind": kind, "class_accuracy": round(float(a), 4),
                     "held_out_accuracy": round(float(h), 4)}
                    for (p, label, kind), a, h in zip(table, *right, strict=True)]
            summary = {kind: {measure: round(float(np.mean([r[measure] for r in rows if r["kind"] == kind])), 4)
                              for measure in ("class_accuracy", "held_out_accuracy")}
                       for kind in ("canonical", "held_out")}
            worst = sorted(rows, key=lambda r: r["class_accuracy"])[:3]
            cards.append({"card": loaded.card.id, "mode": "plain" if n == 1 else f"best-of-{n}", **summary,
                          "worst": [(r["prompt"], r["class_accuracy"]) for r in worst], "rows": rows})
            print(json.dumps({k: v for k, v in cards[-1].items() if k != "rows"}), flush=True)
    document = {"reward": args.reward, "reward_reading": reading, "held_out_judge": args.held_out_judge,
                "per_prompt": args.per_prompt,
                "platform": f"{platform.device}/{platform.arch}", "cards": cards}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, (json.dumps(document, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
