"""status tests: shared test helpers live in tests/helpers/ (on sys.path through pyproject's pythonpath)."""
from comfyui_marker import *  # noqa: F401,F403  (marks the ComfyUI integration tests `comfyui`)
