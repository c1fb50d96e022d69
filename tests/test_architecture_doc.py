"""docs/architecture.md's picture stays true: every code component it names exists, and
the rendered SVG is the current .dot's.

docs/architecture.dot is read as text (no Graphviz here), by the conventions its header
states: one statement per line, nodes as ``id [attr=value, ...];``, edges as
``a -> b [...];`` with two ends. A node that stands for code carries
``tandem_ref="dotted.module:Attribute.path"``; each one must import and resolve.
The SVG must hold exactly the .dot's nodes and visible edges, and every line of every
node label: a .dot edited without ``make architecture-svg`` fails here.
"""

from __future__ import annotations

import html
import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOT = DOCS / "architecture.dot"
SVG = DOCS / "img" / "architecture.svg"

_NODE = re.compile(r"^([A-Za-z_]\w*)\s*\[(.*)\];$")
_EDGE = re.compile(r"^([A-Za-z_]\w*)\s*->\s*([A-Za-z_]\w*)\s*(?:\[(.*)\])?;$")
_ATTR = re.compile(r'([A-Za-z_]\w*)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\s\]]+)')
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_DEFAULTS = ("graph", "node", "edge")


@dataclass
class Graph:
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)  # id -> attributes
    edges: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)


def _attrs(text: str) -> dict[str, str]:
    out = {}
    for key, value in _ATTR.findall(text or ""):
        if value.startswith('"'):
            value = value[1:-1].replace('\\"', '"')
        out[key] = value
    return out


def parse_dot(text: str) -> Graph:
    graph = Graph()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("//"):
            continue
        edge = _EDGE.match(line)
        if edge:
            graph.edges.append((edge[1], edge[2], _attrs(edge[3])))
            continue
        unquoted = _QUOTED.sub('""', line)
        assert "->" not in unquoted, f"architecture.dot:{number}: an edge not in the form `a -> b [...];`: {line}"
        node = _NODE.match(line)
        if node and node[1] not in _DEFAULTS:
            assert node[1] not in graph.nodes, f"architecture.dot:{number}: node {node[1]} declared twice"
            graph.nodes[node[1]] = _attrs(node[2])
    return graph


@pytest.fixture(scope="module")
def graph() -> Graph:
    return parse_dot(DOT.read_text())


def _resolve(ref: str) -> str | None:
    """None if ``ref`` names an object; else why not."""
    if not _REF.match(ref):
        return "not of the form dotted.module:Attribute.path"
    module_name, _, path = ref.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module failed while importing
        return f"module {module_name} does not import: {type(exc).__name__}: {exc}"
    done: list[str] = []
    for part in path.split("."):
        if not hasattr(obj, part):
            where = f"{module_name}:{'.'.join(done)}" if done else f"module {module_name}"
            return f"{where} has no attribute {part!r}"
        obj = getattr(obj, part)
        done.append(part)
    return None


def test_the_dot_parses(graph: Graph) -> None:
    assert len(graph.nodes) >= 40, "architecture.dot: fewer nodes than expected; did the format change?"
    assert graph.edges
    for a, b, _ in graph.edges:
        assert a in graph.nodes and b in graph.nodes, f"edge {a} -> {b}: an end is not a declared node"
    for node_id, attrs in graph.nodes.items():
        assert attrs.get("label"), f"node {node_id} has no label"


def test_every_tandem_ref_resolves(graph: Graph) -> None:
    refs = {node_id: attrs["tandem_ref"] for node_id, attrs in graph.nodes.items() if "tandem_ref" in attrs}
    assert len(refs) >= 40, "architecture.dot: fewer tandem_ref attributes than expected"
    missing = []
    for node_id, ref in refs.items():
        why = _resolve(ref)
        if why is not None:
            missing.append(f"  {node_id}: tandem_ref={ref!r}: {why}")
    assert not missing, (
        "docs/architecture.dot names code that does not exist (fix the reference, the label and "
        "docs/architecture.md, then `make architecture-svg`):\n" + "\n".join(missing)
    )


def _svg_titles(svg: str, kind: str) -> list[str]:
    pattern = rf'<g id="{kind}\d+" class="{kind}">\s*<title>(.*?)</title>'
    return [html.unescape(t) for t in re.findall(pattern, svg)]


def test_the_svg_is_rendered_from_the_current_dot(graph: Graph) -> None:
    assert SVG.exists(), f"{SVG} is missing: run `make architecture-svg`"
    svg = SVG.read_text()
    stale = "docs/img/architecture.svg is older than docs/architecture.dot: run `make architecture-svg`"

    assert sorted(_svg_titles(svg, "node")) == sorted(graph.nodes), f"{stale} (its nodes differ)"
    visible = [f"{a}->{b}" for a, b, attrs in graph.edges if attrs.get("style") != "invis"]
    assert sorted(_svg_titles(svg, "edge")) == sorted(visible), f"{stale} (its edges differ)"

    texts = {html.unescape(t).strip() for t in re.findall(r"<text[^>]*>(.*?)</text>", svg, re.S)}
    absent = []
    for node_id, attrs in graph.nodes.items():
        for line in attrs["label"].split("\\n"):
            if line.strip() and line.strip() not in texts:
                absent.append(f"  {node_id}: {line.strip()!r}")
    assert not absent, f"{stale}; node label lines not in the SVG:\n" + "\n".join(absent)
