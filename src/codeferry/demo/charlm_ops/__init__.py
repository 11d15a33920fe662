"""Helper sub-package of ``charlm``: ``from .charlm_ops.rope import rope``."""

from .rope import rope

__all__ = ["rope"]
