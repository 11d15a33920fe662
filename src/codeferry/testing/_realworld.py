"""Factory variants with the faults real remote-code folders have, one fault per variant.

Each variant is a factory model (``write_model``) with one change that real folders show
(ChatGLM, Qwen-VL, InternVL2, MiniCPM-V, Florence-2, Baichuan2...):

``tokenizer_missing_package``
    the tokenizer module imports a package that is not installed (``sentencepiece``);
    config and models never import it.
``vision_missing_package``
    an extra model class (``AutoModelForVision2Seq``) whose vision tower helper imports a
    package that is not installed (``timm``); the language model does not.
``deferred_helpers``
    two helpers imported only inside methods: ``cpp_kernels.py`` imports a package that is
    not installed (``bitsandbytes``), ``lazy_ops.py`` records its own execution in the file
    named by ``$CODEFERRY_TEST_MARKER``. Plain transformers executes neither at load.
``transformers_name_missing``
    an extra class (``AutoModelForSequenceClassification``) whose helper imports a name
    the installed transformers does not have.
``config_missing_package``
    the configuration module imports a package that is not installed: nothing that
    needs the config can load.
``lfs_config``
    ``config.json`` is a Git LFS pointer (the real file was never pulled).
``no_generation_hooks``
    the causal LM neither inherits ``GenerationMixin`` nor defines ``generate`` or
    ``prepare_inputs_for_generation`` (as many real remote models are written): whether
    transformers gives it ``generate()`` depends on its release.
``super_from_pretrained``
    the causal LM overrides ``from_pretrained`` and calls ``super(ItsClass, cls)`` by the
    module's name for its class, as Baichuan2's does: whatever gives it ``generate()`` must
    leave that name bound to the class itself.
``automodel_only``
    ``auto_map`` names no ``AutoModelForCausalLM``: ``AutoModel`` and
    ``AutoModelForSeq2SeqLM`` both map the causal LM, as ChatGLM-6B's does (users call
    ``AutoModel.from_pretrained(...).generate``).
``embeds_generate``
    ``AutoModelForCausalLM`` maps a chat wrapper around a language model, as vision-language
    models' do (InternVL 2, Florence-2): its ``forward`` needs an image, and its ``generate``
    embeds the ids and calls the language model's ``generate`` with ``inputs_embeds``, which
    returns the new tokens only, without the prompt.

The packages named are real ones that codeferry's test environments do not install;
tests check that they are really absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ._factory import write_model
from ._spec import ModelSpec

__all__ = ["REAL_WORLD_KINDS", "MISSING_PACKAGES", "write_real_world_model"]

REAL_WORLD_KINDS: tuple[str, ...] = (
    "tokenizer_missing_package",
    "vision_missing_package",
    "deferred_helpers",
    "transformers_name_missing",
    "config_missing_package",
    "lfs_config",
    "no_generation_hooks",
    "super_from_pretrained",
    "automodel_only",
    "embeds_generate",
)

#: Packages the variants import that must not be installed where the tests run.
MISSING_PACKAGES: tuple[str, ...] = ("sentencepiece", "timm", "bitsandbytes")

_LFS = "version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize 1234\n".format("0" * 64)


def _edit_auto_map(path: Path, **entries: str) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data["auto_map"].update(entries)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _prepend_import(path: Path, line: str) -> None:
    text = path.read_text(encoding="utf-8")
    head, sep, body = text.partition('"""\n\n')  # after the module docstring
    path.write_text(head + sep + line + "\n" + body, encoding="utf-8")


def write_real_world_model(path: str | os.PathLike[str], kind: str, name: str = "rw") -> Path:
    """Write variant ``kind`` (one of ``REAL_WORLD_KINDS``) at ``path``; returns the folder."""
    if kind not in REAL_WORLD_KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(REAL_WORLD_KINDS)}")
    root = write_model(path, ModelSpec(name=name, tokenizer=True, helpers=("flat",)))
    prefix = name.capitalize()
    if kind == "tokenizer_missing_package":
        _prepend_import(root / f"tokenization_{name}.py", "import sentencepiece as spm")
    elif kind == "vision_missing_package":
        (root / "vision_tower.py").write_text(
            '"""A vision tower built on timm, as many vision-language models do."""\n\n'
            "import timm\n\n\n"
            "def build_tower(name):\n"
            "    return timm.create_model(name, pretrained=False)\n",
            encoding="utf-8",
        )
        (root / f"modeling_vision_{name}.py").write_text(
            f'"""The vision-language head of {name}: needs the vision tower."""\n\n'
            f"from .modeling_{name} import {prefix}PreTrainedModel\n"
            "from .vision_tower import build_tower\n\n\n"
            f"class {prefix}VisionModel({prefix}PreTrainedModel):\n"
            "    def __init__(self, config):\n"
            "        super().__init__(config)\n"
            "        self.tower = build_tower('vit_tiny_patch16_224')\n",
            encoding="utf-8",
        )
        _edit_auto_map(root / "config.json",
                       AutoModelForVision2Seq=f"modeling_vision_{name}.{prefix}VisionModel")
    elif kind == "deferred_helpers":
        (root / "cpp_kernels.py").write_text(
            '"""CUDA kernels, compiled on first use; needs bitsandbytes."""\n\n'
            "import bitsandbytes\n\n\n"
            "def quantize(x):\n"
            "    return bitsandbytes.functional.quantize_4bit(x)\n",
            encoding="utf-8",
        )
        (root / "lazy_ops.py").write_text(
            '"""A helper imported only inside a method: it records when it executes."""\n\n'
            "import os\n\n"
            "_marker = os.environ.get('CODEFERRY_TEST_MARKER')\n"
            "if _marker:\n"
            "    with open(_marker, 'a', encoding='utf-8') as handle:\n"
            "        handle.write(__name__ + '\\n')\n\n\n"
            "def double(x):\n"
            "    return 2 * x\n",
            encoding="utf-8",
        )
        modeling = root / f"modeling_{name}.py"
        modeling.write_text(
            modeling.read_text(encoding="utf-8")
            + "\n\ndef lazy_double(x):\n"
            "    from .lazy_ops import double\n\n"
            "    return double(x)\n\n\n"
            "def quantize_weights(x):\n"
            "    from .cpp_kernels import quantize\n\n"
            "    return quantize(x)\n",
            encoding="utf-8",
        )
    elif kind == "transformers_name_missing":
        (root / "legacy_heads.py").write_text(
            '"""Written for an older transformers: the name moved away since."""\n\n'
            "from transformers.modeling_utils import PretrainedHeadThatNoLongerExists\n\n"
            "HEAD = PretrainedHeadThatNoLongerExists\n",
            encoding="utf-8",
        )
        (root / f"modeling_cls_{name}.py").write_text(
            f'"""A classification head of {name} that needs the legacy helper."""\n\n'
            f"from .modeling_{name} import {prefix}PreTrainedModel\n"
            "from .legacy_heads import HEAD\n\n\n"
            f"class {prefix}ForSequenceClassification({prefix}PreTrainedModel):\n"
            "    head = HEAD\n",
            encoding="utf-8",
        )
        _edit_auto_map(
            root / "config.json",
            AutoModelForSequenceClassification=f"modeling_cls_{name}.{prefix}ForSequenceClassification",
        )
    elif kind == "config_missing_package":
        _prepend_import(root / f"configuration_{name}.py", "import timm  # noqa: F401")
    elif kind == "lfs_config":
        (root / "config.json").write_text(_LFS, encoding="utf-8")
    elif kind == "no_generation_hooks":
        modeling = root / f"modeling_{name}.py"
        text = modeling.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        start = next(i for i, line in enumerate(lines)
                     if line.startswith("    def prepare_inputs_for_generation("))
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or lines[end].startswith("        ")):
            end += 1  # the method's body (and blank lines after it)
        modeling.write_text("".join(lines[:start] + lines[end:]), encoding="utf-8")
        # The model keeps no KV cache: say so, as such models do, so generate() re-reads
        # the whole sequence instead of feeding it the last token only.
        gen = root / "generation_config.json"
        data = json.loads(gen.read_text(encoding="utf-8"))
        data["use_cache"] = False
        gen.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    elif kind == "super_from_pretrained":
        modeling = root / f"modeling_{name}.py"
        text = modeling.read_text(encoding="utf-8")
        anchor = "    def prepare_inputs_for_generation("
        override = (
            "    @classmethod\n"
            "    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):\n"
            "        # as Baichuan2's: its own bookkeeping, then the base class by name\n"
            f"        return super({prefix}ForCausalLM, cls).from_pretrained(\n"
            "            pretrained_model_name_or_path, *model_args, **kwargs)\n\n")
        modeling.write_text(text.replace(anchor, override + anchor, 1), encoding="utf-8")
    elif kind == "automodel_only":
        config = root / "config.json"
        data = json.loads(config.read_text(encoding="utf-8"))
        head = data["auto_map"].pop("AutoModelForCausalLM")
        data["auto_map"].update(AutoModel=head, AutoModelForSeq2SeqLM=head)
        config.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    elif kind == "embeds_generate":
        (root / f"modeling_chat_{name}.py").write_text(_CHAT.format(name=name, prefix=prefix),
                                                      encoding="utf-8")
        _edit_auto_map(root / "config.json",
                       AutoModelForCausalLM=f"modeling_chat_{name}.{prefix}ChatModel")
    return root


_CHAT = '''"""The chat model of {name}: a vision-language wrapper around a language model."""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from .modeling_{name} import {prefix}PreTrainedModel


class {prefix}ChatModel({prefix}PreTrainedModel):
    main_input_name = "pixel_values"

    def __init__(self, config):
        super().__init__(config)
        self.vision_proj = nn.Linear(3, config.hidden_size)
        self.language_model = LlamaForCausalLM(LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=2 * config.hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=2, num_key_value_heads=2, eos_token_id=getattr(config, "eos_token_id", None),
            tie_word_embeddings=False))
        self.post_init()

    def forward(self, pixel_values, input_ids=None, attention_mask=None, **kwargs):
        image = self.vision_proj(pixel_values.mean(dim=(-1, -2)))[:, None]
        embeds = self.language_model.get_input_embeddings()(input_ids)
        return self.language_model(inputs_embeds=torch.cat([image, embeds], 1), **kwargs)

    @torch.no_grad()
    def generate(self, pixel_values=None, input_ids=None, attention_mask=None,
                 generation_config=None, **generate_kwargs):
        input_embeds = self.language_model.get_input_embeddings()(input_ids)
        return self.language_model.generate(inputs_embeds=input_embeds,
                                            attention_mask=attention_mask,
                                            generation_config=generation_config,
                                            use_cache=True, **generate_kwargs)
'''
