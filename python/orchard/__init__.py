"""orchard: portable FlashAttention.

The attention kernels live in the C extension `orchard_ops`; this package re-exports them.
The submodules add the rest; only orchard.torch, orchard.model, orchard.trainer,
orchard.checkpoint and orchard.generation need PyTorch (the optional extra):

    orchard.device_backend   the device, its facts, a training config adapted to them
    orchard.config           loading and validation of configs/universal.yaml
    orchard.reference        the float64 NumPy reference of the attention contract
    orchard.torch            flash_attention (autograd) and patch_model
    orchard.attention_op     one call into orchard_ops, and the same as torch.compile's custom ops
    orchard.flash_attn       FlashAttention-2's Python API (flash_attn_func, varlen, kvcache)
    orchard.bert_padding     flash_attn.bert_padding's unpad_input / pad_input
    orchard.hf               attn_implementation="orchard" in transformers 5.x (the hf extra)
    orchard.model            the GPT-style language model
    orchard.data             token sequences: loading, validation, windows, validation split
    orchard.trainer          the training loop
    orchard.checkpoint       atomic, device-neutral checkpoints
    orchard.atomic           files replaced atomically (checkpoints, metrics, prepared data)
    orchard.progress         progress of long work: a tqdm bar, or plain lines in logs
    orchard.generation       text generation from a checkpoint
    orchard.benchmark        attention throughput of every device and backend
    orchard.tuning           OpenCL block sizes picked by timing
    orchard.cli              the console scripts (orchard-train, orchard-bench, ...)
"""
from orchard_ops import (  # noqa: F401  (re-exported API)
    OrchardError,
    OrchardOutOfMemory,
    __version__,
    default_device,
    devices,
    dropout_mask,
    flash_attn_bwd,
    flash_attn_fwd,
    flash_attn_varlen_bwd,
    flash_attn_varlen_fwd,
    get_num_threads,
    reset_stats,
    set_num_threads,
    stats,
)
