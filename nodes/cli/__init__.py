"""The command line, `python -m comfy_metal {doctor,bench,run}` (main.py), and the tools behind it:
doctor.py (the end-to-end pipeline on synthetic weights), run_workflow.py (a workflow through ComfyUI's
executor, headless), bench/ (one module a capability)."""
