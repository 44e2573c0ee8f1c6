"""Evaluate a `cardtool distill` run mid-way: the generator weights of its checkpoint, as a student card of the teacher
(in a temporary folder), through `cardtool eval` at the student's step count. Appends one row to a JSON curve.

    python benchmarks/distill_checkpoint.py runs/dmd2-4step --teacher fashion-base --steps 4 \
        --out benchmarks/results/dmd2-4step-curve.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from cardtool.atomic import write_atomic
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.writer import write_card
from cardtool.core.evaluation.evaluate import evaluate
from cardtool.core.training.trainer import CHECKPOINT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--teacher", default="fashion-base")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--judge", default="fashion-classifier")
    parser.add_argument("--data", default=None, help="an IDX folder (default: Fashion-MNIST)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)

    with safe_open(str(args.run_dir / CHECKPOINT), framework="pt") as f:
        iteration = int(f.metadata()["step"])
        # with train.ema the card gets the averaged weights, so the curve follows them too
        prefix = "ema.transformer." if any(k.startswith("ema.transformer.") for k in f.keys()) else "model.transformer."
        weights = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    teacher = load_card(locate(args.teacher))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "student"
        write_card(folder, {"schema": "cardtool/v1", "id": "checkpoint", "extends": str(teacher.folder),
                            "components": {"transformer": {"weights": "transformer.safetensors"}},
                            "loops": {"denoise": {"defaults": {"steps": args.steps, "guidance": 1.0,
                                                               "solver": "renoise"}}},
                            "recipe": {"method": "dmd2", "parents": [teacher.id],
                                       "assumes": {"loop": "denoise", "steps": args.steps}}},
                   {"transformer.safetensors": weights})
        started = time.perf_counter()
        [row] = evaluate(str(folder), judge=args.judge, per_class=args.per_class, data=args.data).to_json()["rows"]
    entry = {"iteration": iteration, "steps": args.steps, "weights": prefix.split(".")[0],
             "class_accuracy": row["class_accuracy"], "fid_fmnist": row["fid_fmnist"], "kid": row["kid"],
             "images": row["images"],
             "eval_seconds": round(time.perf_counter() - started, 1)}
    curve = json.loads(args.out.read_text()) if args.out.exists() else []
    curve = [c for c in curve if c["iteration"] != iteration] + [entry]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, (json.dumps(sorted(curve, key=lambda c: c["iteration"]), indent=1) + "\n").encode())
    print(json.dumps(entry), file=sys.stderr)


if __name__ == "__main__":
    main()
