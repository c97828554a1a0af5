"""docs/DESIGN.md's "where things live" map matches `ls`: every module it names exists, and
every module of the product is named there, so a newcomer reading it finds what is there."""

from __future__ import annotations

import re

from conftest import REPO

PACKAGES = ("common", "consumer", "producer", "monitor", "genq")


def mapped() -> set[str]:
    """Every `name.py` the map's table rows mention, with the row's directory when it has one."""
    text = (REPO / "docs" / "DESIGN.md").read_text().split("## ", 2)[1]  # the map's section
    names: set[str] = set()
    where = ""
    for row in text.splitlines():
        cells = row.split("|")
        if len(cells) < 3:
            continue
        head = cells[1].strip().strip("`")
        if head.endswith("/"):  # a directory's row, or the header of its own table
            where = head
        for name in re.findall(r"`([\w/]+\.py)`", row):
            names.add(name if "/" in name else where + name)
    return names


def test_the_map_names_every_module_and_only_modules_that_exist():
    named = mapped()
    present = {str(p.relative_to(REPO)) for package in PACKAGES
               for p in (REPO / package).rglob("*.py")
               if not (p.parent.is_symlink() or p.parent.parent.is_symlink())
               and p.name not in ("__init__.py", "__main__.py") and "lua" not in p.parts}
    assert sorted(present - named) == [], "modules missing from docs/DESIGN.md's map"
    assert sorted(n for n in named if not (REPO / n).exists()) == [], "the map names these"
