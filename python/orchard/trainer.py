"""The training loop: batches, mixed precision, gradient accumulation, the out-of-memory
policy, metrics, validation, checkpoints, resume, Ctrl-C, and data parallelism.

One optimizer step consumes `batch_size` sequences (split evenly over data-parallel ranks),
fed through the model `micro_batch` at a time. The batches of an epoch are a permutation
seeded by (seed, epoch), so a resumed run sees exactly the batches the original would have.
Every `eval_interval` steps and at the end, the mean loss over the held-out sequences
(orchard.data.split_validation, at most eval_sequences of them: evaluation_windows) is
measured and reported as val_loss.
"""
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import signal
import stat
import threading
import time

import orchard_ops
import torch
import torch.distributed as dist

from .atomic import write_atomically, written_in_place
from .checkpoint import FORMAT, check_optimizer_state, checkpoint_contents, save_checkpoint
from .config import AUTO, ConfigError, get_dtype_from_string, is_out_of_memory
from .data import DataError
from .hf_causal_lm import build_model
from .progress import Progress

log = logging.getLogger("orchard")

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _MetricsReaderAbsent(Exception):
    """A stop signal that came while metrics.jsonl, a FIFO or device, waited for its reader."""


def strict_json(record):
    """A metrics record with a non-finite number (a diverged loss) as None: JSON has no NaN,
    and strict parsers (jq, JavaScript, Go) refuse Python's NaN token; null is what they read."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


class Trainer:
    def __init__(self, cfg, backend, chunks, output_dir, requested_cfg=None, seed=1337,
                 data_info=None, resume_state=None, val_chunks=None, hf_config=None,
                 pretrained=None, resume_from="the checkpoint"):
        self.cfg = cfg
        self.requested_cfg = requested_cfg if requested_cfg is not None else cfg
        self.backend = backend
        self.chunks = chunks
        self.val_chunks = val_chunks if val_chunks is not None and len(val_chunks) else None
        self.output_dir = output_dir
        self.seed = seed
        self.data_info = data_info or {}
        train = cfg["training"]
        left = ["%s.%s" % (section, key) for section, keys in cfg.items() if isinstance(keys, dict)
                for key, value in keys.items() if value == AUTO]
        if left:    # adapt_config resolves them for the device
            raise ConfigError("Trainer needs a config adapted to its device "
                              "(backend.adapt_config(cfg)); still 'auto': %s" % ", ".join(left))
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if train["batch_size"] % self.world:
            raise ConfigError("training.batch_size must be a multiple of the %d processes "
                              "(torchrun's --nproc-per-node), got %d"
                              % (self.world, train["batch_size"]))
        self.rank_batch = train["batch_size"] // self.world
        self.micro_batch = min(train["micro_batch"], self.rank_batch)
        self.steps_per_epoch = len(chunks) // train["batch_size"]
        if self.steps_per_epoch < 1:
            # (not val_chunks' count: training.eval_sequences caps it)
            held = ("" if self.val_chunks is None else
                    "; training.val_fraction %g held out that fraction of the windows for "
                    "validation" % train["val_fraction"])
            raise DataError("%d sequence(s) of context %d are fewer than one batch of %d "
                            "(training.batch_size)%s"
                            % (len(chunks), cfg["model"]["context"], train["batch_size"], held))

        torch.manual_seed(seed)
        # hf_config: a transformers model (orchard.hf_causal_lm), whose attention reaches
        # orchard through attn_implementation="orchard" rather than the router.
        self.hf_config = hf_config
        # where attention runs: orchard.hf calls orchard with device=None
        self.attention_device = orchard_ops.default_device() if hf_config else backend.device
        with checkpoint_contents(resume_from) if resume_state else contextlib.nullcontext():
            self.model = build_model(cfg["model"], hf_config, pretrained, checkpoint=resume_from)
        self.model.grad_checkpointing = train["grad_checkpointing"]
        self.router = backend.patch_model(self.model) if hf_config is None else None
        self.optimizer = self._make_optimizer()
        self.dtype = train["dtype"]
        self.scaler = torch.amp.GradScaler("cpu", enabled=self.dtype == "fp16")
        # a resumed fp16 run's loss scale, where this device trains in another dtype: saved
        # again, so that a later resume in fp16 starts from it rather than from scratch
        self.idle_scaler_state = {}
        self.step = 0
        self.history = []
        self.metrics_whole = False      # metrics.jsonl holds the history: append to it
        self.metrics_waiting = False    # a write to a FIFO is under way: a stop ends it
        self.metrics_given_up = False   # ... and ended it: the run writes no more metrics
        self.losses = []    # of the steps since the last log line
        self.schedule_steps = None  # the stopping point a resumed run keeps (see run)
        if resume_state is not None:
            with checkpoint_contents(resume_from):
                self._restore(resume_state)
            check_optimizer_state(self.optimizer, resume_from)
        else:
            # Ranks draw different dropout masks; the model above was initialised alike.
            torch.manual_seed(seed + self.rank)
        self.forward_model = self.model
        if self.distributed:
            self.forward_model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.stop_requested = False
        self.stop_signal = signal.SIGINT    # the one that asked: the exit status is 128 + it

    def _make_optimizer(self):
        train = self.cfg["training"]
        # As GPT-2/nanoGPT: weight decay on matrices and embeddings, not on biases and norms.
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": train["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=train["learning_rate"],
                                 betas=(train["beta1"], train["beta2"]))

    # -- state -------------------------------------------------------------------------------

    def state_dict(self, pending_losses, rank_rng):
        return {
            "format": FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": (self.scaler.state_dict() if self.scaler.is_enabled()
                       else self.idle_scaler_state),
            "step": self.step,
            "schedule_steps": self.schedule_steps,
            "seed": self.seed,
            "config": self.requested_cfg,
            "model_config": self.cfg["model"],
            "hf_config": self.hf_config,
            "data": self.data_info,
            "metrics": self.history,
            "pending_losses": pending_losses,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "torch_ranks": rank_rng},
        }

    def _restore(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        elif state.get("scaler"):
            self.idle_scaler_state = state["scaler"]
        self.step = state["step"]
        self.schedule_steps = state.get("schedule_steps")
        self.history = list(state["metrics"])
        # older checkpoints have none: their first log line averages the steps since the resume
        self.losses = list(state.get("pending_losses", []))
        if not all(isinstance(x, float) for x in self.losses):
            raise TypeError("pending_losses must be a list of floats")
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        ranks = state["rng"].get("torch_ranks")
        if self.rank and ranks is not None and len(ranks) == self.world:
            torch.set_rng_state(ranks[self.rank])   # its dropout masks go on as uninterrupted
        elif self.rank:     # another number of processes, or an older checkpoint: a new stream
            torch.manual_seed(self.seed + self.rank + self.step)

    def pending_losses(self):
        """The losses of the steps since the last log line, averaged over the ranks, so that a
        resumed run's first log line averages the same steps as an uninterrupted one."""
        return [self._sum_over_ranks(x) / self.world for x in self.losses]

    def rank_rng_states(self):
        """Every rank's torch RNG state, by rank: each draws its own dropout masks, which a
        resumed run continues (rank 1's were drawn anew at a resume, so its losses parted from
        an uninterrupted run's)."""
        if not self.distributed:
            return [torch.get_rng_state()]
        states = [None] * self.world
        dist.all_gather_object(states, torch.get_rng_state())
        return states

    def save(self):
        # collectives: every rank, before rank 0 writes
        pending, rank_rng = self.pending_losses(), self.rank_rng_states()
        if self.rank == 0:
            os.makedirs(self.output_dir, exist_ok=True)
            path = os.path.join(self.output_dir, CHECKPOINT_NAME)
            save_checkpoint(self.state_dict(pending, rank_rng), path)
            # the history the checkpoint holds: before this run's first log line, an
            # --overwrite run stopped here had left the replaced run's metrics beside it
            if not self.metrics_whole:
                self._save_metrics()
            return path
        return None

    # -- schedule and data -------------------------------------------------------------------

    def learning_rate(self, step, total_steps):
        train = self.cfg["training"]
        lr, min_lr, warmup = train["learning_rate"], train["min_lr"], train["warmup_steps"]
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)

    def batch(self, step):
        """This rank's share of the sequences of optimizer step `step`: (inputs, targets)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if getattr(self, "_order_epoch", None) != epoch:
            # torch takes seeds below 2^64: a large --seed wraps (smaller ones are unchanged)
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2 ** 64)
            self._order = torch.randperm(len(self.chunks), generator=generator)
            self._order_epoch = epoch
        size = self.cfg["training"]["batch_size"]
        rows = self._order[index * size:(index + 1) * size][self.rank::self.world]
        batch = self.chunks[rows]
        return batch[:, :-1], batch[:, 1:]

    # -- one optimizer step, with the out-of-memory policy -----------------------------------

    def _autocast(self):
        return torch.autocast("cpu", dtype=get_dtype_from_string(self.dtype),
                              enabled=self.dtype != "fp32")

    def _accumulate(self, inputs, targets):
        micro_inputs = inputs.split(self.micro_batch)
        micro_targets = targets.split(self.micro_batch)
        total = 0.0
        for n, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
            last = n == len(micro_inputs) - 1
            # DDP all-reduces gradients on the last micro-batch only.
            sync = (self.forward_model.no_sync() if self.distributed and not last
                    else contextlib.nullcontext())
            with sync:
                with self._autocast():
                    _, loss = self.forward_model(x, y)
                loss = loss.float() * (len(x) / len(inputs))
                self.scaler.scale(loss).backward()
            total += loss.item()
        return total

    def train_step(self, inputs, targets, lr):
        """One optimizer step; on out-of-memory, halve the micro-batch and retry it."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        while True:
            self.optimizer.zero_grad(set_to_none=True)
            try:
                loss = self._accumulate(inputs, targets)
                break
            except (MemoryError, RuntimeError) as exc:
                if not is_out_of_memory(exc) or self.micro_batch == 1 or self.distributed:
                    raise
                old = self.micro_batch
                self.micro_batch = max(1, old // 2)
                log.warning("out of memory at step %d with micro-batch %d (%s: %s); retrying "
                            "with micro-batch %d and %d accumulation steps", self.step + 1,
                            old, type(exc).__name__, exc, self.micro_batch,
                            self.accumulation_steps())
        grad_clip = self.cfg["training"]["grad_clip"]
        if grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def accumulation_steps(self):
        return math.ceil(self.rank_batch / self.micro_batch)

    def _warn_if_unrouted(self):
        """A warning, after the first step, where the router sent none of its attention calls
        to orchard (a head dimension past 256, say): the run's last line says so too, but a
        run is mostly over by then."""
        router = self.router
        if self.rank == 0 and router is not None and not router.routed and router.left_to_torch:
            log.warning("orchard computed none of the first step's attention calls (%d): "
                        "torch's scaled_dot_product_attention did them (%s)",
                        sum(router.left_to_torch.values()), ", ".join(sorted(router.left_to_torch)))

    def micro_batch_text(self):
        """"micro-batch 4 x 2 accumulation", and where the micro-batches do not divide the
        batch, the size of the last (batch 8 as 3 + 3 + 2 would otherwise read as 9)."""
        last = self.rank_batch - (self.accumulation_steps() - 1) * self.micro_batch
        return "micro-batch %d x %d accumulation%s" % (
            self.micro_batch, self.accumulation_steps(),
            "" if last == self.micro_batch else " (the last of %d)" % last)

    @torch.no_grad()
    def evaluate(self):
        """Mean loss over the held-out sequences, each rank taking its share. Dropout is off
        in eval mode, so this draws no random numbers and a resumed run stays exact."""
        self.model.eval()
        total = 0.0
        share = self.val_chunks[self.rank::self.world]
        # (a share of none, where ranks outnumber the windows, splits into one empty batch,
        # whose mean loss is NaN: the sum over ranks was NaN, the run said it had diverged)
        for batch in share.split(self.micro_batch) if len(share) else ():
            with self._autocast():
                _, loss = self.model(batch[:, :-1], batch[:, 1:])
            total += loss.float().item() * len(batch)
        self.model.train()
        return self._sum_over_ranks(total) / len(self.val_chunks)

    # -- the loop ----------------------------------------------------------------------------

    def _request_stop(self, signum, frame):
        self.stop_requested, self.stop_signal = True, signum
        # A second Ctrl-C interrupts at once (unless ignored, as the process started).
        if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        # A FIFO that no process reads holds the run in open() or write() for ever, where
        # SIGTERM, unlike Ctrl-C, has no second signal to end it: no step is in flight there
        if self.metrics_waiting:
            self.metrics_waiting = False    # once: a second signal finds the run stopping
            raise _MetricsReaderAbsent()

    def _should_stop(self):
        if not self.distributed:
            return self.stop_requested
        # All ranks stop after the same step, or the others would wait forever in DDP, and
        # exit with one status: the signal a rank got (the larger, where two differ).
        flag = torch.tensor([int(self.stop_signal) if self.stop_requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.stop_signal = int(flag.item())
        return bool(flag.item())

    def _sum_over_ranks(self, value):
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def _save_metrics(self):
        # Written whole and renamed into place, as the checkpoint, once a run (at its first
        # log line, or as of the checkpoint it resumes); then appended a line at a time: the
        # whole file at every line had made a long run's logging quadratic (2.3 s a line with
        # 200,000 records)
        if self.rank == 0:
            os.makedirs(self.output_dir, exist_ok=True)
            text = "".join(json.dumps(strict_json(r), allow_nan=False) + "\n" for r in self.history).encode()
            self._metrics_io(lambda path: write_atomically(path, lambda f: f.write(text)))
            self.metrics_whole = True

    def _write_metrics(self, record):
        self.history.append(record)
        if self.rank or not self.metrics_whole:
            self._save_metrics()
            return
        line = (json.dumps(strict_json(record), allow_nan=False) + "\n").encode()

        def append(path):   # one write of the whole line, synced as the whole file is
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
                if stat.S_ISREG(os.fstat(fd).st_mode):  # (a FIFO's fsync is EINVAL: an error)
                    os.fsync(fd)
            finally:
                os.close(fd)

        try:
            self._metrics_io(append)
        except FileNotFoundError:       # removed under the run: written whole again
            self._save_metrics()

    def _metrics_io(self, write):
        """write(path of metrics.jsonl); where that is a FIFO or device, one that a stop signal
        may end (_request_stop), after which the run writes it no more."""
        path = os.path.join(self.output_dir, METRICS_NAME)
        if self.metrics_given_up:
            return
        try:
            self.metrics_waiting = written_in_place(path)
            write(path)
        except _MetricsReaderAbsent:
            self.metrics_given_up = True
            log.warning("stopped while writing to %s, a FIFO or device, which waits for its "
                        "reader: the run's metrics from step %d on are not written there (the "
                        "checkpoint holds them)", path,
                        self.history[-1]["step"] if self.history else self.step)
        finally:
            self.metrics_waiting = False

    def stopping_point(self, epochs=None, max_steps=None):
        """The step count the run ends at and its learning-rate schedule spans: `epochs`
        passes over the data (default 1), or `max_steps` optimizer steps in all (as many
        passes as they take, as HuggingFace's max_steps), or with both whichever is fewer. A
        resumed run given neither keeps the stopping point of the run it continues, so its
        schedule goes on exactly where it stopped."""
        if epochs is None and max_steps is None and self.schedule_steps is not None:
            return self.schedule_steps
        if epochs is None and max_steps is not None:
            return max_steps
        total = (1 if epochs is None else epochs) * self.steps_per_epoch
        return total if max_steps is None else min(total, max_steps)

    def run(self, epochs=None, max_steps=None):
        """Train up to stopping_point(epochs, max_steps), counting the steps before a resume.
        Returns 0, or after Ctrl-C 130 (SIGTERM: 143, as the shell's status of a process it
        ended). A run that trains no step writes nothing."""
        train = self.cfg["training"]
        total = self.schedule_steps = self.stopping_point(epochs, max_steps)
        if self.step >= total:
            log.info("nothing to train: the run is at step %d, its stopping point is step %d; "
                     "nothing written", self.step, total)
            return 0
        if self.rank == 0 and self.step and (self.history or os.path.exists(
                os.path.join(self.output_dir, METRICS_NAME))):
            # A resumed run's curve so far, as of the checkpoint: steps logged after it are
            # redone. A new run replaces the file at its first log step, not with an empty
            # file now (a run that fails first keeps the old one; orchard-train --overwrite
            # removes it as the run starts).
            self._save_metrics()
        tokens_per_step = train["batch_size"] * self.cfg["model"]["context"]
        log.info("training %s parameters on %s: %d step(s) (%d per epoch), batch %d = %d "
                 "process(es) x %s, context %d, %s%s",
                 f"{self.model.num_params():,}", self.attention_device, total,
                 self.steps_per_epoch, train["batch_size"], self.world,
                 self.micro_batch_text(), self.cfg["model"]["context"], self.dtype,
                 ", gradient checkpointing" if self.model.grad_checkpointing else "")
        if self.step:
            log.info("resuming at step %d", self.step)
        calls_before = orchard_ops.stats()
        bar = Progress(total, "training", unit="steps", start=self.step, every=None,
                       enabled=self.rank == 0 and log.isEnabledFor(logging.INFO))
        # Ctrl-C, and the SIGTERM with which torchrun (or a scheduler) stops workers, end the
        # run after the step in flight, with a checkpoint.
        # Python allows signal handlers in the main thread only; a signal the process was
        # started ignoring (a shell's background job ignores Ctrl-C) stays ignored.
        main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self._request_stop)
                    for sig in (_STOP_SIGNALS if main_thread else ())
                    if signal.getsignal(sig) != signal.SIG_IGN}
        self.model.train()
        interrupted = diverged = False
        try:
            timed, t0, start = 0, time.perf_counter(), self.step
            while self.step < total:
                inputs, targets = self.batch(self.step)
                lr = self.learning_rate(self.step, total)
                self.losses.append(self.train_step(inputs, targets, lr))
                timed += 1
                self.step += 1
                if timed == 1 and self.step == start + 1:
                    self._warn_if_unrouted()
                validate = self.val_chunks is not None and (
                    self.step % train["eval_interval"] == 0 or self.step == total)
                if self.step % train["log_interval"] == 0 or validate or self.step == total:
                    elapsed = time.perf_counter() - t0
                    record = {
                        "step": self.step,
                        "epoch": (self.step - 1) // self.steps_per_epoch,
                        "loss": round(self._sum_over_ranks(sum(self.losses) / len(self.losses))
                                      / self.world, 5),
                        "lr": lr,
                        "tokens_per_s": round(timed * tokens_per_step / elapsed, 1),
                        "device": self.attention_device,
                        "micro_batch": self.micro_batch,
                        "grad_accum": self.accumulation_steps(),
                    }
                    if validate:
                        record["val_loss"] = round(self.evaluate(), 5)
                    self._write_metrics(record)
                    bad = [k for k in ("loss", "val_loss")
                           if k in record and not math.isfinite(record[k])]
                    if bad and not diverged:
                        diverged = True
                        log.warning("%s %s at step %d: the run has diverged (a smaller "
                                    "training.learning_rate may help); orchard-generate refuses "
                                    "its checkpoints", bad[0].replace("_", " "), record[bad[0]],
                                    self.step)
                    log.info("step %d/%d  epoch %d  loss %.4f%s  lr %.2e  %.0f tokens/s  %s",
                             self.step, total, record["epoch"], record["loss"],
                             "  val loss %.4f" % record["val_loss"] if validate else "", lr,
                             record["tokens_per_s"], self.micro_batch_text())
                    self.losses, timed, t0 = [], 0, time.perf_counter()
                # the last logged loss; none before the first log line (not "nan", which
                # reads as a diverged run)
                bar.update(self.step, "loss %.3f" % self.history[-1]["loss"]
                           if self.history else "")
                if self.step % train["checkpoint_interval"] == 0 and self.step != total:
                    saving = time.perf_counter()
                    self.save()
                    t0 += time.perf_counter() - saving  # tokens/s: training's, as evaluation's
                # a stop asked for during the last step finds the run complete
                if self.step < total and self._should_stop():
                    interrupted = True
                    break
            # under the handlers too: a Ctrl-C or SIGTERM while the last checkpoint is written
            # waits for it, as one during a periodic checkpoint does (the temporary file had
            # been removed and the run's steps since the last periodic checkpoint lost)
            path = self.save()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            bar.close()
        if self.rank == 0:
            if self.router is not None:
                log.info(self.router.summary())
            else:       # a transformers model's calls reach orchard through orchard.hf
                calls = orchard_ops.stats()
                log.info("attention calls computed by orchard (stats()): %d forward, %d "
                         "backward", *(calls[k] - calls_before[k] for k in ("fwd_calls",
                                                                           "bwd_calls")))
            if interrupted:     # a warning: --quiet still says where the run stopped
                log.warning("interrupted: checkpoint of step %d of %d saved to %s", self.step,
                            total, path)
            else:
                log.info("done: checkpoint of step %d saved to %s", self.step, path)
        return 128 + self.stop_signal if interrupted else 0

    def parameters_digest(self):
        """sha256 of every parameter's bytes, to check that data-parallel ranks agree."""
        digest = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(p.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()
