"""`cardtool cards export CARD --format hf --out DIR`: a folder a Hugging Face user recognises — `README.md` with the
model-card front matter (`base_model`, `base_model_relation`, `library_name`, `pipeline_tag`, `tags`) and the card's
lineage and recorded metrics; the transformer in diffusers' layout (`transformer/config.json` +
`diffusion_pytorch_model.safetensors`, which `WanTransformer3DModel.from_pretrained` loads); and the card manifest,
`extends` resolved, every weights file inside the folder and the lineage above it recorded (`recipe.ancestors`), so
cardtool loads and validates the export back as it is on a disk without its parents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from markdown_it import MarkdownIt

from cardtool.core.cards.discovery import locate
from cardtool.core.cards.lineage import check_new_folder, lineage
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.record import EVAL_REPORT
from cardtool.errors import BadInput
from cardtool.files import is_regular_file
from cardtool.paths import opened_by_utf8_name

__all__ = ["FORMATS", "export_card"]

FORMATS = ("hf",)
RELATIONS = {"finetune": "finetune", "dmd2": "finetune", "diffusion_nft": "finetune", "flow_grpo": "finetune",
             "lora": "adapter", "controlnet": "adapter", "lora_extract": "adapter",
             "merge": "merge"}  # recipe.method → base_model_relation
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
DIFFUSERS_CLASS = "WanTransformer3DModel"


def export_card(card_ref: str, out: Path, *, fmt: str = "hf", overwrite: bool = False) -> Card:
    """Write the export of `card_ref` to `out` atomically (validated before it is put in place); the exported card."""
    from safetensors.torch import load_file

    from cardtool.backends.wan_config import WanDiTConfig
    from cardtool.core.cards.writer import write_card

    if fmt not in FORMATS:
        raise BadInput(f"unknown export format '{fmt}'; choose one of: {', '.join(FORMATS)}")
    card = load_card(locate(card_ref))
    check_new_folder(out, [card])  # the files it reads, and the cards its recorded lineage names
    m = card.manifest
    dits = [name for name, c in m.components.items() if c.kind == "dit" and c.impl == "wan-dit"]
    if len(dits) != 1 or m.components[dits[0]].weights is None:
        raise BadInput(f"card '{card.id}' has no wan-dit transformer with weights to export in diffusers' layout")
    name = dits[0]
    dit_config = WanDiTConfig.from_card(m.components[name].config, "wan-dit")
    config = {"_class_name": DIFFUSERS_CLASS, **dit_config.to_diffusers(unpadded_text=True)}
    with opened_by_utf8_name(card.weights_file(name)) as file:
        state = {k: v.float() for k, v in load_file(file).items()}  # diffusers loads float32

    manifest = m.to_json()
    manifest["extends"] = None
    # the lineage goes with the export: on a disk without its parents it still reaches its roots
    manifest["recipe"]["ancestors"] = [{"id": node.id, "method": node.method,
                                        "parents": [parent.id for parent in node.parents]}
                                       for node in lineage(card).above()]
    copies = {}
    for section in ("components", "adapters"):
        for entry_name, entry in manifest[section].items():
            if not entry.get("weights"):
                continue
            if section == "components" and entry_name == name:
                entry["weights"] = TRANSFORMER
                continue
            rel = f"{section}/{entry_name}.safetensors" if section == "adapters" else f"{entry_name}.safetensors"
            copies[rel] = card.weights_file(entry_name, section)
            entry["weights"] = rel
    for entry_name, entry in manifest["components"].items():
        if entry.get("source") and not entry["source"].startswith("package:"):  # a folder of the card's goes with it
            folder, rel = card.source_path(entry_name), f"{entry_name}_files" if entry_name == name else entry_name
            copies.update({f"{rel}/{file.relative_to(folder).as_posix()}": file
                           for file in sorted(folder.rglob("*")) if file.is_file()})
            entry["source"] = rel
    summary, report = m.recipe.metrics.get("eval"), card.folder / EVAL_REPORT
    if isinstance(summary, dict) and summary.get("report") == EVAL_REPORT and is_regular_file(report):
        copies[EVAL_REPORT] = report  # the full table the recorded summary is checked against
    texts = {"README.md": _readme(card, dit_config.text_mask),
             "transformer/config.json": json.dumps(config, indent=2) + "\n"}
    return write_card(Path(out), manifest, {TRANSFORMER: state}, copies=copies, texts=texts, storage="float32",
                      overwrite=overwrite)


def front_matter(card: Card) -> dict:
    recipe = card.manifest.recipe
    data = {}
    if recipe.parents and recipe.method in RELATIONS:
        data["base_model"] = recipe.parents if recipe.method == "merge" else recipe.parents[0]
        data["base_model_relation"] = RELATIONS[recipe.method]
    data.update({"library_name": "cardtool", "pipeline_tag": "text-to-image",
                 "tags": ["cardtool", "diffusers", "wan", "flow-matching", recipe.method.replace("_", "-")]})
    return data


def _readme(card: Card, text_mask: bool) -> str:
    m, recipe = card.manifest, card.manifest.recipe
    lines = ["---", yaml.safe_dump(front_matter(card), sort_keys=False).strip(), "---", "", f"# {m.id}", ""]
    if m.description:
        lines += _description(m.description)
    chain = lineage(card).chain()
    if chain and len(chain) > 1:
        lines += ["## Lineage", "", " → ".join(f"`{node.id}` ({node.method or 'not found'})" for node in chain), ""]
    elif recipe.parents:
        lines += ["## Lineage", "", f"Made by `{recipe.method}` from " + ", ".join(f"`{p}`" for p in recipe.parents),
                  ""]
    loop = m.loops.get("denoise")
    if loop is not None:
        settings = ", ".join(f"{k} {v}" for k, v in loop.defaults.items())
        lines += ["## Sampling", "", f"The weights assume the `denoise` loop with {settings}.", ""]
    lines += _metrics(recipe.metrics)
    if recipe.command:
        lines += ["## Reproduce", "", *_verbatim(recipe.command)]
    lines += ["## Use", "", "```python", "from diffusers import WanTransformer3DModel", "",
              'transformer = WanTransformer3DModel.from_pretrained("PATH/TO/THIS/FOLDER", subfolder="transformer")',
              "```", ""]
    if text_mask:
        lines += ["This transformer was trained with its cross-attention masking padded text tokens (`text_mask: "
                  "true`), which diffusers' Wan attention cannot express: pass each prompt's text states without "
                  "padding (one prompt per call, or prompts of equal token length) and it gives cardtool's "
                  "velocities.", ""]
    lines += ["The whole model (text encoder, VAE, sampling loop) runs with cardtool:", "", "```",
              'cardtool generate PATH/TO/THIS/FOLDER -p "an ankle boot"', "```", ""]
    return "\n".join(lines)


def _description(text: str) -> list[str]:
    """The card's description as README lines: as Markdown when it is self-contained, else verbatim in a code block.
    A description is free text; an unclosed ``` fence or `<!--` would swallow the sections after it (CommonMark, which
    markdown-it follows), and an unclosed HTML tag would wrap them, so a description that reaches past its end or holds
    raw HTML is shown as written."""
    tokens = MarkdownIt("commonmark").parse(text + "\n\n# end\n")
    ends_it = [t.type for t in tokens[-3:]] == ["heading_open", "inline", "heading_close"] and tokens[-3].level == 0
    html = any(t.type == "html_block" or any(c.type == "html_inline" for c in t.children or []) for t in tokens)
    return [text, ""] if ends_it and tokens[-2].content == "end" and not html else _verbatim(text)


def _verbatim(text: str) -> list[str]:
    """`text` in a fenced code block that no run of backticks inside it can close."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
    return [fence, text, fence, ""]


def _metrics(metrics: dict) -> list[str]:
    """The recorded eval at the card's defaults and the held-out judge, as a table. `recipe.metrics` is free-form (a
    card edited by hand validates with any values there): a field that is missing or not a number shows as it is or
    as '–', never failing the export."""
    ev = metrics.get("eval") if isinstance(metrics.get("eval"), dict) else {}
    rows = [r for r in ev.get("rows") or [] if isinstance(r, dict)] if isinstance(ev.get("rows"), list) else []
    if not rows:
        return []
    lines = ["## Metrics", "", f"`cardtool eval`, judged by {_code(ev, 'judge')} on {_cell(ev, 'platform')}, "
             f"{_cell(ev, 'per_class')} image{'' if ev.get('per_class') == 1 else 's'} per class:", "",
             "| steps | guidance | precision | class accuracy | FID-FMNIST | images/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [_cell(r, "steps"), _cell(r, "guidance", "g"), *(_cell(r, k) for k in (
            "precision", "class_accuracy", "fid_fmnist", "images_per_second"))]
        lines.append("| " + " | ".join(cells) + " |")
    held = metrics.get("held_out_judge")
    if isinstance(held, dict) and "class_accuracy" in held:
        lines += ["", f"Class accuracy under the held-out judge {_code(held, 'card')}: "
                      f"{_cell(held, 'class_accuracy')}."]
    return lines + [""]


MARKUP = set("\\`*_[]<>&|~")


def _cell(record: dict, key: str, number_format: str = "") -> str:
    """One recorded value as Markdown text: a number in `number_format`, anything else as written, on one line and with
    each character that can start Markdown or HTML backslash-escaped (CommonMark shows it as itself), so that a pipe
    cannot split a table cell, nor `<!--` or a tag become HTML that hides the sections after it."""
    value = record.get(key)
    if value is None:
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, number_format)
    return "".join("\\" + c if c in MARKUP else c for c in " ".join(str(value).split()))


def _code(record: dict, key: str) -> str:
    """One recorded value as a code span: delimited by a run of backticks longer than any inside it, so none closes
    it early (CommonMark 6.1)."""
    value = record.get(key)
    if value is None:
        return "–"
    text = " ".join(str(value).split())
    ticks = "`" * (1 + max((len(run) for run in re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"
