"""orchard-train --hf-config / --hf-model: a transformers Llama trained on the default data
with attn_implementation="orchard", its checkpoint resumed and generated from, and the
errors of bad paths, a vocabulary that does not fit, and a missing transformers."""
import json
import os
import re
import signal
import types

import pytest

torch = pytest.importorskip("torch")

from orchard.checkpoint import load_checkpoint  # noqa: E402
from orchard.cli import train  # noqa: E402
from orchard.trainer import Trainer  # noqa: E402
from test_py_support import REPO_ROOT, fail_first_forward, read_metrics, run_python  # noqa: E402

needs_transformers = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("transformers"),
    reason="transformers is not installed (pip install '.[hf]')")

TINY_LLAMA = os.path.join(REPO_ROOT, "configs", "hf_llama_tiny.json")
# Short sequences and few held-out ones keep the steps on the default data fast.
FAST = ("model:\n  context: 64\ntraining:\n  batch_size: 8\n  learning_rate: 0.01\n"
        "  min_lr: 0.001\n  warmup_steps: 2\n  log_interval: 1\n  checkpoint_interval: 4\n"
        "  val_fraction: 0.002\n")


@pytest.fixture(scope="module")
def fast_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "fast.yaml"
    path.write_text(FAST)
    return str(path)


def hf_train(fast_config, out, *extra):
    return train.main(["--config", fast_config, "--output", str(out), "--device", "cpu"]
                      + [str(e) for e in extra])


@pytest.fixture(scope="module")
def trained(fast_config, tmp_path_factory):
    """A tiny Llama trained for 12 steps, and the same run interrupted (Ctrl-C) in step 6
    and resumed."""
    straight = tmp_path_factory.mktemp("straight")
    resumed = tmp_path_factory.mktemp("resumed")
    assert hf_train(fast_config, straight, "--hf-config", TINY_LLAMA, "--max-steps", 12) == 0
    train_step = Trainer.train_step

    def ctrl_c_in_step_6(self, *args):
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return train_step(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "train_step", ctrl_c_in_step_6)
        assert hf_train(fast_config, resumed, "--hf-config", TINY_LLAMA, "--max-steps",
                        12) == 130
    assert load_checkpoint(str(resumed))["step"] == 6
    assert hf_train(fast_config, resumed, "--resume", resumed, "--max-steps", 12) == 0
    return straight, resumed


@needs_transformers
def test_llama_trains_on_the_default_data(trained):
    straight, _ = trained
    metrics = read_metrics(straight)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert "val_loss" in metrics[-1]
    state = load_checkpoint(str(straight))
    hf_config = json.loads(state["hf_config"])
    assert hf_config["model_type"] == "llama" and hf_config["vocab_size"] == 256
    assert state["data"]["byte_level"] and state["step"] == 12
    assert state["model_config"]["n_kv_head"] == 2 and state["model_config"]["context"] == 64
    assert any(name.startswith("hf.model.layers.1.self_attn") for name in state["model"])


@needs_transformers
def test_resumed_llama_run_ends_like_the_straight_one(trained):
    straight, resumed = trained
    assert [m["loss"] for m in read_metrics(resumed)] == [m["loss"]
                                                          for m in read_metrics(straight)]
    a, b = load_checkpoint(str(straight))["model"], load_checkpoint(str(resumed))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@needs_transformers
def test_orchard_generate_from_the_llama_checkpoint(trained):
    result = run_python(["-m", "orchard.cli.generate", "--checkpoint", str(trained[0]),
                         "--prompt", "import ", "--max-new-tokens", "24", "--device", "cpu"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("import ") and len(result.stdout) > len("import ") + 10


@needs_transformers
def test_llama_generation_runs_on_orchard_with_its_cache(trained):
    from orchard.generation import generate, load_model
    import orchard_ops

    model, _ = load_model(str(trained[0]), "cpu")
    assert model.hf.config._attn_implementation == "orchard"
    layers = model.hf.config.num_hidden_layers
    prompt = list(b"import os\nimport sys\n")
    orchard_ops.reset_stats()
    cached = generate(model, prompt, 12, temperature=0)
    stats = orchard_ops.stats()
    # a prefill of 20 tokens, then 11 one-token steps through the split-KV decode path
    assert stats["fwd_calls"] == 12 * layers and stats["decode_calls"] == 11 * layers
    assert cached == generate(model, prompt, 12, temperature=0, use_cache=False)


@needs_transformers
def test_pretrained_folder_is_loaded_and_its_vocabulary_checked(fast_config, tmp_path,
                                                                capsys):
    from orchard.hf_causal_lm import load_hf_config, build_model

    config = load_hf_config(TINY_LLAMA)
    pretrained = build_model(None, config.to_json_string()).hf
    pretrained.save_pretrained(str(tmp_path / "llama"))
    frozen = tmp_path / "frozen.yaml"      # learning rate 0: the weights stay the folder's
    frozen.write_text(FAST.replace("learning_rate: 0.01", "learning_rate: 0.0")
                      .replace("min_lr: 0.001", "min_lr: 0.0"))
    assert train.main(["--config", str(frozen), "--output", str(tmp_path / "run"),
                       "--device", "cpu", "--hf-model", str(tmp_path / "llama"),
                       "--max-steps", "1"]) == 0
    saved = load_checkpoint(str(tmp_path / "run"))["model"]
    assert all(torch.equal(saved["hf." + k], v) for k, v in pretrained.state_dict().items())

    config.vocab_size = 100    # the default data's bytes go up to 255
    build_model(None, config.to_json_string()).hf.save_pretrained(str(tmp_path / "small"))
    assert train.main(["--hf-model", str(tmp_path / "small"), "--output", str(tmp_path / "x"),
                       "--device", "cpu"]) == 2
    assert ("orchard-train: error: the built-in data (no --sequences): token ids up to 255, "
            "but the model of %s has a vocabulary of 100" % (tmp_path / "small")
            ) in capsys.readouterr().err

    # weights of another model (one layer fewer than the config's): an error, not a model
    # trained from partly random weights
    config.vocab_size = 256
    config.num_hidden_layers += 1
    config.save_pretrained(str(tmp_path / "llama_2"))
    os.link(tmp_path / "llama" / "model.safetensors", tmp_path / "llama_2" / "model.safetensors")
    assert train.main(["--hf-model", str(tmp_path / "llama_2"), "--output", str(tmp_path / "z"),
                       "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "orchard-train: error: argument --hf-model: %s: its weights lack 9 of the model's "
        "parameters (e.g. model.layers.%d.input_layernorm.weight): not the weights of this "
        "config's model" % (tmp_path / "llama_2", config.num_hidden_layers - 1)]
    assert not (tmp_path / "z").exists()
    config.num_hidden_layers -= 1
    config.vocab_size = 300     # embeddings of other shapes
    config.save_pretrained(str(tmp_path / "llama_2"))
    assert train.main(["--hf-model", str(tmp_path / "llama_2"), "--output", str(tmp_path / "z"),
                       "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "orchard-train: error: argument --hf-model: %s: its weights do not fit the model: 1 of "
        "other shapes (e.g. model.embed_tokens.weight [256, 64], where its config makes [300, "
        "64])"
        % (tmp_path / "llama_2")]

    # a tokenizer beside the weights: its ids are not the data's bytes
    (tmp_path / "llama" / "tokenizer.json").write_text("{}")
    assert train.main(["--hf-model", str(tmp_path / "llama"), "--output", str(tmp_path / "y"),
                       "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "orchard-train: error: the built-in data (no --sequences): bytes" in err, err
    assert "tokenizer.json" in err, err
    assert not (tmp_path / "y").exists()


@needs_transformers
def test_context_is_the_trained_one_without_max_position_embeddings():
    from orchard.hf_causal_lm import build_model, load_hf_config

    model = build_model({"context": 64}, load_hf_config(TINY_LLAMA).to_json_string())
    assert model.context == 256     # the config's max_position_embeddings
    model.hf.config = types.SimpleNamespace()   # none, as in ALiBi models' configs
    assert model.context == 64


@needs_transformers
def test_run_counts_the_attention_calls_orchard_computed(fast_config, tmp_path, caplog):
    """A GPT run logs its router's count; a transformers model's calls reach orchard through
    orchard.hf instead, and the run logs what orchard_ops.stats() counted: every layer's
    backward of each step, and more forwards (validation)."""
    caplog.set_level("INFO", logger="orchard")
    assert hf_train(fast_config, tmp_path / "run", "--hf-config", TINY_LLAMA,
                    "--max-steps", 2) == 0
    found = re.findall(r"attention calls computed by orchard \(stats\(\)\): (\d+) forward, "
                       r"(\d+) backward", caplog.text)
    assert len(found) == 1, caplog.text[-2000:]
    forward, backward = map(int, found[0])
    with open(TINY_LLAMA) as f:
        layers = json.load(f)["num_hidden_layers"]
    assert backward % (2 * layers) == 0 and backward > 0 and forward > backward, found


@needs_transformers
def test_metrics_name_the_device_attention_runs_on(fast_config, tmp_path, caplog):
    """orchard.hf calls orchard with device=None: --device plans memory, the default device
    computes the attention, and the log and metrics say which."""
    import orchard_ops

    opencl = [d["id"] for d in orchard_ops.devices() if d["id"].startswith("opencl:")]
    if not opencl or orchard_ops.default_device() == opencl[0]:
        pytest.skip("needs an OpenCL device other than the default")
    caplog.set_level("INFO", logger="orchard")
    out = tmp_path / "run"
    assert train.main(["--config", fast_config, "--output", str(out), "--device", opencl[0],
                       "--hf-config", TINY_LLAMA, "--max-steps", "1"]) == 0
    assert [r["device"] for r in read_metrics(out)] == [orchard_ops.default_device()]
    assert "parameters on %s:" % orchard_ops.default_device() in caplog.text
    note = ("a transformers model computes its attention on orchard's default device %s, not "
            "%s (ORCHARD_DEVICE chooses it)" % (orchard_ops.default_device(), opencl[0]))
    assert "note: " + note in caplog.text
    # orchard-generate's --device likewise (it had been ignored without a word)
    result = run_python(["-m", "orchard.cli.generate", "--checkpoint", str(out),
                         "--max-new-tokens", "2", "--device", opencl[0]])
    assert result.returncode == 0 and note in result.stderr, result.stderr[-2000:]
    result = run_python(["-m", "orchard.cli.generate", "--checkpoint", str(out),
                         "--max-new-tokens", "2", "--device", orchard_ops.default_device()])
    assert result.returncode == 0 and "computes its attention" not in result.stderr, \
        result.stderr[-2000:]


@needs_transformers
def test_hf_config_vocabulary_grows_to_the_data(fast_config, tmp_path):
    sequences = tmp_path / "seqs.json"
    sequences.write_text(json.dumps({"vocab_size": 300, "sequences": [
        [i % 300 for i in range(2000)]]}))
    assert hf_train(fast_config, tmp_path / "run", "--hf-config", TINY_LLAMA, "--sequences",
                    sequences, "--max-steps", 1) == 0
    assert json.loads(load_checkpoint(str(tmp_path / "run"))["hf_config"])["vocab_size"] == 300


@needs_transformers
@pytest.mark.parametrize("flag, name, why", [
    ("--hf-config", "missing.json", "no such config file"),
    ("--hf-config", "/dev/zero", "not a regular file"),     # ("no such config file", before)
    ("--hf-model", "missing", "no such model folder"),
])
def test_missing_hf_paths_are_one_error_line(tmp_path, flag, name, why):
    path = tmp_path / name
    result = run_python(["-m", "orchard.cli.train", flag, str(path), "--output",
                         str(tmp_path / "out"), "--device", "cpu"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "orchard-train: error: argument %s: %s: %s" % (flag, path, why)], result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


@needs_transformers
def test_a_config_of_a_billion_layers_is_refused_by_the_memory_plan(tmp_path):
    """The check for attention that is not causal builds a few layers on the meta device,
    not all (2 ms each: a billion layers hung there before the memory plan could refuse
    them; the child's 120 s timeout fails this test)."""
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 64, "num_hidden_layers": 10**9}))
    result = run_python(["-m", "orchard.cli.train", "--hf-config", str(path), "--output",
                         str(tmp_path / "out"), "--device", "cpu"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "orchard-train: error: argument --hf-config: the model's weights, gradients and "
        "optimizer state need"), result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


@needs_transformers
@pytest.mark.parametrize("flag, name, content, why", [
    ("--hf-config", "broken.json", '{"model_type": "llama", ', "not valid JSON: "),
    ("--hf-config", "list.json", "[1, 2]", "not a transformers config: expected a JSON "
                                           "object with a 'model_type'"),
    ("--hf-config", "t5.json", '{"model_type": "t5"}', "model_type 't5' is not a causal "
                                                       "language model"),
    ("--hf-config", "nope.json", '{"model_type": "nope"}', "unknown model_type 'nope'"),
    ("--hf-config", "typo.json", '{"model_type": "llama", "hidden_size": "x"}',
     "not a valid llama config: "),
    ("--hf-model", "empty", None, "not a pretrained model folder (no config.json)"),
    ("--hf-config", "bloom.json", '{"model_type": "bloom", "hidden_size": 32, "n_head": 2}',
     "model_type 'bloom': BloomModel computes its attention in its own code, not through "
     "transformers' attention interface"),
    # TrOCR's causal LM has no base model in MODEL_MAPPING: it was trained unmasked
    ("--hf-config", "trocr.json", '{"model_type": "trocr", "d_model": 32}',
     "model_type 'trocr': TrOCRForCausalLM computes its attention in its own code"),
    # Doge builds its mask on the causal one, which orchard's mask function leaves out
    ("--hf-config", "doge.json", '{"model_type": "doge", "hidden_size": 32}',
     "model_type 'doge': transformers marks DogeModel as not supporting FlashAttention-2"),
    # transformers takes these; the first step, or the model's construction, failed with a
    # traceback
    ("--hf-config", "kv.json", '{"model_type": "qwen2", "hidden_size": 32, '
     '"num_attention_heads": 4}', "num_key_value_heads 32 does not divide num_attention_heads "
     "4 (it is qwen2's default: set it)"),
    ("--hf-config", "act.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, '
     '"hidden_act": "nope"}', "transformers cannot build this model: "),
    ("--hf-config", "negative.json", '{"model_type": "llama", "hidden_size": -64, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1}',
     "hidden_size must be at least 1, got -64"),
    # sizes of no model (vocab_size -5 trained, grown to the data's), or of none orchard
    # computes: a dropout probability orchard refused at the first step (a traceback, after
    # --overwrite had removed the previous run), a head dim whose every layer transformers'
    # own attention computed
    ("--hf-config", "vocab.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, '
     '"vocab_size": -5}', "vocab_size must be at least 1, got -5"),
    ("--hf-config", "mlp.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, '
     '"intermediate_size": 0}', "intermediate_size must be at least 1, got 0"),
    ("--hf-config", "dropout.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, '
     '"attention_dropout": 2.0}', "attention_dropout must be in [0, 1), got 2.0"),
    ("--hf-config", "wide.json", '{"model_type": "llama", "hidden_size": 1024, '
     '"num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1}',
     "head dimension 512 is above orchard's 256"),
    ("--hf-config", "zero.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, '
     '"max_position_embeddings": 0}', "max_position_embeddings must be at least 1, got 0"),
    # ints no int64 holds: an OverflowError in the memory plan's message
    ("--hf-config", "huge.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, '
     '"vocab_size": 1%s}' % ("0" * 400), "vocab_size must be below 2**63, got 1000"),
    ("--hf-config", "deep.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, '
     '"num_hidden_layers": 9223372036854775808}',
     "num_hidden_layers must be below 2**63, got 9223372036854775808"),
    ("--hf-config", "mamba.json", '{"model_type": "mamba", "hidden_size": 32}',
     "model_type 'mamba' has no attention heads"),
    # transformers builds a model of no layers, which trained with 0 attention calls
    ("--hf-config", "nolayers.json", '{"model_type": "llama", "hidden_size": 32, '
     '"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": -1}',
     "num_hidden_layers must be at least 1, got -1"),
])
def test_malformed_hf_paths_are_an_error(tmp_path, capsys, flag, name, content, why):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    assert train.main([flag, str(path), "--output", str(tmp_path / "out"), "--device",
                       "cpu"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(
        "orchard-train: error: argument %s: %s: %s" % (flag, path, why)), errors
    assert not os.path.exists(tmp_path / "out")


@needs_transformers
@pytest.mark.parametrize("flag", ["--hf-config", "--hf-model"])
def test_empty_hf_paths_are_an_error(tmp_path, capsys, flag):
    assert train.main([flag, "", "--output", str(tmp_path / "out"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "orchard-train: error: argument %s: '': an empty path" % flag]
    assert not os.path.exists(tmp_path / "out")


@needs_transformers
def test_resume_fixes_the_model(trained, capsys):
    assert train.main(["--resume", str(trained[0]), "--hf-config", TINY_LLAMA, "--output",
                       str(trained[0]), "--device", "cpu"]) == 2
    assert "--resume continues the checkpoint's own model" in capsys.readouterr().err


@needs_transformers
def test_a_checkpoint_whose_hf_config_outgrows_its_weights_is_refused(trained, tmp_path):
    """An hf_config edited to a million layers built layers until the system ran out of
    memory in orchard-generate and --resume; its model is counted on the meta device first
    (the children's 120 s timeout fails this test)."""
    state = load_checkpoint(str(trained[0]))
    hf_config = dict(json.loads(state["hf_config"]), num_hidden_layers=10**6)
    path = tmp_path / "deep.pt"
    torch.save(dict(state, hf_config=json.dumps(hf_config)), str(path))
    for script, argv in (("generate", ["--checkpoint", str(path)]),
                         ("train", ["--resume", str(path), "--output", str(tmp_path / "out")])):
        result = run_python(["-m", "orchard.cli." + script] + argv + ["--device", "cpu"])
        assert result.returncode == 2, result.stderr[-2000:]
        assert re.fullmatch(r"orchard-%s: error: argument %s: (checkpoint )?%s: its hf_config "
                            r"makes a model of at least \d+ parameters, more than the \d+ "
                            r"values its weights hold: an edited or damaged checkpoint"
                            % (script, argv[0], re.escape(str(path))),
                            result.stderr.strip()), result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


@needs_transformers
@pytest.mark.parametrize("model_type, sizes", [
    ("gpt2", {"n_embd": 32, "n_head": 4, "n_layer": 11}),
    # layers of their own shapes: the last four without experts (lighter than the first)
    ("qwen2_moe", {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 12, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16, "mlp_only_layers": [8, 9, 10, 11]})])
def test_parameter_count_is_the_models_own(model_type, sizes):
    """parameter_count builds a model of up to 256 layers on the meta device: its count is
    the model's, whose checkpoint check_model_size takes (eight layers counted and the rest
    taken as the lightest of them had refused a model whose later layers are lighter)."""
    from orchard.checkpoint import check_model_size
    from orchard.hf_causal_lm import build_model, parameter_count
    hf_config = json.dumps(dict(sizes, model_type=model_type, vocab_size=64))
    built = build_model({"context": 32}, hf_config, checkpoint="test")
    assert parameter_count(hf_config, "test") == sum(p.numel() for p in built.parameters())
    check_model_size(None, built.state_dict(), "test", hf_config)


WITHOUT_TRANSFORMERS = r"""
import sys
sys.modules["transformers"] = None      # import transformers now raises ImportError
from orchard.cli import train
sys.exit(train.main(sys.argv[1:]))
"""


def test_without_transformers_hf_flags_are_a_clear_error(tmp_path):
    result = run_python(["-c", WITHOUT_TRANSFORMERS, "--hf-config", TINY_LLAMA, "--output",
                         str(tmp_path), "--device", "cpu"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "orchard-train: error: argument --hf-config: %s: orchard.hf needs transformers 5.x "
        "(pip install '.[hf]' in orchard's source tree)" % TINY_LLAMA]


@needs_transformers
def test_out_of_memory_halves_the_llama_micro_batch(tmp_path, caplog):
    import logging

    from orchard.config import validate
    from orchard.data import token_chunks
    from orchard.device_backend import get_device_backend
    from orchard.hf_causal_lm import load_hf_config, model_section

    hf = load_hf_config(TINY_LLAMA)
    backend = get_device_backend("cpu")
    requested = validate({"training": {"batch_size": 8, "micro_batch": 8}})
    requested["model"] = model_section(hf, 32)
    cfg, _ = backend.adapt_config(requested)
    chunks = token_chunks([list(range(256)) * 4], 32)
    trainer = Trainer(cfg, backend, chunks, str(tmp_path),
                      hf_config=hf.to_json_string(use_diff=False))
    calls = fail_first_forward(trainer.model)
    with caplog.at_level(logging.WARNING, logger="orchard"):
        assert trainer.run(max_steps=1) == 0
    assert calls == [8, 4, 4] and trainer.micro_batch == 4
    assert "out of memory" in caplog.text
    assert json.loads(load_checkpoint(str(tmp_path))["hf_config"])["num_key_value_heads"] == 2
