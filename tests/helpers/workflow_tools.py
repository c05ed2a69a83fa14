"""Check ComfyUI workflows (UI and API format) against node definitions (object_info).

object_info is what ComfyUI's /object_info route returns: per node class, `input` (required /
optional / hidden specs), `input_order`, `output`, `output_name`. For the pack's own nodes it is
computed from the classes (no ComfyUI needed); for core nodes it comes from a real ComfyUI.
"""
from __future__ import annotations

import contextlib
import importlib.util
import numbers
import sys
import types

CONNECTION_ONLY = object()
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
MODEL_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".gguf", ".bin")


def node_info_from_class(name: str, cls, display_name: str | None = None) -> dict:
    """object_info entry for a V1 node class (what server.node_info computes)."""
    inputs = cls.INPUT_TYPES()
    return {
        "input": inputs,
        "input_order": {k: list(v.keys()) for k, v in inputs.items()},
        "output": list(cls.RETURN_TYPES),
        "output_name": list(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES)),
        "name": name,
        "display_name": display_name or name,
        "category": getattr(cls, "CATEGORY", "sd"),
        "output_node": bool(getattr(cls, "OUTPUT_NODE", False)),
    }


@contextlib.contextmanager
def _folder_paths_without_comfyui():
    """Loader nodes list model files via ComfyUI's folder_paths in INPUT_TYPES. Without ComfyUI, a
    stand-in module answers with no files (file COMBOs are then empty; validation with
    allow_missing_files accepts model file names). Does nothing when folder_paths is importable."""
    if "folder_paths" in sys.modules or importlib.util.find_spec("folder_paths") is not None:
        yield
        return
    stand_in = types.ModuleType("folder_paths")
    stand_in.get_filename_list = lambda kind: []
    stand_in.get_folder_paths = lambda kind: []
    sys.modules["folder_paths"] = stand_in
    try:
        yield
    finally:
        if sys.modules.get("folder_paths") is stand_in:
            del sys.modules["folder_paths"]


def pack_object_info() -> dict:
    import comfy_metal

    with _folder_paths_without_comfyui():
        return {name: node_info_from_class(name, cls, comfy_metal.NODE_DISPLAY_NAME_MAPPINGS.get(name))
                for name, cls in comfy_metal.NODE_CLASS_MAPPINGS.items()}


def input_kind(spec) -> str:
    """'COMBO' for a list of choices, else the type name (INT, FLOAT, MODEL, ...)."""
    t = spec[0]
    if isinstance(t, (list, tuple)):
        return "COMBO"
    return str(t)


def combo_options(spec) -> list:
    if isinstance(spec[0], (list, tuple)):
        return list(spec[0])
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return list(opts.get("options", []))


def ordered_inputs(info: dict) -> list[tuple[str, tuple, bool]]:
    """(name, spec, required) in the order the frontend lays them out."""
    out = []
    for section in ("required", "optional"):
        specs = info["input"].get(section, {}) or {}
        order = info.get("input_order", {}).get(section, list(specs))
        for name in order:
            out.append((name, tuple(specs[name]), section == "required"))
    return out


def widget_inputs(info: dict) -> list[tuple[str, tuple, bool]]:
    return [(n, s, r) for n, s, r in ordered_inputs(info) if input_kind(s) in WIDGET_TYPES]


def has_control_after_generate(spec, name: str | None = None) -> bool:
    """The frontend adds a "control after generate" widget (its value follows in widgets_values) when the
    spec asks for one (True or the default mode, e.g. "fixed"), and to every INT named seed / noise_seed."""
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if "control_after_generate" in opts:
        return bool(opts["control_after_generate"])
    return input_kind(spec) == "INT" and name in ("seed", "noise_seed")


def check_value(node: str, name: str, spec, value, allow_missing_files: bool) -> list[str]:
    kind = input_kind(spec)
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    where = f"node {node} input {name!r}"
    if kind == "INT":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return [f"{where}: {value!r} is not an INT"]
    elif kind == "FLOAT":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return [f"{where}: {value!r} is not a FLOAT"]
    elif kind == "STRING":
        if not isinstance(value, str):
            return [f"{where}: {value!r} is not a STRING"]
    elif kind == "BOOLEAN":
        if not isinstance(value, bool):
            return [f"{where}: {value!r} is not a BOOLEAN"]
    elif kind == "COMBO":
        options = combo_options(spec)
        if value not in options:
            # a model file, or a model folder ("name/", as the MoE loader lists Hugging Face folders)
            is_file = isinstance(value, str) and (value.lower().endswith(MODEL_FILE_SUFFIXES) or value.endswith("/"))
            if not (allow_missing_files and is_file):
                return [f"{where}: {value!r} is not one of {options[:8]}{'...' if len(options) > 8 else ''}"]
    if kind in ("INT", "FLOAT"):
        if "min" in opts and value < opts["min"]:
            return [f"{where}: {value} < min {opts['min']}"]
        if "max" in opts and value > opts["max"]:
            return [f"{where}: {value} > max {opts['max']}"]
    return []


def types_match(out_type: str, in_type: str) -> bool:
    if out_type == "*" or in_type == "*":
        return True
    return bool(set(out_type.split(",")) & set(in_type.split(",")))


def validate_ui(workflow: dict, object_info: dict, allow_missing_files: bool = True,
                known_frontend_only: frozenset = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})) -> list[str]:
    problems: list[str] = []
    nodes = {n["id"]: n for n in workflow.get("nodes", [])}
    for n in nodes.values():
        t = n["type"]
        if t in known_frontend_only:
            continue
        info = object_info.get(t)
        if info is None:
            problems.append(f"node {n['id']}: type {t!r} is not a known node")
            continue
        widgets = widget_inputs(info)
        values = list(n.get("widgets_values", []))
        i = 0
        for name, spec, _ in widgets:
            if i >= len(values):
                problems.append(f"node {n['id']} ({t}): missing widget value for {name!r}")
                break
            problems += check_value(f"{n['id']} ({t})", name, spec, values[i], allow_missing_files)
            i += 1
            if has_control_after_generate(spec, name):
                if i < len(values) and values[i] in ("fixed", "increment", "decrement", "randomize"):
                    i += 1
        if i < len(values):
            problems.append(f"node {n['id']} ({t}): {len(values) - i} extra widget values {values[i:]}")
        declared_outputs = info["output"]
        for slot, out in enumerate(n.get("outputs", [])):
            if slot >= len(declared_outputs):
                problems.append(f"node {n['id']} ({t}): output slot {slot} does not exist")
            elif out.get("type") != declared_outputs[slot]:
                problems.append(f"node {n['id']} ({t}): output {slot} is {out.get('type')}, node says {declared_outputs[slot]}")
        connectable = {name: spec for name, spec, _ in ordered_inputs(info)}
        linked = set()
        for inp in n.get("inputs", []):
            if inp["name"] not in connectable:
                problems.append(f"node {n['id']} ({t}): input {inp['name']!r} does not exist")
            if inp.get("link") is not None:
                linked.add(inp["name"])
        for name, spec, required in ordered_inputs(info):
            if required and input_kind(spec) not in WIDGET_TYPES and name not in linked:
                problems.append(f"node {n['id']} ({t}): required input {name!r} is not connected")
    for link in workflow.get("links", []):
        link_id, src, src_slot, dst, dst_slot, ltype = link[:6]
        if src not in nodes or dst not in nodes:
            problems.append(f"link {link_id}: joins missing node {src if src not in nodes else dst}")
            continue
        s, d = nodes[src], nodes[dst]
        s_out = s.get("outputs", [])
        d_in = d.get("inputs", [])
        if src_slot >= len(s_out) or dst_slot >= len(d_in):
            problems.append(f"link {link_id}: slot out of range ({src}:{src_slot} -> {dst}:{dst_slot})")
            continue
        out_type, in_type = s_out[src_slot]["type"], d_in[dst_slot]["type"]
        if not types_match(out_type, in_type) or not types_match(ltype, in_type):
            problems.append(f"link {link_id}: {s['type']}.{s_out[src_slot]['name']} ({out_type}) -> "
                            f"{d['type']}.{d_in[dst_slot]['name']} ({in_type}) types differ")
        if d_in[dst_slot].get("link") != link_id:
            problems.append(f"link {link_id}: target input does not point back at it")
        if link_id not in (s_out[src_slot].get("links") or []):
            problems.append(f"link {link_id}: source output does not list it")
        info = object_info.get(d["type"])
        if info:
            spec = dict((n_, s_) for n_, s_, _ in ordered_inputs(info)).get(d_in[dst_slot]["name"])
            if spec and not types_match(out_type, "COMBO" if input_kind(spec) == "COMBO" else input_kind(spec)) \
                    and input_kind(spec) != "COMBO":
                problems.append(f"link {link_id}: into {d['type']}.{d_in[dst_slot]['name']} which takes {input_kind(spec)}, got {out_type}")
    return problems


def validate_api(prompt: dict, object_info: dict, allow_missing_files: bool = True) -> list[str]:
    problems: list[str] = []
    for node_id, node in prompt.items():
        t = node.get("class_type")
        info = object_info.get(t)
        if info is None:
            problems.append(f"node {node_id}: type {t!r} is not a known node")
            continue
        specs = {n: (s, r) for n, s, r in ordered_inputs(info)}
        inputs = node.get("inputs", {})
        for name, value in inputs.items():
            if name not in specs:
                problems.append(f"node {node_id} ({t}): input {name!r} does not exist")
                continue
            spec, _ = specs[name]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
                src = prompt.get(value[0])
                if src is None:
                    problems.append(f"node {node_id} ({t}): input {name!r} links to missing node {value[0]}")
                    continue
                src_info = object_info.get(src.get("class_type"))
                if src_info is None:
                    continue
                if value[1] >= len(src_info["output"]):
                    problems.append(f"node {node_id} ({t}): input {name!r} links to output {value[1]} of "
                                    f"{src['class_type']} which has {len(src_info['output'])}")
                    continue
                out_type = src_info["output"][value[1]]
                want = input_kind(spec)
                if want != "COMBO" and not types_match(out_type, want):
                    problems.append(f"node {node_id} ({t}): input {name!r} takes {want}, linked to {out_type}")
            else:
                problems += check_value(f"{node_id} ({t})", name, spec, value, allow_missing_files)
        for name, (spec, required) in specs.items():
            if required and name not in inputs:
                problems.append(f"node {node_id} ({t}): required input {name!r} is missing")
    return problems


def api_from_ui(workflow: dict, object_info: dict) -> dict:
    """The API-format prompt a UI-format workflow stands for (frontend-only nodes dropped)."""
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {l[0]: l for l in workflow.get("links", [])}
    prompt = {}
    for n in nodes.values():
        info = object_info.get(n["type"])
        if info is None or n.get("mode", 0) in (2, 4):
            continue
        inputs = {}
        values = list(n.get("widgets_values", []))
        i = 0
        for name, spec, _ in widget_inputs(info):
            if i < len(values):
                inputs[name] = values[i]
            i += 1
            if has_control_after_generate(spec, name) and i < len(values) and values[i] in ("fixed", "increment", "decrement", "randomize"):
                i += 1
        for inp in n.get("inputs", []):
            if inp.get("link") is not None:
                l = links[inp["link"]]
                inputs[inp["name"]] = [str(l[1]), l[2]]
        prompt[str(n["id"])] = {"class_type": n["type"], "inputs": inputs}
    return prompt


def ui_from_api(prompt: dict, object_info: dict, notes: list[str] = (), titles: dict | None = None) -> dict:
    """A drag-and-drop (UI format) workflow for an API-format prompt, laid out left to right by depth."""
    titles = titles or {}
    ids = {k: int(k) for k in prompt}

    def deps(k):
        return [v[0] for v in prompt[k]["inputs"].values()
                if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)]

    depth: dict[str, int] = {}

    def depth_of(k):
        if k not in depth:
            depth[k] = 1 + max((depth_of(d) for d in deps(k)), default=-1)
        return depth[k]

    for k in prompt:
        depth_of(k)
    # A node without inputs (a loader, a noise or latent source) sits in the column just before its
    # first consumer, not all in the first column: a shorter graph that fits the view at a larger scale.
    for k in prompt:
        if not deps(k):
            consumers = [depth[c] for c in prompt if k in deps(c)]
            if consumers:
                depth[k] = max(0, min(consumers) - 1)
    order = sorted(prompt, key=lambda k: (depth[k], ids[k]))
    y_in_col: dict[int, int] = {}
    ui_nodes, links = [], []
    by_id = {}
    for order_index, k in enumerate(order):
        node = prompt[k]
        info = object_info[node["class_type"]]
        col = depth[k]
        height = _node_height(info, node)
        y = y_in_col.get(col, 60)
        y_in_col[col] = y + height + 50
        n = {"id": ids[k], "type": node["class_type"], "pos": [80 + 380 * col, y],
             "size": [340, height], "flags": {}, "order": order_index, "mode": 0,
             "inputs": [], "outputs": [], "properties": {"Node name for S&R": node["class_type"]},
             "widgets_values": []}
        if k in titles:
            n["title"] = titles[k]
        for name, spec, _ in ordered_inputs(info):
            kind = input_kind(spec)
            value = node["inputs"].get(name)
            linked = isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            if kind in WIDGET_TYPES:
                if linked:
                    n["inputs"].append({"name": name, "type": kind if kind != "COMBO" else "COMBO",
                                        "widget": {"name": name}, "link": None})
                default = (spec[1].get("default") if len(spec) > 1 and isinstance(spec[1], dict) else None)
                if default is None and kind == "COMBO":
                    opts = combo_options(spec)
                    default = opts[0] if opts else ""
                elif default is None:  # the frontend keeps a value of the widget's type for a linked widget
                    default = {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(kind)
                n["widgets_values"].append(default if linked or value is None else value)
                if has_control_after_generate(spec, name):
                    n["widgets_values"].append("fixed")
            elif name in node["inputs"] or _required(info, name):
                n["inputs"].append({"name": name, "type": kind, "link": None})
        for slot, (otype, oname) in enumerate(zip(info["output"], info["output_name"])):
            n["outputs"].append({"name": oname, "type": otype, "links": [], "slot_index": slot})
        ui_nodes.append(n)
        by_id[ids[k]] = n
    link_id = 0
    for k in order:
        n = by_id[ids[k]]
        for slot, inp in enumerate(n["inputs"]):
            value = prompt[k]["inputs"].get(inp["name"])
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                link_id += 1
                src = by_id[int(value[0])]
                ltype = src["outputs"][value[1]]["type"]
                inp["link"] = link_id
                src["outputs"][value[1]]["links"].append(link_id)
                links.append([link_id, src["id"], value[1], n["id"], slot, ltype])
    next_id = max(by_id) + 1 if by_id else 1
    first = by_id[ids[order[0]]] if order else {"pos": [80, 60]}
    y = first["pos"][1]
    for i, text in enumerate(notes):
        # beside the first node (left of it, top-aligned), one under the other: what a user reads first
        height = note_height(text)
        ui_nodes.append({"id": next_id + i, "type": "Note", "pos": [first["pos"][0] - NOTE_GAP - NOTE_WIDTH, y],
                         "size": [NOTE_WIDTH, height], "flags": {}, "order": len(ui_nodes), "mode": 0, "inputs": [],
                         "outputs": [], "properties": {}, "widgets_values": [text], "color": "#432", "bgcolor": "#653"})
        y += height + NOTE_GAP
    return {"last_node_id": max(n["id"] for n in ui_nodes) if ui_nodes else 0, "last_link_id": link_id,
            "nodes": ui_nodes, "links": links, "groups": [], "config": {},
            # tests/tools/build_workflows.py replaces the initial view with one fitted to the Notes and the
            # first nodes
            "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}},
            "version": 0.4}


# A Note node's text box (the frontend's multiline widget: 10 px monospace, about 6 px a character and
# 12 px a line at zoom 1) and the space around it.
NOTE_WIDTH = 460
NOTE_GAP = 40
NOTE_CHARS_PER_LINE = 70
NOTE_LINE_HEIGHT = 12


def note_height(text: str) -> int:
    """The height of a Note that shows `text` without scrolling (wrapped at NOTE_CHARS_PER_LINE)."""
    lines = sum(max(1, -(-len(line) // NOTE_CHARS_PER_LINE)) for line in text.split("\n"))
    return 30 + lines * NOTE_LINE_HEIGHT


def _node_height(info: dict, node: dict) -> int:
    """About the height the frontend gives a node: title, one row per socket, widgets (multiline text is tall)."""
    linked = {n for n, v in node["inputs"].items() if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)}
    sockets = sum(1 for n, s, _ in ordered_inputs(info) if input_kind(s) not in WIDGET_TYPES or n in linked)
    rows = max(sockets, len(info["output"]))
    widgets = 0
    for name, spec, _ in widget_inputs(info):
        if name in linked:
            continue
        opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
        widgets += 110 if (input_kind(spec) == "STRING" and opts.get("multiline")) else 24
    return 40 + 22 * rows + widgets


def _required(info, name) -> bool:
    return name in (info["input"].get("required") or {})
