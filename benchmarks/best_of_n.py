"""Best-of-N against plain sampling, per card: class accuracy under the reward's judge (which best-of-N selects by)
and under a held-out judge (which it never sees), FID-FMNIST, model evaluations and wall seconds per output image.

Each card samples the eval's requests (the class prompts × seeds 0…per_class−1, at the card's loop defaults) once
plainly and once as best-of-N under the reward, in the same process; best-of-N's wall time includes scoring. At
equal samples (the same number of output images) the rows compare directly; at equal wall time, a best-of-N row is
set against the plain rows that cost as much or less per image (listed as `costs_no_more_than`).

    python benchmarks/best_of_n.py --card fashion-base --card fashion-base-nft-2step --n 4 \
        --out benchmarks/results/best_of_n.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from judging import Judging, add_arguments  # benchmarks/, this script's folder

from cardtool.core.sampling.best_of import best_of_n
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.sampler import sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", action="append", required=True, help="A card to sample; repeat.")
    parser.add_argument("--n", type=int, default=4)
    add_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    judging = Judging.from_args(args)
    rows = []
    for ref in args.card:
        loaded = LoadedCard(ref, device=args.device)
        loop, reward = loaded.loop(), loaded.reward(args.reward)
        requests = judging.requests(loaded.card)
        sample(loop, requests[:8])  # warm: first-call costs stay out of the timings
        for n in (1, args.n):
            started = time.perf_counter()
            if n == 1:
                images = loop.finalize(sample(loop, requests, max_batch=256))
            else:
                images = best_of_n(loop, reward, requests, n, max_batch=256).checked(loaded.card.id).images
            seconds = time.perf_counter() - started
            row = {"card": loaded.card.id, "mode": "plain" if n == 1 else f"best-of-{n}", "candidates_per_image": n,
                   "model_evaluations_per_image": n * requests[0].model_evaluations(), **judging.score(images),
                   "seconds": round(seconds, 2), "ms_per_image": round(1000 * seconds / len(images), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:
        if row["candidates_per_image"] > 1:
            row["costs_no_more_than"] = [f"{r['card']} {r['mode']}" for r in rows if r["candidates_per_image"] == 1
                                         and r["ms_per_image"] >= row["ms_per_image"]]
    judging.write(args.out, rows, n=args.n)


if __name__ == "__main__":
    main()
