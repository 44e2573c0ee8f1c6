"""Loading a card: parse its manifest, resolve `extends`, validate the schema, check references and files.

`extends` derives a card from another: mappings merge key by key, a `null` removes an inherited key, and
any other value (lists included) replaces the inherited one whole. `id`, `extends` and `recipe` belong to
each card and are never inherited. Inherited weight paths keep pointing into the parent's folder.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from cardtool.core.cards.adapters import adapter_problems
from cardtool.core.cards.components import component_problems, few, loop_problems
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.schema import CardManifest
from cardtool.core.cards.schema_errors import locate_problem, schema_problems
from cardtool.core.cards.source import FieldPath, Source, display_path, read_source
from cardtool.core.cards.weight_files import PICKLE_SUFFIXES, format_problem, non_finite_tensors, sha256_file
from cardtool.errors import BadInput, CardValidationError, Problem
from cardtool.files import is_regular_file

__all__ = ["Card", "load_card", "merge_extends", "package_path"]

_OWN_KEYS = ("id", "extends", "recipe")  # never inherited through `extends`


@dataclass(frozen=True)
class Card:
    """A validated card: its manifest (with `extends` resolved) and where every field came from."""

    manifest: CardManifest
    file: Path
    sources: tuple[Source, ...]  # this card's manifest first, then the ones it extends, nearest first
    raw: dict  # merged data, paths relative to this card's folder

    @property
    def id(self) -> str:
        return self.manifest.id

    @property
    def folder(self) -> Path:
        return self.file.parent

    def problem(self, path: FieldPath, message: str, fix: str = "", *, key: bool = False) -> Problem:
        return locate_problem(self.sources, path, message, fix, key=key)

    def weights_file(self, name: str, section: str | None = None) -> Path:
        """The weights of component or adapter `name`, checked: a safetensors file whose sha256 matches. An adapter may
        share a component's name (a LoRA called `vae`): `section` ("components" or "adapters") says which is meant;
        without it a component is."""
        where = section or ("components" if name in self.manifest.components else "adapters")
        entry = getattr(self.manifest, where).get(name)
        if entry is None or entry.weights is None:
            what = where[:-1] if section else "component or adapter"
            raise BadInput(f"card '{self.id}' has no {what} '{name}' with weights")
        problems = _file_problems(self, (where, name), entry.weights, entry.sha256, checksums=True)
        if problems:
            raise CardValidationError(problems)
        return self.folder / entry.weights

    def files(self) -> list[Path]:
        """Every file the card is read from: its manifests (its own, then those it extends) and its weights."""
        entries = [*self.manifest.components.values(), *self.manifest.adapters.values()]
        return [s.file for s in self.sources] + [self.folder / e.weights for e in entries if e.weights is not None]

    def source_path(self, name: str) -> Path | None:
        """Where component `name`'s `source` lives: inside an installed package or the card folder."""
        source = self.manifest.components[name].source
        if source is None:
            return None
        return package_path(source) if source.startswith("package:") else self.folder / source


def package_path(source: str) -> Path:
    """The folder a `package:<module>/<path>` source names inside an installed package, found without
    importing the package (its __init__ may be heavy)."""
    import importlib.util

    module, _, rest = source.removeprefix("package:").partition("/")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise BadInput(f"source {source}: the package '{module}' is not installed "
                       f"(pip install {module.replace('_', '-')})")
    if not spec.submodule_search_locations:
        raise BadInput(f"source {source}: '{module}' is a module, not a package holding folders")
    root = Path(list(spec.submodule_search_locations)[0])
    folder = root / rest
    # inside the package, as a card's files are inside its folder: no ../ anywhere on the disk (a link the package
    # itself ships is its own business)
    if os.path.isabs(rest) or not Path(os.path.normpath(folder)).is_relative_to(os.path.normpath(root)):
        raise BadInput(f"source {source}: {rest!r} leads out of the package '{module}'")
    if not folder.exists():
        raise BadInput(f"source {source}: {folder} does not exist in the installed package '{module}'")
    return folder


def load_card(ref: str | Path, *, checksums: bool = False, adapters: bool = True,
              _chain: tuple[Path, ...] = ()) -> Card:
    """Load and validate the card named by `ref` (a folder, a manifest file or an id).

    Raises CardValidationError listing every problem found; with `checksums`, every declared sha256 is
    verified too (otherwise sums are checked when weights are loaded). Without `adapters`, the LoRA files are not
    checked against their target here but when a request uses them (serving: one unfit adapter does not take the
    card's other adapters, or the base, down with it)."""
    if not isinstance(checksums, bool) or not isinstance(adapters, bool):
        raise BadInput(f"checksums and adapters are True or False, got {checksums!r} and {adapters!r}"[:300])
    file = locate(ref).resolve()
    source = read_source(file)
    problems = _own_path_problems(source)
    data, sources = source.data, (source,)
    extends = data.get("extends")
    if isinstance(extends, str):
        parent = _load_parent(source, extends, checksums, _chain + (file,))
        inherited = {k: v for k, v in parent.raw.items() if k not in _OWN_KEYS}
        data = merge_extends(_rebase(inherited, parent.folder, file.parent), data)
        sources += parent.sources
    try:
        manifest = CardManifest.model_validate(data)
    except ValidationError as e:
        raise CardValidationError(problems + schema_problems(e, data, sources)) from None
    card = Card(manifest, file, sources, data)
    problems += _reference_problems(card)
    files_ok, refused = True, {p.field for p in problems}  # paths refused already (escaping, a loop)
    for section in ("components", "adapters"):
        for name, entry in getattr(manifest, section).items():
            if entry.weights is not None and f"{section}.{name}.weights" not in refused:
                found = _file_problems(card, (section, name), entry.weights, entry.sha256, checksums)
                files_ok &= not found
                problems += found
    if checksums:
        problems += _report_problems(card)
    if not problems and files_ok:
        found, facts = component_problems(card)
        problems += found + loop_problems(card, facts) + (adapter_problems(card, facts) if adapters else [])
    if problems:
        raise CardValidationError(problems)
    return card


def merge_extends(base: dict, override: dict) -> dict:
    """Derive `override` from `base`: mappings merge by key, null removes, other values replace."""
    out = dict(base)
    for key, value in override.items():
        if value is None and key in out:
            del out[key]
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_extends(out[key], value)
        else:
            out[key] = value
    return out


# --- extends -----------------------------------------------------------------------------------------

MAX_EXTENDS = 32  # cards a manifest may reach through `extends`: far beyond real use, well within Python's recursion
_INVALID = "which is invalid"


def _load_parent(source: Source, extends: str, checksums: bool, chain: tuple[Path, ...]) -> Card:
    folder = source.file.parent
    here = source.problem(("extends",), "", key=False)
    try:
        if extends.startswith(".") or "/" in extends:
            parent_file = locate(str(folder / extends)).resolve()
        else:
            parent_file = locate(extends, near=folder.parent).resolve()
    except BadInput as e:
        raise CardValidationError([_with(here, f"cannot find the card it extends: {e}",
                                         "name an existing card id or a relative card folder")]) from None
    if parent_file in chain:
        cycle = " → ".join(display_path(p.parent) for p in chain + (parent_file,))
        raise CardValidationError([_with(here, f"extends forms a cycle: {cycle}",
                                         "remove one `extends` from the cycle")])
    if len(chain) > MAX_EXTENDS:
        raise CardValidationError([_with(here, f"extends goes more than {MAX_EXTENDS} cards deep",
                                         "extend the card that holds the weights, not a chain of cards extending it")])
    try:
        return load_card(parent_file, checksums=checksums, _chain=chain)
    except CardValidationError as e:
        # the cards between this one and the invalid one are not listed a line each (up to 32): the problems
        # after this line name their own files
        first = _with(here, f"extends '{extends}', {_INVALID}", "fix the problems listed after this one")
        raise CardValidationError([first] + [p for p in e.problems if not p.message.endswith(_INVALID)]) from None


def _with(problem: Problem, message: str, fix: str) -> Problem:
    return Problem(problem.file, problem.line, problem.column, problem.field, message, fix)


def _file_fields(data: dict):
    """(field path, value) of every manifest field that names a file inside the card folder."""
    for section in ("components", "adapters"):
        entries = data.get(section)
        if not isinstance(entries, dict):
            continue
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                continue
            for field in ("weights", "source"):
                value = entry.get(field)
                if isinstance(value, str) and not (field == "source" and ":" in value):
                    yield (section, str(name), field), value


def _rebase(data: dict, old: Path, new: Path) -> dict:
    """`data` with its file paths rewritten from relative-to-`old` to relative-to-`new`."""
    out = copy.deepcopy(data)
    for (section, name, field), value in _file_fields(data):
        out[section][name][field] = os.path.relpath(old / value, new)
    return out


def _own_path_problems(source: Source) -> list[Problem]:
    """Paths a manifest declares itself must stay inside its card folder."""
    folder = source.file.parent.resolve()
    problems = []
    for path, value in _file_fields(source.data):
        message = f"'{value[:200]}' escapes the card folder {display_path(folder)}"
        try:
            inside = not Path(value).is_absolute() and (folder / value).resolve().is_relative_to(folder)
        except (OSError, ValueError, RuntimeError):  # a NUL byte; a symlink loop (RuntimeError before 3.13)
            inside, message = False, f"'{value[:200]}' cannot be resolved (a symlink loop, or not a usable name)"
        if not inside:
            problems.append(source.problem(path, message, "use a path relative to the card folder, inside it"))
    return problems


# --- checks after the schema -------------------------------------------------------------------------

def _reference_problems(card: Card) -> list[Problem]:
    m = card.manifest
    components = ", ".join(sorted(m.components))
    problems = []
    for name, loop in m.loops.items():
        for i, used in enumerate(loop.uses):
            if used not in m.components:
                problems.append(card.problem(("loops", name, "uses", str(i)),
                                             f"loop '{name}' uses '{used}', which the card does not declare",
                                             f"declare components.{used} or use one of: {components}"))
    for name, adapter in m.adapters.items():
        if adapter.target not in m.components:
            problems.append(card.problem(("adapters", name, "target"),
                                         f"adapter '{name}' targets '{adapter.target}', which is not a component",
                                         f"target one of: {components}"))
    loop = m.recipe.assumes.loop
    if loop is not None and loop not in m.loops:
        declared = ", ".join(sorted(m.loops)) or "none declared"
        problems.append(card.problem(("recipe", "assumes", "loop"),
                                     f"assumes loop '{loop}', which the card does not declare",
                                     f"declare loops.{loop} or assume one of: {declared}"))
    for name, component in m.components.items():
        source = component.source
        if source is None:
            continue
        if ":" in source:
            scheme, _, rest = source.partition(":")
            if scheme != "package" or not rest or rest.startswith("/"):
                problems.append(card.problem(("components", name, "source"), f"unknown source '{source}'",
                                             "use package:<module>/<folder> or a folder inside the card"))
        elif not _exists(card.folder / source):
            problems.append(card.problem(("components", name, "source"),
                                         f"'{source}' does not exist in {display_path(card.folder)}",
                                         "add it to the card folder or correct the path"))
    return problems


def _file_problems(card: Card, at: FieldPath, rel: str, sha256: str | None, checksums: bool) -> list[Problem]:
    path = card.folder / rel
    weights_at = at + ("weights",)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return [card.problem(weights_at, format_problem(path) or "", "convert the weights to .safetensors")]
    if not is_regular_file(path):
        what = "is not a regular file" if _exists(path) else f"does not exist in {display_path(card.folder)}"
        return [card.problem(weights_at, f"'{rel}' {what}", "add the file or correct the path")]
    reason = format_problem(path)
    if reason:
        return [card.problem(weights_at, reason, "write the weights with safetensors")]
    if checksums and sha256 is not None:
        actual = sha256_file(path)
        if actual != sha256:
            return [card.problem(at + ("sha256",), f"sha256 of '{rel}' is {actual}, the manifest declares {sha256}",
                                 "restore the original file, or update sha256 if the new weights are intended")]
    if checksums:  # reading every byte anyway: weights holding NaN or inf would only ever sample noise
        broken = non_finite_tensors(path)
        if broken:
            return [card.problem(weights_at, f"'{rel}' holds NaN or inf in {few(broken)}",
                                 "restore the weights from a good checkpoint")]
    return []


def _report_problems(card: Card) -> list[Problem]:
    """The eval report beside the manifest whose summary `eval --record` wrote into recipe.metrics.eval (its file name
    and sha256): where it is there, it is the report the summary was made from — one changed since would contradict
    the numbers the manifest shows. (A card copied without its report keeps its summary.)"""
    summary = card.manifest.recipe.metrics.get("eval")
    if not isinstance(summary, dict) or not isinstance(summary.get("report"), str) \
            or not isinstance(summary.get("sha256"), str):
        return []
    name, at = summary["report"], ("recipe", "metrics", "eval")
    if name in ("", ".", "..") or name != Path(name).name or "\\" in name:
        return [card.problem(at + ("report",), f"the eval report {name!r} is not a file name beside the manifest",
                             "record the eval again (cardtool eval CARD --record)")]
    path = card.folder / name
    if not is_regular_file(path):
        return []
    actual = sha256_file(path)
    if actual != summary["sha256"]:
        return [card.problem(at + ("sha256",), f"sha256 of the eval report '{name}' is {actual}, the recorded summary "
                             f"declares {summary['sha256']}: the report changed after it was recorded",
                             "restore the report, or record the eval again (cardtool eval CARD --record)")]
    return []


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False
