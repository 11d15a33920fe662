"""Seeded random weights for a corpus model, each tensor seeded by its name, so every
transformers release builds the same: ``python _weights.py MODEL_DIR`` writes
``model.safetensors`` with plain transformers (for a family whose code the running release
cannot import, ``_corpus.build`` runs this with the release it needs first on the path)."""

import json
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_seeded(model: torch.nn.Module, folder: str) -> None:
    state = {}
    for name, tensor in model.state_dict().items():
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        noise = torch.randn(tensor.shape, generator=generator) * 0.3
        state[name] = (noise + (1.0 if name.endswith(("norm.weight", ".ln.weight")) else 0.0)).contiguous()
    save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})


def head(folder: str | Path) -> str:
    """The auto class users build the model with: the causal LM, else ``AutoModel``
    (ChatGLM-6B's map has no causal-LM key; its users call ``AutoModel``)."""
    auto_map = json.loads((Path(folder) / "config.json").read_text())["auto_map"]
    return "AutoModelForCausalLM" if "AutoModelForCausalLM" in auto_map else "AutoModel"


def main() -> None:
    folder = sys.argv[1]
    if len(sys.argv) > 2:  # a release environment: first on the path, as in its workers
        from codeferry._exec.workers.release import hide_conflicts

        sys.path.insert(0, sys.argv[2])
        hide_conflicts(sys.argv[2])
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model_class = getattr(transformers, head(folder))
    save_seeded(model_class.from_config(config, trust_remote_code=True), folder)


if __name__ == "__main__":
    main()
