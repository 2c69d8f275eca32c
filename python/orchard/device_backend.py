"""The device a run trains on: its measured facts, and a training config adapted to them.

Every decision here is derived from what orchard_ops.devices() measured (global_mem_bytes,
fp16, compute_units, kind, unified_memory), never from a table of device names, so a device
nobody has seen before is handled the same way as a familiar one.

Memory model (estimate_memory). Model weights, gradients, AdamW state and activations are
PyTorch tensors in host memory; orchard copies attention operands to the device per call (or
shares them, on unified memory). With P parameters, L layers, width C, key/value width
C_kv = n_kv_head * C / n_head, vocabulary V, micro-batch B, context T, and s bytes per
activation element (4 for fp32, 2 for fp16/bf16):

    weights        4 P      (fp32 master copy)
    gradients      4 P
    optimizer      8 P      (AdamW's two moments)
    activations    B T s (L (22 C + 2 C_kv) + 4 V + 3 C)
                   with gradient checkpointing: B T s (L C + 2 (22 C + 2 C_kv) + 4 V + 3 C)

Per layer the backward needs 15 C + 2 C_kv of saved tensors (LayerNorm inputs and outputs,
q, k, v, attention output and its re-laid-out copy, the MLP's 4 C input and GELU output); the
remaining 7 C are the layer's temporary gradients in backward, which the CPU allocator keeps
around. 4 V covers the logits, their log-softmax and the gradients of both; 3 C the embeddings
and final LayerNorm. Checkpointing keeps each block's input (C) and holds one recomputed
block plus its gradients at a time. There is no N x N term: orchard's attention keeps O(N D)
per worker and a logsumexp per row. tests/test_py_memory.py checks the total against the
measured peak memory of CPU training steps within 25 %.
"""
import copy
import logging
import math
import operator
import os
import sys

import orchard_ops

from .config import AUTO, DECIMAL_INT, ConfigError, shown

log = logging.getLogger("orchard")

GiB = 2**30
# The most processes WORLD_SIZE and LOCAL_WORLD_SIZE may count (a bound for their checks)
MAX_PROCESSES = 2**20
# query rows per attention work item, as the micro-batch floor counts them: fewer than the
# kernels' blocks (96 rows in PoCL's tiled family, 192 natively), so the floor errs low
_ATTENTION_BLOCK = 64
_MIN_CONTEXT = 64


def _bytes_per_element(dtype):
    sizes = {"fp32": 4, AUTO: 4, "fp16": 2, "bf16": 2}
    if dtype not in sizes:     # (any other name had been read as 2 bytes)
        raise ValueError("estimate_memory(): 'dtype' must be one of %s (got %r)"
                         % (", ".join(sizes), dtype))
    return sizes[dtype]


def resolve_device(device, listing=None):
    """The devices() entry for a device string: None/"auto", "cpu", "opencl", "opencl:N"
    or "opencl:NAME" (a substring of a device or platform name, as PYOPENCL_CTX), as
    orchard_ops.resolve_device resolves it."""
    listing = orchard_ops.devices() if listing is None else listing
    by_id = {d["id"]: d for d in listing}
    try:
        chosen = orchard_ops.resolve_device(device)
    except ValueError:
        if device in (None, AUTO):
            raise  # ORCHARD_DEVICE names no device: orchard_ops's message says so
        chosen = None
    if chosen not in by_id:
        why = orchard_ops.opencl_unavailable() if str(device).lower().startswith("opencl") \
            else None
        raise ValueError("unknown device (%r); available: %s%s"
                         % (device, ", ".join(by_id) or "none",
                            "; no OpenCL device: %s" % why if why else ""))
    return by_id[chosen]


def auto_choice_reason(listing=None):
    """(device id that device=None picks, why), for orchard-devices and the trainer's log."""
    listing = orchard_ops.devices() if listing is None else listing
    chosen = resolve_device(None, listing)
    others = [d["id"] for d in listing if d["backend"] == "opencl" and d["kind"] != "gpu"]
    if os.environ.get("ORCHARD_DEVICE", "auto") != "auto":     # ("auto": as unset)
        why = "ORCHARD_DEVICE=%s is set" % os.environ["ORCHARD_DEVICE"]
    elif chosen["backend"] == "opencl" and chosen["kind"] != "gpu":
        why = ("ORCHARD_AUTO_ANY_OPENCL is set, so OpenCL CPU devices may be chosen (a test "
               "setting of builds with ORCHARD_TEST_HOOKS=1)")
    elif chosen["kind"] == "gpu":
        why = ("it is the OpenCL GPU with the most compute units (%d), and a GPU is faster "
               "for attention than the CPU" % chosen["compute_units"])
    elif others:
        why = ("there is no OpenCL GPU, and on the same cores the native path is no slower "
               "than the OpenCL CPU device(s) %s, which are never picked automatically"
               % ", ".join(others))
    elif orchard_ops.opencl_unavailable():
        why = ("there is no OpenCL device (%s), so attention runs on the native C path"
               % orchard_ops.opencl_unavailable())
    else:
        why = "there is no OpenCL GPU, so attention runs on the native C path"
    return chosen["id"], why


class DeviceBackend:
    """One orchard device plus the host it hangs off; see the module docstring."""

    def __init__(self, info, host=None, verbose=False, processes=1, world=None):
        self.info = dict(info)
        self.host = dict(host if host is not None else info)
        self.verbose = verbose
        # Processes sharing this machine (torchrun's LOCAL_WORLD_SIZE): they split its memory
        # and cores.
        self.processes = max(1, processes)
        # Processes of the run on every machine (WORLD_SIZE): they split the batch.
        self.world = max(self.processes, world or 1)

    @property
    def device(self):
        return self.info["id"]

    @property
    def attention_backend(self):
        return self.info["backend"]

    def memory_budget(self, cfg):
        # Training state lives in host memory and attention operands go to the device, so
        # the plan must fit both: the smaller of the two, shared among local processes.
        usable = min(self.info["global_mem_bytes"], self.host["global_mem_bytes"])
        return int(cfg["device"]["memory_fraction"] * usable / self.processes)

    def default_threads(self):
        return max(1, self.host["compute_units"] // self.processes)

    def setup(self, num_threads=AUTO):
        """Threads for the native path and PyTorch, and the OpenCL program cache folder.
        Environment variables are read, never changed."""
        if os.environ.get("ORCHARD_NUM_THREADS"):
            threads = orchard_ops.get_num_threads()
        else:
            threads = self.default_threads() if num_threads == AUTO else num_threads
            orchard_ops.set_num_threads(threads)
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(threads)
        if self.attention_backend == "opencl":
            orchard_ops.cache_dir()  # made now, private to the user, where programs will go
        if self.verbose:
            log.info("orchard threads: %d", threads)
        return self

    def estimate_memory(self, model_cfg, batch_size, seq_len, dtype="fp32",
                        grad_checkpointing=False):
        """Bytes a training step needs, by the formula of the module docstring, itemised:
        {"parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes",
        "total_bytes"}, each a count of bytes (the parameters' count is count_parameters)."""
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            # (a negative one had made a total smaller than the weights alone); NumPy's and
            # torch's integers are integers too
            try:
                count = operator.index(value)
            except TypeError:
                count = None
            if count is None or isinstance(value, bool) or count < 0:
                raise ValueError("estimate_memory(): %r must be an integer >= 0 (got %r)"
                                 % (name, value))
        C, L, V = model_cfg["n_embd"], model_cfg["n_layer"], model_cfg["vocab_size"]
        c_kv = model_cfg["n_kv_head"] * C // model_cfg["n_head"]
        params = self.count_parameters(model_cfg)
        layer = 22 * C + 2 * c_kv
        per_token = (L * C + 2 * layer) if grad_checkpointing else L * layer
        per_token += 4 * V + 3 * C
        parts = {
            "parameter_bytes": 4 * params,
            "gradient_bytes": 4 * params,
            "optimizer_bytes": 8 * params,
            "activation_bytes": batch_size * seq_len * _bytes_per_element(dtype) * per_token,
        }
        parts["total_bytes"] = sum(parts.values())
        return parts

    @staticmethod
    def count_parameters(model_cfg):
        """Parameters of orchard.model.GPT for a model config (tied input/output embedding)."""
        C, L, V = model_cfg["n_embd"], model_cfg["n_layer"], model_cfg["vocab_size"]
        c_kv = model_cfg["n_kv_head"] * C // model_cfg["n_head"]
        bias = 1 if model_cfg["bias"] else 0
        attn = C * C + C * 2 * c_kv + C * C + bias * (C + 2 * c_kv + C)
        mlp = 2 * 4 * C * C + bias * (4 * C + C)
        norms = 2 * C * (1 + bias)
        return V * C + model_cfg["context"] * C + L * (attn + mlp + norms) + C * (1 + bias)

    def _fill_micro_batch(self, model_cfg, per_process_batch):
        # The smallest micro-batch whose attention grid (micro x heads x query blocks) still
        # gives every compute unit a work item; below it a smaller micro-batch only idles
        # the device, so gradient checkpointing is the better way to save memory.
        blocks = model_cfg["n_head"] * math.ceil(model_cfg["context"] / _ATTENTION_BLOCK)
        return min(per_process_batch, max(1, math.ceil(self.info["compute_units"] / blocks)))

    def adapt_config(self, cfg, fixed_model=False):
        """A config adapted to this device, and why: returns (config, reasons).

        config is a new dict (cfg is not changed) with every "auto" resolved and the memory
        plan fitted to memory_budget(); reasons maps each dotted key that changed
        ("training.micro_batch", ...) to one line "old -> new: why". Keys left as they were
        have no entry. fixed_model keeps the model section as it is (a resumed checkpoint
        fixes it), so the context is never shortened.
        """
        missing = [name for name in ("model", "training", "device")
                   if not isinstance(cfg, dict) or not isinstance(cfg.get(name), dict)]
        if missing:     # (a KeyError had named the section and nothing else)
            raise ValueError("adapt_config(): 'cfg' must be a whole config, as load_config() "
                             "or orchard.config.validate() return one: no section %s (a "
                             "mapping)" % " or ".join(repr(m) for m in missing))
        new = copy.deepcopy(cfg)
        reasons = {}
        model, train, dev = new["model"], new["training"], new["device"]
        name = "%s (%s)" % (self.device, self.info["name"])

        def change(section, key, value, why):
            if new[section][key] != value:
                reasons["%s.%s" % (section, key)] = "%r -> %r: %s" % (
                    new[section][key], value, why)
                new[section][key] = value

        # dtype
        if train["dtype"] == AUTO:
            if self.info["kind"] != "cpu" and self.info["fp16"]:
                change("training", "dtype", "fp16",
                       "%s is a %s that supports fp16: half the bytes per attention call, "
                       "with loss scaling" % (name, self.info["kind"]))
            else:
                why = ("%s is a CPU: orchard computes fp16 in fp32 there, so fp16 saves "
                       "memory but no time and needs loss scaling" % name
                       if self.info["kind"] == "cpu" else "%s has no fp16 arithmetic" % name)
                change("training", "dtype", "fp32", why)
        elif train["dtype"] == "fp16" and not self.info["fp16"]:
            change("training", "dtype", "fp32", "%s has no fp16 arithmetic: orchard would "
                   "compute fp16 in fp32 there, saving memory but no time, and needing loss "
                   "scaling" % name)

        if os.environ.get("ORCHARD_NUM_THREADS"):     # setup() keeps it: it wins over the config
            threads = orchard_ops.get_num_threads()
            if dev["num_threads"] != threads:
                change("device", "num_threads", threads,
                       "ORCHARD_NUM_THREADS=%s" % os.environ["ORCHARD_NUM_THREADS"])
        elif dev["num_threads"] == AUTO:
            change("device", "num_threads", self.default_threads(),
                   "%d host cores for %d process(es)" % (self.host["compute_units"],
                                                         self.processes))

        # micro-batch, gradient checkpointing, context: fit the memory budget.
        budget = self.memory_budget(new)
        # what no micro-batch, checkpointing or context shrinks: refused here, where a run
        # would otherwise start and be killed by the operating system when it allocates them
        least = self.estimate_memory(model, 1, 1, train["dtype"], True)
        fixed = least["parameter_bytes"] + least["gradient_bytes"] + least["optimizer_bytes"]
        if fixed > budget:
            raise ConfigError(
                "the model's weights, gradients and optimizer state need %.3g GiB, more than "
                "the memory budget of %.3g GiB (device.memory_fraction %g of %.3g GiB): choose "
                "a smaller model (model.n_layer %d, model.n_embd %d, model.context %d, "
                "model.vocab_size %d: the config's, or the data's vocabulary where larger)"
                % (fixed / GiB, budget / GiB, dev["memory_fraction"],
                   min(self.info["global_mem_bytes"], self.host["global_mem_bytes"]) / GiB,
                   model["n_layer"], model["n_embd"], model["context"], model["vocab_size"]))
        per_process = max(1, train["batch_size"] // self.world)
        requested = per_process if train["micro_batch"] == AUTO else min(
            train["micro_batch"], per_process)
        fill = self._fill_micro_batch(model, per_process)

        def need(micro, checkpointing, context):
            return self.estimate_memory(model, micro, context, train["dtype"],
                                        checkpointing)["total_bytes"]

        def largest_fitting(floor, checkpointing, context):
            micro = requested
            while micro > floor and need(micro, checkpointing, context) > budget:
                micro = max(floor, micro // 2)
            return micro

        checkpointing = train["grad_checkpointing"] is True
        context = model["context"]
        micro = largest_fitting(fill if train["grad_checkpointing"] == AUTO else 1,
                                checkpointing, context)
        if need(micro, checkpointing, context) > budget and train["grad_checkpointing"] == AUTO:
            checkpointing = True
            micro = largest_fitting(1, True, context)
        while (not fixed_model and context > _MIN_CONTEXT
               and need(micro, checkpointing, context) > budget):
            context = max(_MIN_CONTEXT, context // 2)
        fits = need(micro, checkpointing, context) <= budget
        gib = lambda b: "%.2f GiB" % (b / GiB)
        budget_text = "budget %s (%.0f%% of %s, %d process(es))" % (
            gib(budget), 100 * dev["memory_fraction"],
            gib(min(self.info["global_mem_bytes"], self.host["global_mem_bytes"])),
            self.processes)

        if train["grad_checkpointing"] == AUTO:
            change("training", "grad_checkpointing", checkpointing,
                   ("micro-batch %d%s would need %s without it > %s: recompute "
                    "activations instead" % (
                        fill, " (the smallest that keeps the %d compute units busy)"
                        % self.info["compute_units"] if fill > 1 else "",
                        gib(need(fill, False, model["context"])), budget_text))
                   if checkpointing else
                   "micro-batch %d fits without it (%s of %s)" % (
                       micro, gib(need(micro, False, context)), budget_text))
        # (micro-batch 1 wherever the context is cut or nothing fits: every halving above
        # went down to it first)
        how = (" with gradient checkpointing" if checkpointing
               else " without gradient checkpointing (it is off)")
        if context != model["context"]:
            change("model", "context", context, "micro-batch 1%s needs %s at context %d > %s"
                   % (how, gib(need(1, checkpointing, model["context"])),
                      model["context"], budget_text))
        accumulation = math.ceil(per_process / micro)
        why = ("%s per micro-batch of %d%s, %s; %d accumulation step(s) keep the effective "
               "batch of %d" % (gib(need(micro, checkpointing, context)), micro,
                                " with gradient checkpointing" if checkpointing else "",
                                budget_text, accumulation, train["batch_size"]))
        if not fits:    # a warning, not a reason: an explicit micro-batch 1 changes nothing
            # (the out-of-memory policy halves micro-batches above 1)
            log.warning("the memory plan does not fit: micro-batch 1%s needs %s at context %d > "
                        "%s; the run may end out of memory (%sa smaller model or a larger "
                        "device.memory_fraction)", how, gib(need(1, checkpointing, context)),
                        context, budget_text,
                        "" if checkpointing else "training.grad_checkpointing true, ")
        if train["micro_batch"] != AUTO and train["micro_batch"] > per_process:
            why = "at most a process's share of the batch (%d); %s" % (per_process, why)
        change("training", "micro_batch", micro, why)
        return new, reasons

    def check_limitations(self, dtype):
        """Plain-language limits of this device for a dtype ("fp32", "fp16", "bf16", "fp64"
        or a torch dtype); an empty list when there are none."""
        name = str(dtype).replace("torch.", "")
        name = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                "float64": "fp64", "double": "fp64", "float": "fp32"}.get(name, name)
        notes = []
        if name == "fp16" and not self.info["fp16"]:
            notes.append("%s has no float16 arithmetic (cl_khr_fp16): orchard reads and writes "
                         "float16 there and computes in float32, saving memory but no time"
                         % self.device)
        if name == "fp16":
            notes.append("float16 attention accumulates in float32; training needs loss "
                         "scaling (the trainer uses a GradScaler)")
        if name == "bf16":
            notes.append("bfloat16 attention is read and written as bfloat16 and "
                         "accumulated in float32")
        if name == "fp64" and not self.info["fp64"]:
            notes.append("%s does not support float64 (use the cpu device for gradient "
                         "checks)" % self.device)
        if name not in ("fp32", "fp16", "bf16", "fp64"):
            notes.append("dtype %r is not supported by orchard attention" % (dtype,))
        if self.info["kind"] != "cpu" and not self.info["unified_memory"]:
            notes.append("%s has its own memory: attention operands are copied to it and "
                         "back on every call" % self.device)
        return notes

    def log_summary(self):
        """Log (and return) what this backend is: device facts and attention backend. With
        no logging configured (no handler anywhere), it prints to stderr instead, since
        Python would drop an INFO record."""
        i = self.info
        text = ("device %s: %s (%s, %s backend), %d compute units, %.1f GiB, fp16 %s, fp64 %s"
                % (i["id"], i["name"], i["kind"], i["backend"], i["compute_units"],
                   i["global_mem_bytes"] / GiB, "yes" if i["fp16"] else "no",
                   "yes" if i["fp64"] else "no"))
        if log.hasHandlers():
            log.info(text)
        else:
            print(text, file=sys.stderr)
        return text

    def patch_model(self, model):
        """Route model's scaled_dot_product_attention calls to orchard on this device."""
        from .torch import patch_model

        return patch_model(model, device=self.device)


def env_integer(name, what, least, most, unset):
    """The integer torchrun's environment variable name gives (unset: its text where it is
    not set); ValueError naming it and what it must be otherwise."""
    text = os.environ.get(name, unset)
    if (not DECIMAL_INT.match(text) or len(text.lstrip("+-0")) > 9
            or not least <= int(text) <= most):
        raise ValueError("environment variable %s must be %s, an integer from %d to %d (got %s)"
                         % (name, what, least, most, shown(text)))
    return int(text)


def process_count(name):
    """The count of processes torchrun's WORLD_SIZE or LOCAL_WORLD_SIZE gives, 1 where it is
    not set; ValueError naming it otherwise."""
    return env_integer(name, "a count of processes", 1, MAX_PROCESSES, "1")


def get_device_backend(device=None, verbose=False):
    """The DeviceBackend for a device string (see resolve_device); None picks automatically."""
    listing = orchard_ops.devices()
    info = resolve_device(device, listing)
    host = next((d for d in listing if d["id"] == "cpu"), info)
    backend = DeviceBackend(info, host, verbose=verbose,
                            processes=process_count("LOCAL_WORLD_SIZE"),
                            world=process_count("WORLD_SIZE"))
    if verbose:
        backend.log_summary()
    return backend
