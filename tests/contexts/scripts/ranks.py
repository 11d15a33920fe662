"""torchrun or ``accelerate launch``: every rank loads each model at once from empty caches,
then the ranks exchange their configs (``all_gather_object``). Each rank writes
``rank<N>.json``. ``argv[3]`` is ``torchrun`` or ``accelerate`` (the Accelerator's own
barrier and gather)."""

import _ctx

_ctx.codeferry_if_asked()

import sys  # noqa: E402

import torch.distributed as dist  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

if sys.argv[3] == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    distributed = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    barrier = accelerator.wait_for_everyone

    def gather(obj):
        return gather_object([obj])
else:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    distributed = "gloo"
    barrier = dist.barrier

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out


def load(model):
    config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    built = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True)
    return config, built


results = {"world": world, "distributed": distributed}
for layout, model in _ctx.layouts():
    barrier()  # every rank starts its load at the same moment
    try:
        config, built = load(model)
        result = {"config": _ctx.module_of(config), "model": _ctx.module_of(built),
                  "same_config_class": type(built.config) is type(config),
                  "config_class": type(built).config_class is type(config)}
    except Exception as exc:
        config, result = None, _ctx.error(exc)
    try:  # reached by every rank, so no rank waits forever on one that failed
        configs = gather(config)
        if config is not None:
            result["gathered_same_class"] = all(type(c) is type(config) for c in configs)
    except Exception as exc:
        result["gather"] = _ctx.error(exc)
    results[layout] = result
_ctx.report(results, f"{_ctx.out_dir()}/rank{rank}.json")
barrier()
