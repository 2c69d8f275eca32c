"""orchard: portable FlashAttention.

The attention kernels live in the C extension `orchard_ops`; this package re-exports them.
The submodules add the rest, and only orchard.torch, orchard.model and the trainer need
PyTorch (the optional extra):

    orchard.device_backend   the device, its facts, a training config adapted to them
    orchard.config           loading and validation of configs/universal.yaml
    orchard.torch            flash_attention (autograd) and patch_model
    orchard.model            the GPT-style language model
    orchard.data             token sequences; orchard.prepare is orchard-prepare
    orchard.trainer          the training loop; orchard.train is orchard-train
    orchard.checkpoint       atomic, device-neutral checkpoints
    orchard.generate, orchard.list_devices   orchard-generate, orchard-devices
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
