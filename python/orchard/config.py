"""Training configuration: the schema, loading and validation of the universal YAML.

A config is a plain nested dict with three sections (model, training, device). Every key has a
default here, so a YAML file may set any subset; configs/universal.yaml writes all of them out
with comments and is kept equal to these defaults by a test. "auto" values are resolved for the
device at hand by DeviceBackend.adapt_config, which reports a reason for each change.
"""
import re
import reprlib

import orchard_ops

from .data import file_problem

AUTO = "auto"

# section -> key -> (allowed types, default, check or None). A check returns an error text or
# None; types are checked first, so checks may assume them. bool is kept apart from int because
# YAML's `yes` would otherwise pass as the integer 1.
_positive = lambda v: None if v >= 1 else "must be >= 1"
_fraction = lambda v: None if 0.0 <= v < 1.0 else "must be in [0, 1)"
_unit = lambda v: None if 0.0 < v <= 1.0 else "must be in (0, 1]"
_non_negative = lambda v: None if v >= 0 else "must be >= 0"
# the optimizer keeps these in float32: a larger value failed at the first step
_finite = lambda v: None if 0 <= v <= 3.4028234663852886e38 else (
    "must be a number in [0, 3.4e38] (float32's range)")
_MAX_THREADS = orchard_ops.build_info()["max_threads"]
_threads = lambda v: None if 1 <= v <= _MAX_THREADS else "must be in 1..%d" % _MAX_THREADS


def _number_problem(value, types):
    """An error text for an int no int64 holds, or where a real is expected none a float
    holds (both went through the input checks and failed at the first step, after --overwrite
    had removed the last run), else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if float in (types if isinstance(types, tuple) else ()):
        return None if abs(value) <= 1.7976931348623157e308 else "must be a number a float holds"
    return None if -2**63 <= value < 2**63 else "must be an int below 2**63"


def _auto_or(check):
    return lambda v: None if v == AUTO else (
        check(v) if not isinstance(v, str) else "must be a number or 'auto'")


def _one_of(*choices):
    return lambda v: None if v in choices else "must be one of %s" % ", ".join(choices)


SCHEMA = {
    "model": {
        "vocab_size": (int, 256, _positive),
        "context": (int, 256, _positive),
        "n_layer": (int, 4, _positive),
        "n_head": (int, 4, _positive),
        "n_kv_head": (int, 4, _positive),
        "n_embd": (int, 128, _positive),
        "dropout": ((int, float), 0.0, _fraction),
        "bias": (bool, False, None),
    },
    "training": {
        "batch_size": (int, 16, _positive),
        "micro_batch": ((int, str), AUTO, _auto_or(_positive)),
        "learning_rate": ((int, float), 0.002, _finite),
        "min_lr": ((int, float), 0.0002, _non_negative),
        "warmup_steps": (int, 20, _non_negative),
        "weight_decay": ((int, float), 0.1, _finite),
        "beta1": ((int, float), 0.9, _fraction),
        "beta2": ((int, float), 0.95, _fraction),
        "grad_clip": ((int, float), 1.0, _finite),   # .inf printed as Infinity in --json
        "dtype": (str, AUTO, _one_of(AUTO, "fp32", "fp16", "bf16")),
        "grad_checkpointing": ((bool, str), AUTO, lambda v: None if v in (True, False, AUTO)
                               else "must be true, false or 'auto'"),
        "log_interval": (int, 10, _positive),
        "checkpoint_interval": (int, 100, _positive),
        "val_fraction": ((int, float), 0.05, _fraction),
        "eval_interval": (int, 100, _positive),
        "eval_sequences": (int, 512, _positive),
    },
    "device": {
        "memory_fraction": ((int, float), 0.8, _unit),
        "num_threads": ((int, str), AUTO, _auto_or(_threads)),
    },
}


class ConfigError(ValueError):
    """A config file that does not match SCHEMA; the message names the key and the file."""


def is_out_of_memory(exc):
    """Any MemoryError (orchard_ops.OrchardOutOfMemory included), and PyTorch's CPU allocator
    failure, which PyTorch raises as a plain RuntimeError."""
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def first_line(exc):
    """The first line of an exception's message, with the next one where it ends in a colon
    (pydantic-style validation errors and load_state_dict put the problem there)."""
    lines = [line.strip() for line in str(exc).strip().split("\n") if line.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return text[:300]


def default_config():
    return {section: {key: spec[1] for key, spec in keys.items()}
            for section, keys in SCHEMA.items()}


def _text_hint(value, types):
    """A hint for text meant as a number or a boolean: a number in quotes (unquoted, YAML
    reads it as one) or YAML 1.1's yes, no, on and off (YAML 1.2 reads them as text)."""
    import yaml

    if (isinstance(value, str) and value.lower() in ("yes", "no", "on", "off")
            and bool in (types if isinstance(types, tuple) else (types,))):
        return " (YAML 1.2 reads %s as text: write true or false)" % value
    try:
        loaded = yaml.load(value, _config_loader(yaml)) if isinstance(value, str) else None
    except (ValueError, yaml.YAMLError):    # (an int of 4,300+ digits: int() refuses it)
        return ""
    # a number (a key that also takes text, dtype's, had said so of 'float32')
    if isinstance(loaded, bool) or not isinstance(loaded, (int, float)) \
            or not isinstance(loaded, types):
        return ""
    return " (a number in quotes is text: write it without them)"


def _type_names(types):
    # A str next to another type is there only for the word 'auto'.
    types = types if isinstance(types, tuple) else (types,)
    if types == (str,):
        return "a string"
    return " or ".join("'auto'" if t is str else t.__name__ for t in types)


def validate(cfg, source="<config>"):
    """Check a (possibly partial) config dict against SCHEMA and return it merged with defaults."""
    if not isinstance(cfg, dict):
        raise ConfigError("%s: the top level must be a mapping of sections (%s), got %s"
                          % (source, ", ".join(SCHEMA), type(cfg).__name__))
    merged = default_config()
    for section, values in cfg.items():
        if section not in SCHEMA:
            raise ConfigError("%s: unknown key '%s' (sections are %s)"
                              % (source, section, ", ".join(SCHEMA)))
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError("%s: key '%s' must be a mapping, got %s"
                              % (source, section, type(values).__name__))
        for key, value in values.items():
            name = "%s.%s" % (section, key)
            if key not in SCHEMA[section]:
                raise ConfigError("%s: unknown key '%s' (known: %s)"
                                  % (source, name, ", ".join(SCHEMA[section])))
            types, _, check = SCHEMA[section][key]
            bool_mismatch = isinstance(value, bool) and bool not in (
                types if isinstance(types, tuple) else (types,))
            if not isinstance(value, types) or bool_mismatch:
                raise ConfigError("%s: key '%s' must be %s, got %s %s%s"
                                  % (source, name, _type_names(types), type(value).__name__,
                                     shown(value), _text_hint(value, types)))
            problem = _number_problem(value, types) or (check(value) if check else None)
            if problem:
                raise ConfigError("%s: key '%s' %s, got %s%s" % (source, name, problem,
                                                                shown(value),
                                                                _text_hint(value, types)))
            # a YAML int where a real is expected is one (torch's AdamW refused int betas)
            if float in (types if isinstance(types, tuple) else ()) and isinstance(value, int):
                value = float(value)
            merged[section][key] = value
    model = merged["model"]
    if "n_kv_head" not in (cfg.get("model") or {}):
        # as transformers' num_key_value_heads: none given, one per query head (a 4 beside an
        # n_head of 8 would make a GQA model nobody asked for)
        model["n_kv_head"] = model["n_head"]
    if model["n_embd"] % model["n_head"]:
        raise ConfigError("%s: key 'model.n_embd' (%d) must be a multiple of model.n_head (%d)"
                          % (source, model["n_embd"], model["n_head"]))
    if model["n_head"] % model["n_kv_head"]:
        raise ConfigError("%s: key 'model.n_kv_head' (%d) must divide model.n_head (%d)"
                          % (source, model["n_kv_head"], model["n_head"]))
    train = merged["training"]
    if train["min_lr"] > train["learning_rate"]:
        raise ConfigError("%s: key 'training.min_lr' (%g) must be at most "
                          "training.learning_rate (%g), where the schedule decays to it"
                          % (source, train["min_lr"], train["learning_rate"]))
    return merged


# A value in a message, abbreviated (long ints too): two levels of nesting (reprlib's six,
# for YAML aliases nested nine deep, made a message of 140 KB)
_REPR = reprlib.Repr()
_REPR.maxlevel = 2
shown = _REPR.repr


# An integer as YAML 1.2's core schema writes it (and the console scripts' flags): decimal
# ASCII digits, a sign allowed. Python's int() takes `1_000` and other scripts' digits too.
DECIMAL_INT = re.compile(r"[-+]?[0-9]+\Z")
# A real number so (a point and an exponent allowed); float() takes `1_0`, spaces and other
# scripts' digits too.
_REAL = r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
DECIMAL_REAL = re.compile(_REAL + r"\Z")


def _config_loader(yaml):
    """yaml.SafeLoader, but a key given twice in one mapping is an error where PyYAML keeps
    the last value silently (YAML requires unique keys): a config's first value for it would
    be ignored without a word. Merge keys (<<) are YAML's own: keys they bring in may be
    given again, and are overridden so. Numbers and booleans are read as YAML 1.2's core
    schema reads them, not as PyYAML's YAML 1.1: ints are decimal digits (010 had read as 8,
    1:30 as 90, 0x10 and 1_000 are text now, which validate names), floats take an exponent
    without a dot or a sign (3e-4 had been text) but no underscores or sexagesimal parts, and
    booleans are true and false (yes, no, on and off are text)."""
    class ConfigLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value
                    if key.tag != "tag:yaml.org,2002:merge"]
            for i, key in enumerate(keys):
                if key in keys[:i]:
                    raise yaml.constructor.ConstructorError(
                        None, None, "key %r given twice" % (key,), node.value[i][0].start_mark)
            return super().construct_mapping(node, deep)

    numbers = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    boolean = "tag:yaml.org,2002:bool"
    ConfigLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in numbers + (boolean,)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    ConfigLoader.add_implicit_resolver(
        boolean, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    ConfigLoader.add_implicit_resolver(numbers[0], DECIMAL_INT, list("-+0123456789"))
    ConfigLoader.add_implicit_resolver(
        numbers[1], re.compile(r"^(?:" + _REAL + r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."))
    ConfigLoader.add_constructor(numbers[0],
                                 lambda loader, node: int(loader.construct_scalar(node)))
    return ConfigLoader


def load_config(path=None):
    """The validated config of a YAML file, or the defaults (= configs/universal.yaml) for None."""
    if path is None:
        return default_config()
    import yaml

    problem = file_problem(path, "config file")
    if problem:
        raise ConfigError("%s: %s" % (path, problem))
    try:
        with open(path, "rb") as f:
            cfg = yaml.load(f, _config_loader(yaml))
    except OSError as exc:
        raise ConfigError("%s: cannot be read (%s)" % (path, exc.strerror or exc)) from None
    except yaml.YAMLError as exc:
        # one line: where, and what the parser expected
        mark = getattr(exc, "problem_mark", None)
        where = " at line %d, column %d" % (mark.line + 1, mark.column + 1) if mark else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("%s: not valid YAML%s: %s" % (path, where, what)) from None
    except ValueError as exc:   # an int of 4,300+ digits, which PyYAML converts unchecked
        raise ConfigError("%s: not valid YAML: %s" % (path, exc)) from None
    except RecursionError:      # (PyYAML composes nested lists and mappings recursively)
        raise ConfigError("%s: not a config file: nested too deeply" % path) from None
    return validate(cfg if cfg is not None else {}, source=path)


def get_dtype_from_string(name):
    """torch dtype of a config dtype name: "fp32", "fp16" or "bf16"."""
    import torch

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError("unknown dtype %r: expected one of %s" % (name, ", ".join(dtypes)))
    return dtypes[name]
