"""The training loop: build everything from a RunConfig, resume, train, checkpoint, report."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from trainium_api import exitcodes
from trainium_api.progress import CheckpointSeen, ProgressReport, SaveFailure, StoreReport

from ..model import backends
from ..contract.busy import mark
from ..contract.podenv import PodEnv
from ..checkpoint.checkpointer import Checkpointer
from ..config import ConfigError, RunConfig, derive_layout, to_dict
from ..data.packed import PackedDataset, heldout_batches
from . import tensorboard
from .health import GradNormMonitor, finite
from .tensorboard import ScalarLog
from ..model.metrics import TrainerMetrics, mfu
from ..model.transformer import Transformer
from ..model.optim import ShardedAdamW, lr_at
from ..model.parallel import ParallelState, to_device
from ..contract.progress import ProgressReporter

log = logging.getLogger("trainer")


class _StopFlag:
    """Set by SIGTERM; checked at step boundaries and agreed on by all ranks."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        self.requested = True
        mark("stopping")  # alive: the pod's agent keeps the grace for the stop-save (trainer.contract.busy)

    def set(self) -> None:
        self.requested = True


_FROM = {"memory": "node memory", "peer": "a peer node's memory (on at least one rank)", "store": "the store"}


def source_list(data) -> list[dict]:
    """data.sources as saved in a checkpoint's meta: what the data positions belong to."""
    return [{"uri": src.uri, "weight": src.weight, "textField": data.text_field_of(src)} for src in data.sources]


def _uris(sources: list[dict]) -> list[str]:
    return [str(s["uri"]).rstrip("/") for s in sources]  # a trailing slash names the same folder


def changed_data(meta: dict, data, kinds: list[str] | None = None,
                 listings: list[dict | None] | None = None,
                 tokenizer_digest: str | None = None) -> tuple[str, str, str] | None:
    """(field, then, now) when the checkpoint's data positions do not belong to ``data``: other
    source URIs (a prefix changed, a source added, removed or reordered), another tokenizer,
    end-of-document token, text field or packing, or a raw source whose folder lists other files
    (``listings``: PackedDataset.listings; its position counts files of its listing, which
    another trainer's listing rules or files added or removed change), or a tokenizer file whose
    bytes changed under the same name (``tokenizer_digest``: a file replaced, or a directory whose
    tokenizer.json went and whose tokenizer.model is read instead). None when they do (a weight may change: the
    positions stay valid, the mix going forward follows the new weights), or when the
    checkpoint predates the record."""
    saved = meta.get("dataSources")
    if saved is not None and _uris(saved) != _uris(source_list(data)):
        return "data.sources", json.dumps(_uris(saved)), json.dumps(_uris(source_list(data)))
    if kinds is not None and meta.get("dataSourceKinds", kinds) != kinds:  # a directory prepared in place
        return "data.sources", f"sources of kinds {json.dumps(meta['dataSourceKinds'])}", \
            f"{json.dumps(kinds)} (raw text or prepared token shards)"
    if "textField" in meta:  # a source's text field changed: other tokens, so other positions
        now = [data.text_field_of(s) for s in data.sources]
        # a checkpoint from before per-source fields: its data.textField, for every source
        then = [s.get("textField", meta["textField"]) for s in saved] if saved is not None else \
            [meta["textField"]] * len(now)
        for i, (was, now_i) in enumerate(zip(then, now)):
            if was != now_i and (kinds is None or kinds[i] != "prepared"):  # a prepared source's tokens are made
                own = data.sources[i].text_field
                return (f"data.sources[{i}].textField" if own else "data.textField"), json.dumps(was), json.dumps(now_i)
    positions = (meta.get("data") or {}).get("sources") or []
    for i, (listing, pos) in enumerate(zip(listings or [], positions)):
        if listing and isinstance(pos, dict) and "listing" in pos and pos["listing"] != listing["listing"]:
            return (f"data.sources[{i}].uri", f"{pos.get('files')} files (listing {pos['listing']})",
                    f"{listing['files']} files (listing {listing['listing']}): files were added, removed or "
                    f"renamed, so its position would name other documents")
    for key, now in (("tokenizer", data.tokenizer), ("eosToken", data.eos_token), ("packing", data.packing)):
        if key in meta and meta[key] != now:
            return f"data.{key}", json.dumps(meta[key]), json.dumps(now)
    if tokenizer_digest and meta.get("tokenizerDigest") not in (None, tokenizer_digest):
        return ("data.tokenizer", f"{data.tokenizer} with sha256 {meta['tokenizerDigest'][:12]}",
                f"the same name with sha256 {tokenizer_digest[:12]} (its file changed)")
    return None


class Trainer:
    def __init__(self, cfg: RunConfig, env: PodEnv | None = None):
        """``env``: the process's environment, read at its entry (python -m trainer)."""
        self.cfg = cfg
        self.env = env = env or PodEnv.from_environ()
        self.backend = backend = backends.pick(cfg.backend)
        local_world = env.local_world_size
        self.ps: ParallelState = backend.init_parallel(
            lambda ws: derive_layout(ws, cfg.model, cfg.parallelism, cfg.training, backend.name, local_world),
            cfg.parallelism.sequence_parallel, cfg.training.precision,
            cfg.model.kv_replicas(cfg.parallelism.tensor), env)
        ps, tcfg = self.ps, cfg.training
        backend.prepare(tcfg.micro_batch_size, ps, env)
        self.data = PackedDataset(cfg.data, tcfg.seq_len, tcfg.seed, cfg.model.vocab_size)
        if self.data.reads_all_rows and ps.dp > 1 and ps.rank == 0:
            log.warning("data: raw-text sources are read and tokenized whole by every rank (%d ranks); "
                        "prepare them once (python -m trainer.data.prepare) so each rank reads only its rows",
                        ps.world_size)
        self.heldout = self._heldout_batches()
        self.eval_perplexity: float | None = None
        self.restore_seconds: float | None = None  # what resuming from a checkpoint took (resume)
        self.compute_seconds: float | None = None  # smoothed time before each step's first collective
        # what the pre-flight check before this run took (trainer.pod.launch), for goodput
        self.preflight_seconds = env.preflight_seconds
        tp = backend.layers(ps)  # NxD's parallel layers on Neuron, ours elsewhere
        dtype = torch.bfloat16 if tcfg.precision == "bf16-sr" else torch.float32
        self.model = to_device(Transformer(cfg.model, tp, seed=tcfg.seed, max_seq_len=tcfg.seq_len,
                                           activation_checkpointing=cfg.parallelism.activation_checkpointing,
                                           stage=ps.stage), ps.device, dtype)
        self.autocast = (torch.autocast(ps.device.type, dtype=torch.bfloat16)
                         if tcfg.precision == "mixed" else nullcontext())
        self.pipeline = self._pipeline()
        self.optim = ShardedAdamW(list(self.model.named_parameters()), tcfg, ps, cfg.parallelism.zero1)
        ckpt_group = dist.new_group(backend="gloo") if ps.is_distributed else None
        # Host tensors cannot travel on NCCL or XLA groups: time-based saves agree on gloo.
        host_group = (dist.new_group(backend="gloo")
                      if ps.is_distributed and not backend.default_group_carries_host_tensors else None)
        self.stop = _StopFlag()
        # a gang fenced by a newer attempt (checkpoint.py) stops as on SIGTERM, agreed at a step
        self.ckpt = Checkpointer(cfg.checkpoint, ps, ckpt_group, host_group, epoch=env.epoch,
                                 on_fenced=self.stop.set, env=env)
        self.health = GradNormMonitor(cfg.health.spike_window, cfg.health.spike_factor)
        self.step = 0
        self.start_step = 0  # where this process began: 0, or the checkpoint it resumed from
        self.first_step_time: float | None = None  # when this process's first step ended (epoch)
        self.tokens = 0
        self.last_ckpt_step: int | None = None
        self.last_ckpt_time: float | None = None  # when that step ended, where this process trained it
        self._saved_step_ends: dict[int, float] = {}  # saves in flight: step -> when it ended
        self._failed_seen = 0  # failed saves already counted in the metrics
        # what this pod says of its store (the operator cannot read it): the newest complete tag
        # (resumed from or saved; a save is dated when this rank first saw it complete) and why the
        # store could not be read at start
        self.checkpoint_seen: CheckpointSeen | None = None
        self.store_error: str | None = None
        self.stop_agreed = False  # set when every rank has seen a SIGTERM (through a step's all-reduce)
        self._observed_at = time.perf_counter()
        # neuron_parallel_compile's pass (trainer.pod.launch): graphs only, so nothing is reported or saved.
        self.precompile_steps = env.precompiling
        is_reporter = ps.local_rank == 0 and not self.precompile_steps
        self.metrics = TrainerMetrics(cfg.logging.metrics_port if is_reporter else 0,
                                      {"run": env.training_run or "local", "node_rank": env.node_rank})
        self.progress = ProgressReporter(cfg.logging.progress_interval_seconds, env=env) if is_reporter else None
        self.peak = cfg.logging.peak_flops or backend.peak_flops()
        self.losses_fh = None
        if cfg.logging.losses_file and ps.rank == 0 and not self.precompile_steps:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.logging.losses_file)), exist_ok=True)
            self.losses_fh = open(cfg.logging.losses_file, "a")
        # logging.tensorboard's writer (rank 0): opened once resumed, when the resumed step is known
        self.scalars: ScalarLog | None = None

    def _pipeline(self):
        """The stage's schedule when the model is split into pipeline stages, else None."""
        ps = self.ps
        if ps.pp == 1:
            return None
        return self.backend.pipeline(self.model, ps, ps.layout.grad_accum_steps, self.autocast)

    # -- state ----------------------------------------------------------------------------------

    def layout_meta(self) -> dict:
        return {"tensor": self.ps.tp, "data": self.ps.dp, "pipeline": self.ps.pp, "zero1": self.optim.zero1}

    def resume(self) -> None:
        tag = self.ckpt.select_resume()  # (rank 0 lists the store; the others wait for its answer)
        started = time.perf_counter()  # after that wait: the ranks' start-up skew is not restore
        if tag is None:
            if self.cfg.init.from_:
                self.initialise_from(self.cfg.init.from_)
            elif self.ps.rank == 0:
                log.info("no complete checkpoint to resume from; starting at step 0")
            return
        if self.cfg.init.from_ and self.ps.rank == 0:
            log.info("init.from %s ignored: a checkpoint exists", self.cfg.init.from_)
        # every rank checks what it reads against meta.json's records; a damaged tag makes all
        # ranks take the previous complete one (ckpt.skipped names it), and with none left that
        # loads the process exits retryable (checkpoint.NoIntactCheckpoint), never from step 0
        state = self.ckpt.load(tag, self.layout_meta())
        tag, meta = state["tag"], state["meta"]
        self.checkpoint_seen = CheckpointSeen(tag.tag, meta["step"], tag.done_mtime)  # reported (store.py)
        changed = changed_data(meta, self.cfg.data, self.data.kinds, self.data.listings, self.data.tokenizer_digest)
        if changed and not self.cfg.data.allow_changed_sources:
            raise exitcodes.FatalError(f"{changed[0]}: checkpoint {tag.tag} was written with {changed[1]}, the config "
                                       f"now has {changed[2]}; its data positions belong to the old data. Set "
                                       f"data.allowChangedSources: true to resume the model and read the new data "
                                       f"from its beginning")
        if meta.get("configDigest") != self.cfg.digest() and self.ps.rank == 0:
            log.warning("checkpoint %s was written with a different model/data config (digest %s, now %s)",
                        tag.tag, meta.get("configDigest"), self.cfg.digest())
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        if changed:
            if self.ps.rank == 0:
                log.warning("%s changed since checkpoint %s (data.allowChangedSources): the new data is read from "
                            "its beginning", changed[0], tag.tag)
        else:
            self.data.load_state(meta["data"])
        self.health.load_state(state["user_content"]["health"])
        torch.set_rng_state(state["user_content"]["torch_rng"])
        self.step, self.tokens = meta["step"], meta["tokens"]
        self.last_ckpt_step = self.start_step = meta["step"]
        # what this attempt spent restoring (this rank's shards read and loaded): goodput's
        # restore phase, the slowest pod's report being the gang's
        self.restore_seconds = time.perf_counter() - started
        self.metrics.restore_seconds.set(self.restore_seconds)
        self.metrics.restored_from(self.ckpt.restore_source)
        if self.ps.rank == 0:
            log.info("resumed from %s at step %d (%d tokens)", tag.uri, self.step, self.tokens)
            log.info("restore: %s read from %s and loaded in %.2f s", tag.tag, _FROM[self.ckpt.restore_source],
                     self.restore_seconds)

    def initialise_from(self, uri: str) -> None:
        """First start only: weights (not optimizer or data state) from a Hugging Face directory
        or one of our checkpoint tags. Shapes are checked before any weight is read."""
        ps, started = self.ps, time.perf_counter()
        own = set(self.model.state_dict())  # this stage's parameter names
        if self.cfg.init.is_hf():
            from ..model import hf
            hf.check_matches(self.cfg.model, hf.read_config(uri), uri)
            shard = hf.read_shard(hf.SafetensorsDir(uri), self.cfg.model, ps.tp, ps.tp_rank)
        else:
            shard = self.ckpt.read_model_shard(uri, self.cfg.model, ps.tp, ps.tp_rank, own)
        shard = {k: v for k, v in shard.items() if k in own}  # this pipeline stage's
        missing = own - set(shard)
        if missing:
            raise exitcodes.FatalError(f"init.from {uri} lacks {sorted(missing)[:3]}")
        self.model.load_state_dict(shard)
        if ps.rank == 0:
            log.info("initialised from %s (first start; %.1fs)", uri, time.perf_counter() - started)

    def save(self) -> None:
        meta = {"step": self.step, "tokens": self.tokens, "data": self.data.state(),
                "configDigest": self.cfg.digest(), "layout": self.layout_meta(),
                "model": to_dict(self.cfg.model), "tokenizer": self.cfg.data.tokenizer,
                "dataSources": source_list(self.cfg.data), "dataSourceKinds": self.data.kinds,
                "tokenizerDigest": self.data.tokenizer_digest,
                "textField": self.cfg.data.text_field,
                "packing": self.cfg.data.packing,
                "eosToken": self.cfg.data.eos_token}
        user = {"health": self.health.state(), "torch_rng": torch.get_rng_state(), "step": self.step}
        if hasattr(self, "_last") and self._last[0] == self.step:
            self._saved_step_ends[self.step] = self._last[3]
        result = self.ckpt.save(self.step, self.model.state_dict(), self.optim.state_dict(),
                                {"last_step": self.step, "lr": lr_at(max(self.step - 1, 0), self.cfg.training)},
                                user, meta)
        self.metrics.ckpt_stall.set(result.stall_seconds)
        if self.scalars is not None:
            self.scalars.persist()  # logged steps up to the checkpoint on their way to the store
        self._note_finished_saves()

    def _note_finished_saves(self) -> None:
        newer = False
        for r in self.ckpt.results:
            if r.ok and (self.last_ckpt_step is None or r.step > self.last_ckpt_step):
                self.last_ckpt_step = r.step
                self.last_ckpt_time = self._saved_step_ends.get(r.step)
                self._saved_step_ends = {s: t for s, t in self._saved_step_ends.items() if s > r.step}
                self.metrics.ckpt_step.set(r.step)
                if r.durable_seconds:  # known where the marker was written (rank 0)
                    self.metrics.ckpt_durable.set(r.durable_seconds)
                self.checkpoint_seen = CheckpointSeen(r.tag, r.step, time.time())
                newer = True
        failed = sum(1 for r in self.ckpt.results if not r.ok)
        if failed != self._failed_seen or newer:  # said at once: a new checkpoint, or a save failing
            self._report_progress(force=True)
        self.metrics.ckpt_failures.inc(failed - self._failed_seen)
        self._failed_seen = failed

    def store_report(self) -> StoreReport:
        """What this pod says of its checkpoint store in its progress report."""
        failed = list(itertools.takewhile(lambda r: not r.ok, reversed(self.ckpt.results)))
        failure = SaveFailure(failed[0].tag, failed[0].error or "another rank failed", len(failed)) if failed else None
        return StoreReport(self.checkpoint_seen, self.store_error, failure, self.ckpt.skipped)

    # -- held-out evaluation ----------------------------------------------------------------

    def _heldout_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slices of the first data.evalBatches global batches of data.heldOut,
        the same batches at every evaluation (so perplexities compare across checkpoints)."""
        cfg = self.cfg
        if not cfg.data.held_out:
            return []
        t = cfg.training
        return heldout_batches(cfg.data, t.seq_len, t.seed, cfg.model.vocab_size, t.global_batch_size,
                               cfg.data.eval_batches, self.ps.dp_rank, self.ps.dp)

    def evaluate(self) -> tuple[float, float]:
        """Mean token loss and perplexity on the held-out batches (all ranks take part)."""
        ps, accum = self.ps, self.ps.layout.grad_accum_steps
        self.model.eval()
        total = torch.zeros((), device=ps.device)
        with torch.no_grad():
            for inputs, targets in self.heldout:
                if self.pipeline is not None:
                    total += self.pipeline.evaluate(inputs, targets)
                    continue
                for ids, tgt in zip(inputs.chunk(accum), targets.chunk(accum)):
                    with self.autocast:
                        total += self.model(ids.to(ps.device), tgt.to(ps.device)).float() / accum
        if ps.is_distributed:
            dist.all_reduce(total)  # every TP rank of the last stage holds the same loss
        self.model.train()
        loss = total.item() / self.loss_holders / len(self.heldout)
        return loss, math.exp(min(loss, 80.0))

    def _maybe_evaluate(self) -> None:
        cfg = self.cfg
        every = cfg.data.eval_interval_steps
        if not self.heldout or not (self.step == cfg.training.steps or (every and self.step % every == 0)):
            return
        loss, ppl = self.evaluate()
        self.eval_perplexity = ppl
        self.metrics.eval_loss.set(loss), self.metrics.eval_perplexity.set(ppl)
        if self.scalars is not None:
            self.scalars.scalars(self.step, {tensorboard.EVAL_LOSS: loss, tensorboard.EVAL_PERPLEXITY: ppl})
        if self.ps.rank == 0:
            log.info("step %d held-out loss %.4f perplexity %.3f (%d batches)", self.step, loss, ppl,
                     len(self.heldout))
        if self.losses_fh:
            self.losses_fh.write(json.dumps({"evalStep": self.step, "evalLoss": loss, "evalPerplexity": ppl,
                                             "time": round(time.time(), 3)}) + "\n")
            self.losses_fh.flush()
        self._report_progress()

    # -- one step -------------------------------------------------------------------------------

    @property
    def loss_holders(self) -> int:
        """How many ranks hold a step's loss: every tensor- and data-parallel rank of the last
        pipeline stage (the others add zero to the world's sum)."""
        return self.ps.world_size // self.ps.pp

    def _forward_backward(self) -> torch.Tensor:
        """Forward/backward over the local micro batches; returns this rank's summed loss and
        this rank's SIGTERM flag, all-reduced over the world in one collective: every TP rank
        of the last stage holds the same loss, so the world sum / loss_holders is the mean over
        data-parallel ranks. With pipeline stages the micro batches run on the 1F1B schedule."""
        ps, tcfg = self.ps, self.cfg.training
        began = time.perf_counter()
        inputs, targets = self.data.next_batch(tcfg.global_batch_size, ps.dp_rank, ps.dp)
        accum = ps.layout.grad_accum_steps
        if self.pipeline is not None:
            loss_sum = self.pipeline.forward_backward(inputs, targets)
        else:
            loss_sum = torch.zeros((), device=ps.device)
            for ids, tgt in zip(inputs.chunk(accum), targets.chunk(accum)):
                with self.autocast:
                    loss = self.model(ids.to(ps.device), tgt.to(ps.device)) / accum
                loss.backward()
                loss_sum += loss.detach().float()
        shared = torch.stack([loss_sum, torch.tensor(float(self.stop.requested), device=ps.device)])
        if not ps.runtime.lazy:  # a lazy device has only built the graph by now: nothing to time
            self._note_compute(time.perf_counter() - began)
        if ps.is_distributed:
            dist.all_reduce(shared)
        return shared

    def _note_compute(self, seconds: float) -> None:
        """This rank's time before the step's first collective (data, forward, backward): what a
        slow node stretches, while its peers' show up as waiting in that collective instead.
        Smoothed over steps; the progress report carries it (straggler detection). With pipeline
        stages it includes the schedule's own point-to-point waits."""
        prev = self.compute_seconds
        self.compute_seconds = seconds if prev is None else 0.7 * prev + 0.3 * seconds

    def train_step(self) -> tuple[float, float, bool]:
        """One optimizer step on an eager device. Returns (loss, grad_norm, stop_requested)
        with the loss averaged over data-parallel ranks."""
        tcfg = self.cfg.training
        shared = self._forward_backward()
        loss_value, stop = shared[0].item() / self.loss_holders, shared[1].item() > 0
        grads, grad_norm = self.optim.sync_and_norm()
        if finite(loss_value, grad_norm):
            self.optim.step(grads, grad_norm, lr_at(self.step, tcfg))
        else:
            self._skipped(loss_value, grad_norm, self.step + 1)
        self.optim.zero_grad()
        return loss_value, grad_norm, stop

    def train_step_lazy(self) -> torch.Tensor:
        """One optimizer step on a lazy device (XLA), built as one graph with no host reads:
        returns the device vector [loss, grad_norm, stop, applied, param_norm] that the
        deferred observation reads."""
        ps, tcfg = self.ps, self.cfg.training
        shared = self._forward_backward()
        loss = shared[0] / self.loss_holders
        grads, sq = self.optim.sync_and_norm_sq()
        lr = torch.tensor(lr_at(self.step, tcfg), device=ps.device)  # data, not a graph constant
        applied = self.optim.step_on_device(grads, sq, loss, lr)
        self.optim.zero_grad()
        return torch.stack([loss, sq.clamp(min=0).sqrt(), shared[1], applied.float(),
                            self.optim.param_norm_sq(self.optim.last_flat).clamp(min=0).sqrt()])

    def _skipped(self, loss_value: float, grad_norm: float, step: int) -> None:
        self.metrics.skipped.inc()
        if self.cfg.health.nan_policy == "stop":
            raise exitcodes.FatalError(f"non-finite loss {loss_value} or gradient norm {grad_norm} "
                                       f"at step {step} (health.nanPolicy=stop)")
        if self.ps.rank == 0:
            log.warning("step %d: non-finite loss/grad norm, update skipped", step)

    def _observe(self, step: int, values, started: float) -> None:
        """Everything a finished step feeds on the host: health, metrics, log, progress, the
        losses file, and the agreed stop. Eager devices call it at once; XLA one step later."""
        if self.ps.runtime.lazy:
            loss, grad_norm, stop, applied, param_norm = values.tolist()  # waits for this step only
            now = time.perf_counter()
            stop = stop > 0
            if not applied:
                self._skipped(loss, grad_norm, step)
            dt = now - self._observed_at  # steps overlap on the device: time between results
        else:
            loss, grad_norm, stop = values
            param_norm = None
            now = time.perf_counter()
            dt = now - started
        self._observed_at = now
        spike = self.health.update(step, grad_norm)
        log_now = step % self.cfg.logging.interval == 0 or step == 1 or spike  # same on every rank
        if log_now and param_norm is None:
            param_norm = self.optim.param_norm()  # a TP collective: all ranks
        self._report(step, loss, grad_norm, dt, spike, param_norm if log_now else None)
        self.stop_agreed = self.stop_agreed or stop

    # -- the loop -------------------------------------------------------------------------------

    def _open_scalars(self) -> None:
        """logging.tensorboard's writer on rank 0, now that the resumed step is known (its purge
        step). One that cannot be opened (no tensorboard package in the image, a read-only or
        missing volume, a store library absent) is reported and left off: training goes on."""
        if not self.cfg.logging.tensorboard or self.ps.rank != 0 or self.precompile_steps:
            return
        try:
            self.scalars = ScalarLog(self.cfg.logging.tensorboard, first_step=self.start_step + 1)
        except Exception as exc:
            log.error("TensorBoard logging to %s is off: %s: %s; training goes on", self.cfg.logging.tensorboard,
                      type(exc).__name__, exc)

    def run(self) -> int:
        cfg, ps = self.cfg, self.ps
        self._resume_or_say_why()
        self._open_scalars()
        tokens_per_step = ps.layout.tokens_per_step
        if ps.rank == 0:
            log.info("model %s: %.1fM parameters; layout tp=%d pp=%d dp=%d accum=%d; %d tokens/step; backend %s",
                     cfg.model.preset, cfg.model.num_params() / 1e6, ps.tp, ps.pp, ps.dp,
                     ps.layout.grad_accum_steps, tokens_per_step, self.backend)
        code = exitcodes.OK
        runtime = ps.runtime
        last_step = cfg.training.steps
        if self.precompile_steps:
            last_step = min(last_step, self.step + self.precompile_steps)
            if ps.rank == 0:
                log.info("pre-compilation pass: steps %d-%d, nothing saved or reported", self.step + 1, last_step)
        while self.step < last_step:
            t0 = time.perf_counter()
            values = self.train_step_lazy() if runtime.lazy else self.train_step()
            self.step += 1
            self.tokens += tokens_per_step
            runtime.end_step(lambda step=self.step, values=values, t0=t0: self._observe(step, values, t0))
            if not self.precompile_steps:
                self._maybe_evaluate()
            saved = not self.precompile_steps and (
                self.ckpt.due(self.step) or (self.step == cfg.training.steps and cfg.checkpoint.enabled()))
            if saved:
                runtime.flush()  # the saved health state and losses include this step
                self.save()
            if self.stop_agreed:  # every rank saw it at the same step
                if ps.rank == 0:
                    log.warning("%s: stopping after step %d, %s",
                                f"fenced by {self.ckpt.describe(self.ckpt.fenced_by)}" if self.ckpt.fenced_by
                                else "SIGTERM",
                                self.step,
                                "saving it" if cfg.checkpoint.save_on_stop and cfg.checkpoint.enabled() and not saved
                                else "finalizing checkpoints")
                if cfg.checkpoint.save_on_stop and cfg.checkpoint.enabled() and not saved and not self.precompile_steps:
                    runtime.flush()
                    self.save()
                code = exitcodes.TERMINATED
                break
        runtime.flush()
        last = self.ckpt.finalize()
        self._note_finished_saves()
        if code == exitcodes.OK and last is not None and not last.ok:
            log.error("the final checkpoint %s was not written; exiting retryable", last.tag)
            code = exitcodes.RETRYABLE
        self._report_progress(force=True)
        return code

    def _resume_or_say_why(self) -> None:
        """resume(), and what this pod then says of its store: the tag it resumed from, or why
        the store could not be read (the run's CheckpointStoreReadable condition)."""
        try:
            self.resume()
        except (ConfigError, exitcodes.FatalError):
            raise  # the run's configuration: named as such
        except (OSError, SystemExit) as exc:
            # the store's: listing or reading it failed for good (store_errors: StoreUnavailable,
            # StoreConfigError, an OSError) or no complete tag loads (NoIntactCheckpoint); a peer
            # lost mid-restore or a device error is not the store's, and says nothing of it
            self.store_error = f"cannot resume from {self.cfg.checkpoint.uri}: {type(exc).__name__}: {exc}"
            self._report_progress(force=True)
            raise

    def _report(self, step: int, loss: float, grad_norm: float, dt: float, spike: bool,
                param_norm: float | None) -> None:
        cfg, ps = self.cfg, self.ps
        tps = ps.layout.tokens_per_step / dt
        util = mfu(tps, cfg.model, cfg.training.seq_len, ps.world_size, self.peak)
        lr = lr_at(step - 1, cfg.training)
        m = self.metrics
        m.step.set(step), m.loss.set(loss), m.lr.set(lr), m.grad_norm.set(grad_norm)
        m.tokens_per_second.set(tps), m.step_seconds.set(dt), m.tokens.inc(ps.layout.tokens_per_step)
        if util is not None:
            m.mfu.set(util)
        if spike:
            m.spikes.inc()
        if param_norm is not None:
            m.param_norm.set(param_norm)
        self._last = (step, loss, tps, time.time())  # the step's end (observed)
        if self.first_step_time is None:  # the operator dates this attempt's training start from it
            self.first_step_time = self._last[3]
        self._note_finished_saves()
        self._report_progress()
        if self.losses_fh:
            # time: when the step ended (epoch seconds), the ground truth for goodput checks
            self.losses_fh.write(json.dumps({"step": step, "loss": loss, "gradNorm": grad_norm, "lr": lr,
                                             "time": round(self._last[3], 3), "startStep": self.start_step}) + "\n")
            self.losses_fh.flush()
        if self.scalars is not None:
            self.scalars.scalars(step, {tensorboard.LOSS: loss, tensorboard.LEARNING_RATE: lr,
                                        tensorboard.GRAD_NORM: grad_norm, tensorboard.TOKENS_PER_SECOND: tps,
                                        tensorboard.MFU: util, tensorboard.STEP_SECONDS: dt},
                                 walltime=self._last[3])
        if ps.rank == 0 and param_norm is not None:
            log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f%s param_norm %.2f tokens/s %.0f mfu %s step %.3fs",
                     step, cfg.training.steps, loss, lr, grad_norm, " (SPIKE)" if spike else "", param_norm,
                     tps, f"{util:.1%}" if util is not None else "n/a", dt)

    def _report_progress(self, force: bool = False) -> None:
        if self.progress is not None and (hasattr(self, "_last") or self.store_error):
            # before the first step only to say the store cannot be read
            step, loss, tps, ended = getattr(self, "_last", (None, None, None, None))
            self.progress.report(ProgressReport(
                step=step, time=ended, tokens_per_second=tps,
                loss=None if loss is None else loss if math.isfinite(loss) else -1.0,
                last_checkpoint_step=self.last_ckpt_step, last_checkpoint_time=self.last_ckpt_time,
                start_step=self.start_step, eval_perplexity=self.eval_perplexity, compute_seconds=self.compute_seconds,
                preflight_seconds=self.preflight_seconds, restore_seconds=self.restore_seconds,
                restore_source=self.ckpt.restore_source, first_step_time=self.first_step_time,
                store=self.store_report()), force=force)

    def close(self) -> None:
        self.ckpt.wait()
        if self.progress:
            self.progress.close()
        self.metrics.close()
        if self.losses_fh:
            self.losses_fh.close()
        if self.scalars is not None:
            self.scalars.close()

