"""HuggingFace transformers 5.x on orchard: attn_implementation="orchard".

    import orchard.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="orchard")

register() (run by the import) adds two things to transformers: the attention function, and
the mask function that transformers calls once per forward to describe the mask. The mask
function returns what orchard can compute, as transformers' FlashAttention-2 integration
does: None (causal, perhaps with the layer's sliding window), a 2-D (batch, keys) padding
mask, which the attention function unpads onto orchard's varlen path (or, for left padding
without gradients, as in generate(), reads in place; over a static cache the mask also marks
the unwritten keys, so that torch.compile need not read their count), or the sequence ids
(batch, seqlen) of packed sequences. Any other mask (a caller's own 4-D mask, a mask function
orchard does not know) is materialised for transformers' sdpa attention, which then computes
those calls, with one warning per reason. It also makes transformers refuse "orchard" for a
model orchard cannot run (unsupported_reason) as the model is built, and keep it for
continuous batching (generate_batch), where orchard runs as FlashAttention does (varlen calls
over the batch's requests, decode-only batches read in their pages).
"""
import collections
import functools
import itertools
import sys
import warnings
import weakref

import numpy as np

# orchard's extras, from its source tree (PyPI's "orchard" is another project)
_INSTALL = "(pip install '.[%s]' in orchard's source tree)"


def _import_error(package, needs, extras, e):
    """orchard.hf's ImportError for `package`: advice to install it where it is missing (or
    lacks a module or name orchard imports: an older version), else the cause (a dependency
    of its own missing, a local file shadowing one), which no install of it would fix."""
    if e.name == package or (e.name or "").startswith(package + "."):
        return ImportError("orchard.hf needs %s %s" % (needs, _INSTALL % extras))
    return ImportError("orchard.hf: %s failed to import: %s" % (package, e))


try:
    import torch
except ImportError as e:
    raise _import_error("torch", "PyTorch and transformers 5.x", "torch,hf", e) from e
try:
    import transformers
    from transformers import AttentionInterface, masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.auto.configuration_auto import (CONFIG_MAPPING,
                                                             CONFIG_MAPPING_NAMES,
                                                             model_type_to_module_name)
except ImportError as e:
    raise _import_error("transformers", "transformers 5.x", "hf", e) from e
if int(transformers.__version__.split(".")[0]) != 5:
    raise ImportError("orchard.hf needs transformers 5.x, found %s %s"
                      % (transformers.__version__, _INSTALL % "hf"))

try:    # continuous batching (generate_batch)
    from transformers.generation.continuous_batching import (PagedAttentionCache,
                                                             continuous_api, initialization)
except ImportError:     # (a transformers without it)
    PagedAttentionCache = continuous_api = initialization = None

from orchard.bert_padding import pad_input, unpad_input
from orchard.flash_attn import (_cache_call, _check_not_inference, _options, _read_cache,
                                _writable_in_call, flash_attn_varlen_func)
from orchard.torch import _MAX_HEAD_DIM, _ROUTABLE_DTYPES, _as_autocast, _attention, _recording

__all__ = ["register", "attention_forward", "attention_mask", "computes_attention_itself",
           "unsupported_reason"]

NAME = "orchard"

# ----------------------------------------------------------------------------- the model


def _model_class(config_type):
    """transformers' model class for a config class: the base model, else (a decoder-only
    model such as TrOCR's) the causal LM; None for one it does not map (custom code)."""
    for mapping in (transformers.MODEL_MAPPING, transformers.MODEL_FOR_CAUSAL_LM_MAPPING):
        if config_type in mapping:
            cls = mapping[config_type]
            # (several classes for one config, Funnel's: the first is the base model)
            return cls[0] if isinstance(cls, tuple) else cls
    return None


def computes_attention_itself(config):
    """The name of the transformers model class of `config` where that class computes its
    attention in its own code rather than through transformers' attention interface (Bloom,
    XGLM, TrOCR, MPT, ...): attn_implementation="orchard" never reaches its
    attention, and the masks orchard's mask function describes (None for causal) would leave
    it unmasked. None for any other model, or one transformers does not map (custom code)."""
    return _computes_itself(type(config))


# What a model class does depends on its config's class alone; reading it (its source, for
# _can_set_attn_implementation) is too slow to repeat at every attention call: cached.
@functools.lru_cache(maxsize=None)
def _computes_itself(config_type):
    cls = _model_class(config_type)
    if cls is None or cls.is_backend_compatible():
        return None
    # Some models use the interface without the flag that says so (BioGPT): transformers'
    # own test for whether a model's attention can be switched reads its source for the call.
    can_switch = getattr(cls, "_can_set_attn_implementation", None)
    return None if can_switch is not None and can_switch() else cls.__name__


# torch.compile calls it once while tracing and keeps the answer: traced, transformers' model
# mapping fails on a config class (AttributeError: 'debug_repr')
@torch.compiler.assume_constant_result
def unsupported_reason(config):
    """Why attn_implementation="orchard" cannot run the model of `config`, or None. orchard
    reads masks as transformers' FlashAttention-2 integration does (None for causal, a padding
    mask, sequence ids), so it serves the models that integration serves: not those computing
    attention in their own code, nor those whose class says _supports_flash_attn = False
    (their attention needs more than that description: a decoder self-attention causal only
    through its mask (BigBirdPegasus), a mask built on the causal one (Doge), a position bias
    (T5), a mask tensor read by the model (DeepSeek V3.2's indexer), chunked layers (Llama 4)),
    nor those that add an ALiBi bias to the mask (Falcon with alibi=True: transformers refuses
    FlashAttention-2 there)."""
    why = _unsupported(type(config))
    if why is None and getattr(config, "alibi", False) is True:
        why = ("%s with alibi=True adds its ALiBi position bias to the attention mask, which "
               "orchard (as FlashAttention-2) does not read" % type(config).__name__)
    return why


@functools.lru_cache(maxsize=None)
def _unsupported(config_type):
    own = _computes_itself(config_type)
    if own is not None:
        return ("%s computes its attention in its own code, not through transformers' "
                "attention interface" % own)
    cls = _model_class(config_type)
    if cls is None:
        return _sub_model_verdict(config_type)
    if not getattr(cls, "_supports_flash_attn", True):
        return ("transformers marks %s as not supporting FlashAttention-2 "
                "(_supports_flash_attn = False), whose description of the mask orchard reads"
                % cls.__name__)
    return None


def _sub_model_verdict(config_type):
    """For the config of a sub-model that transformers maps to no model class (T5Gemma2's
    decoder, which its layers hold): the reason the models of its folder in transformers
    share, where every one of them has one (the layers never see the top model's config)."""
    module = config_type.__module__.split(".")
    if module[:2] != ["transformers", "models"] or len(module) < 4:
        return None     # custom code
    mapped = [CONFIG_MAPPING[t] for t in CONFIG_MAPPING_NAMES
              if model_type_to_module_name(t) == module[2]]
    reasons = [_unsupported(c) for c in mapped
               if c is not config_type and _model_class(c) is not None]
    if reasons and all(reasons):
        return "%s belongs to a model that orchard cannot run: %s" % (config_type.__name__,
                                                                      reasons[0])
    return None


def _refuse_unsupported(config):
    why = unsupported_reason(config)
    if why is not None:
        cls = _model_class(type(config))
        others = "'sdpa' or 'eager'" if getattr(cls, "_supports_sdpa", False) else "'eager'"
        raise ValueError("orchard.hf: %s, so attn_implementation=%r cannot run it: use %s"
                         % (why, NAME, others))


# ----------------------------------------------------------------------------- the mask


class _Unsupported(Exception):
    """A mask orchard cannot compute; the message says why."""


def _code(fn):
    return getattr(fn, "__code__", None)


def _free_vars(fn):
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))


# transformers builds mask functions as closures of a few factories; a closure is recognised by
# its factory's code object, the same for every closure that factory makes.
_AND = _code(masking_utils.and_masks(masking_utils.causal_mask_function))
_OR = _code(masking_utils.or_masks(masking_utils.causal_mask_function))
_WINDOW = _code(masking_utils.sliding_window_overlay(1))
_CHUNKED = _code(masking_utils.chunked_overlay(1, None))
_PACKED = _code(masking_utils.packed_sequence_mask_function(None))
# from transformers 5.2x on (absent before): the causal part of a packed mask, positions remapped
_REMAP = (_code(masking_utils.remap_positions_for_packed_sequence(None, None))
          if hasattr(masking_utils, "remap_positions_for_packed_sequence") else None)


def _packed_parts(parts):
    """(the packed-sequence part, the causal part) of an and_masks' two parts, or None. The
    parts come in either order (5.24 swapped them); the causal part is plain up to
    transformers 5.17, wrapped by _REMAP later (unwrapped here)."""
    if len(parts) != 2 or _PACKED not in {_code(f) for f in parts}:
        return None
    packed, causal = parts if _code(parts[0]) is _PACKED else parts[::-1]
    if _REMAP is not None and _code(causal) is _REMAP:
        causal = _free_vars(causal)["mask_function"]
    return packed, causal


def _window_of(mask_function):
    """The window of a sliding-window causal mask function, also inside the packed-sequence
    mask transformers' compiled forwards make of it; None for any other."""
    if _code(mask_function) is _AND:
        parts = _free_vars(mask_function)["mask_functions"]
        if (len(parts) == 2 and parts[1] is masking_utils.causal_mask_function
                and _code(parts[0]) is _WINDOW):
            return _free_vars(parts[0])["sliding_window"]
        packed = _packed_parts(parts)
        if packed is not None:
            return _window_of(packed[1])
    return None


# The windows of the causal masks each model config's forwards made (None: no window), so
# that a layer that neither passes its window nor keeps it (PhiMoE) gets the one its mask
# had: id(config) -> (a weak reference to it, that set).
_windows_made = {}


# Compiled, it runs once as the graph is traced, unseen by Dynamo: traced, its first insertion
# was guarded on, and the next call compiled the whole forward again
@torch.compiler.assume_constant_result
def _record_window(config, window):
    key = id(config)
    ref, windows = _windows_made.get(key, (None, set()))
    if ref is None or ref() is not config:     # new, or another config at a reused id
        # the entry goes with its config
        ref, windows = weakref.ref(config, lambda _: _windows_made.pop(key, None)), set()
        _windows_made[key] = (ref, windows)
    windows.add(window)


def _window_for(module, causal):
    """The window of a layer that passed none: its own attribute (Qwen2-MoE keeps it), else,
    for a causal layer, the one every causal mask made for its model had, else None. (Not
    for a non-causal one: an encoder-decoder's encoder layers ran before its decoder's mask
    was made, so a compiled forward's first trace found no window there and Dynamo's restart
    found one, and the compile failed, SpeculationLogDivergence.)"""
    if torch.compiler.is_compiling():
        # (Dynamo guards on getattr, not on a read of vars(): the compiled frame of a layer
        # without a window served the windowed layers of Qwen2-MoE's packed forwards)
        window = getattr(module, "sliding_window", None)
    else:
        # not getattr: for the layers without one (most), nn.Module's __getattr__ raised and
        # caught an AttributeError, 3 us of every call
        window = vars(module).get("sliding_window")
        if window is None and hasattr(type(module), "sliding_window"):   # a property, say
            window = module.sliding_window
    if window is not None or not causal:
        return window
    config = getattr(module, "config", None)
    # a layer its config calls full attention has none (Qwen2-MoE's, beside sliding ones,
    # warned of several windows)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if (isinstance(types, (list, tuple)) and isinstance(index, int) and 0 <= index < len(types)
            and types[index] == "full_attention"):
        return None
    ref, windows = _windows_made.get(id(config), (None, set()))
    if ref is None or ref() is not config:
        return None
    if len(windows) > 1 and ("windows", type(module)) not in _warned:
        # (Moshi: generate()'s static cache makes sliding masks, its own forward causal ones)
        _warned.add(("windows", type(module)))
        warnings.warn("orchard.hf: %s passes no sliding window and its model's masks had "
                      "several (%s): computed without one, as its own causal masks ask"
                      % (type(module).__name__, ", ".join(sorted(map(str, windows)))),
                      stacklevel=3)
    return next(iter(windows)) if len(windows) == 1 else None


def _packed_ids(mask_function):
    """None for a causal or sliding-window causal mask function, the sequence ids (batch,
    seqlen) for one over packed sequences; _Unsupported for any other."""
    fn = mask_function
    if fn is masking_utils.causal_mask_function:
        return None
    if _code(fn) is _AND:
        parts = _free_vars(fn)["mask_functions"]
        if len(parts) == 2 and parts[1] is masking_utils.causal_mask_function:
            if _code(parts[0]) is _WINDOW:
                return None     # the layer passes its sliding_window to the attention function
            if _code(parts[0]) is _CHUNKED:
                raise _Unsupported("chunked attention (attention_chunk_size)")
        packed = _packed_parts(parts)      # packed sequences: the ids' part and a causal one
        if packed is not None:
            packed, causal = packed
            if _code(causal) is not _PACKED and _packed_ids(causal) is None:
                ids = _free_vars(packed)["packed_sequence_mask"]
                # transformers' compiled forwards without a cache make this mask whatever
                # the sequences: one a row is plain causal
                return None if bool((ids[:, -1] == 0).all()) else ids
    if _code(fn) is _OR:
        raise _Unsupported("a causal mask widened by an or_mask_function (for example "
                           "bidirectional attention within image tokens)")
    raise _Unsupported("a mask function orchard does not know (%s)" % _mask_name(fn))


def _mask_name(fn):
    """A mask function by the factories that made it, for messages:
    "and_masks(sliding_window_bidirectional_overlay, padding_mask_function)"."""
    if _code(fn) in (_AND, _OR):
        return "%s(%s)" % ("and_masks" if _code(fn) is _AND else "or_masks",
                           ", ".join(map(_mask_name, _free_vars(fn)["mask_functions"])))
    return getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>")[0]


# Dynamo cannot read a closure's cells: traced, a mask function that is one (a sliding window,
# packed sequences: transformers' compiled forwards without a cache make that mask) is read
# eagerly, one graph break per mask made
@torch.compiler.disable
def _read_mask_function(fn):
    """(packed-sequence ids or None, window or None, None), or (None, None, why orchard cannot
    compute the mask)."""
    try:
        return _packed_ids(fn), _window_of(fn), None
    except _Unsupported as e:
        return None, None, str(e)


def _copied_ids(mask):
    """Whether mask, without orchard's marks, is a copy of packed sequences' ids that
    attention_mask() made: a reentrant checkpoint (gradient_checkpointing with
    use_reentrant=True) recomputes a layer on detached copies of its arguments, a saved
    tensors hook (save_on_cpu) on copies in other memory, and neither keeps the marks (GPT-2's
    packed ids were then read as a padding mask: gradients wrong, silently). orchard writes
    the ids negative, which no padding mask is."""
    # (recorded, the mask is orchard's own, marked, or a caller's: its values are not read)
    return (mask is not None and mask.dtype == torch.int64 and mask.dim() == 2
            and not hasattr(mask, "orchard_packed") and not _recording()
            and bool((mask < 0).any()))


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=masking_utils.causal_mask_function, attention_mask=None,
                   **kwargs):
    """transformers' mask function for "orchard" (AttentionMaskInterface). The queries are at
    positions q_offset.., the keys at kv_offset..; attention_mask (batch, positions) marks
    the real tokens. Returns None, a (batch, keys) bool padding mask over the keys up to the
    last query, packed-sequence ids (written -1 - id) marked orchard_packed, or for a mask
    orchard cannot compute transformers' 4-D sdpa mask marked orchard_fallback (the reason)."""
    config = kwargs.get("config")
    if config is not None:
        _refuse_unsupported(config)
    # A static cache gives its length as a tensor, so that compiled decode steps share one
    # graph: its mask keeps the cache's length and marks the keys past the last query (its
    # unwritten rows) as padding, their count left unread (_mark_written).
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        # (transformers takes a 4-D one as the mask itself and asks no mask function)
        raise ValueError("orchard.hf: 'attention_mask' of shape %s: a padding mask is (batch, "
                         "positions), a mask given whole (batch, 1, queries, keys)"
                         % (tuple(attention_mask.shape),))
    static = isinstance(q_offset, torch.Tensor)
    kv_offset = int(kv_offset)
    q_offset = q_offset if static else int(q_offset)
    try:
        mask = _orchard_mask(batch_size, q_length, kv_length, q_offset, kv_offset, static,
                             mask_function, attention_mask, config, kwargs.get("device"),
                             kwargs.get("allow_is_bidirectional_skip", True))
        # a model may cut the masks of a forward of several queries (Gemma 4's)
        cut = mask is not None and q_length > 1 and config is not None and _cut_reason(config)
        if cut:
            raise _Unsupported(cut)
        if config is not None and mask_function is not masking_utils.bidirectional_mask_function:
            why = _not_causal_under(mask, config)
            if why is not None:
                raise _Unsupported(why)
    except _Unsupported as e:
        # a real mask to mark, also where sdpa would skip it (a bidirectional mask without
        # padding, which an encoder's is)
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        mask = masking_utils.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)
        mask.orchard_fallback = str(e)
    return mask


# Models whose decoder self-attention layers are built non-causal (is_causal=False), causal
# only through the masks their model makes: orchard, as FlashAttention-2, takes causality
# from the layer, and its masks (None for causal) would drop it.
_CAUSAL_BY_MASK_ONLY = ("PegasusXConfig", "Aimv2TextConfig", "VideoPrismTextConfig")
# Models whose causal decoder layers pass is_causal=False whenever they are given a mask
# (sdpa's, causal itself): with orchard's (the padding alone) they would see later tokens.
_NOT_CAUSAL_UNDER_A_MASK = ("MoonshineConfig", "MoonshineStreamingConfig")


def _causal_only_by_mask(config):
    """Why the layers of config's model take their causality from its masks alone, or None."""
    if getattr(config, "use_bidirectional_attention", False) is True:
        # (Gemma's, PaliGemma's text model: the model still makes causal masks)
        return "layers built non-causal (use_bidirectional_attention=True) under causal masks"
    if type(config).__name__ in _CAUSAL_BY_MASK_ONLY:
        return ("%s's decoder self-attention is causal only through its mask (is_causal=False)"
                % type(config).__name__[:-len("Config")])
    return None


def _not_causal_under(mask, config):
    """Why orchard's causal mask (None: no padding) would turn config's layers non-causal,
    or None."""
    name = type(config).__name__
    if mask is not None and name in _NOT_CAUSAL_UNDER_A_MASK:
        return ("%s's decoder self-attention passes is_causal=False under a mask, causal only "
                "through it" % name[:-len("Config")])
    return None


def _orchard_mask(batch_size, q_length, kv_length, q_offset, kv_offset, static, mask_function,
                  attention_mask, config, device, skip_bidirectional):
    """attention_mask's answer where orchard computes the mask; _Unsupported where not."""
    n_keys = q_offset + q_length - kv_offset
    if mask_function is masking_utils.bidirectional_mask_function:
        return _bidirectional(batch_size, kv_length, kv_offset, static, attention_mask,
                              skip_bidirectional, device)
    ids = window = None
    if mask_function is not masking_utils.causal_mask_function:
        ids, window, why = _read_mask_function(mask_function)
        if why is not None:
            raise _Unsupported(why)
    why = _causal_only_by_mask(config)
    if why is not None:     # (every mask orchard computes is causal)
        raise _Unsupported(why)
    if not static and not q_length <= n_keys <= kv_length:
        raise _Unsupported("queries at positions %d to %d over keys at %d to %d" % (
            q_offset, q_offset + q_length - 1, kv_offset, kv_offset + kv_length - 1))
    if config is not None:      # (packed too: a model trained on packed sequences alone)
        _record_window(config, window)
    if ids is not None:
        ids = -1 - ids.to(torch.int64)      # negative: what a copy without the mark shows
        ids.orchard_packed = True
        return ids
    if static or n_keys < kv_length:
        # keys past the last query: a static cache's unwritten rows
        return _mark_written(batch_size, kv_length, kv_offset, n_keys, attention_mask, device)
    if attention_mask is None:
        return None
    if attention_mask.shape[1] == n_keys:
        # already cut to these keys: this function's own result, which generate() makes in
        # advance for a static cache (a full sliding-window layer) and the model passes here
        # (a view of it, so that what this call notes on the mask is its own)
        padding = attention_mask[:, :].bool()
    else:
        padding = attention_mask[:, kv_offset:kv_offset + n_keys].bool()
    if padding.shape[1] < n_keys:     # as sdpa: positions past the 2-D mask are padding
        padding = torch.nn.functional.pad(padding, (0, n_keys - padding.shape[1]), value=False)
    if torch.compiler.is_compiling() and window is None and q_length == n_keys:
        # a query at every position and a plain causal mask: laid out without reading the
        # mask (_sorted_attention), so the graph does not break
        padding.orchard_sortable = True
        return padding
    return _planned(padding, q_length)


# A padding mask's answers for every layer of a forward (orchard_plan on the mask): its keys
# and queries (width, q_length: the mask's shape), whether it is left padding (fits, a bool),
# each row's padding (leftpad (batch,) int32), whether a row has padding between real tokens
# (gaps, a bool), and the real keys and queries (the last q_length positions) as (rows,
# columns) indices and their cu_seqlens (int32). No value read from the mask is a Python int:
# compiled, the graph would be guarded on it (the longest sequence of each batch had
# recompiled it batch after batch), so the varlen calls take the shape as max_seqlen.
_Plan = collections.namedtuple("_Plan", "width q_length fits leftpad gaps keys queries")
_Tokens = collections.namedtuple("_Tokens", "rows columns cu_seqlens")


# Eager: reading the mask's values breaks a compiled graph, here once per mask made rather
# than at every layer (about eight breaks a layer, and the resumed frames of transformers'
# shared wrappers hit Dynamo's recompile limit, after which the layers ran uncompiled)
@torch.compiler.disable
def _planned(padding, q_length):
    """None for a (batch, keys) bool padding mask of real tokens only; else the mask, marked
    with its _Plan as orchard_plan."""
    if bool(padding.all()):
        return None

    def tokens(mask):
        cu = torch.nn.functional.pad(mask.sum(1).cumsum(0, dtype=torch.int32), (1, 0))
        return _Tokens(*mask.nonzero(as_tuple=True), cu)

    leftpad, _, fits = _left_padding(padding, padding, padding.shape[1], False)
    fits = bool(fits)
    padding.orchard_plan = _Plan(padding.shape[1], q_length, fits, leftpad,
                                 not fits and _has_gaps(padding),
                                 tokens(padding), tokens(padding[:, padding.shape[1] - q_length:]))
    return padding


def _bidirectional(batch_size, kv_length, kv_offset, static, attention_mask, skip, device):
    """attention_mask's answer for a bidirectional mask (an encoder's, a cross-attention's):
    sdpa's own (batch, 1, 1, keys) bool mask, every query seeing the real keys (attention_forward
    reads such a mask as key padding, _key_padding); None where nothing is padded and
    transformers lets it skip the mask (skip), as sdpa (the layers' is_causal then holds, as
    for sdpa), but in a compiled call, whose graph would break at that read."""
    if static:
        raise _Unsupported("a bidirectional mask over a static cache")
    if attention_mask is None and skip:
        return None
    if attention_mask is None:
        return torch.ones(batch_size, 1, 1, kv_length, dtype=torch.bool, device=device)
    padding = attention_mask[:, kv_offset:kv_offset + kv_length].bool()
    if padding.shape[1] < kv_length:     # as sdpa: positions past the 2-D mask are padding
        padding = torch.nn.functional.pad(padding, (0, kv_length - padding.shape[1]),
                                          value=False)
    if skip and not torch.compiler.is_compiling() and bool(padding.all()):
        return None
    return padding[:, None, None, :]


def _key_padding(mask, batch, n_keys):
    """The (batch, keys) bool mask of the keys every query sees where mask is a bidirectional
    padding mask: sdpa's (batch, 1, 1, keys) bool mask, which _bidirectional makes, a copy of
    it (a reentrant checkpoint's) or a caller's, all of which sdpa reads alike; None for any
    other mask (orchard's fallback masks keep their reason)."""
    if (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[1:] == (1, 1, n_keys) and mask.shape[0] in (1, batch)
            and not hasattr(mask, "orchard_fallback")):
        return mask[:, 0, 0].expand(batch, n_keys)
    return None


@torch.compiler.assume_constant_result     # as unsupported_reason
def _cut_reason(config):
    """Why the model of config needs 4-D masks in a forward of several queries, or None:
    transformers' Gemma 4 text model with KV-shared layers cuts its masks to the positions it
    keeps before those layers, indexing them as 4-D tensors (_maybe_slice_kv_shared_inputs,
    which only FlashAttention and flex attention skip); the cut masks are new tensors,
    without orchard's marks."""
    cls = _model_class(type(config))
    if not (getattr(config, "num_kv_shared_layers", 0)
            and hasattr(cls, "_maybe_slice_kv_shared_inputs")):
        return None
    return ("%s cuts its masks to the positions it keeps before its KV-shared layers, as 4-D "
            "tensors (except for FlashAttention), which orchard's masks are not" % cls.__name__)


def _mark_written(batch_size, kv_length, kv_offset, n_keys, attention_mask, device):
    """A static cache's (batch, kv_length) bool mask: the real tokens of attention_mask (over
    positions from 0, or this function's own result, which generate() makes in advance and the
    model passes here again) among the first n_keys, the written keys. It carries n_keys (a
    tensor once the cache holds tokens) as orchard_written."""
    written = torch.arange(kv_length, device=device) < n_keys
    if attention_mask is None:
        padding = written.expand(batch_size, kv_length).clone()
    else:
        if attention_mask.shape[1] != kv_length:
            attention_mask = attention_mask[:, kv_offset:kv_offset + kv_length]
            attention_mask = torch.nn.functional.pad(
                attention_mask, (0, kv_length - attention_mask.shape[1]), value=False)
        padding = attention_mask.bool() & written
    padding.orchard_written = n_keys
    padding.orchard_left_padding = None
    return padding


# ----------------------------------------------------------------------------- fallback

_warned = set()


def _warn_once(reason, to):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn("orchard.hf: %s: orchard cannot compute this, so these attention calls "
                      "run on %s" % (reason, to), stacklevel=4)


def _has_gaps(padding):
    """Whether a row of the (batch, keys) bool padding mask has padding between real tokens."""
    n = padding.sum(1)
    first = padding.int().argmax(1)
    last = padding.shape[1] - 1 - padding.flip(1).int().argmax(1)
    return bool(((n > 0) & (last - first + 1 != n)).any())


def _gaps(mask, in_place):
    """Whether a row of the (batch, keys) padding mask has padding between real tokens: its
    plan's answer; for a static cache's mask in a compiled call that reads the cache in place
    none, unread (reading it broke the graph at every sliding-window layer of every decode
    step): that call asserts left padding when the graph runs (_left_padded)."""
    plan = getattr(mask, "orchard_plan", None)
    if plan is not None:
        return plan.gaps
    if in_place and hasattr(mask, "orchard_written") and torch.compiler.is_compiling():
        return False
    return _has_gaps(mask.bool())


def _why_not(query, key, value, mask, sliding_window, in_place, config, kwargs):
    """None when orchard computes this call (in_place: _in_place's answer), else the reason it
    cannot; ValueError for a 2-D mask that does not fit the call."""
    if not (query.is_cpu and key.is_cpu and value.is_cpu) or not (
            query.layout == key.layout == value.layout == torch.strided):
        return "tensors on %s (orchard computes dense CPU tensors)" % query.device
    if query.dtype not in _ROUTABLE_DTYPES:
        return "dtype %s" % query.dtype
    if not (query.shape[-1] <= _MAX_HEAD_DIM and value.shape[-1] <= _MAX_HEAD_DIM):
        return "head dimension %d above orchard's %d" % (max(query.shape[-1],
                                                             value.shape[-1]), _MAX_HEAD_DIM)
    if kwargs.get("s_aux") is not None:
        return "attention sinks (s_aux)"
    if kwargs.get("position_bias") is not None:
        return "an additive position bias"
    if mask is None or getattr(mask, "orchard_packed", False):
        return None
    if _key_padding(mask, query.shape[0], key.shape[2]) is not None:
        return "a sliding window over a bidirectional mask" if sliding_window is not None else None
    if mask.dim() != 2:
        # orchard's mask function marks the 4-D masks it makes; those a model cut from them
        # are new tensors, unmarked (read on the tensor it cut, `_base`, the mark is lost
        # under torch.compile)
        return (getattr(mask, "orchard_fallback", None)
                or config is not None and _cut_reason(config)
                or "a %d-D attention mask passed by the caller" % mask.dim())
    if not query.shape[2] <= mask.shape[1] <= key.shape[2] or mask.shape[0] != query.shape[0]:
        raise ValueError("orchard.hf: 'attention_mask' of shape %s does not fit %d queries of "
                         "batch %d over %d keys: a 2-D mask marks the keys, the queries being "
                         "the last of them" % (tuple(mask.shape), query.shape[2],
                                               query.shape[0], key.shape[2]))
    # orchard's window counts real tokens; transformers' counts positions, padding included
    if sliding_window is not None and _gaps(mask, in_place):
        return "a sliding window over a padding mask with padding between real tokens"
    return None


def _visible(mask, batch, nq, nk, causal, window, device, cu=None):
    """(batch, 1, nq, nk) bool: the keys each query sees in orchard's reading of the mask
    (queries the last nq positions), for the fallback. cu = (cu_seq_lens_q, cu_seq_lens_k):
    packed sequences in one row instead, each sequence's queries at its last positions
    (bottom-right), seeing its own sequence's keys alone."""
    packed = getattr(mask, "orchard_packed", False)
    if mask is not None and not packed:
        nk = mask.shape[1]
    q, k = torch.arange(nq, device=device), torch.arange(nk, device=device)
    if cu is None:
        q = q + nk - nq
    else:       # positions within each sequence, its queries aligned with its last keys
        cu_q, cu_k = (c.to(device=device, dtype=torch.int64) for c in cu)
        # (tokens past the last sequence, continuous batching's padding: counted in the last
        # sequence, after its keys, so that causally no real query sees them)
        last = cu_q.numel() - 2
        seq_q = torch.bucketize(q, cu_q[1:], right=True).clamp(max=last)
        seq_k = torch.bucketize(k, cu_k[1:], right=True).clamp(max=last)
        before = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])   # keys before the queries
        q = q - cu_q[seq_q] + before[seq_q]
        k = k - cu_k[seq_k]
    q, k = q[:, None], k[None, :]
    seen = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        seen &= k <= q
    if window[0] >= 0:
        seen &= k >= q - window[0]
    if window[1] >= 0:
        seen &= k <= q + window[1]
    if cu is not None:
        seen &= seq_q[:, None] == seq_k[None, :]
    seen = seen.expand(batch, 1, nq, nk)
    if packed and cu is None:
        seen = seen & (mask[:, None, :, None] == mask[:, None, None, :])
    elif mask is not None and not packed:
        seen = seen & mask.bool()[:, None, None, :]
    return seen


def _fallback(reason, module, query, key, value, mask, causal, window, dropout, scaling,
              softcap, kwargs):
    """transformers' sdpa attention, or the model's own eager attention for a softcap or
    attention sinks (sdpa has neither), on the mask orchard was given, materialised. With
    cu_seq_lens (and no mask but packed ids) the batch's tokens as one row, each sequence
    masked to its own keys, as orchard's varlen call reads them."""
    if getattr(mask, "orchard_written", None) is not None:   # a static cache's written keys
        mask = mask[:, :int(mask.orchard_written)]
    batch = query.shape[0]
    cu = None
    if mask is None or getattr(mask, "orchard_packed", False):
        cu = _given_offsets(kwargs)
    if cu is not None:      # one row of the batch's tokens, as orchard's varlen call reads them
        _check_covers("cu_seq_lens_q", cu[0], batch * query.shape[2], kwargs)
        _check_covers("cu_seq_lens_k", cu[1], batch * key.shape[2], kwargs)
        query, key, value = (t.transpose(0, 1).flatten(1, 2)[None]
                             for t in (query, key, value))
    if mask is None or mask.dim() == 2:
        if mask is not None and not getattr(mask, "orchard_packed", False):
            key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
        if mask is not None or causal or window != (-1, -1) or cu is not None:
            mask = _visible(mask, query.shape[0], query.shape[2], key.shape[2], causal,
                            window, query.device, cu)
    if softcap is None and kwargs.get("s_aux") is None:
        _warn_once(reason, "transformers' sdpa attention")
        out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                        scaling=scaling, is_causal=causal, **kwargs)
    else:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward",
                        None)
        if eager is None:
            raise ValueError("orchard.hf: %s, and sdpa has no softcap or attention sinks: use "
                             "attn_implementation='eager'" % reason)
        _warn_once(reason, "the model's eager attention (sdpa has no softcap or attention "
                   "sinks)")
        if mask is not None and mask.dtype == torch.bool:     # eager adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        if softcap is not None:
            kwargs = dict(kwargs, softcap=softcap)
        out, _ = eager(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                       **kwargs)
    return out.reshape(batch, -1, *out.shape[2:]), None


# ----------------------------------------------------------------------------- attention


def _lengths(cu, longest):
    """cu_seq_lens as int32, and the longest sequence: given (transformers' max_length_q/k, as
    from DataCollatorWithFlattening; then torch.compile traces the call whole) or read."""
    if longest is None:
        longest = (cu[1:] - cu[:-1]).max()
    if isinstance(longest, torch.Tensor):
        longest = int(longest)      # a value read: torch.compile breaks the graph here
    return cu.to(torch.int32), longest


def _packed_offsets(mask, batch):
    """cu_seq_lens of a packed-ids mask (_orchard_mask): a new sequence starts where the id
    changes, and at every batch row. Compiled, one entry a token, the starts first and the rest
    empty sequences at the end: a shape that does not depend on the values, so the layers
    stay in the graph (the exact offsets broke it in every layer and recompiled there for each
    new number of sequences, 19 graphs over a 3-layer Llama's first 12 packings)."""
    ids = -1 - mask     # (written negative: _orchard_mask)
    ids = (ids + torch.arange(batch, device=mask.device)[:, None] * (ids.max() + 1)).flatten()
    tokens = ids.numel()
    if torch.compiler.is_compiling():
        first = torch.cat([ids.new_ones(1, dtype=torch.bool), ids[1:] != ids[:-1]])
        where = torch.arange(tokens, device=ids.device)
        starts = torch.where(first, where, tokens).sort().values
        return torch.cat([starts, starts.new_tensor([tokens])])
    starts = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    return torch.cat([starts.new_zeros(1), starts, starts.new_tensor([tokens])])


def _given_offsets(kwargs):
    """(cu_seq_lens_q, cu_seq_lens_k) where the caller gave both (transformers' continuous
    batching, DataCollatorWithFlattening), else None."""
    cu = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    return None if cu[0] is None or cu[1] is None else cu


def _check_covers(name, cu, tokens, kwargs):
    """cu_seq_lens of a packed batch must cover its tokens, 0 to B * N: flash_attn_varlen_func
    takes tokens outside them as padding (FlashAttention-2's static buffers), and a packed
    batch's tokens past a short cu_seq_lens got outputs 0, silently. Continuous batching's
    keywords carry read_index, and its compiled batches pad their tokens past the last
    request: there cu_seq_lens may end before the tokens."""
    padded = "read_index" in kwargs
    if torch.compiler.is_compiling():   # (a value read would break the graph)
        last = cu[-1] <= tokens if padded else cu[-1] == tokens
        torch._assert_async((cu[0] == 0) & last, "orchard.hf: '%s' must run from 0 to the "
                            "batch's tokens (batch x sequence length)" % name)
    elif cu.numel() == 0 or int(cu[0]) != 0 or not (
            int(cu[-1]) <= tokens if padded else int(cu[-1]) == tokens):
        raise ValueError("orchard.hf: '%s' must run from 0 to the batch's %d tokens (batch x "
                         "sequence length), got %s" % (name, tokens, cu.tolist()))


def _left_padding(attention_mask, mask, written, static):
    """(leftpad, used, fits) of the (batch, keys) bool mask: whether each row is left padding,
    then real tokens up to the written keys (a count, a tensor for a static cache), then
    unwritten ones (fits, a bool tensor); each row's padding (leftpad (batch,) int32) and, for
    a static cache, its written keys (used (batch,); else None: all). A mask this module's
    mask function made (attention_mask, orchard_left_padding) keeps the answer for the
    forward's other layers, eagerly: read once per forward, not once per layer."""
    known = getattr(attention_mask, "orchard_left_padding", None)
    if known is not None:
        return known
    real = mask.sum(1, dtype=torch.int32)
    leftpad = written - real
    positions = torch.arange(mask.shape[1], device=mask.device)
    fits = (mask == ((positions >= leftpad[:, None]) & (positions < written))).all()
    used = torch.as_tensor(written).expand(mask.shape[0]) if static else None
    if hasattr(attention_mask, "orchard_left_padding") and not torch.compiler.is_compiling():
        attention_mask.orchard_left_padding = leftpad, used, fits
    return leftpad, used, fits


def _in_place(q, k, v, dropout_p):
    """Whether the keys and values of this call may be read in place: nothing needs a gradient
    and there is no dropout (generate())."""
    return not dropout_p and not (torch.is_grad_enabled()
                                  and any(t.requires_grad for t in (q, k, v)))


def _read_left_padded(q, k, v, used, leftpad, options):
    """Attention of q over rows [leftpad[b], used[b]) (used None: all) of the keys and values,
    read in place: unpadding would copy all keys and values at every step (3x the time of a
    4,096-key decode step, measured). leftpad and used lie in range: flash_attn_with_kvcache's
    checks would add nothing."""
    opts = _options("orchard.hf", q, k.shape[1], 0.0, options["softmax_scale"],
                    options["causal"], options["window_size"], options["softcap"], None,
                    q.shape[0], None)
    return _read_cache(q, k, v, used, leftpad, opts)[0]


def _left_padded(q, k, v, attention_mask, mask, written, static, options):
    """_read_left_padded where each row of the (batch, keys) mask is left padding, then real
    tokens up to the written keys, then unwritten ones (_left_padding); None for another mask.
    Over a static cache traced by torch.compile the mask is not read (the graph would break at
    every step): checked when the graph runs."""
    leftpad, used, fits = _left_padding(attention_mask, mask, written, static)
    if static and torch.compiler.is_compiling():
        torch._assert_async(fits, "orchard.hf: compiled, a padding mask over a static cache "
                            "must be left padding (each row's real tokens one run up to the "
                            "last query): left-pad, or run this call eagerly")
    elif not bool(fits):
        return None
    return _read_left_padded(q, k, v, used, leftpad, options)


def _dense(query, key, value, options):
    """flash_attn_func's call on transformers' (B, H, N, D) tensors as they are, without its
    checks (_why_not's and orchard_ops' cover them) and transposes. out (B, N, H, Dv)."""
    opts = _options("orchard.hf", query, key.shape[2], options["dropout_p"],
                    options["softmax_scale"], options["causal"], options["window_size"],
                    options["softcap"], None, query.shape[0], None)
    out, _ = _attention(query, key, value, opts)
    return out.transpose(1, 2).contiguous()


def _padded(query, key, value, attention_mask, options, in_place):
    """attention_forward's call with a (batch, keys) padding mask without a _Plan (a static
    cache's, or one a caller passed): read in place where it is left padding and nothing needs
    a gradient, else unpadded onto the varlen path. out (B, Nq, H, Dv)."""
    mask = attention_mask.bool()
    # a static cache's mask (_mark_written) counts its written keys, else all are
    written = getattr(attention_mask, "orchard_written", None)
    if written is None:
        if key.shape[2] != mask.shape[1]:
            key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
        if bool(mask.all()):
            return _dense(query, key, value, options)
    # (B, N, H, D) views of transformers' (B, H, N, D) tensors: orchard reads them in place.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if in_place:
        out = _left_padded(q, k, v, attention_mask, mask,
                           mask.shape[1] if written is None else written, written is not None,
                           options)
        if out is not None:
            return out
    if written is not None:     # (a value read: a compiled call breaks its graph here)
        n = int(written)
        mask, k, v = mask[:, :n], k[:, :n], v[:, :n]
    # unpad: the queries are the last nq positions of the keys' sequence
    batch, nq = q.shape[:2]
    k, _, cu_k, max_k, _ = unpad_input(k, mask)
    q, idx_q, cu_q, max_q, _ = unpad_input(q, mask[:, -nq:])
    out = flash_attn_varlen_func(q, k, v[mask], cu_q, cu_k, max_q, max_k, **options)
    return pad_input(out, idx_q, batch, nq)


def _sorted_attention(query, key, value, mask, options):
    """attention_forward's call with a (batch, N) padding mask over N queries and N keys, causal
    and without a window, laid out without reading the mask (compiled: no graph break, and no
    shape that depends on it): each row's real tokens first, in their order (a stable sort),
    one dense causal call, each output put back at its position, padded positions 0. A real
    query then sees exactly the real keys up to it; a padded one sees other keys too, but its
    output is dropped, and with it its share of the gradients. out (B, N, H, Dv)."""
    mask = mask.bool()
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)     # real tokens first

    def gathered(t):    # (B, H, N, D) rows in the order
        return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))

    out = _dense(gathered(query), gathered(key), gathered(value), options)    # (B, N, H, Dv)
    back = order.argsort(dim=1)     # the inverse order
    out = out.gather(1, back[:, :, None, None].expand(-1, -1, out.shape[2], out.shape[3]))
    return torch.where(mask[:, :, None, None], out, 0)


def _planned_attention(query, key, value, plan, options, in_place):
    """attention_forward's call with a padding mask of orchard's mask function, from its _Plan,
    not reading the mask (so, compiled, without a graph break): read in place where it is left
    padding and nothing needs a gradient, else the real tokens gathered onto the varlen path
    and their outputs put back. out (B, Nq, H, Dv)."""
    batch, nq = query.shape[0], query.shape[2]
    # (B, N, H, D) views of transformers' (B, H, N, D) tensors, over the mask's keys
    q, k, v = (t.transpose(1, 2) for t in (query, key[:, :, :plan.width], value[:, :, :plan.width]))
    if plan.fits and in_place:
        return _read_left_padded(q, k, v, None, plan.leftpad, options)
    ks, qs = plan.keys, plan.queries
    out = flash_attn_varlen_func(q[qs.rows, qs.columns], k[ks.rows, ks.columns],
                                 v[ks.rows, ks.columns], qs.cu_seqlens, ks.cu_seqlens,
                                 nq, plan.width, **options)
    return pad_input(out, qs.rows * nq + qs.columns, batch, nq)


def _keys_attention(query, key, value, keys, options):
    """attention_forward's call with a bidirectional padding mask (_key_padding: keys, (B, Nk)
    bool, the real keys): every query over its row's real keys, not reading the mask (compiled:
    no graph break, no shape that depends on it). Each row's real keys first, in their order (a
    stable sort), then one varlen call of two sequences a row: its queries over those keys, and
    no queries over the rest. out (B, Nq, H, Dv)."""
    batch, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    order = torch.argsort((~keys).to(torch.uint8), dim=1, stable=True)     # real keys first

    def gathered(t):    # (B * Nk, Hkv, D) rows of (B, Hkv, Nk, D) in the order
        t = t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
        return t.transpose(1, 2).reshape(batch * nk, t.shape[1], t.shape[3])

    rows = torch.arange(batch + 1, dtype=torch.int32, device=query.device)
    real = torch.nn.functional.pad(keys.sum(1, dtype=torch.int32), (0, 1))
    cu_q = torch.stack([rows * nq, rows * nq], 1).flatten()[1:]
    cu_k = torch.stack([rows * nk, rows * nk + real], 1).flatten()[:-1]
    q = query.transpose(1, 2).reshape(batch * nq, query.shape[1], query.shape[3])
    out = flash_attn_varlen_func(q, gathered(key), gathered(value), cu_q, cu_k, nq, nk,
                                 **options)
    return out.view(batch, nq, *out.shape[1:])


def _requests(query, kwargs):
    """(block_table, each request's keys (a list), the number of requests) of a decode-only
    batch on continuous batching's fast path; compiled, it pads the batch with requests of no
    keys, at its end, which are not counted."""
    table = kwargs["block_table"]
    if query.shape[2] != table.shape[0]:
        raise ValueError("orchard.hf: a 'block_table' of %d requests with %d query tokens: the "
                         "paged decode step takes one token a request" % (table.shape[0],
                                                                          query.shape[2]))
    cu = kwargs["cu_seq_lens_k"][:table.shape[0] + 1].tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    return table, lengths, sum(n > 0 for n in lengths)


def _new_key_slots(table, ends, page):
    """(pages, rows): index tensors (B,) of the cache rows where request b's new key goes, key
    position ends[b] of the pages its row of table (B, pages) lists; ValueError where that page
    is negative (transformers' tables hold -1 where no page is: indexing would wrap it around
    to another request's page)."""
    at = np.asarray(ends, dtype=np.int64)
    pages = table.numpy()[np.arange(len(ends)), at // page]
    if pages.size and pages.min() < 0:
        b = int((pages < 0).nonzero()[0][0])
        raise ValueError("orchard.hf: 'block_table' row %d lists page %d for its new key"
                         % (b, pages[b]))
    return torch.from_numpy(pages).long(), torch.from_numpy(at % page)


# Compiled (continuous batching's compile options), Dynamo would recompile inside at every
# step, the request count read being a value: run eagerly, as transformers runs
# FlashAttention's paged call.
@torch.compiler.disable
def _paged_decode(query, key, value, kwargs, options):
    """A decode-only batch on continuous batching's fast path (block_table, k_cache and v_cache
    in kwargs): query (1, H, B, D), one token of each of B requests, key and value (1, Hkv, B,
    D) theirs, written at each request's end in its pages of k_cache and v_cache (pages, page
    size, Hkv, D) and every key read there, in place: flash_attn_with_kvcache's call without
    its checks, which took half of what a step spent around orchard_ops' call (130-370 us;
    transformers makes these arguments, and orchard_ops checks every page the call reads, the
    new keys' included, before it writes them). out (1, B, H, Dv)."""
    table, lengths, batch = _requests(query, kwargs)
    caches = kwargs["k_cache"], kwargs["v_cache"]
    if caches[0].dtype != query.dtype:      # (autocast's, say)
        raise TypeError("orchard.hf: the paged cache holds %s, the layer's queries are %s"
                        % (caches[0].dtype, query.dtype))
    page, rows = caches[0].shape[1], table.shape[0]
    table = table[:batch]
    # (B, 1, H, D) queries, (B, 1, Hkv, D) new keys and values
    q, k, v = (x[0, :, :batch].transpose(0, 1)[:, None] for x in (query, key, value))
    _check_not_inference("orchard.hf", zip(("k_cache", "v_cache"), caches))
    in_call = _writable_in_call(caches, (k, v))
    if not in_call:
        at = _new_key_slots(table, [n - 1 for n in lengths[:batch]], page)
        for cache, new in zip(caches, (k, v)):
            cache[at] = new[:, 0]
    opts = _options("orchard.hf", q, table.shape[1] * page, 0.0, options["softmax_scale"],
                    options["causal"], options["window_size"], options["softcap"], None, batch,
                    None)
    out, _ = _cache_call(q, *caches, [0] + list(itertools.accumulate(lengths[:batch])), opts,
                         (k, v) if in_call else None, block_table=table)
    if batch < rows:      # the padding requests' outputs: zeros
        out = torch.cat([out, out.new_zeros(rows - batch, *out.shape[1:])])
    return out.transpose(0, 1)


@torch.compiler.disable     # (as _paged_decode)
def _unpaged(query, key, value, kwargs):
    """_paged_decode's keys and values for a fallback: the new ones written at each request's
    end in its pages, then every request's keys gathered in order, (1, Hkv, keys, D), as
    transformers' other path gives them, with cu_seq_lens of as many requests."""
    table, lengths, batch = _requests(query, kwargs)
    caches = kwargs["k_cache"], kwargs["v_cache"]
    page = caches[0].shape[1]
    at = _new_key_slots(table[:batch], [n - 1 for n in lengths[:batch]], page)
    for cache, new in zip(caches, (key, value)):
        cache[at] = new[0, :, :batch].transpose(0, 1).to(cache.dtype)
    table, lengths = table.long(), torch.tensor(lengths, dtype=torch.long)
    request = torch.repeat_interleave(torch.arange(lengths.numel(), device=table.device),
                                      lengths)
    cu_k = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    at = torch.arange(int(cu_k[-1]), device=table.device) - cu_k[request]
    pages, rows = table[request, at // page], at % page
    key, value = (cache[pages, rows].transpose(0, 1)[None] for cache in caches)
    return key, value, dict(kwargs, cu_seq_lens_q=kwargs["cu_seq_lens_q"][:table.shape[0] + 1],
                            cu_seq_lens_k=cu_k)


# sliding_window's default: a layer that passes none (Qwen2-MoE, PhiMoE) is told apart from one
# that passes None for a full-attention layer while keeping its model's window (Exaone 4)
_NOT_PASSED = object()


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=_NOT_PASSED, softcap=None, is_causal=None, **kwargs):
    """transformers' attention function for "orchard" (AttentionInterface): query (B, H, Nq,
    D), key and value (B, Hkv, Nk, D) with Hkv dividing H, attention_mask from
    attention_mask() or the caller. Returns (out (B, Nq, H, Dv), None). Causal masks are
    bottom-right aligned (a decode step's queries are the last positions)."""
    config = getattr(module, "config", None)
    if config is not None:
        _refuse_unsupported(config)     # a model that makes no mask reaches orchard here
    if kwargs.get("output_attentions") and "output_attentions" not in _warned:
        _warned.add("output_attentions")     # as sdpa and flash_attention_2 say, once
        warnings.warn("orchard.hf: output_attentions=True: orchard never forms the attention "
                      "weights, so none are returned (attn_implementation='eager' returns "
                      "them)", stacklevel=3)
    if PagedAttentionCache is not None and isinstance(kwargs.get("cache"), PagedAttentionCache):
        # transformers 5.20 hands continuous batching's cache to the attention function, which
        # writes the new keys and values (its own functions do; 5.25's layers write them):
        # keys (1, Hkv, keys, D) of the batch's requests back, or the fast path's keywords
        cache = kwargs.pop("cache")
        key, value = cache.update(key_states=key, value_states=value,
                                  layer_idx=module.layer_idx, kwargs=kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    keys = _key_padding(attention_mask, query.shape[0], key.shape[2])
    if keys is not None:     # a bidirectional mask governs, as sdpa's
        causal = False
    if sliding_window is _NOT_PASSED:
        # a layer with a window that does not pass it on (Qwen2-MoE, PhiMoE): its mask, which
        # orchard's mask function left out, applied it
        sliding_window = _window_for(module, causal)
    # transformers' sliding window counts the query itself: kv > q - sliding_window.
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    # Under autocast, in its dtype, as sdpa (autocast casts its inputs) and transformers'
    # FlashAttention-2 integration compute (rotary embeddings leave q and k in float32 and v in
    # the half dtype, a layer norm before them all three in float32).
    query, key, value = _as_autocast(query, key, value)
    if len({query.dtype, key.dtype, value.dtype}) > 1:
        query, key = query.to(value.dtype), key.to(value.dtype)
    mask = attention_mask
    if _copied_ids(mask):
        mask = mask.view_as(mask)   # (a view to mark, not the caller's tensor)
        mask.orchard_packed = True
    in_place = _in_place(query, key, value, dropout)
    reason = _why_not(query, key, value, mask, sliding_window, in_place, config, kwargs)
    paged = kwargs.get("block_table") is not None
    if reason is not None:
        if paged:
            key, value, kwargs = _unpaged(query, key, value, kwargs)
        return _fallback(reason, module, query, key, value, mask, causal, window, dropout,
                         scaling, softcap, kwargs)
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                   softcap=softcap or 0.0)
    if paged:
        return _paged_decode(query, key, value, kwargs, options), None
    batch, heads, nq, _ = query.shape
    if keys is not None:
        return _keys_attention(query, key, value, keys, options), None
    packed = getattr(mask, "orchard_packed", False)

    if mask is not None and not packed:
        plan = getattr(mask, "orchard_plan", None)
        if plan is not None and plan.q_length == nq:     # (a layer of other queries reads it)
            return _planned_attention(query, key, value, plan, options, in_place), None
        if (getattr(mask, "orchard_sortable", False) and causal
                and window == (-1, -1) and nq == key.shape[2] == mask.shape[1]):
            return _sorted_attention(query, key, value, mask, options), None
        return _padded(query, key, value, mask, options, in_place), None

    cu_q, cu_k = _given_offsets(kwargs) or (None, None)
    if cu_q is None and packed:
        cu_q = cu_k = _packed_offsets(mask, batch)
        if torch.compiler.is_compiling():   # no sequence spans two rows
            kwargs = dict(kwargs, max_length_q=mask.shape[1], max_length_k=mask.shape[1])
    if cu_q is not None:
        (cu_q, max_q), (cu_k, max_k) = (_lengths(cu_q, kwargs.get("max_length_q")),
                                        _lengths(cu_k, kwargs.get("max_length_k")))
        # (B * N, H, D) of transformers' (B, H, N, D) tensors
        q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))
        _check_covers("cu_seq_lens_q", cu_q, q.shape[0], kwargs)
        _check_covers("cu_seq_lens_k", cu_k, k.shape[0], kwargs)
        try:
            out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
        except ValueError:
            # a max_length_q/k given too short is refused there as max_seqlen_q/k: named here
            # as the caller passed it (checked after the refusal: no cost to other calls), where
            # the offsets are not refused themselves (never decreasing)
            for name, cu, given in (("q", cu_q, max_q), ("k", cu_k, max_k)):
                lengths = cu[1:] - cu[:-1]
                longest = int(lengths.max()) if len(lengths) else 0
                if given < longest and bool((lengths >= 0).all()):
                    raise ValueError("orchard.hf: 'max_length_%s' must be at least %d, the "
                                     "longest sequence of 'cu_seq_lens_%s', got %d"
                                     % (name, longest, name, given)) from None
            raise
        return out.view(batch, nq, heads, out.shape[-1]), None

    return _dense(query, key, value, options), None


def _refusing(check):
    """transformers' check of the attention a model asks for, which each model (and sub-model)
    runs while it is built and in set_attn_implementation, refusing "orchard" for a model
    orchard cannot run: there, as transformers refuses flash_attention_2, and before a
    model's __init__ looks its attention classes up by name (GPT-Neo, Data2VecVision:
    KeyError: 'orchard')."""
    @functools.wraps(check)
    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        if requested_attention == NAME:
            _refuse_unsupported(self.config)
        return check(self, requested_attention, *args, **kwargs)
    get_correct_attn_implementation.orchard_refusing = True
    return get_correct_attn_implementation


def _batching(switch):
    """transformers' continuous batching (generate_batch, init_continuous_batching) switches a
    model to an implementation it knows (sdpa, "paged|eager", FlashAttention's), refusing any
    other. "orchard" runs there as FlashAttention does, so it is kept: without a mask, one
    varlen call over the batch's requests (cu_seq_lens_q/k), each query over its own request's
    keys, where sdpa runs the batch as one sequence under a block mask."""
    @functools.wraps(switch)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if model.config._attn_implementation == NAME:
            return None
        return switch(self, model, *args, **kwargs)
    switch_to_cb_friendly_attn.orchard_batching = True
    return switch_to_cb_friendly_attn


def _fast_decoding(ensure):
    """transformers' continuous batching keeps its decode fast path (a
    decode-only batch's keys read in their pages through a block table, the new ones written
    there by the attention call: no copy of every key at every step) for FlashAttention on CUDA
    and XPU alone. orchard reads pages on every device (_paged_decode), so "orchard" keeps it
    wherever every layer type of the model has block tables (full attention, not sliding
    windows), as FlashAttention does."""
    @functools.wraps(ensure)
    def ensure_decode_fast_path_is_available(config, cb_config, *args, **kwargs):
        if config._attn_implementation != NAME:
            return ensure(config, cb_config, *args, **kwargs)
        types = initialization.group_layers_by_attn_type(config)
        if not all(initialization.ATTN_TYPE_TO_ALLOCATOR[t].supports_block_table for t in types):
            cb_config.max_blocks_per_request = 0
        return None
    ensure_decode_fast_path_is_available.orchard_batching = True
    return ensure_decode_fast_path_is_available


def register():
    """Make attn_implementation="orchard" available in transformers (idempotent)."""
    AttentionInterface.register(NAME, attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, attention_mask)
    model = transformers.PreTrainedModel
    if not hasattr(model.get_correct_attn_implementation, "orchard_refusing"):
        model.get_correct_attn_implementation = _refusing(model.get_correct_attn_implementation)
    manager = getattr(continuous_api, "ContinuousBatchingManager", None)
    switch = getattr(manager, "switch_to_cb_friendly_attn", None)
    if switch is not None and not hasattr(switch, "orchard_batching"):
        manager.switch_to_cb_friendly_attn = _batching(switch)
    ensure = getattr(initialization, "ensure_decode_fast_path_is_available", None)
    if (ensure is not None and not hasattr(ensure, "orchard_batching")
            and hasattr(initialization, "group_layers_by_attn_type")
            and hasattr(initialization, "ATTN_TYPE_TO_ALLOCATOR")):
        initialization.ensure_decode_fast_path_is_available = _fast_decoding(ensure)


register()
