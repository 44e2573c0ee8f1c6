"""`cardtool cards list | show | validate | lineage | diff | export | compose | merge | extract-lora | import`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import console, emit_json, handled, printable, warn
from cardtool.core.cards.calls import MAX_TOP

app = typer.Typer(help="Find, inspect, check and trace cards.", no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")]
CardArgument = Annotated[str, typer.Argument(help="A card id, card folder or manifest file.")]


@app.command("list")
def list_command(json_: JsonOption = False) -> None:
    """List the cards on the search path: ./cards, CARDTOOL_PATH, then the built-in cards."""
    from cardtool.core.cards.catalog import list_cards
    from cardtool.core.cards.discovery import search_roots, unsearchable

    with handled(json_):
        summaries = list_cards()
    for root in unsearchable(search_roots()):  # on stderr, also under --json: why cards expected there are missing
        warn(f"searched nothing in {root}")
    if json_:
        emit_json({"cards": [s.to_json() for s in summaries]})
        return
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    for column in ("id", "method", "status"):
        table.add_column(column, no_wrap=True)
    table.add_column("path", overflow="fold")
    table.add_column("description", overflow="fold", min_width=24)
    for s in summaries:
        status = "[green]ok[/green]" if s.valid else f"[red]invalid[/red] ({len(s.problems)})"
        table.add_row(*map(escape, (s.id or "?", s.method or "")), status, *map(escape, (s.path, s.description)))
    if summaries:
        console().print(table)
    else:
        console().print("no cards found in ./cards, on CARDTOOL_PATH or among the built-in cards")


@app.command("show")
def show_command(card: CardArgument, json_: JsonOption = False) -> None:
    """Show a card's manifest with `extends` resolved: components, loops, adapters, recipe."""
    from cardtool.backends.wan_config import CONTROLNET_BLOCKS
    from cardtool.core.cards.loader import load_card
    from cardtool.core.cards.schema import LADDER
    from cardtool.core.cards.source import display_path

    with handled(json_):
        loaded = load_card(card)
    m = loaded.manifest
    if json_:
        emit_json({"id": m.id, "path": display_path(loaded.folder), "manifest": display_path(loaded.file),
                   "card": m.to_json()})
        return
    from rich.markup import escape
    from rich.table import Table

    out = console()
    out.print(f"[bold]{m.id}[/bold]  {escape(m.description)}")
    out.print(display_path(loaded.file) + (f"  (extends {m.extends})" if m.extends else ""), markup=False)
    table = Table(title="components", title_justify="left")
    for column in ("name", "kind", "impl", "weights / source", "sha256", "config"):
        table.add_column(column, overflow="fold")
    for name, c in m.components.items():
        config = ", ".join(f"{k}={v}" for k, v in c.config.items())
        table.add_row(*map(escape, (name, c.kind, c.impl, c.weights or c.source or "", (c.sha256 or "")[:12], config)))
    out.print(table)
    if m.loops:
        table = Table(title="loops", title_justify="left")
        for column in ("name", "kind", "uses", "defaults"):
            table.add_column(column, overflow="fold")
        for name, loop in m.loops.items():
            defaults = ", ".join(f"{k}={v}" for k, v in loop.defaults.items())
            table.add_row(*map(escape, (name, loop.kind, ", ".join(loop.uses), defaults)))
        out.print(table)
    if m.adapters:
        table = Table(title="adapters", title_justify="left")
        for column in ("name", "kind", "target", "settings", "weights"):
            table.add_column(column, overflow="fold")
        for name, a in m.adapters.items():
            settings = f"rank {a.rank}, alpha {a.alpha:g}" if a.kind == "lora" else \
                f"control {a.control}, {a.config.get('blocks', CONTROLNET_BLOCKS)} blocks"
            table.add_row(*map(escape, (name, a.kind, a.target, settings, a.weights)))
        out.print(table)
    r = m.recipe
    out.print(f"recipe: method={r.method} parents=[{', '.join(r.parents)}] assumes: loop={r.assumes.loop} "
              f"steps={r.assumes.steps} precision={r.assumes.precision}", markup=False)
    out.print(f"parity: {m.parity.consistency} — {LADDER[m.parity.consistency]}", markup=False)
    if r.command:
        out.print(f"made by: {r.command}", markup=False)
    if r.metrics:
        out.print("metrics: " + ", ".join(f"{k}={v}" for k, v in r.metrics.items()), markup=False)


@app.command("validate")
def validate_command(
    paths: Annotated[list[str], typer.Argument(help="Card folders, manifest files, or folders of cards.")],
    checksums: Annotated[bool, typer.Option("--checksums", help="Also verify every declared sha256.")] = False,
    json_: JsonOption = False,
) -> None:
    """Validate cards strictly; exit 1 if any card has a problem."""
    from cardtool.core.cards.catalog import validate_paths

    with handled(json_):
        results = validate_paths(paths, checksums=checksums)
    ok = all(r.valid for r in results)
    if json_:
        emit_json({"ok": ok, "checksums": checksums, "results": [r.to_json() for r in results]})
    else:
        from rich.markup import escape

        out, err = console(), console(stderr=True)
        for r in results:
            if r.valid:
                out.print(f"[green]ok[/green]      {r.id}  ({escape(r.path)})")
            else:
                out.print(f"[red]invalid[/red] {escape(r.path)}")
                for problem in r.problems:
                    err.print(f"  {escape(printable(str(problem)))}")
    if not ok:
        raise typer.Exit(1)


@app.command("lineage")
def lineage_command(card: CardArgument, json_: JsonOption = False) -> None:
    """Walk recipe.parents back to the roots and print the tree (base → rl → distilled)."""
    from cardtool.core.cards.lineage import lineage
    from cardtool.core.cards.loader import load_card

    with handled(json_):
        root = lineage(load_card(card))
    complete = not any(node.missing for node in root.nodes())
    if json_:
        emit_json({"complete": complete, "lineage": root.to_json()})
    else:
        from rich.tree import Tree

        def label(node) -> str:
            if node.missing:
                return f"[red]{node.id} (missing)[/red]"
            return f"{node.id} [dim]({node.method}{', recorded by the export' if node.recorded else ''})[/dim]"

        shown = {root.id}

        def grow(tree, node) -> None:
            for parent in node.parents:
                if parent.id in shown:  # a diamond of parents: its parents are shown where it first appears
                    tree.add(f"{parent.id} [dim](above)[/dim]")
                    continue
                shown.add(parent.id)
                grow(tree.add(label(parent)), parent)

        tree = Tree(label(root))
        grow(tree, root)
        out = console()
        out.print(tree)
        chain = root.chain()
        if chain and len(chain) > 1:
            out.print(" → ".join(f"{n.id} ({'missing' if n.missing else n.method})" for n in chain))
    if not complete:
        raise typer.Exit(1)


@app.command("diff")
def diff_command(
    a: Annotated[str, typer.Argument(help="The card compared against (a base, say).")],
    b: Annotated[str, typer.Argument(help="The card whose changes are shown (its RL'd or distilled card, say).")],
    top: Annotated[int, typer.Option("--top", min=0, max=MAX_TOP,
                                     help="The tensors listed per changed weights file, largest change first.")] = 5,
    json_: JsonOption = False,
) -> None:
    """What card B changes of card A: manifest fields, and how far each component's weights moved (‖B − A‖ / ‖A‖)."""
    from cardtool.core.cards.calls import diff

    with handled(json_):
        report = diff(a, b, top=top)
    if json_:
        emit_json(report)
        return
    from rich.markup import escape
    from rich.table import Table

    def shown(value) -> str:
        text = "—" if value is None else json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
        return escape(text if len(text) <= 60 else text[:57] + "…")

    out = console()
    out.print(f"[bold]{escape(report['a'])}[/bold] → [bold]{escape(report['b'])}[/bold]")
    if report["manifest"]:
        table = Table(title="manifest", title_justify="left")
        for column in ("field", report["a"], report["b"]):
            table.add_column(escape(column), overflow="fold")
        for field, (old, new) in report["manifest"].items():
            table.add_row(escape(field), shown(old), shown(new))
        out.print(table)
    table = Table(title="weights", title_justify="left")
    for column in ("name", "status", "tensors changed", "‖B − A‖ / ‖A‖", "largest changes (relative)"):
        table.add_column(column, overflow="fold")
    for w in report["weights"]:
        changed = w["status"] == "changed"
        largest = [f"{r['tensor']} ({_number(r['relative_change'], 3)})" for r in w.get("largest", [])]
        # tensors that cannot be compared value by value: in one file only, or of another shape (another config)
        kinds = (("reshaped", "reshaped"), ("only_in_a", f"only in {report['a']}"),
                 ("only_in_b", f"only in {report['b']}"))
        apart = [(what, w[key]) for key, what in kinds if w.get(key)]
        largest += [f"{what}: {', '.join(names[:3])}{', …' if len(names) > 3 else ''}" for what, names in apart]
        count = ", ".join([f"{w['tensors_changed']} of {w['tensors']}", *(f"{len(n)} {what}" for what, n in apart)]) \
            if changed else ""  # a file the same as A's has no counts
        table.add_row(escape(w["name"]), w["status"], count,
                      _number(w["relative_change"], 4) if changed else "", escape("; ".join(largest)))
    out.print(table)


def _number(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


@app.command("export")
def export_command(
    card: CardArgument,
    out: Annotated[Path, typer.Option("--out", help="The export folder.")],
    fmt: Annotated[str, typer.Option("--format", help="hf: a Hugging Face model folder (README.md with front "
                                     "matter, the transformer in diffusers' layout, the card manifest).")] = "hf",
    overwrite: Annotated[bool, typer.Option("--overwrite", "--force",
                                            help="Replace an existing export folder.")] = False,
    json_: JsonOption = False,
) -> None:
    """Export a card for people who do not use cardtool: diffusers loads its transformer, cardtool loads it all."""
    from cardtool.core.cards.calls import export
    from cardtool.core.cards.source import display_path

    with handled(json_):
        exported = export(card, out, format=fmt, overwrite=overwrite)
    files = sorted(str(p.relative_to(exported.folder)) for p in exported.folder.rglob("*") if p.is_file())
    if json_:
        emit_json({"card": exported.id, "format": fmt, "path": display_path(exported.folder), "files": files})
        return
    console().print(f"exported {exported.id} ({fmt}) to {display_path(exported.folder)}: {', '.join(files)}",
                    markup=False)


@app.command("compose")
def compose_command(
    base: CardArgument,
    adapter_cards: Annotated[list[str], typer.Argument(help="Adapter cards that extend BASE (lora, controlnet).")],
    card_id: Annotated[str, typer.Option("--id", help="The serving card's id.")],
    out: Annotated[Path | None, typer.Option("--out", help="The card folder (default cards/ID).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", "--force", help="Replace an existing card folder.")] = False,
    json_: JsonOption = False,
) -> None:
    """One card serving the adapters of several adapter cards made on BASE, chosen per request with --adapter."""
    from cardtool.core.cards.calls import compose
    from cardtool.core.cards.source import display_path

    with handled(json_):
        card = compose(base, adapter_cards, card_id=card_id, out=out, overwrite=overwrite)
    adapters = sorted(card.manifest.adapters)
    if json_:
        emit_json({"card": card.id, "path": display_path(card.folder), "extends": card.manifest.extends,
                   "adapters": adapters, "parents": card.manifest.recipe.parents})
        return
    console().print(f"wrote {card.id} to {display_path(card.folder)}: {', '.join(adapters)} on "
                    f"{card.manifest.recipe.parents[0]}", markup=False)


@app.command("merge")
def merge_command(
    shares: Annotated[list[str], typer.Argument(metavar="CARD[=WEIGHT]...", help="Cards made from one model, each "
                                                "with its weight (the weights sum to 1; none given: an equal mix). "
                                                "The first card's loops and adapters are kept.")],
    card_id: Annotated[str, typer.Option("--id", help="The merged card's id.")],
    out: Annotated[Path | None, typer.Option("--out", help="The card folder (default cards/ID).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", "--force", help="Replace an existing card folder.")] = False,
    json_: JsonOption = False,
) -> None:
    """A card whose weights are the weighted average of several cards' (a model soup; base → RL'd interpolation)."""
    from cardtool.core.cards.calls import merge as merge_cards
    from cardtool.core.cards.source import display_path

    with handled(json_):
        merge = merge_cards(shares, card_id=card_id, out=out, overwrite=overwrite)
    card, parents = merge.card, merge.card.manifest.recipe.parents
    if json_:
        emit_json({"card": card.id, "path": display_path(card.folder), "extends": card.manifest.extends,
                   "parents": parents, "weights": merge.weights, "merged": merge.merged,
                   "loops_differ": merge.loops_differ})
        return
    mix = ", ".join(f"{p} ({w:g})" for p, w in zip(parents, merge.weights, strict=True))
    console().print(f"wrote {card.id} to {display_path(card.folder)}: {', '.join(merge.merged)} averaged from {mix}",
                    markup=False)
    if merge.loops_differ:
        console().print(f"note: the loops of {', '.join(merge.loops_differ)} differ from {parents[0]}'s; the merged "
                        f"card runs {parents[0]}'s (name first the card whose loop you want)", markup=False)


@app.command("extract-lora")
def extract_lora_command(
    base: CardArgument,
    tuned: Annotated[str, typer.Argument(help="A card made from BASE whose transformer's change the LoRA carries.")],
    rank: Annotated[int, typer.Option("--rank", help="The LoRA's rank (each layer's change truncated by SVD).")],
    card_id: Annotated[str, typer.Option("--id", help="The adapter card's id.")],
    adapter: Annotated[str | None, typer.Option("--adapter", help="The adapter's name (default: TUNED's id).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="The card folder (default cards/ID).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", "--force", help="Replace an existing card folder.")] = False,
    json_: JsonOption = False,
) -> None:
    """An adapter card on BASE whose LoRA approximates TUNED: an RL'd or distilled card served per request."""
    from cardtool.core.cards.calls import extract_lora
    from cardtool.core.cards.source import display_path

    with handled(json_):
        made = extract_lora(base, tuned, rank=rank, card_id=card_id, adapter=adapter, out=out, overwrite=overwrite)
    card = made.card
    if json_:
        emit_json({"card": card.id, "path": display_path(card.folder), "extends": card.manifest.extends,
                   "adapter": made.adapter, "rank": made.rank, "modules": made.modules,
                   "linear_share": made.linear_share, "kept": made.kept})
        return
    console().print(f"wrote {card.id} to {display_path(card.folder)}: LoRA '{made.adapter}' (rank {made.rank}, "
                    f"{made.modules} layers) on {card.manifest.recipe.parents[0]}; it keeps {made.kept:.1%} of the "
                    f"linear layers' change, which is {made.linear_share:.1%} of the whole", markup=False)


@app.command("import")
def import_command(
    source: Annotated[Path, typer.Argument(help="A diffusers WanTransformer3DModel folder (config.json + "
                                           "safetensors), or a model folder with one in transformer/.")],
    base: Annotated[str, typer.Option("--base", help="The card whose text encoder, VAE and loop it uses.")],
    card_id: Annotated[str, typer.Option("--id", help="The new card's id.")],
    out: Annotated[Path | None, typer.Option("--out", help="The card folder (default cards/ID).")] = None,
    variant: Annotated[str | None, typer.Option("--variant", help="diffusers' weights variant, e.g. fp16 "
                                                "(diffusion_pytorch_model.fp16.safetensors).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", "--force", help="Replace an existing card folder.")] = False,
    json_: JsonOption = False,
) -> None:
    """A card from a transformer in diffusers' layout, on another card's text encoder and VAE."""
    from cardtool.core.cards.calls import import_diffusers
    from cardtool.core.cards.source import display_path

    with handled(json_):
        card = import_diffusers(source, base=base, card_id=card_id, out=out, variant=variant, overwrite=overwrite)
    config = card.manifest.components["transformer"].config
    if json_:
        emit_json({"card": card.id, "path": display_path(card.folder), "extends": card.manifest.extends,
                   "transformer": config})
        return
    console().print(f"wrote {card.id} to {display_path(card.folder)}: a wan-dit of {config['depth']} blocks, "
                    f"width {config['dim']}, on {card.manifest.recipe.parents[0]}", markup=False)
