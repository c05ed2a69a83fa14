"""The command line, `python -m comfy_metal {doctor,bench,run}` (main.py), and the tools behind it:
run_workflow.py (a workflow through ComfyUI's executor, headless), bench/ (one module a capability)."""
