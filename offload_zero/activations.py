"""Activation memory of a Hugging Face decoder (Llama-style blocks): what autograd keeps from
forward for backward, in bytes per device, and a way to measure it.

[Note: activation arithmetic]
The per-layer accounting of Korthikanti et al., 2022 ("Reducing Activation Recomputation in
Large Transformer Models", sec. 4.1), redone for what a Hugging Face Llama-style block
(``LlamaDecoderLayer``: RMSNorm, rotary attention with eager softmax, SwiGLU MLP) saves in
``transformers`` with eager attention, tensor by tensor. Symbols: b micro-batch per device,
s tokens per sequence, h hidden size, a attention heads, d head dimension (q = a d), f MLP
intermediate size, V vocabulary, L layers, K bytes per element of the compute dtype (2 for
bf16/fp16, 4 for fp32); RMSNorm computes in fp32 (4 bytes) whatever K is.

One block saves, in bytes::

    2 [(4 + K) b s h + 4 b s]      two RMSNorms: the fp32 input, the normalised x (K) and
                                   the fp32 reciprocal RMS (b s)
  + 2 K b s h                      the inputs of q/k/v_proj and of gate/up_proj (norm outputs)
  + 4 K b s q                      rotated q, k and v (repeated to a heads for grouped-query
                                   attention: the same bytes), and the input of o_proj
  + (4 + K [K != 4]) b a s^2       the fp32 softmax output and its copy in the compute dtype
                                   (the same tensor when K = 4); dropout p=0 saves nothing
  + 4 K b s f                      SwiGLU: the gate's input, silu(gate), up, and down's input

Outside the blocks: 16 b s (int64 token ids for the embedding and the loss's targets),
2 K s d (rotary cos and sin, shared by every block), the final norm's (4 + K) b s h + 4 b s,
lm_head's input K b s h, the loss's fp32 log-softmax 4 b s V, and the logits the model returns,
K b s V (held until backward ends). Parameters (weights saved by matmuls) are model states,
not activations, and are not counted here.

With activation checkpointing (each block recomputed in backward, as the engine's
``activation_checkpointing=True``) the blocks keep only their inputs, L K b s h, and one block's
saved tensors exist at a time during backward (the block being recomputed): the total is
``L K b s h + one block + outside``.

Error: :func:`saved_tensor_bytes` on tiny Llama configurations (fp32 and bf16, grouped-query and
plain attention, two sizes) agrees with the formula within 0.1%; the documented bound is 1%
(``tests/test_activations.py``). Not counted: transient tensors of backward (gradients of
activations, at most about one block's worth plus the logits' gradient, 4 b s V), the
allocator's fragmentation and the framework's workspace; SDPA and flash attention save less
than eager (no ``b a s^2`` terms), so for them the figure is an upper bound.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch

_FP32 = 4  # bytes of the fp32 tensors RMSNorm and the loss compute in
_ID = 8    # bytes of an int64 token id


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-style decoder that its activations depend on (elements).

    Fields: hidden_size (h), num_layers (L), num_heads (a), head_dim (d), intermediate_size
    (f), vocab_size (V); all ints >= 1.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> "DecoderShape":
        """The shape of a transformers config (its text config where it has one): reads
        ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``,
        ``vocab_size`` and ``head_dim`` (default ``hidden_size // num_attention_heads``).

        Raises:
            NotImplementedError: the config lacks one of those fields (not a Llama-style
                decoder: the formula of [Note: activation arithmetic] does not apply), naming
                the config class and the missing fields.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        names = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size", "vocab_size")
        missing = [n for n in names if not isinstance(getattr(config, n, None), int)]
        if missing:
            raise NotImplementedError(
                f"activations of {type(config).__name__} are not estimated: the formula is for "
                f"Llama-style decoders, and this config has no {', '.join(missing)}")
        head_dim = getattr(config, "head_dim", None)
        if not isinstance(head_dim, int):
            head_dim = config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                   head_dim, config.intermediate_size, config.vocab_size)

    @classmethod
    def assumed(cls, num_layers: int, hidden_size: int, vocab_size: int) -> "DecoderShape":
        """The shape assumed for a model known by its parameter count (see
        :func:`offload_zero.estimator.assumed_layout`, whose L and h are passed in): heads of
        128 dimensions, a SwiGLU MLP of ``8 h / 3`` (12 h^2 parameters per block)."""
        heads = max(1, hidden_size // 128)
        return cls(hidden_size, num_layers, heads, hidden_size // heads,
                   max(1, round(8 * hidden_size / 3)), vocab_size)


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes per device for one micro-batch (see [Note: activation arithmetic]).

    Fields: per_layer (one block's saved tensors), blocks (what all blocks keep until backward:
    L per_layer, or with checkpointing L block inputs plus one block), outside (embedding,
    rotary tables, final norm, head and loss), logits (the returned logits); total: their sum.
    """

    per_layer: int
    blocks: int
    outside: int
    logits: int

    @property
    def total(self) -> int:
        """blocks + outside + logits (bytes)."""
        return self.blocks + self.outside + self.logits


def activation_bytes(shape: DecoderShape, batch_size: int, seq_len: int,
                     dtype: torch.dtype = torch.bfloat16,
                     activation_checkpointing: bool = False) -> ActivationBytes:
    """Bytes autograd keeps for backward in one forward of ``batch_size`` sequences of
    ``seq_len`` tokens on one device, by [Note: activation arithmetic].

    Args:
        shape: the decoder's sizes. batch_size: micro-batch per device (b), int >= 1.
        seq_len: tokens per sequence (s), int >= 1. dtype: the compute dtype (float32, bfloat16
            or float16). activation_checkpointing: each block recomputed in backward.

    Raises:
        ValueError: a batch size or sequence length that is not an int >= 1, or another dtype.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not valid; it must be an int >= 1")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} is not valid; choose float32, bfloat16 or float16")
    k = torch.empty(0, dtype=dtype).element_size()
    b, s, sh = batch_size, seq_len, shape
    bs, q = b * s, sh.num_heads * sh.head_dim
    norm = (_FP32 + k) * bs * sh.hidden_size + _FP32 * bs
    scores = (_FP32 + (k if k != _FP32 else 0)) * b * sh.num_heads * s * s
    per_layer = (2 * norm + 2 * k * bs * sh.hidden_size + 4 * k * bs * q + scores
                 + 4 * k * bs * sh.intermediate_size)
    if activation_checkpointing:
        blocks = sh.num_layers * k * bs * sh.hidden_size + per_layer
    else:
        blocks = sh.num_layers * per_layer
    outside = (2 * _ID * bs + 2 * k * s * sh.head_dim + norm + k * bs * sh.hidden_size
               + _FP32 * bs * sh.vocab_size)
    return ActivationBytes(per_layer, blocks, outside, k * bs * sh.vocab_size)


def saved_storages(forward: Callable[[], object], exclude=()) -> Tuple[Dict[int, int], object]:
    """Run ``forward()`` under ``torch.autograd.graph.saved_tensors_hooks`` and collect the
    distinct storages autograd packs for backward, plus the storage of the returned ``logits``
    (if the result has them). Storages of the tensors in ``exclude`` (the parameters) are left
    out. Returns ``({storage data_ptr: bytes}, forward's result)``.

    Tensors kept by a non-reentrant checkpoint are not all seen: inside the checkpointed region
    its own hooks replace these (the caller adds the block inputs it keeps).
    """
    left_out = {t.untyped_storage().data_ptr() for t in exclude}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in left_out:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    logits: Optional[torch.Tensor] = getattr(out, "logits", None)
    if logits is not None:
        seen.setdefault(logits.untyped_storage().data_ptr(), logits.untyped_storage().nbytes())
    return seen, out


def saved_tensor_bytes(forward: Callable[[], object], exclude=()) -> int:
    """Bytes of :func:`saved_storages` (distinct storages autograd keeps for backward, and the
    returned logits), the measurement [Note: activation arithmetic] is checked against."""
    return sum(saved_storages(forward, exclude)[0].values())
