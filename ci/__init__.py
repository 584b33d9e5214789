"""The pipeline's modules (``ci.pipeline`` is the driver and maps the others; noxfile.py calls
it)."""
