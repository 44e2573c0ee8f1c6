"""Built-in cards ship inside the wheel and are found from an installed wheel, not only from a checkout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

from helpers import EXAMPLE_CARDS, REPO


def test_builtin_cards_are_found_from_a_built_wheel(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("cardtool", "cards"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", source / "cards" / "tiny-base")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("cardtool-*.whl")
    assert "cardtool/cards/tiny-base/card.yaml" in zipfile.ZipFile(wheel).namelist()

    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = ("import sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'cardtool'; "
           "from cardtool.cli import main; main()")
    listed = subprocess.run([sys.executable, "-c", run, str(installed), "cards", "list", "--json"], cwd=elsewhere,
                            capture_output=True, text=True, timeout=60, check=True)
    cards = {c["id"]: c for c in json.loads(listed.stdout)["cards"]}
    card = cards["tiny-base"]
    assert (card["origin"], card["valid"]) == ("builtin", True)
    assert all(c["origin"] == "builtin" and c["valid"] for c in cards.values()), "every shipped card is found"
    assert card["path"].startswith(str(installed / "cardtool" / "cards"))
    shown = subprocess.run([sys.executable, "-c", run, str(installed), "cards", "validate", "--checksums",
                            card["path"]], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
