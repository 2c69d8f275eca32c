"""orchard.device_backend: decisions from fabricated device facts, each with its reason."""
import pytest

import orchard_ops
from orchard.config import ConfigError, default_config
from orchard.device_backend import (GiB, DeviceBackend, auto_choice_reason, get_device_backend,
                                    resolve_device)
from test_py_support import run_python


def device(kind, mem_gib, compute_units, fp16=True, id="opencl:0", unified=False):
    return {"id": id, "name": "fabricated %s" % kind, "vendor": "nobody", "kind": kind,
            "backend": "native" if id == "cpu" else "opencl", "platform": "test",
            "driver_version": "0", "compute_units": compute_units,
            "global_mem_bytes": int(mem_gib * GiB), "local_mem_bytes": 65536,
            "max_work_group_size": 256, "fp16": fp16, "fp64": False, "unified_memory": unified}


HOST = device("cpu", 64, 16, id="cpu", unified=True)
SMALL_GPU = device("gpu", 2, 8)
LARGE_GPU = device("gpu", 80, 132)
NO_FP16_GPU = device("gpu", 8, 16, fp16=False)


def gpt2_small():
    cfg = default_config()
    cfg["model"].update(n_layer=12, n_head=12, n_kv_head=12, n_embd=768, context=1024)
    cfg["training"]["batch_size"] = 64
    return cfg


def changed_keys(old, new):
    return {"%s.%s" % (s, k) for s in old for k in old[s] if old[s][k] != new[s][k]}


def adapt(info, cfg, **kwargs):
    new, reasons = DeviceBackend(info, HOST).adapt_config(cfg, **kwargs)
    assert changed_keys(cfg, new) == set(reasons), "every change, and only changes, has a reason"
    assert all(isinstance(r, str) and r for r in reasons.values())
    return new, reasons


def test_small_gpu_checkpoints_and_accumulates():
    cfg = gpt2_small()
    new, reasons = adapt(SMALL_GPU, cfg)
    t = new["training"]
    assert t["dtype"] == "fp16" and "fp16" in reasons["training.dtype"]
    assert t["grad_checkpointing"] is True and "recompute" in reasons["training.grad_checkpointing"]
    assert 1 <= t["micro_batch"] < 64 and "accumulation" in reasons["training.micro_batch"]
    assert new["model"]["context"] == 1024
    backend = DeviceBackend(SMALL_GPU, HOST)
    need = backend.estimate_memory(new["model"], t["micro_batch"], 1024, "fp16",
                                   True)["total_bytes"]
    assert need <= backend.memory_budget(new)


def test_large_gpu_keeps_the_whole_batch():
    new, reasons = adapt(LARGE_GPU, gpt2_small())
    assert new["training"]["micro_batch"] == 64
    assert new["training"]["grad_checkpointing"] is False
    assert new["training"]["dtype"] == "fp16"
    assert "fits without it" in reasons["training.grad_checkpointing"]


def test_cpu_only_uses_fp32_and_its_cores():
    new, reasons = adapt(HOST, default_config())
    assert new["training"]["dtype"] == "fp32" and "CPU" in reasons["training.dtype"]
    assert new["device"]["num_threads"] == 16
    assert new["training"]["micro_batch"] == 16 and new["training"]["grad_checkpointing"] is False


def test_tiny_device_shortens_the_context_unless_the_model_is_fixed():
    tiny = device("gpu", 0.08, 4)
    cfg = gpt2_small()
    cfg["model"].update(n_layer=4, n_embd=256, n_head=4, n_kv_head=4)
    new, reasons = adapt(tiny, cfg)
    assert new["model"]["context"] < 1024 and "model.context" in reasons
    assert new["training"]["micro_batch"] == 1
    fixed, _ = adapt(tiny, cfg, fixed_model=True)
    assert fixed["model"] == cfg["model"]


def test_reasons_name_the_plan_chosen_with_checkpointing_off(caplog):
    """With gradient checkpointing off, a shortened context's reason gives what the plan
    without it needs (it gave the need with it, which fitted); a plan that fits at no context
    warns that the run may end out of memory (the out-of-memory policy halves micro-batches
    above 1: it had said the policy would shrink it) and how to avoid it, also where an
    explicit micro-batch 1 changes nothing, and so has no reason."""
    cfg = gpt2_small()
    cfg["model"].update(n_layer=4, n_embd=256, n_head=4, n_kv_head=4)
    cfg["training"]["grad_checkpointing"] = False
    backend = DeviceBackend(device("gpu", 0.08, 4), HOST)
    need = lambda checkpointing, context: backend.estimate_memory(
        cfg["model"], 1, context, "fp16", checkpointing)["total_bytes"]
    budget = backend.memory_budget(cfg)
    new, reasons = adapt(device("gpu", 0.08, 4), cfg)
    assert new["model"]["context"] < 1024 and new["training"]["grad_checkpointing"] is False
    assert ("micro-batch 1 without gradient checkpointing (it is off) needs %.2f GiB at context "
            "1024 > budget" % (need(False, 1024) / GiB)) in reasons["model.context"]
    assert need(False, 1024) > budget and "does not fit" not in caplog.text
    # fits with neither: the context at its floor, the weights alone within the budget
    for micro_batch in ("auto", 1):
        caplog.clear()
        cfg["training"]["micro_batch"] = micro_batch
        new, reasons = adapt(device("gpu", 0.066, 4), cfg)
        assert new["model"]["context"] == 64 and new["training"]["micro_batch"] == 1
        assert [r.getMessage() for r in caplog.records] == [
            "the memory plan does not fit: micro-batch 1 without gradient checkpointing (it is "
            "off) needs %.2f GiB at context 64 > budget %.2f GiB (80%% of 0.07 GiB, 1 "
            "process(es)); the run may end out of memory (training.grad_checkpointing true, a "
            "smaller model or a larger device.memory_fraction)" % (need(False, 64) / GiB,
                                                                   0.8 * 0.066)]


def test_a_model_whose_weights_alone_do_not_fit_is_refused():
    """Weights, gradients and optimizer state shrink with no micro-batch or context: a plan
    that cannot hold them is a ConfigError (a token id of 10^9 in the data makes such a
    vocabulary), not a run the operating system kills."""
    cfg = default_config()
    cfg["model"]["vocab_size"] = 10 ** 9
    with pytest.raises(ConfigError, match="weights, gradients and optimizer state need.*"
                       r"model.vocab_size 1000000000: the config's, or the data's vocabulary "
                       r"where larger\)"):
        adapt(HOST, cfg)


def test_explicit_choices_are_kept_unless_impossible():
    cfg = default_config()
    cfg["training"].update(dtype="fp16", micro_batch=4, grad_checkpointing=False)
    new, reasons = adapt(NO_FP16_GPU, cfg)
    assert new["training"]["dtype"] == "fp32" and "no fp16" in reasons["training.dtype"]
    assert new["training"]["micro_batch"] == 4 and new["training"]["grad_checkpointing"] is False
    new, _ = adapt(LARGE_GPU, dict(cfg, training=dict(cfg["training"], dtype="bf16")))
    assert new["training"]["dtype"] == "bf16"
    # a micro-batch larger than the batch is cut to it, and the note says so
    new, reasons = adapt(LARGE_GPU, dict(cfg, training=dict(cfg["training"], micro_batch=1000)))
    batch = cfg["training"]["batch_size"]
    assert new["training"]["micro_batch"] == batch
    assert reasons["training.micro_batch"].startswith(
        "1000 -> %d: at most a process's share of the batch (%d)" % (batch, batch))


def test_processes_share_memory_and_cores():
    one = DeviceBackend(HOST, HOST)
    two = DeviceBackend(HOST, HOST, processes=2)
    cfg = default_config()
    assert two.memory_budget(cfg) == one.memory_budget(cfg) // 2
    assert two.adapt_config(cfg)[0]["device"]["num_threads"] == 8
    assert two.adapt_config(cfg)[0]["training"]["micro_batch"] == 8


def test_the_batch_is_split_over_every_machines_processes():
    """Two machines of two processes: each process takes a quarter of the batch (the plan had
    split it over the local processes only, planning twice the micro-batch the trainer runs),
    and each machine's memory and cores are split in two."""
    cfg = default_config()
    local = DeviceBackend(HOST, HOST, processes=2)
    nodes = DeviceBackend(HOST, HOST, processes=2, world=4)
    assert nodes.memory_budget(cfg) == local.memory_budget(cfg)
    new, reasons = nodes.adapt_config(cfg)
    assert new["training"]["micro_batch"] == cfg["training"]["batch_size"] // 4
    assert new["device"]["num_threads"] == 8
    assert "keep the effective batch of %d" % cfg["training"]["batch_size"] in \
        reasons["training.micro_batch"]


def test_parameter_count_matches_the_model():
    pytest.importorskip("torch")
    from orchard.model import GPT, GPTConfig

    for model_cfg in (default_config()["model"],
                      dict(default_config()["model"], bias=True, n_kv_head=2, vocab_size=300)):
        model = GPT(GPTConfig.from_dict(model_cfg))
        assert DeviceBackend.count_parameters(model_cfg) == model.num_params()


def test_estimate_grows_linearly_and_checkpointing_saves():
    backend = DeviceBackend(HOST, HOST)
    m = default_config()["model"]
    a1 = backend.estimate_memory(m, 1, 256)["activation_bytes"]
    assert backend.estimate_memory(m, 4, 256)["activation_bytes"] == 4 * a1
    # Linear in the context: no N x N term.
    assert backend.estimate_memory(m, 1, 1024)["activation_bytes"] == 4 * a1
    assert backend.estimate_memory(m, 1, 256, grad_checkpointing=True)["activation_bytes"] < a1
    parts = backend.estimate_memory(m, 1, 256)
    assert parts["total_bytes"] == sum(v for k, v in parts.items() if k != "total_bytes")
    # float32 weights: 4 bytes per parameter; AdamW's two moments: 8
    assert parts["parameter_bytes"] == 4 * DeviceBackend.count_parameters(m)
    assert parts["optimizer_bytes"] == 2 * parts["parameter_bytes"]
    # half precision halves the activations; a name it does not know is refused (any other had
    # been read as 2 bytes an element)
    assert 2 * backend.estimate_memory(m, 1, 256, "bf16")["activation_bytes"] == a1
    for dtype in ("fp8", None, "float32"):
        with pytest.raises(ValueError, match="'dtype' must be one of fp32, auto, fp16, bf16 "
                                             r"\(got %r\)" % (dtype,)):
            backend.estimate_memory(m, 1, 256, dtype)
    # a batch or context that is no count is refused (a negative one made a total smaller
    # than the weights alone), as a config that is not whole is by adapt_config (a KeyError)
    for args in ((-1, 16), (1.5, 16), (True, 16), ("4", 16), (1, -16)):
        with pytest.raises(ValueError, match=r"estimate_memory\(\): '(batch_size|seq_len)' "
                                             r"must be an integer >= 0 \(got "):
            backend.estimate_memory(m, *args)
    assert backend.estimate_memory(m, 0, 16)["activation_bytes"] == 0
    import numpy as np
    assert backend.estimate_memory(m, np.int64(4), np.uint16(256)) == \
        backend.estimate_memory(m, 4, 256)
    for cfg, missing in (({"training": {"batch_size": 4}}, "'model' or 'device'"),
                         ({}, "'model' or 'training' or 'device'"), (None, "'model' or")):
        with pytest.raises(ValueError, match=r"adapt_config\(\): 'cfg' must be a whole config.*"
                                             r": no section %s" % missing):
            backend.adapt_config(cfg)


def test_orchard_device_auto_is_not_the_reason(monkeypatch):
    """ORCHARD_DEVICE=auto is as unset (orchard_ops' rule): the reason is the rule that
    chose, not the variable."""
    monkeypatch.delenv("ORCHARD_DEVICE", raising=False)
    unset = auto_choice_reason()
    monkeypatch.setenv("ORCHARD_DEVICE", "auto")
    assert auto_choice_reason() == unset and "ORCHARD_DEVICE" not in unset[1]


def test_log_summary_prints_when_logging_is_not_configured():
    r = run_python(["-c", "from orchard.device_backend import get_device_backend\n"
                          "get_device_backend('cpu').log_summary()"])
    assert r.returncode == 0 and r.stderr.startswith("device cpu: "), r.stderr


def test_real_device_backend():
    backend = get_device_backend()
    assert backend.device == orchard_ops.default_device()
    assert backend.info in orchard_ops.devices()
    assert backend.attention_backend in ("native", "opencl")
    assert backend.device in backend.log_summary()
    assert backend.setup() is backend
    assert get_device_backend("cpu").device == "cpu"
    chosen, why = auto_choice_reason()
    assert chosen == backend.device and why
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu:7")


def test_check_limitations():
    gpu = DeviceBackend(NO_FP16_GPU, HOST)
    # float16 runs there (read and written as half, computed in float32): not refused
    assert any("computes in float32" in n and "use fp32" not in n
               for n in gpu.check_limitations("fp16"))
    assert any("copied" in n for n in gpu.check_limitations("fp32"))
    assert any("accumulated in float32" in n for n in gpu.check_limitations("bf16"))
    assert DeviceBackend(HOST, HOST).check_limitations("fp32") == []


def test_resolve_device_is_orchard_ops_own():
    """One resolution of device strings: orchard_ops.resolve_device, looked up in devices()."""
    listing = orchard_ops.devices()
    for device in [None, "auto", "cpu", "opencl", "opencl:0"] + [d["id"] for d in listing]:
        try:
            expected = orchard_ops.resolve_device(device)
        except ValueError:
            with pytest.raises(ValueError, match="unknown device"):
                resolve_device(device, listing)
            continue
        assert resolve_device(device, listing)["id"] == expected
    with pytest.raises(TypeError):
        resolve_device(0)


def test_setup_makes_the_program_cache_folder(tmp_path, monkeypatch):
    """An OpenCL backend's setup() makes orchard_ops.cache_dir(), which honours XDG_CACHE_HOME."""
    for var in ("ORCHARD_CACHE_DIR", "ORCHARD_NO_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # thread counts as they are: setup() reads them instead of setting them
    monkeypatch.setenv("ORCHARD_NUM_THREADS", str(orchard_ops.get_num_threads()))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    DeviceBackend(SMALL_GPU, HOST).setup()
    assert (tmp_path / "orchard").is_dir()


def test_orchard_num_threads_is_what_adapt_config_reports():
    """setup() keeps ORCHARD_NUM_THREADS over the config's num_threads: adapt_config says so
    (it had reported 'auto' -> the core count)."""
    code = ("from orchard.config import default_config\n"
            "from orchard.device_backend import get_device_backend\n"
            "cfg, why = get_device_backend('cpu').adapt_config(default_config())\n"
            "print(cfg['device']['num_threads'], why['device.num_threads'])\n")
    result = run_python(["-c", code], ORCHARD_NUM_THREADS="3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3 'auto' -> 3: ORCHARD_NUM_THREADS=3"
