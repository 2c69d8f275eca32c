"""orchard: portable FlashAttention.

The attention kernels live in the C extension `orchard_ops`; this package re-exports them and
(in later layers) adds device selection, PyTorch integration and a trainer.
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
