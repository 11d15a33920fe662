"""CPU Linear layers packed once for oneDNN (``_exec/packing.py``): the same model, faster.

Runs in this process on a tiny random Llama; ``test_decode.py`` checks that an executor's
worker packs its model and still gives ``generate``'s greedy tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from codeferry._exec.generate.decode import RowOptions, decode
from codeferry._exec.generate.packing import pack_linears

torch = pytest.importorskip("torch")

from test_decode import EOS, generated, llama_folder, tiny_llama  # noqa: E402  (after importorskip)

from codeferry._exec.generate import packing  # noqa: E402

#: Every dtype is packed: half precision natively where the CPU has instructions for it,
#: else upcast (a float32 copy); ``test_half_precision_upcast...`` forces the upcast.
DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_model_gives_the_same_logits_and_greedy_tokens(dtype: str) -> None:
    plain, packed = tiny_llama().to(getattr(torch, dtype)), tiny_llama().to(getattr(torch, dtype))
    assert pack_linears(packed) == 2 * 7 + 1  # q, k, v, o, gate, up, down; the head
    assert all("forward" in vars(m) for m in packed.modules() if type(m) is torch.nn.Linear)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2], [1, 44, 8, 90, 12, 19]])
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), packed(ids).logits.float()
    rounding = 1e-4 if dtype == "float32" else 2e-2
    assert (got - want).abs().max() <= rounding * want.abs().max()
    if dtype == "float32":
        prompts = [[1, 5, 9, 33], [1, 44, 8], [1, 7, 7, 7, 7, 60]]
        options = [RowOptions(30, (EOS,))] * len(prompts)
        assert decode(packed, prompts, options, pad_token_id=0) == decode(
            plain, prompts, options, pad_token_id=0)


def test_training_and_other_dtypes_take_f_linear() -> None:
    model = tiny_llama()
    pack_linears(model)
    ids = torch.tensor([[1, 5, 9, 33]])
    model(ids).logits.sum().backward()  # autograd on: F.linear, so gradients reach weights
    assert model.lm_head.weight.grad is not None
    layer = model.model.layers[0].mlp.up_proj
    with torch.inference_mode(), pytest.raises(RuntimeError):
        layer(torch.ones(2, 64, dtype=torch.float64))  # F.linear's own refusal, not oneDNN's


class Scaled(torch.nn.Linear):
    def forward(self, x: Any) -> Any:
        return super().forward(x) * 2


def test_subclasses_hooked_modules_and_other_devices_stay_as_they_are() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Scaled(8, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 8).double())
    hooked = model[2]
    hooked.forward = functools.partial(torch.nn.Linear.forward, hooked)  # as accelerate does
    assert pack_linears(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
    assert isinstance(vars(hooked)["forward"], functools.partial)
    assert "forward" not in vars(model[3])  # float64: not packed
    assert pack_linears(torch.nn.Sequential(torch.nn.ReLU())) == 0


def test_the_switch_turns_it_off_in_the_workers(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Any) -> None:
    import codeferry
    from codeferry import _settings

    assert _settings.cpu_pack_enabled()
    monkeypatch.setenv("CODEFERRY_CPU_PACK", "0")
    assert not _settings.cpu_pack_enabled()
    model, tokenizer = llama_folder(tmp_path / "llama")
    # a spawned worker reads it from the environment it starts with; generate's tokens still
    with codeferry.Executor(tmp_path / "llama", workers=1, preload=("generate",)) as ex:
        assert ex.worker_info[0]["packed_linears"] == 0, ex.worker_info[0]
        got = ex.generate(["w9 w20 w31"], max_new_tokens=5)[0]
    want = generated(model, tokenizer("w9 w20 w31")["input_ids"], RowOptions(5, (EOS,)))
    assert got == tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_of_any_shape_and_stride_give_f_linears_product(dtype: str) -> None:
    packed = torch.nn.Linear(64, 48).to(getattr(torch, dtype))
    plain = torch.nn.Linear(64, 48).to(getattr(torch, dtype))
    plain.load_state_dict(packed.state_dict())
    assert pack_linears(torch.nn.Sequential(packed)) == 1
    inputs = [torch.randn(64, 5, 3).permute(1, 2, 0), torch.randn(7, 128)[:, ::2],
              torch.randn(2, 3, 4, 64), torch.randn(0, 64), torch.randn(64)]
    rounding = 1e-5 if dtype == "float32" else 2e-2
    with torch.inference_mode():
        for x in (i.to(getattr(torch, dtype)) for i in inputs):
            got, want = packed(x).float(), plain(x).float()
            assert got.shape == want.shape
            assert got.numel() == 0 or (got - want).abs().max() <= rounding * want.abs().max()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_upcast_gives_the_plain_models_greedy_tokens(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # as on a CPU without AVX-512 BF16/FP16 or AMX: float32 copies of the weights
    monkeypatch.setattr(packing, "native_dtypes", lambda: {torch.float32})
    half = getattr(torch, dtype)
    plain, packed = tiny_llama().to(half), tiny_llama().to(half)
    assert pack_linears(packed) == 2 * 7 + 1
    assert all(vars(m)["forward"].upcast for m in packed.modules() if type(m) is torch.nn.Linear)
    x = torch.randn(16, 64).to(half)
    layer = packed.model.layers[0].mlp.up_proj
    with torch.inference_mode():
        got, want = layer(x), torch.nn.functional.linear(x, layer.weight)
    assert got.dtype == half  # cast back: the model's next op sees its own dtype
    # a half-precision matmul that accumulates in float32, as PyTorch's: all but a rounding
    # step here and there bit-identical
    assert (got == want).float().mean() > 0.99
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    prompts = [[1, 5, 9, 33], [1, 44, 8], [1, 7, 7, 7, 7, 60]]
    options = [RowOptions(30, (EOS,))] * len(prompts)
    assert decode(packed, prompts, options, pad_token_id=0) == decode(
        plain, prompts, options, pad_token_id=0)


def test_no_upcast_without_room_for_the_float32_copies(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(packing, "native_dtypes", lambda: {torch.float32})
    model = tiny_llama().to(torch.bfloat16)
    weights = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setattr(packing, "available_bytes", lambda: 2 * 4 * weights - 2)
    with caplog.at_level("WARNING", logger=packing.__name__):
        assert pack_linears(model) == 0  # the copies would take more than half of what is free
    assert "bfloat16 layers keep PyTorch's own matmul" in caplog.text
    assert "x 1 workers" in caplog.text
    monkeypatch.setattr(packing, "available_bytes", lambda: 2 * 4 * weights)
    # Two workers building at once each see this much free: together they would not fit.
    assert pack_linears(model, sharing=2) == 0
    assert "x 2 workers" in caplog.text
    assert pack_linears(model) == 2 * 7 + 1
