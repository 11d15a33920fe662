"""What the command line runs: ``run``, ``doctor`` and the renderers of ``inspect``."""
