"""User tools around `run`: sweep, bundle, watch, plot (each one module, the CLI in cli/tools.py)."""
