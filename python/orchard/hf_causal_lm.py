"""A HuggingFace transformers causal language model in orchard's trainer and generation.

orchard-train --hf-config FILE builds a randomly initialised model from a config.json (any
LlamaForCausalLM-style model), --hf-model DIR loads a local pretrained folder; both use
attn_implementation="orchard" (orchard.hf), so their attention runs on orchard. HFCausalLM
gives such a model the interface of orchard.model.GPT (forward(idx, targets, cache) ->
(logits, loss), context, new_cache, num_params, grad_checkpointing), so the trainer's loop,
out-of-memory policy, checkpoints and orchard-generate serve both. A checkpoint records the
model's config as JSON (hf_config), from which build_model rebuilds it.

transformers is an optional extra (pip install '.[hf]'); it is imported only here, and only
when an HF model is asked for.
"""
import contextlib
import copy
import inspect
import json
import os

import orchard_ops
import torch
import torch.nn.functional as F

from .config import ConfigError, first_line, shown
from .data import read_json
from .model import GPT, GPTConfig

ATTN_IMPLEMENTATION = "orchard"


def cache_keyword(hf_model):
    """The keyword a transformers model's forward takes its KV cache by: transformers 5.24
    renamed past_key_values to cache (the old name warns, and goes in 5.40)."""
    params = inspect.signature(hf_model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def checkpointing_name(hf_model):
    """The prefix of a transformers model's checkpointing methods and flag (its _enable,
    _disable, is_): transformers 5.2x renamed gradient_checkpointing_* to
    activation_checkpointing_* (the old names warn, to go in 6); before, only the old exist."""
    return ("activation" if hasattr(hf_model, "activation_checkpointing_enable")
            else "gradient") + "_checkpointing"


class HFModelError(ConfigError):
    """An --hf-config or --hf-model that cannot be used; the message names the path."""


def _transformers(path):
    """transformers, once orchard.hf has imported it and registered attn_implementation=
    "orchard" (idempotent); HFModelError naming path where it cannot."""
    try:
        from . import hf
    except ImportError as e:    # missing, too old, or failing on an import of its own
        raise HFModelError("%s: %s" % (path, first_line(e))) from None
    return hf.transformers


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' warnings and progress bars held back (the load report of a pretrained
    folder, advice on standalone use): what orchard needs from them it checks and reports
    itself."""
    verbosity, bars = (transformers.logging.get_verbosity(),
                       transformers.logging.is_progress_bar_enabled())
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()


# Levels of objects and lists a config may have: transformers' nest a few; it copies them
# recursively (copy.deepcopy), which 500 levels took past Python's recursion limit.
MAX_NESTING = 64
# Layers of the meta-device model whose modules say whether its attention is causal
_PROBE_LAYERS = 8
# Layers of the meta-device model whose parameters are counted (2 ms each): every layer of any
# real model; past them a config edited to more layers makes more than its weights hold
_COUNTED_LAYERS = 256


def _nesting(value):
    """How many levels of objects and lists value has, counted a level at a time (not
    recursively: what it guards against is nesting too deep to recurse into)."""
    levels, level = 0, [value]
    while level:
        level = [x for x in level if isinstance(x, (dict, list))]
        levels += bool(level)
        level = [item for x in level for item in (x.values() if isinstance(x, dict) else x)]
    return levels


def _config_from_dict(values, path):
    transformers = _transformers(path)
    from . import hf
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise HFModelError("%s: not a transformers config: expected a JSON object with a "
                           "'model_type'" % path)
    if _nesting(values) > MAX_NESTING:
        raise HFModelError("%s: not a transformers config: nested more than %d levels deep"
                           % (path, MAX_NESTING))
    values = dict(values)
    model_type = values.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise HFModelError("%s: unknown model_type %r (transformers %s)"
                           % (path, model_type, transformers.__version__))
    try:
        with _quiet(transformers):
            config = transformers.AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # transformers validates fields with several exception types
        raise HFModelError("%s: not a valid %s config: %s"
                           % (path, model_type, first_line(exc))) from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise HFModelError("%s: model_type %r is not a causal language model"
                           % (path, model_type))
    if not getattr(config, "num_attention_heads", None):
        raise HFModelError("%s: model_type %r has no attention heads (num_attention_heads): "
                           "orchard trains attention models" % (path, model_type))
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:      # transformers builds, and trains, no layers
        raise HFModelError("%s: num_hidden_layers must be at least 1, got %d" % (path, layers))
    # sizes transformers takes and builds no model of (zero-element tensors, a warning), or
    # one orchard would not compute (a dropout probability it refuses at the first step); one
    # no int64 holds was an OverflowError in the memory plan's message
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings")
    for name in sizes + ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                         "head_dim"):
        size = getattr(config, name, None)
        if isinstance(size, int) and size >= 2**63:
            raise HFModelError("%s: %s must be below 2**63, got %s"
                               % (path, name, shown(size)))
        if isinstance(size, int) and size < 1 and name in sizes:
            raise HFModelError("%s: %s must be at least 1, got %d" % (path, name, size))
    dropout = getattr(config, "attention_dropout", None)
    if isinstance(dropout, (int, float)) and not 0 <= dropout < 1:
        raise HFModelError("%s: attention_dropout must be in [0, 1), got %r" % (path, dropout))
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    if isinstance(head_dim, int) and head_dim > hf._MAX_HEAD_DIM:
        # (transformers' own attention would compute every layer, orchard none)
        raise HFModelError("%s: head dimension %d is above orchard's %d"
                           % (path, head_dim, hf._MAX_HEAD_DIM))
    if isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        # transformers takes it, and the first step fails; a left-out num_key_value_heads is
        # the model's default, 32 for Qwen2, more than a small model's heads
        raise HFModelError("%s: num_key_value_heads %d does not divide num_attention_heads %d"
                           "%s" % (path, kv_heads, heads, "" if "num_key_value_heads" in values
                                   else " (it is %s's default: set it)" % model_type))
    why = hf.unsupported_reason(config)
    if why is not None:
        raise HFModelError("%s: model_type %r: %s, so orchard cannot run it"
                           % (path, model_type, why))
    # An encoder (BERT without is_decoder) has a language-model head over attention that sees
    # later tokens: next-token training would teach it to copy them. Its modules say so.
    model = _meta_model(transformers, config, _PROBE_LAYERS) or torch.nn.Module()
    seeing = sorted({type(m).__name__ for m in model.modules()
                     if getattr(m, "is_causal", None) is False})
    if seeing:
        raise HFModelError("%s: model_type %r builds attention that is not causal (%s): not a "
                           "causal language model as configured (BERT-like models need "
                           "\"is_decoder\": true)" % (path, model_type, seeing[0]))
    return config


def _meta_model(transformers, config, layers):
    """config's model built on the meta device, where it costs no memory, with at most `layers`
    of its layers (each 2 ms: 100,000 layers took minutes before the memory plan could refuse
    them); None where it cannot be built there (it is built, and judged, later)."""
    probe = copy.deepcopy(config)
    if _layers(config) > layers:
        probe.num_hidden_layers = layers
    try:
        with torch.device("meta"), _quiet(transformers):
            return transformers.AutoModelForCausalLM.from_config(probe)
    except Exception:
        return None


def parameter_count(hf_config, source):
    """At least how many parameters the model of hf_config (a config's JSON, as the checkpoint
    file source records it) has: counted on the meta device, the layers past _COUNTED_LAYERS
    as none; None where it cannot be built there."""
    try:
        values = json.loads(hf_config)
    except (TypeError, ValueError, RecursionError) as exc:
        raise HFModelError("%s: its hf_config: not a config's JSON (%s)"
                           % (source, first_line(exc))) from None
    config = _config_from_dict(values, "%s: its hf_config" % source)
    model = _meta_model(_transformers(source), config, _COUNTED_LAYERS)
    return None if model is None else sum(p.numel() for p in model.parameters())


def _layers(config):
    """config's num_hidden_layers, 0 where it has none."""
    layers = getattr(config, "num_hidden_layers", None)
    return layers if isinstance(layers, int) else 0


def load_hf_config(path, pretrained=False):
    """The transformers config of a config.json file (pretrained=False, --hf-config) or of a
    local pretrained model folder (pretrained=True, --hf-model)."""
    if not path:
        raise HFModelError("%r: an empty path" % path)
    if pretrained:
        if not os.path.isdir(path):
            raise HFModelError("%s: %s" % (path, "a file, not a model folder"
                                           if os.path.exists(path) else "no such model folder"))
        path_json = os.path.join(path, "config.json")
        if not os.path.isfile(path_json):
            raise HFModelError("%s: not a pretrained model folder (no config.json)" % path)
    else:
        path_json = path
    return _config_from_dict(read_json(path_json, HFModelError, "config file"), path)


def model_section(config, context):
    """The config's model section for an HF config: its sizes in GPT's terms (the memory
    plan of DeviceBackend.adapt_config reads them) and the training context, at most the
    model's max_position_embeddings."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_positions = getattr(config, "max_position_embeddings", None) or context
    return {
        "vocab_size": config.vocab_size,
        "context": min(context, max_positions),
        "n_layer": config.num_hidden_layers,
        "n_head": heads,
        "n_kv_head": getattr(config, "num_key_value_heads", None) or heads,
        "n_embd": heads * head_dim,
        "dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
        "bias": bool(getattr(config, "attention_bias", False)),
    }


def attention_device_note(device):
    """Where orchard's default device is not device, what a user who asked for device is told:
    a transformers model computes its attention there (orchard.hf calls orchard with
    device=None); else None."""
    default = orchard_ops.default_device()
    return None if default == device else (
        "a transformers model computes its attention on orchard's default device %s, not %s "
        "(ORCHARD_DEVICE chooses it)" % (default, device))


class HFCausalLM(torch.nn.Module):
    """A transformers causal LM with orchard.model.GPT's interface."""

    def __init__(self, hf_model, context):
        super().__init__()
        self.hf = hf_model
        self.trained_context = context
        self.cache_keyword = cache_keyword(hf_model)

    @property
    def context(self):
        """The most positions one forward may hold (generation slides its window past it):
        the model's max_position_embeddings, else the context it was trained on."""
        return getattr(self.hf.config, "max_position_embeddings", None) or self.trained_context

    @property
    def _checkpointing(self):
        return checkpointing_name(self.hf)

    @property
    def grad_checkpointing(self):
        return getattr(self.hf, "is_" + self._checkpointing)

    @grad_checkpointing.setter
    def grad_checkpointing(self, on):
        if on:
            getattr(self.hf, self._checkpointing + "_enable")({"use_reentrant": False})
        else:
            getattr(self.hf, self._checkpointing + "_disable")()

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, batch, size):
        """transformers' StaticCache of `size` positions, preallocated as GPT's KVCache (it
        takes the batch size from its first forward)."""
        from transformers import StaticCache

        return StaticCache(config=self.hf.config, max_cache_len=size)

    def forward(self, idx, targets=None, cache=None):
        out = self.hf(input_ids=idx, use_cache=cache is not None, **{self.cache_keyword: cache})
        logits = out.logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(model_cfg, hf_config=None, pretrained=None, checkpoint="the checkpoint"):
    """The built-in GPT of a config's model section, or, when hf_config (a config's JSON, as
    the checkpoint file `checkpoint` records it) is given, the transformers model it
    describes: randomly initialised, or with the weights of the local folder `pretrained`."""
    if hf_config is None:
        return GPT(GPTConfig.from_dict(model_cfg))
    # what the messages name: the folder, the checkpoint, or (a new run of --hf-config,
    # whose caller names the file) nothing
    source = pretrained or (checkpoint and "%s: its hf_config" % checkpoint)
    config = _config_from_dict(json.loads(hf_config), source or "the config")
    transformers = _transformers(source)
    # float32 master weights, whatever dtype the config or files name: the trainer casts
    # with autocast.
    with _quiet(transformers):
        if pretrained is None:
            try:
                model = transformers.AutoModelForCausalLM.from_config(
                    config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
            except Exception as exc:   # a config transformers takes but cannot build
                raise HFModelError("%stransformers cannot build this model: %s"
                                   % (source + ": " if source else "", first_line(exc))) \
                    from None
        else:
            model = _pretrained(transformers, pretrained, config)
    return HFCausalLM(model, (model_cfg or {}).get("context"))


def _pretrained(transformers, folder, config):
    """The model of a pretrained folder, every parameter from its weights (transformers
    initialises missing and, asked to go on, mismatched ones at random, with a report)."""
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, config=config, attn_implementation=ATTN_IMPLEMENTATION,
            dtype=torch.float32, local_files_only=True, output_loading_info=True,
            ignore_mismatched_sizes=True)
    except Exception as exc:  # a damaged weights file raises safetensors' own type too
        raise HFModelError("%s: cannot load the pretrained model: %s"
                           % (folder, first_line(exc))) from None
    missing, mismatched = sorted(info["missing_keys"]), sorted(info["mismatched_keys"])
    if mismatched:
        name, stored, wanted = mismatched[0]
        raise HFModelError("%s: its weights do not fit the model: %d of other shapes (e.g. %s "
                           "%s, where its config makes %s)" % (folder, len(mismatched), name,
                                                               list(stored), list(wanted)))
    if missing:
        raise HFModelError("%s: its weights lack %d of the model's parameters (e.g. %s): not "
                           "the weights of this config's model" % (folder, len(missing),
                                                                   missing[0]))
    return model
