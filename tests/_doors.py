"""Model folders with the doors beside ``auto_map``, shared by the ``test_doors_*`` modules."""

from __future__ import annotations

import json
from pathlib import Path

PIPE = '''from transformers import Pipeline
from .pipe_helper import WHO


class TokPipeline(Pipeline):
    def _sanitize_parameters(self, **kwargs):
        return {}, {}, {}

    def preprocess(self, text):
        return self.tokenizer(text, return_tensors="pt")

    def _forward(self, inputs):
        return self.model(**inputs)

    def postprocess(self, outputs):
        return {"who": WHO}
'''


def add_pipeline(folder: Path, who: str = "locked", impl: object = "pipe_tok.TokPipeline") -> Path:
    """``folder`` with a custom pipeline ``tok-task`` whose module imports a helper."""
    (folder / "pipe_tok.py").write_text(PIPE, encoding="utf-8")
    (folder / "pipe_helper.py").write_text(f"WHO = {who!r}\n", encoding="utf-8")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config["custom_pipelines"] = {"tok-task": {"impl": impl, "pt": ["AutoModelForCausalLM"]}}
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def edit_json(path: Path, **fields: object) -> None:
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    data.update(fields)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def write_native_model(folder: Path, **config: object) -> Path:
    """A tiny Llama (transformers' own code: no ``auto_map``, no trust needed) whose
    config.json gets ``config``'s fields, e.g. a Hub kernel as its attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(small).save_pretrained(folder)
    edit_json(folder / "config.json", **config)
    return folder
