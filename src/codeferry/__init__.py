"""codeferry: load Hugging Face remote code correctly in every process and on every node."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
