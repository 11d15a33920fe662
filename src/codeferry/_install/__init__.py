"""``install()``/``uninstall()``, adopting transformers-loaded code, the model_type guard, the
vLLM plugin and the switch of ``codeferry exec`` (``switch``; ``boot/`` is the folder it puts
on ``PYTHONPATH``, not a package).

These answer transformers for the models ``load`` loaded, so ``load`` must reach them without
importing them (an import that ran back up, and the circles it made, is what this layout
removes): importing this package subscribes their after-load callbacks to ``_load``. The
package facade imports it, so every process that imports codeferry has them.
"""

from .. import _load
from . import adopt, model_types

_load.after_load(model_types.on_load)
_load.after_load(adopt.on_load)
