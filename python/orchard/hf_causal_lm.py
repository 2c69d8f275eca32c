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
import json
import os

import torch
import torch.nn.functional as F

from .config import ConfigError
from .data import read_json
from .model import GPT, GPTConfig

ATTN_IMPLEMENTATION = "orchard"


class HFModelError(ConfigError):
    """An --hf-config or --hf-model that cannot be used; the message names the path."""


def _transformers(path):
    try:
        import transformers
    except ImportError:
        raise HFModelError("%s: a transformers model needs the transformers package: "
                           "pip install 'orchard[hf]'" % path) from None
    # `import orchard.hf` registers attn_implementation="orchard" (idempotent).
    from . import hf  # noqa: F401
    return transformers


def _first_line(exc):
    """The first line of an exception's message, with the next one where it ends in a colon
    (pydantic-style validation errors put the field's problem there)."""
    lines = [line.strip() for line in str(exc).strip().split("\n") if line.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return text[:300]


def _config_from_dict(values, path):
    transformers = _transformers(path)
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise HFModelError("%s: not a transformers config: expected a JSON object with a "
                           "'model_type'" % path)
    values = dict(values)
    model_type = values.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise HFModelError("%s: unknown model_type %r (transformers %s)"
                           % (path, model_type, transformers.__version__))
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # transformers validates fields with several exception types
        raise HFModelError("%s: not a valid %s config: %s"
                           % (path, model_type, _first_line(exc))) from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise HFModelError("%s: model_type %r is not a causal language model"
                           % (path, model_type))
    # An encoder (BERT without is_decoder) has a language-model head over attention that sees
    # later tokens: next-token training would teach it to copy them. Its modules say so; built
    # on the meta device, they cost no memory.
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:   # a model that cannot be built there is built, and judged, later
        model = torch.nn.Module()
    seeing = sorted({type(m).__name__ for m in model.modules()
                     if getattr(m, "is_causal", None) is False})
    if seeing:
        raise HFModelError("%s: model_type %r builds attention that is not causal (%s): not a "
                           "causal language model as configured (BERT-like models need "
                           "\"is_decoder\": true)" % (path, model_type, seeing[0]))
    return config


def load_hf_config(path, pretrained=False):
    """The transformers config of a config.json file (pretrained=False, --hf-config) or of a
    local pretrained model folder (pretrained=True, --hf-model)."""
    if pretrained:
        if not os.path.isdir(path):
            raise HFModelError("%s: %s" % (path, "a file, not a model folder"
                                           if os.path.exists(path) else "no such model folder"))
        path_json = os.path.join(path, "config.json")
        if not os.path.isfile(path_json):
            raise HFModelError("%s: not a pretrained model folder (no config.json)" % path)
    else:
        if not os.path.isfile(path):
            raise HFModelError("%s: %s" % (path, "a folder, not a config file"
                                           if os.path.isdir(path) else "no such config file"))
        path_json = path
    return _config_from_dict(read_json(path_json, HFModelError, "config"), path)


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


class HFCausalLM(torch.nn.Module):
    """A transformers causal LM with orchard.model.GPT's interface."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    @property
    def context(self):
        """The most positions one forward may hold (generation slides its window past it)."""
        return self.hf.config.max_position_embeddings

    @property
    def grad_checkpointing(self):
        return self.hf.is_activation_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, on):
        if on:
            self.hf.activation_checkpointing_enable({"use_reentrant": False})
        else:
            self.hf.activation_checkpointing_disable()

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, batch, size):
        """transformers' StaticCache of `size` positions, preallocated as GPT's KVCache (it
        takes the batch size from its first forward)."""
        from transformers import StaticCache

        return StaticCache(config=self.hf.config, max_cache_len=size)

    def forward(self, idx, targets=None, cache=None):
        out = self.hf(input_ids=idx, past_key_values=cache, use_cache=cache is not None)
        logits = out.logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(model_cfg, hf_config=None, pretrained=None):
    """The built-in GPT of a config's model section, or, when hf_config (a config's JSON, as
    checkpoints record it) is given, the transformers model it describes: randomly
    initialised, or with the weights of the local folder `pretrained`."""
    if hf_config is None:
        return GPT(GPTConfig.from_dict(model_cfg))
    source = pretrained or "the checkpoint's hf_config"
    config = _config_from_dict(json.loads(hf_config), source)
    transformers = _transformers(source)
    # float32 master weights, whatever dtype the config or files name: the trainer casts
    # with autocast.
    if pretrained is None:
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
    else:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                pretrained, config=config, attn_implementation=ATTN_IMPLEMENTATION,
                dtype=torch.float32, local_files_only=True)
        except Exception as exc:  # a damaged weights file raises safetensors' own type too
            raise HFModelError("%s: cannot load the pretrained model: %s"
                               % (pretrained, _first_line(exc))) from None
    return HFCausalLM(model)
