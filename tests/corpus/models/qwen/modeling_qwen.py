# ruff: noqa
"""The ``qwen`` corpus model: a decoder written the way Qwen (v1) chat and audio's remote code
was (a reproduction, see ../README.md): keys and values cached as ``[batch, seq, heads, dim]``
tuples whose past length is read from dim 1, ``self.get_head_mask``, ``if past_key_values:``
in ``prepare_inputs_for_generation``, rotary positions by index (padding included) with a
dynamic-NTK ``inv_freq`` and a ``logn_tensor`` made in ``__init__`` as non-persistent
buffers, precision flags set from the config, a ``generate`` override that adds a stop-words
logits processor from the generation config before ``super().generate``, a helper module
imported relatively, and ``transformers_stream_generator`` imported inside ``chat_stream``:
on transformers 5 that package cannot be imported (``DisjunctiveConstraint``), and plain
transformers' import check imports it."""

import math
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizer, StoppingCriteriaList
from transformers.generation.logits_process import LogitsProcessorList

if TYPE_CHECKING:
    from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateOutput
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

try:
    from einops import rearrange
except ImportError:
    rearrange = None

SUPPORT_CUDA = torch.cuda.is_available()
SUPPORT_BF16 = SUPPORT_CUDA and torch.cuda.is_bf16_supported()
SUPPORT_FP16 = SUPPORT_CUDA and torch.cuda.get_device_capability(0)[0] >= 7

from .configuration_qwen import QWenConfig
from .qwen_generation_utils import StopWordsLogitsProcessor, get_stop_words_ids

logger = logging.get_logger(__name__)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._ntk_alpha_cached = 1.0
        self._ntk_alpha_cached_list = [1.0]

    def update_rotary_pos_emb_cache(self, seqlen, ntk_alpha=1.0):
        if seqlen > self._seq_len_cached or ntk_alpha != self._ntk_alpha_cached:
            base = self.base * ntk_alpha ** (self.dim / (self.dim - 2))
            self.inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2).float() / self.dim))
            self._seq_len_cached = max(2 * seqlen, 16)
            self._ntk_alpha_cached = ntk_alpha
            seq = torch.arange(self._seq_len_cached)
            freqs = torch.outer(seq.type_as(self.inv_freq), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]
            self._rotary_pos_emb_cache = [emb.cos(), emb.sin()]

    def forward(self, max_seq_len, ntk_alpha=1.0):
        self.update_rotary_pos_emb_cache(max_seq_len, ntk_alpha)
        cos, sin = self._rotary_pos_emb_cache
        return [cos[:, :max_seq_len], sin[:, :max_seq_len]]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    cos, sin = freqs
    return (t.float() * cos) + (_rotate_half(t.float()) * sin)


class QWenAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)
        self.seq_length = config.seq_length
        self.hidden_size = config.hidden_size
        self.split_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.scale_attn_weights = True
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.c_attn = nn.Linear(config.hidden_size, 3 * self.projection_size)
        self.c_proj = nn.Linear(config.hidden_size, self.projection_size, bias=not config.no_bias)
        self.use_logn_attn = config.use_logn_attn
        logn_list = [math.log(i, self.seq_length) if i > self.seq_length else 1
                     for i in range(1, 32768)]
        self.register_buffer("logn_tensor", torch.tensor(logn_list)[None, :, None, None],
                             persistent=False)

    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5,
                                                     dtype=attn_weights.dtype)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = torch.tril(torch.ones((key_length, key_length), dtype=torch.bool)).view(
            1, 1, key_length, key_length)[:, :, key_length - query_length:key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(causal_mask, attn_weights,
                                   torch.full([], mask_value, dtype=attn_weights.dtype))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights.float(), dim=-1).type(value.dtype)
        if head_mask is not None:
            attn_weights = attn_weights * head_mask
        return torch.matmul(attn_weights, value).transpose(1, 2), attn_weights

    def _split_heads(self, tensor, num_heads, attn_head_size):
        return tensor.view(tensor.size()[:-1] + (num_heads, attn_head_size))

    def forward(self, hidden_states, rotary_pos_emb_list=None, layer_past=None,
                attention_mask=None, head_mask=None, use_cache=False):
        mixed_x_layer = self.c_attn(hidden_states)
        query, key, value = mixed_x_layer.split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        if rotary_pos_emb_list is not None:
            cur_len = query.shape[1]
            rotary_pos_emb = [i[:, -cur_len:, :, :] for i in rotary_pos_emb_list[0]]
            query = apply_rotary_pos_emb(query, rotary_pos_emb).type_as(value)
            key = apply_rotary_pos_emb(key, rotary_pos_emb).type_as(value)
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=1)
            value = torch.cat((layer_past[1], value), dim=1)
        present = (key, value) if use_cache else None
        if self.use_logn_attn and not self.training:
            seq_start, seq_end = key.size(1) - query.size(1), key.size(1)
            query = query * self.logn_tensor[:, seq_start:seq_end, :, :].type_as(query)
        query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
        attn_output, _ = self._attn(query, key, value, attention_mask, head_mask)
        attn_output = attn_output.contiguous().view(attn_output.size(0), attn_output.size(1), -1)
        return self.c_proj(attn_output), present


class QWenMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        ff_dim_in = config.intermediate_size // 2
        self.w1 = nn.Linear(config.hidden_size, ff_dim_in, bias=not config.no_bias)
        self.w2 = nn.Linear(config.hidden_size, ff_dim_in, bias=not config.no_bias)
        self.c_proj = nn.Linear(ff_dim_in, config.hidden_size, bias=not config.no_bias)

    def forward(self, hidden_states):
        return self.c_proj(self.w1(hidden_states) * F.silu(self.w2(hidden_states)))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class QWenBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = QWenAttention(config)
        self.ln_2 = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = QWenMLP(config)

    def forward(self, hidden_states, rotary_pos_emb_list=None, layer_past=None,
                attention_mask=None, head_mask=None, use_cache=False):
        attn_output, present = self.attn(self.ln_1(hidden_states), rotary_pos_emb_list,
                                         layer_past, attention_mask, head_mask, use_cache)
        layernorm_input = attn_output + hidden_states
        return self.mlp(self.ln_2(layernorm_input)) + layernorm_input, present


class QWenPreTrainedModel(PreTrainedModel):
    config_class = QWenConfig
    base_model_prefix = "transformer"
    is_parallelizable = False
    supports_gradient_checkpointing = True
    _no_split_modules = ["QWenBlock"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)


class QWenModel(QWenPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.vocab_size = config.vocab_size
        self.num_hidden_layers = config.num_hidden_layers
        self.embed_dim = config.hidden_size
        self.use_dynamic_ntk = config.use_dynamic_ntk
        self.seq_length = config.seq_length
        self.wte = nn.Embedding(self.vocab_size, self.embed_dim)
        self.drop = nn.Dropout(config.emb_dropout_prob)
        dim = int(config.kv_channels * config.rotary_pct)
        self.rotary_emb = RotaryEmbedding(dim, base=config.rotary_emb_base)
        self.h = nn.ModuleList([QWenBlock(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = RMSNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.post_init()

    def get_ntk_alpha(self, true_seq_len):
        context_value = math.log(true_seq_len / self.seq_length, 2) + 1
        ntk_alpha = 2 ** math.ceil(context_value) - 1
        return max(ntk_alpha, 1)

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None,
                token_type_ids=None, position_ids=None, head_mask=None, inputs_embeds=None,
                use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        batch_size = input_ids.shape[0]
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.h))
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)[:, None, None, :]
            attention_mask = attention_mask.to(dtype=self.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(self.dtype).min
        head_mask = self.get_head_mask(head_mask, self.config.num_hidden_layers)
        hidden_states = self.drop(self.wte(input_ids))
        kv_seq_len = hidden_states.size()[1]
        if past_key_values[0] is not None:
            kv_seq_len += past_key_values[0][0].shape[1]
        if self.training or not self.use_dynamic_ntk:
            ntk_alpha_list = [1.0]
        elif kv_seq_len != hidden_states.size()[1]:
            ntk_alpha_list = self.rotary_emb._ntk_alpha_cached_list
        else:
            ntk_alpha_list = [self.get_ntk_alpha(kv_seq_len)]
        self.rotary_emb._ntk_alpha_cached_list = ntk_alpha_list
        rotary_pos_emb_list = [self.rotary_emb(kv_seq_len, ntk_alpha=a) for a in ntk_alpha_list]
        presents = () if use_cache else None
        for i, (block, layer_past) in enumerate(zip(self.h, past_key_values)):
            hidden_states, present = block(hidden_states, rotary_pos_emb_list, layer_past,
                                           attention_mask, head_mask[i], use_cache)
            if use_cache:
                presents = presents + (present,)
        hidden_states = self.ln_f(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=presents)


class QWenLMHeadModel(QWenPreTrainedModel):
    _keys_to_ignore_on_load_missing = [r"h\.\d+\.attn\.rotary_emb\.inv_freq"]
    _keys_to_ignore_on_load_unexpected = [r"h\.\d+\.attn\.masked_bias"]

    def __init__(self, config):
        super().__init__(config)
        assert config.bf16 + config.fp16 + config.fp32 <= 1, "Only one of bf16, fp16, fp32 may be true"
        autoset_precision = config.bf16 + config.fp16 + config.fp32 == 0
        if autoset_precision:
            if SUPPORT_BF16:
                config.bf16 = True
            elif SUPPORT_FP16:
                config.fp16 = True
            else:
                config.fp32 = True
        if config.use_flash_attn == "auto":
            config.use_flash_attn = False
        self.transformer = QWenModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.bf16:
            self.transformer.bfloat16()
            self.lm_head.bfloat16()
        if config.fp16:
            self.transformer.half()
            self.lm_head.half()
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, inputs_embeds=None,
                                      **kwargs):
        if past_key_values:
            input_ids = input_ids[:, -1].unsqueeze(-1)
        if input_ids.size(0) == 1:
            attention_mask = None
        else:
            attention_mask = kwargs.get("attention_mask", None)
        if inputs_embeds is not None and past_key_values is None:
            model_inputs = {"inputs_embeds": inputs_embeds}
        else:
            model_inputs = {"input_ids": input_ids}
        model_inputs.update({"past_key_values": past_key_values,
                             "use_cache": kwargs.get("use_cache"),
                             "attention_mask": attention_mask})
        return model_inputs

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None,
                token_type_ids=None, position_ids=None, head_mask=None, inputs_embeds=None,
                labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        transformer_outputs = self.transformer(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
            head_mask=head_mask, use_cache=use_cache)
        lm_logits = self.lm_head(transformer_outputs.last_hidden_state)
        return CausalLMOutputWithPast(logits=lm_logits,
                                      past_key_values=transformer_outputs.past_key_values)

    @staticmethod
    def _reorder_cache(past_key_values, beam_idx):
        return tuple(tuple(p.index_select(0, beam_idx) for p in layer) for layer in past_key_values)

    def chat_stream(self, tokenizer: PreTrainedTokenizer, query: str,
                    generation_config: Optional[GenerationConfig] = None, **kwargs):
        from transformers_stream_generator.main import NewGenerationMixin, StreamGenerationConfig

        generation_config = generation_config or self.generation_config
        stop_words_ids = get_stop_words_ids(generation_config.chat_format, tokenizer)
        logits_processor = LogitsProcessorList([StopWordsLogitsProcessor(
            stop_words_ids=stop_words_ids, eos_token_id=generation_config.eos_token_id)])
        input_ids = torch.tensor([tokenizer.encode(query)])
        self.__class__.generate_stream = NewGenerationMixin.generate
        self.__class__.sample_stream = NewGenerationMixin.sample_stream
        stream_config = StreamGenerationConfig(**generation_config.to_dict(), do_stream=True)
        return self.generate_stream(input_ids, return_dict_in_generate=False,
                                    generation_config=stream_config,
                                    logits_processor=logits_processor, seed=-1, **kwargs)

    def generate(self, inputs: Optional[torch.Tensor] = None,
                 generation_config: Optional[GenerationConfig] = None,
                 logits_processor: Optional[LogitsProcessorList] = None,
                 stopping_criteria: Optional[StoppingCriteriaList] = None,
                 prefix_allowed_tokens_fn: Optional[Callable[[int, torch.Tensor], List[int]]] = None,
                 synced_gpus: Optional[bool] = None, assistant_model: Optional["PreTrainedModel"] = None,
                 streamer: Optional["BaseStreamer"] = None,
                 **kwargs) -> Union[GenerateOutput, torch.LongTensor]:
        generation_config = generation_config if generation_config is not None else self.generation_config
        stop_words_ids = kwargs.pop("stop_words_ids", None)
        if stop_words_ids is None and generation_config is not None:
            stop_words_ids = getattr(generation_config, "stop_words_ids", None)
        if stop_words_ids is not None:
            stop_words_logits_processor = StopWordsLogitsProcessor(
                stop_words_ids=stop_words_ids, eos_token_id=generation_config.eos_token_id)
            if logits_processor is None:
                logits_processor = LogitsProcessorList([stop_words_logits_processor])
            else:
                logits_processor.append(stop_words_logits_processor)
        return super().generate(inputs, generation_config=generation_config,
                                logits_processor=logits_processor,
                                stopping_criteria=stopping_criteria,
                                prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                                synced_gpus=synced_gpus, assistant_model=assistant_model,
                                streamer=streamer, **kwargs)
