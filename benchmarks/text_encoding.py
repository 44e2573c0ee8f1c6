"""Many distinct prompts: the text encoder's share of `generate`, prompts encoded one by one against in fixed groups.

    python benchmarks/text_encoding.py [--card fashion-base] [--prompts 256] [--repeats 3] [--threads 2]
        [--out benchmarks/results/text_encoding.json]

Each repeat runs both ways in turn, on a warm `LoadedCard` with an empty in-memory text cache (so every prompt is
encoded): `encode_prompts` alone, then a whole `generate` of one image per prompt at the card's defaults (out=None).
"alone" forces the one-by-one path; "grouped" is the default, which groups where its trial shows the same bits. The
features (and so the images) of both ways are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="fashion-base")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "text_encoding.json")
    args = parser.parse_args()

    import numpy as np
    import torch

    from cardtool.atomic import write_atomic

    torch.set_num_threads(args.threads)
    from cardtool.core.sampling import text_cache
    from cardtool.core.sampling.generate import LoadedCard
    from cardtool.core.sampling.text_cache import TextFeatureCache, encode_prompts

    garments = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
    prompts = [f"a {'dark' if i % 2 else 'light'} {garments[i % 10]}, number {i}" for i in range(args.prompts)]
    card = LoadedCard(args.card)
    card.generate(prompts[0], out=None)  # build every component once: loading is not what is timed
    grouped_from = text_cache.GROUPED_FROM
    times: dict[str, dict[str, list[float]]] = {"alone": {"encode": [], "generate": []},
                                                "grouped": {"encode": [], "generate": []}}
    features = {}
    for _ in range(args.repeats):
        for way in times:
            text_cache.GROUPED_FROM = 10**12 if way == "alone" else grouped_from
            try:
                card.cache = card.loop().cache = TextFeatureCache(disk=False)
                start = time.perf_counter()
                features[way] = encode_prompts(card.loop().instance, prompts, card.cache)
                times[way]["encode"].append(time.perf_counter() - start)
                card.cache = card.loop().cache = TextFeatureCache(disk=False)
                start = time.perf_counter()
                card.generate(prompts, out=None)
                times[way]["generate"].append(time.perf_counter() - start)
            finally:
                text_cache.GROUPED_FROM = grouped_from
    same = all(np.array_equal(a, b) for one, other in zip(features["alone"], features["grouped"], strict=True)
               for a, b in zip(one, other, strict=True))
    median = {way: {what: statistics.median(t) for what, t in whats.items()} for way, whats in times.items()}
    results = {"card": args.card, "prompts": args.prompts, "repeats": args.repeats, "threads": args.threads,
               "machine": platform.machine(), "platform": f"{card.platform.device}/{card.platform.arch}",
               "cpus": os.cpu_count(),
               "grouped_is_exact": bool(text_cache._verdict(card.loop().instance.component(card.loop().text_encoder))),
               "same_features": same, "seconds": times, "median_s": median,
               "prompts_per_s": {way: args.prompts / m["encode"] for way, m in median.items()},
               "speedup": {what: median["alone"][what] / median["grouped"][what] for what in ("encode", "generate")}}
    for way, m in median.items():
        print(f"{way:8s} encode {m['encode']:7.2f} s ({args.prompts / m['encode']:6.1f} prompts/s)   "
              f"generate {m['generate']:7.2f} s")
    speedup = results["speedup"]
    print(f"grouped / alone: encode {speedup['encode']:.2f}×, generate {speedup['generate']:.2f}×; trial exact: "
          f"{results['grouped_is_exact']}; same features: {same}")
    write_atomic(args.out, (json.dumps(results, indent=2) + "\n").encode())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
