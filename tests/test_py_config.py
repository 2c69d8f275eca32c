"""orchard.config: the universal YAML, validation errors that name key and file, dtypes."""
import os
import re

import pytest
import yaml

from orchard.config import ConfigError, default_config, get_dtype_from_string, load_config
from test_py_support import REPO_ROOT

UNIVERSAL = os.path.join(REPO_ROOT, "configs", "universal.yaml")


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_universal_yaml_is_complete_and_equals_the_defaults():
    with open(UNIVERSAL) as f:
        raw = yaml.safe_load(f)
    assert {s: set(v) for s, v in raw.items()} == {s: set(v) for s, v in default_config().items()}
    assert load_config(UNIVERSAL) == default_config()


def test_partial_config_takes_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  n_layer: 2\n"))
    assert cfg["model"]["n_layer"] == 2
    assert cfg["training"] == default_config()["training"]
    # kv heads left out: one per query head, whatever n_head is
    for n_head in (2, 8):
        cfg = load_config(write(tmp_path, "model:\n  n_head: %d\n" % n_head))
        assert cfg["model"]["n_kv_head"] == n_head
    cfg = load_config(write(tmp_path, "model:\n  n_head: 8\n  n_kv_head: 2\n"))
    assert cfg["model"]["n_kv_head"] == 2


@pytest.mark.parametrize("text, key", [
    ("model:\n  n_layers: 2\n", "model.n_layers"),
    ("optimizer:\n  lr: 1\n", "optimizer"),
    ("training:\n  batch_size: '16'\n", "training.batch_size"),
    ("training:\n  learning_rate: fast\n", "training.learning_rate"),
    ("model:\n  bias: 1\n", "model.bias"),
    ("model:\n  n_layer: true\n", "model.n_layer"),
    ("training:\n  dtype: fp8\n", "training.dtype"),
    ("training:\n  micro_batch: 0\n", "training.micro_batch"),
    ("device:\n  memory_fraction: 1.5\n", "device.memory_fraction"),
    ("training:\n  val_fraction: 1\n", "training.val_fraction"),
    ("training:\n  eval_interval: 0\n", "training.eval_interval"),
    ("training:\n  learning_rate: 1.0e+39\n", "training.learning_rate"),
    ("model:\n  n_embd: 100\n  n_head: 3\n", "model.n_embd"),
    ("training:\n  learning_rate: 0.001\n  min_lr: 0.01\n", "training.min_lr"),
    ("model: 3\n", "model"),
    ("device:\n  num_threads: 100000\n", "device.num_threads"),   # past orchard_ops' limit
    ("training:\n  learning_rate: .inf\n", "training.learning_rate"),
    ("training:\n  weight_decay: .nan\n", "training.weight_decay"),
    ("training:\n  grad_clip: .inf\n", "training.grad_clip"),   # (no JSON number)
    # YAML 1.1's other ints are text: 1:30 had read as 90, 0x10 as 16
    ("training:\n  batch_size: 1:30\n", "training.batch_size"),
    ("training:\n  batch_size: 0x10\n", "training.batch_size"),
    ("model:\n  n_layer: 1_0\n", "model.n_layer"),
    ("training:\n  learning_rate: 1:30.0\n", "training.learning_rate"),   # (90.0)
    ("training:\n  grad_clip: 1_0.5\n", "training.grad_clip"),
    ("training:\n  grad_clip: -1\n", "training.grad_clip"),
    # numbers no float or int64 holds: they passed, and failed at the first step
    ("training:\n  grad_clip: 1%s\n" % ("0" * 400), "training.grad_clip"),
    ("training:\n  warmup_steps: %d\n" % 2**63, "training.warmup_steps"),
])
def test_errors_name_the_key_and_the_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "'%s'" % key in str(info.value) and path in str(info.value)


@pytest.mark.parametrize("text", ["1e-3", "1.0e3", "+.5e-3", "3E-4", "2.", "1.0e+3"])
def test_floats_take_an_exponent_without_a_dot_or_sign(tmp_path, text):
    """As YAML 1.2 reads them: PyYAML (YAML 1.1) read 1e-3, 1.0e3 and +.5e-3 as text."""
    assert load_config(write(tmp_path, "training:\n  learning_rate: %s\n" % text))[
        "training"]["learning_rate"] == float(text)


def test_ints_are_decimal_digits(tmp_path):
    """YAML 1.1 (PyYAML) read 010 as 8, an octal: a leading zero is a decimal digit."""
    cfg = load_config(write(tmp_path, "training:\n  batch_size: 010\n  warmup_steps: +0\n"))
    assert cfg["training"]["batch_size"] == 10 and cfg["training"]["warmup_steps"] == 0


@pytest.mark.parametrize("key", ["model.bias", "training.grad_checkpointing"])
@pytest.mark.parametrize("word", ["yes", "No", "on", "OFF"])
def test_booleans_are_true_and_false(tmp_path, key, word):
    """As YAML 1.2 reads them: PyYAML (YAML 1.1) read yes, no, on and off as booleans, where
    the numbers already followed YAML 1.2; they are text, refused with a hint."""
    section, name = key.split(".")
    text = "%s:\n  %s: %%s\n" % (section, name)
    for spelling, value in (("true", True), ("False", False), ("TRUE", True)):
        assert load_config(write(tmp_path, text % spelling))[section][name] is value
    with pytest.raises(ConfigError, match=r"key '%s' must .* got (str )?'%s' \(YAML 1.2 reads "
                                          r"%s as text: write true or false\)" % (key, word, word)):
        load_config(write(tmp_path, text % word))


def test_a_number_in_quotes_gets_a_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"got str '1.0e-3' \(a number in quotes is text: "
                                          r"write it without them\)"):
        load_config(write(tmp_path, 'training:\n  learning_rate: "1.0e-3"\n'))
    with pytest.raises(ConfigError, match=r"got str '16' \(a number in quotes is text"):
        load_config(write(tmp_path, "training:\n  batch_size: '16'\n"))
    # text that is no number of the key's type: no hint (an int of 5,000 digits: no traceback)
    for text in ("'1_000'", "'1.5'", "'%s'" % ("1" * 5000)):
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path, "training:\n  batch_size: %s\n" % text))
        assert "without them" not in str(info.value)
    # nor text where a key also takes text (it had said so of dtype's 'float32', no number)
    for text in ("training:\n  dtype: float32\n", "training:\n  micro_batch: big\n",
                 "device:\n  num_threads: all\n"):
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path, text))
        assert "without them" not in str(info.value)
    with pytest.raises(ConfigError, match=r"got '8' \(a number in quotes is text"):
        load_config(write(tmp_path, "training:\n  micro_batch: '8'\n"))


def test_an_int_where_a_real_is_expected_is_read_as_a_float(tmp_path):
    """beta1: 0 is a YAML int; torch's AdamW refused int betas with a traceback."""
    cfg = load_config(write(tmp_path, "training:\n  beta1: 0\n  grad_clip: 1\n"))
    assert cfg["training"]["beta1"] == 0.0 and type(cfg["training"]["beta1"]) is float
    assert type(cfg["training"]["grad_clip"]) is float


def test_a_key_given_twice_is_an_error(tmp_path):
    # PyYAML would keep the last value and drop the first without a word
    path = write(tmp_path, "training:\n  batch_size: 8\n  batch_size: 16\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == ("%s: not valid YAML at line 3, column 3: key 'batch_size' given "
                            "twice" % path)
    with pytest.raises(ConfigError, match="line 3, column 1: key 'training' given twice"):
        load_config(write(tmp_path, "training:\n  batch_size: 8\ntraining:\n  epochs: 2\n"))


def test_merge_keys_are_yaml_and_a_merged_key_may_be_given_again(tmp_path):
    """<< merges a mapping (refused: "could not determine a constructor"); keys given beside
    it override the merged ones, as YAML says."""
    cfg = load_config(write(tmp_path, "model:\n  <<: {n_layer: 1, n_head: 2, n_embd: 32}\n"
                                      "  n_head: 4\n"))
    assert (cfg["model"]["n_layer"], cfg["model"]["n_head"], cfg["model"]["n_embd"]) == (1, 4, 32)


def test_a_value_of_the_wrong_type_is_shown_short(tmp_path):
    """Nested aliases (a few hundred bytes of YAML for billions of elements) or a long string
    are shown abbreviated: the message formatted the whole value, without end."""
    laughs = "model:\n  context:\n    - &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for i in range(1, 9):
        laughs += "    - &x%d [%s]\n" % (i, ", ".join(["*x%d" % (i - 1)] * 9))
    for text in (laughs, "model:\n  context: '%s'\n" % ("A" * 100000)):
        with pytest.raises(ConfigError, match="key 'model.context' must be") as e:
            load_config(write(tmp_path, text))
        assert len(str(e.value)) < 500


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [1,\n"))


def test_get_dtype_from_string():
    torch = pytest.importorskip("torch")
    assert get_dtype_from_string("fp32") is torch.float32
    assert get_dtype_from_string("fp16") is torch.float16
    assert get_dtype_from_string("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        get_dtype_from_string("fp8")
