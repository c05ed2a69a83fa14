"""python -m comfy_metal {doctor,bench,run}"""
import sys

from .nodes.cli.main import main

sys.exit(main())
