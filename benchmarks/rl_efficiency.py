"""DiffusionNFT against Flow-GRPO from the same base, reward, prompts and wall-clock budget: the rollout reward and
the policy's class accuracy under the reward's judge and a held-out judge (plus FID-FMNIST) against training seconds
and samples, as JSON and a plot, with the seconds each method takes to reach a held-out accuracy of 0.95.

Each method runs its recipe through the shared trainer (the same code `cardtool rl` runs); every `--watch-every`
updates the policy samples the class prompts at the tuned card's serving settings (the base's steps, guidance 1)
and both judges score it. Watch time is excluded from the training seconds.

    python benchmarks/rl_efficiency.py --budget 600 --out benchmarks/results/rl_efficiency.json \
        --plot benchmarks/results/rl_efficiency.png
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cardtool.atomic import write_atomic
from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.evaluation.reward import check_held_out, load_reward
from cardtool.core.training.rl import default_prompts, make_task, rl_recipe, serving_loop
from cardtool.core.training.trainer import train_loop
from cardtool.core.training.watch import Watch

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"diffusion_nft": "examples/recipes/fashion-nft.yaml", "flow_grpo": "examples/recipes/fashion-grpo.yaml"}


class Budget(Exception):
    pass


def run(method: str, args) -> dict:
    """One method until `args.budget` training seconds; the watch points and the run's settings."""
    platform = Platform.detect(args.device)
    recipe = rl_recipe(args.base, args.reward, method, REPO / RECIPES[method],
                       [f"optim.steps={args.max_updates}", f"train.log_every={args.watch_every}",
                        f"train.checkpoint_every={args.max_updates}", *args.set])
    task = make_task(recipe, platform, load_card(locate(args.base)), load_reward(args.reward, platform),
                     default_prompts())
    watch = Watch(task.base, task.name, task.policy, task.cache, serving_loop(task.base),
                  [args.reward, args.held_out_judge], platform, recipe.train.precision, args.per_class, args.data)
    samples_per_rollout = recipe.optim.batch_size * task.settings.group_size
    points, started = [], time.perf_counter()

    def record(step: int, check: bool = True) -> None:
        seconds = time.perf_counter() - started - watch.seconds
        scores = watch()
        points.append({"update": step, "train_seconds": round(seconds, 2),
                       "samples": len(task.reward_history) * samples_per_rollout,
                       "reward": round(task.reward_history[-1], 4) if task.reward_history else None,
                       "accuracy": scores["watch_accuracy"],
                       "held_out_accuracy": scores[f"watch_accuracy_{watch.judges[1].card_id}"],
                       "fid_fmnist": round(scores["watch_fid"], 3)})
        print(json.dumps({"method": method, **points[-1]}), flush=True)
        if check and seconds >= args.budget:
            raise Budget

    record(0, check=False)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            train_loop(task, recipe, platform, Path(run_dir), on_log=lambda entry: record(entry["step"]))
    except Budget:
        pass
    reached = next((p["train_seconds"] for p in points if p["held_out_accuracy"] >= args.target), None)
    return {"method": method, "recipe": RECIPES[method], "overrides": [*args.set],
            "samples_per_rollout": samples_per_rollout, "seconds_to_target": reached, "points": points}


def plot(results: list[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"diffusion_nft": "tab:blue", "flow_grpo": "tab:orange"}
    for result in results:
        pts, color = result["points"], colors[result["method"]]
        for ax, x in ((axes[0], "train_seconds"), (axes[1], "samples")):
            ax.plot([p[x] for p in pts], [p["held_out_accuracy"] for p in pts], "o-", color=color,
                    label=f"{result['method']}: held-out judge accuracy")
            ax.plot([p[x] for p in pts], [p["reward"] for p in pts], ":", color=color,
                    label=f"{result['method']}: rollout reward")
        axes[2].plot([p["train_seconds"] for p in pts], [p["fid_fmnist"] for p in pts], "o-", color=color,
                     label=result["method"])
    for ax, xlabel in ((axes[0], "training seconds (2-core CPU)"), (axes[1], "samples")):
        ax.axhline(target, color="grey", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy / reward")
        ax.legend(fontsize=7)
    axes[2].set_xlabel("training seconds (2-core CPU)")
    axes[2].set_ylabel("FID-FMNIST of the probe (lower is better)")
    axes[2].legend(fontsize=7)
    fig.suptitle("Reward fine-tuning of fashion-base without CFG: DiffusionNFT vs Flow-GRPO, same budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="fashion-base")
    parser.add_argument("--reward", default="fashion-classifier")
    parser.add_argument("--held-out-judge", default="fashion-referee")
    parser.add_argument("--methods", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--budget", type=float, default=600.0, help="training seconds per method")
    parser.add_argument("--max-updates", type=int, default=2000, help="the schedule's length (LR decay)")
    parser.add_argument("--watch-every", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=50, help="probe images per class")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--set", action="append", default=[], help="an override applied to both recipes")
    parser.add_argument("--device")
    parser.add_argument("--data")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    check_held_out(args.held_out_judge, args.reward)  # its accuracy would be the reward's again
    results = [run(method, args) for method in args.methods]
    write_atomic(args.out, (json.dumps({"budget_seconds": args.budget, "target": args.target, "base": args.base,
                                        "reward": args.reward, "held_out_judge": args.held_out_judge,
                                        "probe_images": 10 * args.per_class, "results": results}, indent=1)
                            + "\n").encode())
    if args.plot:
        plot(results, args.target, args.plot)
    for r in results:
        print(f"{r['method']}: held-out accuracy {args.target} after "
              f"{r['seconds_to_target'] if r['seconds_to_target'] is not None else 'not reached in'} s")


if __name__ == "__main__":
    main()
