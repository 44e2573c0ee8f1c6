"""cardtool's generation against diffusers on the same weights, every method interleaved in one run (issue 11).

One prompt × B seeds, S steps, CFG w on every step, the card's weights, per precision (float32; bfloat16 as mixed
precision, autocast for diffusers too) and batch size B:

- generate warm:  `LoadedCard.generate` on a card loaded once (decoding and writing the PNGs included)
- generate cold:  a fresh `LoadedCard` per call in this process (parse, build, then as warm)
- command:        `cardtool generate` in a fresh process (interpreter, torch import, everything)
- loop:           the denoise loop alone (`sample`: no decoding, no PNGs)
- bare forward:   the same DiT's forwards (with the text mask, for a card that masks) and Euler updates on fixed
                  tensors, nothing else
- diffusers loop: diffusers' `WanTransformer3DModel` holding the same weights, its FlowMatchEulerDiscreteScheduler
                  and a hand-written CFG loop, on the same text states and initial noise
- WanPipeline:    `WanPipeline(output_type="latent")` given the same prompt embeddings and latents (it evaluates
                  the conditional and unconditional branches as two forwards)

Each repeat runs every (B, precision, method) once, in turn, so load on a shared machine spreads over all of them;
medians are reported. Start-up is measured the same way: `cardtool generate CARD -p X -n 1 --steps 1` against
`python -c "import torch"`, interleaved. Needs the `bench` extra (diffusers, matplotlib for the plot).

    python benchmarks/peer_diffusers.py [--card fashion-base] [--steps 20] [--batch-sizes 1 16 64]
        [--precisions float32 bfloat16] [--repeats 5] [--out benchmarks/results/peer_diffusers.json]
        [--plot benchmarks/results/peer_diffusers.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cardtool.atomic import write_atomic
from cardtool.backends.precision import autocast
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.core.cards.discovery import locate
from cardtool.core.sampling.denoise import Request, shifted_sigmas
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import encode_prompts

PROMPT = "an ankle boot"
# the console script as users run it; the module where no script is on PATH
# the console script pip installed beside this interpreter — what a venv puts on PATH; not a version manager's shim
# on PATH (pyenv's adds 0.1–0.25 s of shell to every start), which `python -c` below would not pay either
_SCRIPT = Path(sys.executable).with_name("cardtool")
CARDTOOL = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "cardtool"]
METHODS = ("generate warm", "generate cold", "command", "loop", "bare forward", "diffusers loop", "WanPipeline")


class Peers:
    """Everything each method needs, built once: the loaded card per precision, the diffusers model and
    pipeline with the card's transformer weights, and the text states both sides are given."""

    def __init__(self, card_ref: str, steps: int, guidance: float, shift: float, precisions: list[str], out: Path):
        import diffusers

        self.card_ref, self.steps, self.guidance, self.shift = card_ref, steps, guidance, shift
        self.loaded = LoadedCard(card_ref, device="cpu")
        for precision in precisions:
            self.loaded.loop(precision)
        loop = self.loaded.loop("float32")
        card = self.loaded.card
        cond, uncond = encode_prompts(loop.instance, [PROMPT, ""], self.loaded.cache, loop.text_encoder)
        self.cond, self.uncond = (torch.from_numpy(states[None]).float() for states, _ in (cond, uncond))
        self.masks = [torch.from_numpy(mask[None]) for _, mask in (cond, uncond)]
        config = WanDiTConfig.from_card(card.manifest.components[loop.transformer].config, "wan-dit")
        self.text_mask = config.text_mask  # diffusers has no mask: a masked card is compared for speed only
        self.dit = diffusers.WanTransformer3DModel(**config.model_copy(update={"text_mask": False}).to_diffusers())
        from safetensors.torch import load_file

        state = load_file(str(card.weights_file(loop.transformer)))
        self.dit.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        self.dit.eval().requires_grad_(False)
        self.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
        self.pipeline = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=self.dit,
                                              scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=shift))
        self.pipeline.set_progress_bar_config(disable=True)
        self.latent_shape = loop.latent_shape()
        self.out = out  # where `generate` writes its PNGs

    def options(self, batch: int, precision: str) -> dict:
        return {"num": batch, "steps": self.steps, "guidance": self.guidance, "shift": self.shift,
                "guidance_interval": (0.0, 1.0), "precision": precision, "out": self.out}

    def noise(self, batch: int) -> torch.Tensor:
        return torch.from_numpy(np.random.default_rng(0).standard_normal((batch, *self.latent_shape))).float()

    def run(self, method: str, batch: int, precision: str) -> float:
        started = time.perf_counter()
        getattr(self, "_" + method.replace(" ", "_").lower())(batch, precision)
        return time.perf_counter() - started

    def _generate_warm(self, batch, precision):
        self.loaded.generate([PROMPT], **self.options(batch, precision))

    def _generate_cold(self, batch, precision):
        LoadedCard(self.card_ref, device="cpu").generate([PROMPT], **self.options(batch, precision))

    def _command(self, batch, precision):
        subprocess.run([*CARDTOOL, "generate", self.card_ref, "-p", PROMPT, "-n", str(batch), "--steps",
                        str(self.steps), "--guidance", str(self.guidance), "--shift", str(self.shift),
                        "--guidance-interval", "0,1", "--precision", precision, "--device", "cpu",
                        "--out", str(self.out)], check=True, capture_output=True)

    def _loop(self, batch, precision):
        requests = [Request(PROMPT, seed=i, steps=self.steps, guidance=self.guidance, shift=self.shift)
                    for i in range(batch)]
        sample(self.loaded.loop(precision), requests)

    def _bare_forward(self, batch, precision):
        loop = self.loaded.loop(precision)
        dit, sigmas = loop.instance.component(loop.transformer), shifted_sigmas(self.steps, self.shift)
        x, text = self.noise(batch), torch.cat([self.cond.expand(batch, -1, -1), self.uncond.expand(batch, -1, -1)])
        mask = torch.cat([m.expand(batch, -1) for m in self.masks])  # used only by a card that masks
        with loop.arrays.inference():
            for i in range(self.steps):
                t = torch.full((2 * batch,), sigmas[i] * 1000.0)
                v_cond, v_uncond = dit(torch.cat([x, x]), t, text, mask).float().chunk(2)
                x = x + (sigmas[i + 1] - sigmas[i]) * (v_uncond + self.guidance * (v_cond - v_uncond))

    def _diffusers_loop(self, batch, precision):
        scheduler = self.scheduler
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 0.0, self.steps + 1)[:-1]))
        x, text = self.noise(batch), torch.cat([self.cond.expand(batch, -1, -1), self.uncond.expand(batch, -1, -1)])
        with torch.inference_mode(), autocast(self.loaded.platform, precision):
            for t in scheduler.timesteps:
                v = self.dit(torch.cat([x, x]), t.expand(2 * batch), text, return_dict=False)[0].float()
                v_cond, v_uncond = v.chunk(2)
                x = scheduler.step(v_uncond + self.guidance * (v_cond - v_uncond), t, x, return_dict=False)[0]

    def _wanpipeline(self, batch, precision):
        with torch.inference_mode(), autocast(self.loaded.platform, precision):
            self.pipeline(prompt_embeds=self.cond.expand(batch, -1, -1),
                          negative_prompt_embeds=self.uncond.expand(batch, -1, -1),
                          height=8 * self.latent_shape[2], width=8 * self.latent_shape[3], num_frames=1,
                          num_inference_steps=self.steps, guidance_scale=self.guidance, latents=self.noise(batch),
                          output_type="latent")


def startup(card_ref: str, repeats: int, out: Path) -> dict:
    """Medians of a one-step one-image command and of importing torch, interleaved, in fresh processes. cardtool's
    bytecode is compiled first, as `pip install` does (torch's is, being installed): a checkout run with
    PYTHONDONTWRITEBYTECODE set would otherwise compile every module on every start."""
    import compileall

    import cardtool

    compileall.compile_dir(Path(cardtool.__file__).parent, quiet=1)
    commands = {"cardtool generate -n 1 --steps 1": [*CARDTOOL, "generate", card_ref, "-p", PROMPT, "-n", "1",
                                                     "--steps", "1", "--out", str(out)],
                "python -c 'import torch'": [sys.executable, "-c", "import torch"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"median_s": medians, "runs_s": times, "launcher": CARDTOOL,
            "ratio": medians["cardtool generate -n 1 --steps 1"] / medians["python -c 'import torch'"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="fashion-base")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--shift", type=float, default=1.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--precisions", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--startup-repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_diffusers.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()

    card_ref = str(locate(args.card)) if Path(args.card).exists() else args.card
    with tempfile.TemporaryDirectory(prefix="cardtool-peer-") as scratch:  # the PNGs every method writes
        report = measure(args, card_ref, Path(scratch))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, (json.dumps(report, indent=1) + "\n").encode())
    if args.plot:
        plot(report, args.plot)
    print(json.dumps({"ratios": report["ratios"], "startup": report["startup"] and report["startup"]["ratio"]},
                     indent=1))


def measure(args: argparse.Namespace, card_ref: str, scratch: Path) -> dict:
    """Every method's times, interleaved, and the start-up times, as the report records them."""
    peers = Peers(card_ref, args.steps, args.guidance, args.shift, args.precisions, scratch)
    cells = [(m, b, p) for b in args.batch_sizes for p in args.precisions for m in args.methods]
    for cell in cells:  # warm-up: first calls build kernels, caches and allocator pools
        peers.run(*cell)
    times: dict[tuple, list[float]] = {cell: [] for cell in cells}
    for repeat in range(args.repeats):
        for cell in cells:
            times[cell].append(peers.run(*cell))
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    median = {cell: statistics.median(t) for cell, t in times.items()}
    return {
        "card": args.card, "steps": args.steps, "guidance": args.guidance, "cfg_every_step": True,
        "card_masks_text": peers.text_mask, "repeats": args.repeats,
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "python": platform.python_version(),
                    "platform": f"{peers.loaded.platform.device}/{peers.loaded.platform.arch}"},
        "rows": [{"method": m, "batch": b, "precision": p, "median_s": round(median[(m, b, p)], 5),
                  "images_per_s": round(b / median[(m, b, p)], 2), "runs_s": [round(t, 5) for t in times[(m, b, p)]]}
                 for m, b, p in cells],
        "ratios": ratios(median, args.batch_sizes, args.precisions, args.methods),
        "startup": startup(card_ref, args.startup_repeats, scratch / "one.png") if args.startup_repeats else None,
    }


def ratios(median: dict, batches: list[int], precisions: list[str], methods: list[str]) -> dict:
    """Speed ratios (> 1: the first is faster), each from medians of the same run."""
    def ratio(slow, fast, b, p):
        return round(median[(slow, b, p)] / median[(fast, b, p)], 3) \
            if (slow, b, p) in median and (fast, b, p) in median else None

    table = {}
    for p in precisions:
        for b in batches:
            table[f"{p} B={b}"] = {
                "generate warm / diffusers loop": ratio("diffusers loop", "generate warm", b, p),
                "generate cold / diffusers loop": ratio("diffusers loop", "generate cold", b, p),
                "loop / bare forward": ratio("bare forward", "loop", b, p),
                "generate warm / WanPipeline": ratio("WanPipeline", "generate warm", b, p),
                "bare forward / diffusers loop": ratio("diffusers loop", "bare forward", b, p)}
    if "float32" in precisions and "bfloat16" in precisions:
        for b in batches:
            table[f"bfloat16 / float32 B={b}"] = {
                m: round(median[(m, b, "float32")] / median[(m, b, "bfloat16")], 3) for m in methods
                if (m, b, "float32") in median and (m, b, "bfloat16") in median}
    return table


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    figure, axes = plt.subplots(1, len(precisions), figsize=(6 * len(precisions), 4), squeeze=False)
    width = 0.8 / len(methods)
    for ax, precision in zip(axes[0], precisions, strict=True):
        for i, method in enumerate(methods):
            speed = {r["batch"]: r["images_per_s"] for r in rows
                     if r["method"] == method and r["precision"] == precision}
            ax.bar([j + i * width for j in range(len(batches))], [speed[b] for b in batches], width, label=method)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"B = {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("images / s (median)")
        ax.set_title(f"{report['card']}, {report['steps']} steps, CFG every step, {precision}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
