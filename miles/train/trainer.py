"""The trainer: run plan → model → parallelize → optimizer, then per iteration collect → score →
the algorithm's optimizer steps → log, with checkpoints, resume and held-out evaluation.

The batch's route (docs/ARCHITECTURE.md): the collector (``miles.train.collect``, or the algorithm's
own batch source, ``miles.train.sources``) samples every dp rank's prompt groups, its sp peers
sampling the same ones with the same noise; ``score`` (``miles.train.score``) decodes, rewards and
forms advantages; the algorithm (``miles.algorithms``) turns the batch into optimizer steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from miles.algorithms import Policy, build_algorithm
from miles.config import Config, to_dict
from miles.data.prompts import GroupSampler
from miles.eval import evaluate, summarize, write_eval
from miles.eval.evaluate import eval_settings, grid_caption
from miles.models.family import FamilyModel
from miles.parallel.fsdp import unsharded_for_rollout
from miles.parallel.topology import build_parallel_mesh
from miles.parallel.topology_checks import local_world_size_from_env
from miles.rewards.base import resident_bytes
from miles.rewards.from_config import build_configured_rewards
from miles.rewards.shaping import EvalRewards
from miles.rollout.batch import RolloutBatch, Scores
from miles.rollout.prompt_cache import PromptCache
from miles.train.checkpoint import (
    checkpoint_error_reason,
    has_ema,
    has_state,
    last_good_checkpoint,
    load_checkpoint,
    save_checkpoint,
    weights_digest,
)
from miles.train.collect import Collector, decode_ahead_for, guidance_scales, run_generator
from miles.train.ema import EMA
from miles.train.export import export_pipeline
from miles.train.extra_state import extra_state, load_extra_state
from miles.train.guard import build_guard, react
from miles.train.logging import (
    MetricsLogger,
    configure_library_progress,
    eval_line,
    layout_line,
    print0,
    rollout_line,
    show_progress,
)
from miles.train.memory_budget import ResidentMemory
from miles.train.old_policy import OldPolicy
from miles.train.outcome import stopped_line
from miles.train.parallelize import compute_dtype, parallelize
from miles.train.plan import plan_run
from miles.train.prompt_checks import warn_truncated_prompts
from miles.train.redact import secret_values
from miles.train.resume import prompt_fingerprint
from miles.train.reward_failure import GuardedRewards, reward_failed
from miles.train.run_dir import clear_run_dir, lock_run_dir
from miles.train.runtime import deterministic_kernels, init_distributed, maybe_inject_fault, peak_memory_gib
from miles.train.schedule import build_lr_scheduler, current_lr
from miles.train.score import NonFiniteError, score
from miles.train.sources import batch_source, unscored
from miles.train.stop import GracefulStop, StopRequested


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = init_distributed(cfg.run.collective_timeout_s)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if cfg.parallel.deterministic_mode:
            deterministic_kernels()
        torch.manual_seed(cfg.run.seed)
        self.progress = show_progress(cfg.run.progress)  # rank 0, on a terminal
        configure_library_progress(self.progress)

        # Everything that can be refused is checked before the model is moved or a rollout runs, by
        # the run plan the dry run prints (miles.train.plan), identically on every rank.
        self.plan = plan_run(
            cfg,
            self.world_size,
            local_world_size=local_world_size_from_env(),
            device_type=self.device.type,
            strict=True,
        )
        self.run_dir, self.dims = self.plan.run_dir, self.plan.dims
        self.attention_backend = self.plan.attention_backend
        self.resume_from = self.plan.resume_from  # as saved, with this model, adapters, prompts, seed...
        self.run_lock = lock_run_dir(self.run_dir, secret_values(cfg))  # one launch per dir, before the model
        # Saved with every checkpoint, checked on resume: the model folder (a resume re-reads its frozen
        # weights), the prompt file's bytes (the sampler's position refers to them).
        self.model_fingerprint, self.prompt_fingerprint = self.plan.model_fingerprint, prompt_fingerprint(cfg)
        self._load_inputs()
        # The transformers come as meta skeletons: _parallelize shards them, then loads each rank's shards.
        self.model: FamilyModel = self.plan.family.load(
            cfg.model, self.device, experts="skeleton", seed=cfg.run.seed
        )
        self.prompt_cache = PromptCache(
            self.model.pipeline,
            negative_prompt=cfg.data.negative_prompt,
            max_sequence_length=cfg.data.max_sequence_length,
            device=self.device,
            offload=cfg.model.text_encoder_offload,
            batch_size=cfg.train.micro_batch_size,
            encode_texts=self.model.encode_texts,
        )
        tokenizer = getattr(self.model.pipeline, "tokenizer", None)
        warn_truncated_prompts(cfg, tokenizer, self.prompts, self.eval_prompts, self.rank)  # as the dry run
        self.mesh = build_parallel_mesh(self.dims, self.device.type)
        self.sampler = self._group_sampler()
        # fp32 master weights; FSDP2 casts to the compute dtype (None: compute in fp32).
        self.compute_dtype = compute_dtype(cfg)
        self.num_tokens = self.plan.shape.tokens_per_sample  # the plan counts them once
        self.algorithm = build_algorithm(cfg, self.plan.schedule)
        experts = parallelize(
            self.model,
            self.plan,
            self.mesh,
            self.device,
            self._resident_memory,
            uses_old_policy=self.algorithm.uses_old_policy,
            uses_reference=self.algorithm.uses_reference,
        )
        self.old_policy = OldPolicy(experts.old, experts.policy) if experts.old else None
        self.reference = experts.reference
        self.policy = Policy(
            transformers=self.model.transformers,
            guidance_scales=guidance_scales(cfg.rollout, len(self.model.transformers)),
            routing=self.model.routing,
            reference=self._reference_experts if self.algorithm.uses_reference else None,
            generator=self._generator,
            old=self.old_policy,
        )
        self._training_state()
        self.stop = GracefulStop(self.device)  # SIGINT/SIGTERM: save at the next safe point, then exit
        self.collector = self._collector()
        self._open_run_dir()
        if self.resume_from is not None:
            self._resume(self.resume_from)
        else:
            self.logger.truncate_after(0)  # rows of a run that saved no checkpoint are redone
        self._say_layout()

    # ------------------------------------------------------------------------------------------
    # setup

    def _say_layout(self) -> None:
        """The run's layout, model and directory, once (rank 0)."""
        print0(layout_line(self))

    def _group_sampler(self) -> GroupSampler:
        """This dp rank's prompt groups, drawn alike on every rank (``miles.data.prompts``)."""
        d = self.cfg.data
        return GroupSampler(
            num_prompts=len(self.prompts),
            prompts_per_dp_rank=d.prompts_per_rank,
            group_size=d.group_size,
            dp_rank=self.mesh.dp_rank,
            dp_size=self.mesh.dp_size,
            seed=self.cfg.run.seed,
        )

    def _collector(self):
        """Rollouts (:class:`Collector`), or the batches of the source the algorithm declares
        (:mod:`miles.train.sources`)."""
        cfg, model = self.cfg, self.model
        self.decode_ahead = decode_ahead_for(cfg, self.algorithm, model, self.mesh, self.device)
        collector = Collector(cfg=cfg, model=model, algorithm=self.algorithm, policy=self.policy,
                              prompts=self.prompts, prompt_cache=self.prompt_cache, sampler=self.sampler,
                              device=self.device, rank=self.rank, stop=self.stop.requested,
                              progress=self.progress, decode_ahead=self.decode_ahead)  # fmt: skip
        return batch_source(self.algorithm, collector)

    def _training_state(self) -> None:
        """AdamW over the trainable parameters, the counters and the EMA."""
        cfg = self.cfg.train
        params = [p for t in self.model.transformers for p in t.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=cfg.learning_rate,
            betas=tuple(cfg.adam_betas),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)  # None: a constant lr
        self.guard = build_guard(self.cfg)  # train.guard: reward hacking on the held-out set
        self._saved_step = -1
        self._eval_step = -1
        self.step = 0  # optimizer steps taken
        self.rollout_index = 0  # rollout batches completed
        self.experts = nn.ModuleList(self.model.transformers)  # one module for checkpoints
        trainable = [(n, p) for n, p in self.experts.named_parameters() if p.requires_grad]
        self.ema = EMA(trainable, cfg.ema_decay) if cfg.ema_decay > 0 else None

    def _open_run_dir(self) -> None:
        """Every check has passed: only now is a previous run deleted (``--train.overwrite``); the
        metrics logger opens and rank 0 writes ``config.yaml``."""
        cfg = self.cfg
        if cfg.train.overwrite:
            if self.rank == 0 and (removed := clear_run_dir(self.run_dir)):
                print0(
                    f"[miles] --train.overwrite: deleted the previous run's {', '.join(removed)} in {self.run_dir}"
                )
            dist.barrier()
        self.logger = MetricsLogger(
            self.run_dir,
            to_dict(cfg),
            mode=os.environ.get("WANDB_MODE", cfg.run.wandb_mode)
            if cfg.run.wandb_mode != "disabled"
            else "disabled",
            project=cfg.run.wandb_project,
            name=cfg.run.name,
            enabled=self.rank == 0,
            tensorboard=cfg.run.tensorboard,
            secrets=secret_values(cfg),
        )
        if self.rank == 0:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def _load_inputs(self) -> None:
        """The prompts (training and held-out, and their images for image-to-video), loaded and
        checked by the plan, and the rewards."""
        cfg, plan = self.cfg, self.plan
        self.prompts = plan.prompts
        self.eval_prompts = [p.text for p in plan.held_out]
        self.eval_images = [p.image for p in plan.held_out] if plan.image_to_video else None
        held_out = (
            f", {len(self.eval_prompts)} held-out from {cfg.eval.prompt_file}" if self.eval_prompts else ""
        )
        source = cfg.data.prompt_file or "the built-in list"
        print0(f"[miles] loaded {len(self.prompts)} prompts from {source}" + held_out)
        self.rewards, self.gold_rewards = build_configured_rewards(cfg.reward, self.device)
        self.rewards = GuardedRewards(self.rewards)  # a server down after retries: save and stop

    def _resident_memory(self) -> ResidentMemory:
        """The plan's per-rank resident terms, the loaded reward models' device bytes in place of its estimate."""
        mixes = [self.rewards] + ([self.gold_rewards] if self.gold_rewards is not None else [])
        rewards = resident_bytes([r for mix in mixes for r in mix.rewards.values()], self.device)
        return dataclasses.replace(self.plan.resident, rewards=float(rewards))

    # ------------------------------------------------------------------------------------------
    # one iteration

    def _generator(self, *parts: int) -> torch.Generator:
        """A generator seeded from the run seed and ``parts``: same on every rank given the same parts."""
        return run_generator(self.cfg.run.seed, *parts)

    def rollout(self) -> RolloutBatch:
        """Collect the next rollout batch (:mod:`miles.train.collect`)."""
        return self.collector.collect(self.rollout_index)

    def score(self, batch: RolloutBatch) -> Scores:
        """Decode, reward and normalise the batch (:mod:`miles.train.score`); sets its advantages."""
        if not self.algorithm.uses_rewards:
            return unscored(batch, self.mesh.dp_size)
        return score(
            batch,
            self.rewards,
            cfg=self.cfg,
            model=self.model,
            mesh=self.mesh,
            device=self.device,
            keep_videos=self._logs_videos(self.rollout_index),
            step=self.step,
        )

    def _bar(self, items, desc: str):
        """An inner progress bar on rank 0 (cleared when done)."""
        return tqdm(items, desc=desc, leave=False, disable=not self.progress)

    def _logs_videos(self, rollout_index: int) -> bool:
        """Whether this rank logs the videos of that rollout (rank 0, every ``run.log_video_every``)."""
        every = self.cfg.run.log_video_every
        return bool(every) and self.rank == 0 and rollout_index % every == 0

    def train_on(self, batch: RolloutBatch) -> list[dict]:
        """``steps_per_rollout`` optimizer steps over the rollout batch.

        Each step takes its share of micro-batches; the algorithm backpropagates its loss over
        them (``miles.algorithms``), then the gradients are clipped and the optimizer steps.
        """
        cfg = self.cfg
        chunks = batch.chunks
        per_step = len(chunks) // cfg.train.steps_per_rollout
        stats = []
        for m in self._bar(range(cfg.train.steps_per_rollout), "optimizer steps"):
            mine = chunks[m * per_step : (m + 1) * per_step]
            sums = self.algorithm.accumulate(self.policy, batch, mine, step_in_rollout=m)
            canary = sums.pop("log_prob_mean_abs_diff", None)
            if not self._all_finite(sums["loss"]):
                raise NonFiniteError(f"the loss is NaN or inf at step {self.step + 1}")
            maybe_inject_fault(self.rank, self.step + 1)
            grad_norm = self._clip_grad_norm()
            if not math.isfinite(grad_norm):  # the same on every rank: all stop together
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"the gradient norm is NaN or inf at step {self.step + 1}")
            lr = current_lr(self.optimizer)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self.ema is not None:
                self.ema.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            row = {**sums, "grad_norm": grad_norm, "lr": lr}
            if m == 0 and canary is not None:
                # The first step of a rollout runs with exactly the weights that sampled it.
                row["log_prob_mean_abs_diff"] = canary
            stats.append(self._mean_over_dp(row))
        return stats

    @contextlib.contextmanager
    def _reference_experts(self):
        """The reference (initial) policy's experts: the frozen copy, or the LoRA model with its
        adapters off for the duration of the context."""
        if self.reference is not None:
            yield self.reference
            return
        for t in self.model.transformers:
            t.disable_adapters()
        try:
            yield self.model.transformers
        finally:
            for t in self.model.transformers:
                t.enable_adapters()

    def _all_finite(self, value: float) -> bool:
        """Whether ``value`` is finite on every rank (so that all ranks stop together)."""
        flag = torch.tensor([0.0 if math.isfinite(value) else 1.0], device=self.device)
        dist.all_reduce(flag)
        return flag.item() == 0.0

    def _clip_grad_norm(self) -> float:
        params = [p for t in self.model.transformers for p in t.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _mean_over_dp(self, row: dict) -> dict:
        keys = sorted(row)
        t = torch.tensor([row[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.mesh.dp_group)
        return {k: v / self.mesh.dp_size for k, v in zip(keys, t.tolist())}

    # ------------------------------------------------------------------------------------------
    # checkpoints

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "rollout_index": self.rollout_index,
            "sampler": self.sampler.state_dict(),
            "world_size": self.world_size,
            "dp": self.dims.dp,
            "sp": self.dims.sp,
            "config": to_dict(self.cfg),
            "model_fingerprint": self.model_fingerprint,
            "prompt_fingerprint": self.prompt_fingerprint,
            **extra_state(self.lr_scheduler, self.algorithm, self.guard),
        }

    def save(self) -> None:
        path = save_checkpoint(
            self.run_dir,
            self.step,
            self.experts,
            self.optimizer,
            self._trainer_state(),
            self.cfg.train.keep_checkpoints,
            ema=self.ema,
            old_policy=self.old_policy,
        )
        self._saved_step = self.step
        print0(f"[miles] checkpoint saved: {path}{self._digest_note()}")

    def _digest_note(self) -> str:
        if not self.cfg.train.weight_digest:
            return ""
        return f" (weights sha256 {weights_digest(self.experts)})"

    def _resume(self, path: Path) -> None:
        if self.ema is not None and not has_ema(path):
            print0(f"[miles] {path} holds no EMA: the EMA starts from its weights")
        if self.old_policy is not None and not has_state(path, "old_policy"):
            print0(f"[miles] {path} holds no old policy: it starts from the checkpoint's weights")
        try:
            state = load_checkpoint(
                path, self.experts, self.optimizer, ema=self.ema, old_policy=self.old_policy
            )
        except CheckpointException as e:  # on every rank: DCP gathers the ranks' failures
            raise ValueError(
                f"the checkpoint {path} could not be loaded ({checkpoint_error_reason(e)}): it is damaged. "
                "Move it aside to resume from the previous one"
            ) from None
        if self.old_policy is not None and not has_state(path, "old_policy"):
            self.old_policy.soft_update(0.0)
        self.step, self.rollout_index = state["step"], state["rollout_index"]
        self.sampler.load_state_dict(state["sampler"])
        load_extra_state(state, self.lr_scheduler, self.algorithm, self.guard)
        self.logger.truncate_after(self.step)
        self._saved_step = self.step
        print0(
            f"[miles] resumed from {path} (step {self.step}, rollout {self.rollout_index}; saved at "
            f"dp {state['dp']} x sp {state['sp']}, now dp {self.dims.dp} x sp {self.dims.sp})"
            f"{self._digest_note()}"
        )

    def train(self) -> None:
        """Every rollout up to ``train.num_rollouts``, then the final evaluation, save and export.
        A SIGINT/SIGTERM stops it at the next safe point with a checkpoint (``self.stop``)."""
        cfg = self.cfg
        bar = tqdm(
            total=cfg.train.num_rollouts,
            initial=self.rollout_index,
            desc="rollouts",
            disable=not self.progress,
        )
        with self.stop:
            if self.rollout_index == 0:
                self.evaluate()  # the baseline
            while self.rollout_index < cfg.train.num_rollouts and not self.guard.stopped:
                if self.stop.requested() or not self._iteration():
                    break
                bar.update(1)
                if cfg.eval.every and self.rollout_index % cfg.eval.every == 0:
                    self.evaluate()
                every = cfg.train.checkpoint_every
                if every and self.rollout_index % every == 0 and self.rollout_index < cfg.train.num_rollouts:
                    self.save()
            bar.close()
            if self.stop.agreed:
                self._save_on_stop()
                return
            if self._eval_step != self.step:
                self.evaluate()
            if self._saved_step != self.step:
                self.save()
        if cfg.train.export:
            with self._averaged():
                out = export_pipeline(
                    cfg, self.model.path, list(self.model.transformers), self.run_dir / "export"
                )
            print0(f"[miles] exported the trained model to {out}")

    def _iteration(self) -> bool:
        """One rollout → reward → update → log; False when a stop request abandoned the rollout
        before it trained (the prompt sampler is then put back: the resumed run redoes it)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sampler_state = self.sampler.state_dict()
        t0 = time.perf_counter()
        try:
            batch = self.rollout()
            if self.stop.requested():
                raise StopRequested
        except StopRequested:
            self.sampler.load_state_dict(sampler_state)
            return False
        t1 = time.perf_counter()
        try:
            scores = self.score(batch)
            t2 = time.perf_counter()
            step_stats = self.train_on(batch)
            after = self.algorithm.after_rollout(self.policy, self.step)
        except NonFiniteError as e:
            if (failure := self.rewards.agreed_failure(self.device)) is not None:
                self.sampler.load_state_dict(sampler_state)  # the resumed run redoes this rollout
                if self._saved_step != self.step and self.step > 0:
                    self.save()
                raise reward_failed(failure, self.step, last_good_checkpoint(self.run_dir)) from None
            # Nothing of this rollout is saved: the last complete checkpoint stays the good one.
            last = last_good_checkpoint(self.run_dir)  # verified: a corrupt one is never named good
            raise NonFiniteError(
                f"{e}. Stopped without saving; the last good checkpoint is {last or 'none (none was saved)'}"
            ) from None
        t3 = time.perf_counter()
        self._log(batch, scores, step_stats, after, t1 - t0, t2 - t1, t3 - t2)
        self.rollout_index += 1
        return True

    def _save_on_stop(self) -> None:
        """The stop request's checkpoint (unless this step is saved already, or nothing has trained
        yet) and how to resume."""
        if self._saved_step != self.step and self.step > 0:
            self.save()
        n = self.cfg.train.num_rollouts
        print0(stopped_line(self.run_dir, self.stop.name, self.step, self.rollout_index, n, sys.argv[1:]))

    def _averaged(self):
        """The EMA weights in place of the trained ones (``train.ema_decay``), else nothing."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    def evaluate(self) -> None:
        """Sample the held-out prompts deterministically, score them with every reward, log
        ``eval/<reward>/mean`` (``eval.jsonl``, wandb) and write ``<run>/eval/step_N.{json,mp4}``."""
        cfg = self.cfg
        if not self.eval_prompts:
            return
        t0 = time.perf_counter()
        settings = eval_settings(cfg, self.model)
        self.prompt_cache.prepare(self.eval_prompts)  # one encoder visit for every held-out prompt

        def gather(experts):
            return unsharded_for_rollout(
                experts,
                enabled=cfg.parallel.rollout_unsharded,
                reshard_after_forward=cfg.parallel.reshard_after_forward,
            )

        with self._averaged():
            result = evaluate(
                self.model,
                EvalRewards(self.rewards, self.gold_rewards),
                self.eval_prompts,
                cfg.eval.num_seeds,
                settings,
                negative_prompt=cfg.data.negative_prompt,
                max_sequence_length=cfg.data.max_sequence_length,
                device=self.device,
                dp_rank=self.mesh.dp_rank,
                dp_size=self.mesh.dp_size,
                dp_group=self.mesh.dp_group,
                keep_videos=self.rank == 0 and cfg.eval.log_videos,
                images=self.eval_images,
                encode=lambda texts: (self.prompt_cache.embeds(texts), self.prompt_cache.negative()),
                gather=gather,
                progress=self.progress,
            )
        metrics = {
            **summarize(result),
            "rollout": self.rollout_index,
            "time/eval_s": time.perf_counter() - t0,
        }
        grid, caption = None, ""
        if self.rank == 0:
            grid = write_eval(result, self.run_dir / "eval", f"step_{self.step:06d}").get("video")
            caption = grid_caption(result, f"held-out, step {self.step}") if grid else ""
        self.logger.log_eval(metrics, step=self.step, grid=grid, caption=caption)
        self._eval_step = self.step
        print0(eval_line(self.step, metrics, len(result["prompts"])))
        react(self.guard, self.step, metrics, self.algorithm, self.cfg.train, self.run_dir, print0)

    def _log(
        self,
        batch: RolloutBatch,
        scores: Scores,
        step_stats: list[dict],
        after: dict,
        t_rollout: float,
        t_reward: float,
        t_train: float,
    ) -> None:
        rewards = scores.reward_all
        self.guard.train_reward(float(rewards.mean()))
        forwards = self.algorithm.forwards_per_sample(batch)
        samples = rewards.numel()
        metrics = {
            "rollout": self.rollout_index,
            **scores.summary(),
            "time/rollout_s": t_rollout,
            "time/reward_s": t_reward,
            "time/train_s": t_train,
            "time/step_s": t_train / len(step_stats),
            # every training forward (with or without gradient; CFG counts twice), per second
            "perf/train_tokens_per_s": samples * forwards * self.num_tokens / max(t_train, 1e-9),
            "memory/peak_gib": peak_memory_gib(self.device),
            **{f"train/{k}": v for k, v in after.items()},
        }
        metrics.update(scores.breakdown())
        for i, row in enumerate(step_stats):
            step = self.step - len(step_stats) + i + 1
            row_metrics = {f"train/{k}": v for k, v in row.items()}
            self.logger.log({**metrics, **row_metrics} if i == 0 else row_metrics, step=step)
        shown = rewards if self.algorithm.uses_rewards else None  # SFT scores nothing: its loss
        print0(rollout_line(self.rollout_index, self.step, shown, step_stats[0], t_train / len(step_stats)))
        if self._logs_videos(self.rollout_index) and scores.videos is not None:
            # rank 0's decoded samples: with sp > 1, every sp-th micro-batch of its dp rank
            self.logger.log_videos(scores.videos, scores.video_prompts, scores.video_rewards, step=self.step)

    def close(self) -> None:
        if self.decode_ahead is not None:
            self.decode_ahead.close()
        self.logger.close()
