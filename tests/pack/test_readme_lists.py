"""The README's node table and sampler list name what the code registers (issue 15: "the README's node and
sampler lists match the code")."""
from __future__ import annotations

import pathlib
import re

import comfy_metal
from comfy_metal.nodes import sampling

README = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 3)
    return README[start:end if end > 0 else None]


def test_every_node_is_in_the_readme_node_table():
    table = _section("Install into ComfyUI")
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


def test_every_metal_sampler_is_in_the_readme_sampler_list():
    text = _section("Metal samplers")
    intro = text[: text.index("\n- ")]
    listed = set(re.findall(r"[a-z][a-z0-9_]+", intro.replace("**", " ")))
    assert set(sampling.SAMPLER_NAMES) <= listed, set(sampling.SAMPLER_NAMES) - listed
