"""Loads the ``oldnames`` folder with codeferry and prints, as JSON, which of its names are
transformers' own, and which of them this release has: run by ``test_compat.py``."""

import json
import sys

import codeferry


def main() -> None:
    import transformers.utils
    from transformers import PreTrainedModel
    from transformers.cache_utils import DynamicCache

    classes = codeferry.load(sys.argv[1], trust_remote_code=True)
    model_class = classes["AutoModel"]
    module = sys.modules[model_class.__module__]
    print(json.dumps({
        "version": transformers.__version__,
        "fx_is_transformers": module.is_torch_fx_available is getattr(
            transformers.utils, "is_torch_fx_available", None),
        "cache_is_transformers": module.DynamicCache is DynamicCache,
        "head_mask_is_transformers": model_class.get_head_mask is getattr(
            PreTrainedModel, "get_head_mask", None),
        "max_length": classes["AutoConfig"]().max_length,
        "has": {"fx": hasattr(transformers.utils, "is_torch_fx_available"),
                "cache": hasattr(DynamicCache, "from_legacy_cache"),
                "head_mask": hasattr(PreTrainedModel, "get_head_mask")},
    }))


if __name__ == "__main__":
    main()
