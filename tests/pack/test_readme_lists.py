"""The documentation names what the code registers and links to what exists: the README's node table and
docs/samplers.md's sampler list match the code, the README keeps the two commands CI runs, and every relative
link in the README, CONTRIBUTING.md and docs/ resolves (file and heading)."""
from __future__ import annotations

import pathlib
import re

import comfy_metal
from comfy_metal.nodes import sampling

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 3)
    return text[start:end if end > 0 else None]


def test_every_node_is_in_the_readme_node_table():
    table = _section(README, "Nodes")
    missing = []
    for name in comfy_metal.NODE_CLASS_MAPPINGS:
        if f"`{name}`" in table:
            continue
        # the multi-encoder loaders share a row: `...Dual...`, `…Triple…`, `…Quadruple…`
        size = next((s for s in ("Triple", "Quadruple") if s in name), None)
        if size and f"`{name.replace(size, 'Dual')}`" in table and f"`…{size}…`" in table:
            continue
        missing.append(name)
    assert not missing, f"nodes missing from the README's node table: {missing}"
    named = set(re.findall(r"`(Metal[A-Za-z0-9]+)`", table))
    assert named <= set(comfy_metal.NODE_CLASS_MAPPINGS), named - set(comfy_metal.NODE_CLASS_MAPPINGS)


def test_every_metal_sampler_is_in_the_sampler_list():
    text = (ROOT / "docs" / "samplers.md").read_text(encoding="utf-8")
    intro = text[: text.index("\n- ")]
    listed = set(re.findall(r"[a-z][a-z0-9_]+", intro.replace("**", " ")))
    assert set(sampling.SAMPLER_NAMES) <= listed, set(sampling.SAMPLER_NAMES) - listed


def test_the_readme_keeps_the_two_commands_and_ci_runs_its_test_command():
    commands = _section(README, "The two commands")
    assert "python -m comfy_metal doctor" in commands and "bash tests/run.sh" in commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^\s*(exec\s+)?bash tests/run\.sh\b", ci, re.M), ci


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text(encoding="utf-8"))
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        text = re.sub(r"(?ms)^```.*?^```", "", doc.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
                continue
            if anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
