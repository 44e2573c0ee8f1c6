"""LoRAs extracted from tuned cards (`cards extract-lora BASE TUNED --rank R`) against the tuned cards themselves: for
each tuned card, its own row and one per rank — the share of the linear layers' change the rank keeps, then the eval's
requests sampled at the tuned card's loop defaults (which the adapter card takes) and scored for class accuracy (the
reward's judge and a held-out one), mean reward and FID-FMNIST.

    python benchmarks/lora_extract.py --base fashion-base --tuned fashion-base-nft --tuned fashion-base-2step \
        --rank 4 --rank 16 --rank 64 --out benchmarks/results/lora_extract.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from judging import Judging, add_arguments  # benchmarks/, this script's folder

from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.lora_extract import extract_lora
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.sampler import sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="fashion-base")
    parser.add_argument("--tuned", action="append", required=True, help="A card made from BASE; repeat.")
    parser.add_argument("--rank", type=int, action="append", required=True, help="A LoRA rank; repeat.")
    add_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    judging = Judging.from_args(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tuned in args.tuned:
            for rank in [None, *args.rank]:
                row = {"tuned": tuned, "rank": rank}
                if rank is None:  # the tuned card itself
                    card = load_card(locate(tuned))
                else:
                    name = f"lora-{len(rows)}"
                    made = extract_lora(args.base, tuned, rank, name, out=Path(tmp) / name)
                    card = made.card
                    row |= {"kept": round(made.kept, 4), "linear_share": round(made.linear_share, 4)}
                loop = LoadedCard(str(card.folder), device=args.device).loop()
                images = loop.finalize(sample(loop, judging.requests(card), max_batch=256))
                rows.append({**row, **judging.score(images)})
                print(json.dumps(rows[-1]), flush=True)
    judging.write(args.out, rows, base=args.base)


if __name__ == "__main__":
    main()
