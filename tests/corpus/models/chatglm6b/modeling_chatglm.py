# ruff: noqa
"""The ``chatglm6b`` corpus model: a decoder written the way ChatGLM-6B's remote code was (the
first ChatGLM, for transformers 4.27; a reproduction, see ../README.md): an ``auto_map`` with
``AutoModel`` and ``AutoModelForSeq2SeqLM`` and no causal-LM key (users call
``AutoModel.from_pretrained(...).generate``); 2-D rotary positions found from the prompt's
``[gMASK]`` and ``<sop>`` tokens; a context that attends both ways; sequence-first tuple caches;
``skip_init`` and no ``post_init``; residuals scaled by ``alpha``; and
``_update_model_kwargs_for_generation`` assigning
``self._extract_past_from_model_output(outputs, standardize_cache_format=...)`` (up to 4.41, that
returned the cache; from 4.42 a pair; transformers 5 has no such method)."""

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import LayerNorm
from torch.nn.utils import skip_init
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.utils import GenerationConfig, LogitsProcessorList, ModelOutput, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import add_start_docstrings, logging

from .configuration_chatglm import ChatGLMConfig

logger = logging.get_logger(__name__)


class InvalidScoreLogitsProcessor(LogitsProcessor):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if torch.isnan(scores).any() or torch.isinf(scores).any():
            scores.zero_()
            scores[..., 5] = 5e4
        return scores


def gelu_impl(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def default_init(cls, *args, **kwargs):
    return cls(*args, **kwargs)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.max_seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x, seq_dim=1, seq_len=None):
        if seq_len is None:
            seq_len = x.shape[seq_dim]
        if self.max_seq_len_cached is None or (seq_len > self.max_seq_len_cached):
            self.max_seq_len_cached = seq_len
            t = torch.arange(seq_len, device=x.device, dtype=self.inv_freq.dtype)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
            self.cos_cached = emb.cos()[:, None, :]
            self.sin_cached = emb.sin()[:, None, :]
        return self.cos_cached[:seq_len, ...], self.sin_cached[:seq_len, ...]


def rotate_half(x):
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def apply_rotary_pos_emb_index(q, k, cos, sin, position_id):
    # position_id: [sq, b], q, k: [sq, b, np, hn], cos: [sq, 1, hn] -> [sq, b, 1, hn]
    cos, sin = F.embedding(position_id, cos.squeeze(1)).unsqueeze(2), F.embedding(position_id, sin.squeeze(1)).unsqueeze(2)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def attention_fn(self, query_layer, key_layer, value_layer, attention_mask, hidden_size_per_partition, layer_id,
                 layer_past=None, scaling_attention_score=True, use_cache=False):
    if layer_past is not None:
        past_key, past_value = layer_past[0], layer_past[1]
        key_layer = torch.cat((past_key, key_layer), dim=0)
        value_layer = torch.cat((past_value, value_layer), dim=0)
    seq_len, b, nh, hidden_size = key_layer.shape
    present = (key_layer, value_layer) if use_cache else None
    query_key_layer_scaling_coeff = float(layer_id + 1)
    if scaling_attention_score:
        query_layer = query_layer / (math.sqrt(hidden_size) * query_key_layer_scaling_coeff)
    # [b, np, sq, sk]
    output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
    query_layer = query_layer.view(output_size[2], output_size[0] * output_size[1], -1)
    key_layer = key_layer.view(output_size[3], output_size[0] * output_size[1], -1)
    matmul_result = torch.bmm(query_layer.transpose(0, 1), key_layer.transpose(0, 1).transpose(1, 2))
    attention_scores = matmul_result.view(*output_size)
    if not (attention_mask == 0).all():
        attention_scores.masked_fill_(attention_mask, -10000.0)
    attention_scores = attention_scores.float() * query_key_layer_scaling_coeff
    attention_probs = F.softmax(attention_scores, dim=-1)
    output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
    value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)
    attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
    context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
    context_layer = context_layer.view(*output_size).permute(2, 0, 1, 3).contiguous()
    context_layer = context_layer.view(*context_layer.size()[:-2], hidden_size_per_partition)
    return context_layer, present


class SelfAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_id, position_encoding_2d=True, empty_init=True):
        super().__init__()
        init_method = skip_init if empty_init else default_init
        self.layer_id = layer_id
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.position_encoding_2d = position_encoding_2d
        self.rotary_emb = RotaryEmbedding(
            self.hidden_size_per_attention_head // 2 if position_encoding_2d else self.hidden_size_per_attention_head)
        self.query_key_value = init_method(torch.nn.Linear, hidden_size, 3 * hidden_size, bias=True)
        self.dense = init_method(torch.nn.Linear, hidden_size, hidden_size, bias=True)

    def split_tensor_along_last_dim(self, tensor, num_partitions):
        last_dim = tensor.dim() - 1
        last_dim_size = tensor.size()[last_dim] // num_partitions
        return torch.split(tensor, last_dim_size, dim=last_dim)

    def forward(self, hidden_states, position_ids, attention_mask, layer_id, layer_past=None, use_cache=False):
        # hidden_states: [seq_len, batch, hidden_size]
        mixed_raw_layer = self.query_key_value(hidden_states)
        new_shape = mixed_raw_layer.size()[:-1] + (self.num_attention_heads, 3 * self.hidden_size_per_attention_head)
        mixed_raw_layer = mixed_raw_layer.view(*new_shape)
        (query_layer, key_layer, value_layer) = self.split_tensor_along_last_dim(mixed_raw_layer, 3)
        if self.position_encoding_2d:
            q1, q2 = query_layer.chunk(2, dim=(query_layer.ndim - 1))
            k1, k2 = key_layer.chunk(2, dim=(key_layer.ndim - 1))
            cos, sin = self.rotary_emb(q1, seq_len=position_ids.max() + 1)
            position_ids, block_position_ids = position_ids[:, 0, :].transpose(0, 1).contiguous(), \
                position_ids[:, 1, :].transpose(0, 1).contiguous()
            q1, k1 = apply_rotary_pos_emb_index(q1, k1, cos, sin, position_ids)
            q2, k2 = apply_rotary_pos_emb_index(q2, k2, cos, sin, block_position_ids)
            query_layer = torch.concat([q1, q2], dim=(q1.ndim - 1))
            key_layer = torch.concat([k1, k2], dim=(k1.ndim - 1))
        else:
            position_ids = position_ids.transpose(0, 1)
            cos, sin = self.rotary_emb(value_layer, seq_len=position_ids.max() + 1)
            query_layer, key_layer = apply_rotary_pos_emb_index(query_layer, key_layer, cos, sin, position_ids)
        context_layer, present = attention_fn(self, query_layer, key_layer, value_layer, attention_mask,
                                              self.hidden_size, layer_id, layer_past=layer_past, use_cache=use_cache)
        return self.dense(context_layer), present


class GLU(torch.nn.Module):
    def __init__(self, hidden_size, inner_hidden_size, empty_init=True):
        super().__init__()
        init_method = skip_init if empty_init else default_init
        self.dense_h_to_4h = init_method(torch.nn.Linear, hidden_size, inner_hidden_size, bias=True)
        self.dense_4h_to_h = init_method(torch.nn.Linear, inner_hidden_size, hidden_size, bias=True)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(gelu_impl(self.dense_h_to_4h(hidden_states)))


class GLMBlock(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layernorm_epsilon, layer_id, inner_hidden_size,
                 num_layers, position_encoding_2d=True, empty_init=True):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.attention = SelfAttention(hidden_size, num_attention_heads, layer_id,
                                       position_encoding_2d=position_encoding_2d, empty_init=empty_init)
        self.post_attention_layernorm = LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.num_layers = num_layers
        self.mlp = GLU(hidden_size, inner_hidden_size, empty_init=empty_init)

    def forward(self, hidden_states, position_ids, attention_mask, layer_id, layer_past=None, use_cache=False):
        attention_input = self.input_layernorm(hidden_states)
        attention_output, present = self.attention(attention_input, position_ids, attention_mask, layer_id,
                                                   layer_past=layer_past, use_cache=use_cache)
        alpha = (2 * self.num_layers) ** 0.5
        hidden_states = attention_input * alpha + attention_output
        mlp_input = self.post_attention_layernorm(hidden_states)
        output = mlp_input * alpha + self.mlp(mlp_input)
        return output, present


class ChatGLMPreTrainedModel(PreTrainedModel):
    is_parallelizable = False
    supports_gradient_checkpointing = True
    config_class = ChatGLMConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["GLMBlock"]

    def _init_weights(self, module: nn.Module):
        return

    def get_masks(self, input_ids, device):
        batch_size, seq_length = input_ids.shape
        context_lengths = [seq.tolist().index(self.config.bos_token_id) for seq in input_ids]
        attention_mask = torch.ones((batch_size, seq_length, seq_length), device=device)
        attention_mask.tril_()
        for i, context_length in enumerate(context_lengths):
            attention_mask[i, :, :context_length] = 1
        attention_mask.unsqueeze_(1)
        return (attention_mask < 0.5).bool()

    def get_position_ids(self, input_ids, mask_positions, device, use_gmasks=None):
        batch_size, seq_length = input_ids.shape
        if use_gmasks is None:
            use_gmasks = [False] * batch_size
        context_lengths = [seq.tolist().index(self.config.bos_token_id) for seq in input_ids]
        if self.position_encoding_2d:
            position_ids = torch.arange(seq_length, dtype=torch.long, device=device).unsqueeze(0).repeat(batch_size, 1)
            for i, context_length in enumerate(context_lengths):
                position_ids[i, context_length:] = mask_positions[i]
            block_position_ids = [torch.cat((
                torch.zeros(context_length, dtype=torch.long, device=device),
                torch.arange(seq_length - context_length, dtype=torch.long, device=device) + 1,
            )) for context_length in context_lengths]
            block_position_ids = torch.stack(block_position_ids, dim=0)
            position_ids = torch.stack((position_ids, block_position_ids), dim=1)
        else:
            position_ids = torch.arange(seq_length, dtype=torch.long, device=device).unsqueeze(0).repeat(batch_size, 1)
            for i, context_length in enumerate(context_lengths):
                if not use_gmasks[i]:
                    position_ids[i, context_length:] = mask_positions[i]
        return position_ids


@add_start_docstrings("The bare ChatGLM-6B Model transformer outputting raw hidden-states.")
class ChatGLMModel(ChatGLMPreTrainedModel):
    def __init__(self, config: ChatGLMConfig, empty_init=True):
        super().__init__(config)
        init_method = skip_init if empty_init else default_init
        self.max_sequence_length = config.max_sequence_length
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.num_layers = config.num_layers
        self.position_encoding_2d = config.position_encoding_2d
        self.word_embeddings = init_method(torch.nn.Embedding, num_embeddings=self.vocab_size,
                                           embedding_dim=self.hidden_size)
        self.layers = torch.nn.ModuleList([
            GLMBlock(self.hidden_size, self.num_attention_heads, config.layernorm_epsilon, layer_id,
                     inner_hidden_size=config.inner_hidden_size, num_layers=self.num_layers,
                     position_encoding_2d=self.position_encoding_2d, empty_init=empty_init)
            for layer_id in range(self.num_layers)])
        self.final_layernorm = LayerNorm(self.hidden_size, eps=config.layernorm_epsilon)

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, new_embeddings: torch.Tensor):
        self.word_embeddings = new_embeddings

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.layers))
            if attention_mask is None:
                attention_mask = self.get_masks(input_ids, device=input_ids.device)
            if position_ids is None:
                MASK, gMASK = self.config.mask_token_id, self.config.gmask_token_id
                seqs = input_ids.tolist()
                mask_positions, use_gmasks = [], []
                for seq in seqs:
                    mask_token = gMASK if gMASK in seq else MASK
                    use_gmask = mask_token == gMASK
                    mask_positions.append(seq.index(mask_token))
                    use_gmasks.append(use_gmask)
                position_ids = self.get_position_ids(input_ids, mask_positions=mask_positions,
                                                     device=input_ids.device, use_gmasks=use_gmasks)
        # [seq_len, batch, hidden_size]
        hidden_states = inputs_embeds.transpose(0, 1)
        presents = () if use_cache else None
        if attention_mask is None:
            attention_mask = torch.zeros(1, 1, device=input_ids.device).bool()
        else:
            attention_mask = attention_mask.to(hidden_states.device)
        for i, layer in enumerate(self.layers):
            hidden_states, present = layer(hidden_states, position_ids=position_ids, attention_mask=attention_mask,
                                           layer_id=torch.tensor(i), layer_past=past_key_values[i],
                                           use_cache=use_cache)
            if use_cache:
                presents = presents + (present,)
        hidden_states = self.final_layernorm(hidden_states)
        if not return_dict:
            return tuple(v for v in [hidden_states, presents] if v is not None)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=presents)


class ChatGLMForConditionalGeneration(ChatGLMPreTrainedModel):
    def __init__(self, config: ChatGLMConfig, empty_init=True):
        super().__init__(config)
        init_method = skip_init if empty_init else default_init
        self.max_sequence_length = config.max_sequence_length
        self.position_encoding_2d = config.position_encoding_2d
        self.transformer = ChatGLMModel(config, empty_init=empty_init)
        self.lm_head = init_method(nn.Linear, config.hidden_size, config.vocab_size, bias=False)
        self.config = config
        self.quantized = False
        if self.config.quantization_bit:
            raise NotImplementedError("quantization is not part of this reproduction")

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _update_model_kwargs_for_generation(self, outputs: ModelOutput, model_kwargs: Dict[str, Any],
                                            is_encoder_decoder: bool = False,
                                            standardize_cache_format: bool = False) -> Dict[str, Any]:
        # update past_key_values
        model_kwargs["past_key_values"] = self._extract_past_from_model_output(
            outputs, standardize_cache_format=standardize_cache_format)
        # update attention mask
        if "attention_mask" in model_kwargs:
            attention_mask = model_kwargs["attention_mask"]
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                attention_mask = torch.cat(
                    [attention_mask, attention_mask.new_ones((*attention_mask.shape[:3], 1))], dim=3)
                new_attention_mask = attention_mask[:, :, -1:].clone()
                new_attention_mask[..., -1] = False
                model_kwargs["attention_mask"] = torch.cat([attention_mask, new_attention_mask], dim=2)
        # update position ids
        if "position_ids" in model_kwargs:
            position_ids = model_kwargs["position_ids"]
            new_position_id = position_ids[..., -1:].clone()
            new_position_id[:, 1, :] += 1
            model_kwargs["position_ids"] = torch.cat([position_ids, new_position_id], dim=-1)
        return model_kwargs

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, past: Optional[torch.Tensor] = None,
                                      past_key_values: Optional[torch.Tensor] = None, attention_mask=None,
                                      position_ids=None, **kwargs) -> dict:
        batch_size, seq_length = input_ids.shape
        MASK, gMASK = self.config.mask_token_id, self.config.gmask_token_id
        seqs = input_ids.tolist()
        mask_positions, use_gmasks = [], []
        for seq in seqs:
            mask_token = gMASK if gMASK in seq else MASK
            use_gmask = mask_token == gMASK
            mask_positions.append(seq.index(mask_token))
            use_gmasks.append(use_gmask)
        # only last token for input_ids if past is not None
        if past is not None or past_key_values is not None:
            last_token = input_ids[:, -1].unsqueeze(-1)
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                attention_mask = attention_mask[:, :, -1:]
            else:
                attention_mask = None
            if position_ids is not None:
                position_ids = position_ids[..., -1:]
            else:
                context_lengths = [seq.index(self.config.bos_token_id) for seq in seqs]
                if self.position_encoding_2d:
                    position_ids = torch.tensor(
                        [[mask_position, seq_length - context_length] for mask_position, context_length in
                         zip(mask_positions, context_lengths)], dtype=torch.long, device=input_ids.device).unsqueeze(-1)
                else:
                    position_ids = torch.tensor(mask_positions, dtype=torch.long,
                                                device=input_ids.device).unsqueeze(-1)
            if past is None:
                past = past_key_values
            return {"input_ids": last_token, "past_key_values": past, "position_ids": position_ids,
                    "attention_mask": attention_mask}
        else:
            if attention_mask is not None and attention_mask.dtype != torch.bool:
                logger.warning_once(f"The dtype of attention mask ({attention_mask.dtype}) is not bool")
                attention_mask = None
            if attention_mask is None:
                attention_mask = self.get_masks(input_ids, device=input_ids.device)
            if position_ids is None:
                position_ids = self.get_position_ids(input_ids, device=input_ids.device,
                                                     mask_positions=mask_positions, use_gmasks=use_gmasks)
            return {"input_ids": input_ids, "past_key_values": past, "position_ids": position_ids,
                    "attention_mask": attention_mask}

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        transformer_outputs = self.transformer(input_ids=input_ids, position_ids=position_ids,
                                               attention_mask=attention_mask, past_key_values=past_key_values,
                                               inputs_embeds=inputs_embeds, use_cache=use_cache,
                                               return_dict=return_dict)
        hidden_states = transformer_outputs[0]
        lm_logits = self.lm_head(hidden_states).permute(1, 0, 2).contiguous()
        if not return_dict:
            return (lm_logits,) + transformer_outputs[1:]
        return CausalLMOutputWithPast(logits=lm_logits, past_key_values=transformer_outputs.past_key_values)

    @staticmethod
    def _reorder_cache(past: Tuple[Tuple[torch.Tensor, torch.Tensor], ...],
                       beam_idx: torch.LongTensor) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
        return tuple((layer_past[0].index_select(1, beam_idx.to(layer_past[0].device)),
                      layer_past[1].index_select(1, beam_idx.to(layer_past[1].device))) for layer_past in past)

    @torch.no_grad()
    def chat(self, tokenizer, query: str, history: List[Tuple[str, str]] = None, max_length: int = 2048,
             num_beams=1, do_sample=True, top_p=0.7, temperature=0.95, logits_processor=None, **kwargs):
        history = history or []
        if logits_processor is None:
            logits_processor = LogitsProcessorList()
        logits_processor.append(InvalidScoreLogitsProcessor())
        gen_kwargs = {"max_length": max_length, "num_beams": num_beams, "do_sample": do_sample, "top_p": top_p,
                      "temperature": temperature, "logits_processor": logits_processor, **kwargs}
        prompt = query
        if history:
            prompt = "".join(f"[Round {i}]\n问：{q}\n答：{r}\n" for i, (q, r) in enumerate(history))
            prompt += f"[Round {len(history)}]\n问：{query}\n答："
        inputs = tokenizer([prompt], return_tensors="pt").to(self.device)
        outputs = self.generate(**inputs, **gen_kwargs)
        outputs = outputs.tolist()[0][len(inputs["input_ids"][0]):]
        response = tokenizer.decode(outputs)
        return response, history + [(query, response)]
