"""The docs list what the registries hold: every place in README.md and docs/ that enumerates
the ``layer_pattern`` letters (``models/hybrid/layers.py`` ``LAYERS``) or the recurrences
(``ops/cp/recurrence.py`` ``RECURRENCES``) names every registered one, so a new layer kind or
recurrence that the docs forget fails here with the place and the name.

Each place is ``(file, start, end, pattern, which)``: the passage from the first ``start`` to
the next ``end`` after it, the names ``pattern`` finds in it (its first group; a multi-letter
match, such as an example pattern ``"KKGA"``, counts each letter), and which registered names
it must list. A reworded passage fails with its anchor, so this list follows the docs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

from torchtitan_cp.models.hybrid.layers import LAYERS
from torchtitan_cp.ops.cp.recurrence import RECURRENCES

ROOT = Path(__file__).resolve().parents[1]


class Place(NamedTuple):
    file: str
    start: str
    end: str
    pattern: str
    which: str  # "letters"; "linear letters" / "linear kinds": letters / names of the kinds with
    # kernels of their own (not attention); "recurrences"
    exact: bool = True  # False: examples, where listing more (or repeating) is fine


def registered(which: str) -> dict[str, str]:
    """Name -> what it is, for the registry ``which`` names."""
    if which == "letters":
        return {c: f"{k.name}, {k.description}" for c, k in LAYERS.items()}
    if which == "linear letters":
        return {c: f"{k.name}, {k.description}" for c, k in LAYERS.items() if k.kernels.backends}
    if which == "linear kinds":  # by name, in any case: "KDA / GDN / Mamba2 / retention"
        return {k.name: k.description for k in LAYERS.values() if k.kernels.backends}
    if which == "recurrences":
        return {name: path for name, (path, _) in RECURRENCES.items()}
    raise ValueError(which)


PLACES = [
    Place("README.md", "`layer_pattern` such as", "`attention_backend", r'`"([A-Z]+)"`',
          "letters", exact=False),
    Place("docs/architecture.md", "through the registry `models/hybrid/layers.py` (",
          "), each with", r"`([A-Z])` =", "letters"),
    Place("docs/configuration.md", "| `layer_pattern` |", "\n", r"`([A-Z])` \w", "letters"),
    Place("docs/configuration.md", "kernels of the linear layers (", ")", r"\b([A-Z])\b",
          "linear letters"),
    Place("docs/configuration.md", "every layer pattern (", " and mixes)", r"\b([A-Z])\b",
          "letters"),
    Place("docs/architecture.md", "## Context parallelism, per layer type\n\n* **", "**",
          r"(\w+)", "linear kinds"),
    Place("docs/architecture.md", "HybridDecoder(tokens, positions, seq_ctx)\n     ├─ ", " block:",
          r"(\w+)", "linear kinds"),
    Place("docs/CONTRACTS.md", "# name: recurrence(", ", **options)", r'"(\w+)"', "recurrences"),
]  # fmt: skip # a table, laid out by hand to read across


def passage(text: str, place: Place) -> str:
    """The text of ``place`` in ``text``; an assertion line naming the anchor if it is gone."""
    i = text.find(place.start)
    assert i >= 0, f"{place.file} no longer has {place.start!r}: update PLACES in {__file__}"
    j = text.find(place.end, i + len(place.start))
    assert j >= 0, f"{place.file}: no {place.end!r} after {place.start!r}"
    return text[i + len(place.start) : j]


def listed(text: str, place: Place) -> set[str]:
    found = re.findall(place.pattern, passage(text, place))
    if place.which == "linear kinds":
        return {name.lower() for name in found}
    return set("".join(found)) if "letters" in place.which else set(found)


def problems(text: str, place: Place) -> list[str]:
    """One line per registered name ``place`` does not list (and, for an exact list, per name
    it lists that is not registered)."""
    names, have = registered(place.which), listed(text, place)
    kind = {"recurrences": "recurrence", "linear kinds": "layer kind"}.get(
        place.which, "layer letter"
    )
    registry = (
        "ops/cp/recurrence.py RECURRENCES"
        if place.which == "recurrences"
        else "models/hybrid/layers.py LAYERS"
    )
    where = f"{place.file} (after {place.start!r})"
    out = [
        f"{where} does not list the {kind} {n!r} ({names[n]}), registered in {registry}"
        for n in names
        if n not in have
    ]
    if place.exact:
        out += [
            f"{where} lists {kind} {n!r}, which {registry} does not have" for n in have - set(names)
        ]
    return out


@pytest.mark.parametrize("place", PLACES, ids=lambda p: f"{p.file}:{p.which}:{p.start[:24]}")
def test_docs_list_every_registered_name(place):
    bad = problems((ROOT / place.file).read_text(), place)
    assert not bad, "\n".join(bad)


def test_every_registry_has_a_place():
    # Both registries are enumerated somewhere (a place dropped from PLACES is noticed).
    assert {p.which for p in PLACES} >= {"letters", "recurrences"}


def test_a_missing_name_is_named():
    """The check can fail: drop a letter and a recurrence from the docs' text and the failure
    names each, with the file and the registry."""
    letter, rec = next(iter(LAYERS)), next(iter(RECURRENCES))
    config = (ROOT / "docs/configuration.md").read_text()
    row = PLACES[2]
    cut = config.replace(f"`{letter}` {LAYERS[letter].description.split()[0]}", "", 1)
    assert problems(cut, row) == [
        f"docs/configuration.md (after '| `layer_pattern` |') does not list the layer letter "
        f"{letter!r} ({LAYERS[letter].name}, {LAYERS[letter].description}), registered in "
        "models/hybrid/layers.py LAYERS"
    ]
    contracts = (ROOT / "docs/CONTRACTS.md").read_text()
    place = PLACES[-1]
    i = contracts.index(place.start) + len(place.start)
    body = passage(contracts, place)
    cut = contracts[:i] + body.replace(f'"{rec}"', '""') + contracts[i + len(body) :]
    assert [m for m in problems(cut, place) if repr(rec) in m and "RECURRENCES" in m]
    with pytest.raises(AssertionError, match="no longer has"):
        passage("nothing here", row)
