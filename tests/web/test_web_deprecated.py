"""No deprecated frontend API in the pack: web/ uses none of the names ComfyUI's frontend warns about (v1.49.6, the
comfyui-frontend-package of ComfyUI v0.33: its bundle's console.warn / warnDeprecated / defineDeprecatedProperty
messages), and the node definitions use no deprecated option. The properties the installed bundle marks with
defineDeprecatedProperty are added to the list from the bundle itself."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

# name (a regular expression) -> what the frontend says instead
DEPRECATED = {
    r"\binputEl\b": "widget.inputEl is deprecated: use widget.element",
    r"\bmenuContainer\b": "the legacy menu (app.ui.menuContainer) is deprecated: use the sidebar or the new menu",
    r"\bComfyList\b": "the legacy queue/history menu is deprecated",
    r"(?<![-\w])comfy-menu(?![-\w])": "the legacy menu's container (.comfy-menu) is deprecated",
    r"\bui\.settings\b|\baddSetting\b": "the legacy settings dialog: declare `settings` in registerExtension",
    r"\bgetSettingValue\b": "app.getSettingValue: use app.extensionManager.setting.get",
    r"\bgetCanvasMenuOptions\b": "monkey-patching getCanvasMenuOptions is deprecated: use getCanvasMenuItems",
    r"\bgetNodeMenuOptions\b": "monkey-patching getNodeMenuOptions is deprecated: use getNodeMenuItems",
    r"\bgetGroupMenuOptions\b": "LGraphCanvas.getGroupMenuOptions is deprecated: use LGraphGroup.getMenuOptions",
    r"\bsetSizeForImage\b": "node.setSizeForImage is deprecated and has no effect",
    r"\bcheckState\b": "checkState() is deprecated: use captureCanvasState()",
    r"\bopen_maskeditor\b": "ComfyApp.open_maskeditor is deprecated",
    r"\bwidgets_up\b": "the widgets_up property is unsupported: use widgets_start_y",
    r"\bcaptureInput\b": "captureInput is deprecated: use LGraphCanvas.pointer",
    r"\bonBeforeChange\b": "LGraph.onBeforeChange is deprecated: listen on LGraphCanvas.onBeforeChange",
}


def frontend_deprecated_properties() -> set[str]:
    """The properties the installed frontend bundle defines as deprecated (defineDeprecatedProperty(obj, `name`...))."""
    try:
        import comfyui_frontend_package
    except ImportError:
        return set()
    assets = pathlib.Path(comfyui_frontend_package.__file__).parent / "static" / "assets"
    found = set()
    for js in assets.glob("*.js"):
        found |= set(re.findall(r"defineDeprecatedProperty\(\w+,\s*[`'\"](\w+)[`'\"]", js.read_text("utf-8", "replace")))
    return found


def deprecated_uses(text: str) -> list[str]:
    patterns = dict(DEPRECATED)
    for name in frontend_deprecated_properties():
        patterns.setdefault(rf"\b{name}\b", f"{name} is deprecated in the installed frontend")
    return [f"line {text[:m.start()].count(chr(10)) + 1}: {m.group(0)} ({why})"
            for pattern, why in patterns.items() for m in re.finditer(pattern, text)]


def test_web_uses_no_deprecated_frontend_api():
    files = sorted((ROOT / "web").rglob("*.js"))
    assert files
    found = {str(p.relative_to(ROOT)): deprecated_uses(p.read_text()) for p in files}
    assert {k: v for k, v in found.items() if v} == {}


def test_node_definitions_use_no_deprecated_input_option():
    """The frontend warns on `defaultInput` in a node's input options (use forceInput, or drop it)."""
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "nodes").rglob("*.py") if "defaultInput" in p.read_text()]
    assert found == []


def test_the_check_finds_what_the_frontend_warns_about():
    assert frontend_deprecated_properties() >= {"inputEl"} or not frontend_deprecated_properties()
    bad = "const el = widget.inputEl ?? widget.element;\napp.ui.menuContainer.append(b); LGraphCanvas.prototype." \
          "getCanvasMenuOptions = f;"
    found = deprecated_uses(bad)
    assert any("inputEl" in f and f.startswith("line 1") for f in found)
    assert any("menuContainer" in f and f.startswith("line 2") for f in found)
    assert any("getCanvasMenuOptions" in f for f in found)
    assert deprecated_uses("background: var(--comfy-menu-bg, #222); widget.element") == []
