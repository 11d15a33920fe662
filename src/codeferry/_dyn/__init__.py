"""The namespace of remote code loaded by codeferry: ``codeferry._dyn.u<token>.<module>``.

Nothing lives here on disk. Importing this package (which any unpickling of a
codeferry class by name does first) installs the finder that serves these names, from
this process's registered units or from the store (see ``codeferry._runtime.loader``).
"""

from __future__ import annotations

from .._runtime import loader as _loader

_loader.install_finder()
