"""The pipeline's modules (``ci.pipeline`` holds the steps; noxfile.py calls them)."""
