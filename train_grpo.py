"""GRPO fine-tuning of Wan video transformers with USP sequence parallelism and FSDP2.

    torchrun --nproc-per-node 4 train_grpo.py --config configs/tiny_cpu.yaml --sequence-parallel-size 2
    python train_grpo.py --config configs/wan2_1_t2v_1_3b.yaml --dry-run --world-size 8

See README.md for the recipes and ``--help`` for every option.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from miles.config import ConfigError, config_warnings, parse_args

# Seconds a rank other than 0 waits before it reports a user error and exits: when every rank
# refuses alike, rank 0 exits first and torchrun stops the rest, so the message appears once; when
# only some ranks refuse, they still speak (torchrun may have killed rank 0 already, or not).
OTHER_RANKS_REPORT_AFTER_S = 5.0


def report_user_error(error: Exception) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        time.sleep(OTHER_RANKS_REPORT_AFTER_S)
    print(f"error: {error}" if rank == 0 else f"error (rank {rank}): {error}", file=sys.stderr, flush=True)


def run_preflight_first(cfg) -> bool:
    """``--preflight``: every rank samples the prior and judges the reward alike (rank 0 prints the
    table) before any process group forms; False, with a message, when a trained reward has no signal."""
    from miles.console import configure_library_progress, show_progress
    from miles.preflight import has_signal, run_preflight

    rank0 = int(os.environ.get("RANK", "0")) == 0
    configure_library_progress(show_progress(cfg.run.progress) and rank0)
    report = run_preflight(cfg, say=print if rank0 else (lambda text: None))
    if has_signal(report, list(cfg.reward.weights)):
        return True
    if rank0:
        print("error: --preflight: a trained reward gives GRPO no signal (the table above)", file=sys.stderr)
    return False


def run_dry(cfg, world_size: int | None) -> int:
    """``--dry-run``: the plan, or the refusal the real run would give (exit code 2)."""
    from miles.train.dry_run import dry_run
    from miles.train.logging import configure_library_progress, show_progress

    configure_library_progress(show_progress(cfg.run.progress))  # no bars into a redirected log
    try:
        dry_run(cfg, world_size=world_size)  # its report lists the config warnings too
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def finished_early(cfg) -> int | None:
    """A relaunch of a finished run: say so before anything is built and return 0 (2: its directory
    is in use by another launch); None: there is work to do."""
    from miles.train.outcome import finished_at_launch

    try:
        note = finished_at_launch(cfg)
    except ValueError as e:
        report_user_error(e)
        return 2
    if note and int(os.environ.get("RANK", "0")) == 0:
        print(note, flush=True)
    return 0 if note else None


def parse_launch(argv: list[str]):
    """(config, launcher options, whether to run the reward preflight first) of ``argv``; None after
    printing why the flags are refused."""
    preflight = "--preflight" in argv  # the reward preflight first (miles/preflight.py)
    try:
        cfg, opts = parse_args([a for a in argv if a != "--preflight"])
        if opts.world_size is not None and not opts.dry_run:
            raise ConfigError(
                "--world-size is for --dry-run only; a real run takes its world size from torchrun "
                "(torchrun --nproc-per-node N train_grpo.py ...)"
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return cfg, opts, preflight


def main(argv: list[str] | None = None) -> int:
    parsed = parse_launch(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        return 2
    cfg, opts, preflight = parsed
    if opts.dry_run:
        return run_dry(cfg, opts.world_size)
    if int(os.environ.get("RANK", "0")) == 0:
        for warning in config_warnings(cfg):
            print(f"[miles] warning: {warning}", file=sys.stderr)

    from miles.train.checkpoint import CheckpointWriteError
    from miles.train.export import ExportWriteError
    from miles.train.outcome import finished_note, result_line
    from miles.train.reward_failure import RewardFailed

    if (code := finished_early(cfg)) is not None:
        return code
    if preflight and not run_preflight_first(cfg):
        return 2
    from miles.train.trainer import Trainer

    trainer, last_line = None, None
    try:
        try:
            trainer = Trainer(cfg)
        except (ValueError, FileNotFoundError) as e:
            # Bad input found before any rollout: the message names the fix.
            report_user_error(e)
            return 2
        rank0 = int(os.environ.get("RANK", "0")) == 0
        cfg_t, run_dir = cfg.train, trainer.run_dir
        if note := finished_note(
            run_dir, cfg_t.num_rollouts, cfg_t.export, trainer.rollout_index, trainer.step
        ):
            if rank0:  # a finished run: no second evaluation, no duplicate rows
                print(note, flush=True)
            return 0
        trainer.train()  # a SIGINT/SIGTERM ends it early with a checkpoint (miles/train/stop.py)
        if rank0 and not trainer.stop.agreed:  # printed last, after the logger closed (wandb's lines)
            uses_rewards = trainer.algorithm.uses_rewards
            last_line = result_line(run_dir, trainer.rollout_index, trainer.step, uses_rewards)
            last_line += f"; {trainer.guard.note}" if trainer.guard.note else ""  # train.guard fired
    except (CheckpointWriteError, ExportWriteError, RewardFailed) as e:  # raised on every rank
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop's safe points (while loading or exporting).
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                "[miles] interrupted while loading or exporting: nothing more was saved (complete "
                "checkpoints are kept; relaunch to resume)",
                file=sys.stderr,
            )
        return 130
    except (RuntimeError, dist.DistBackendError) as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            print(
                f"[miles] a collective did not complete within run.collective_timeout_s = "
                f"{cfg.run.collective_timeout_s:g} s: a rank died or hung. Resume from the last complete "
                f"checkpoint under {cfg.run.output_dir}/{cfg.run.name}/checkpoints by relaunching.",
                file=sys.stderr,
            )
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if last_line:
        print(last_line, flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if code == 0 and (finished := os.environ.get("MILES_FINISHED_DIR")):
        # Testing hook: this rank's work is done; a failure after this is a teardown failure.
        os.makedirs(finished, exist_ok=True)
        open(os.path.join(finished, f"rank{os.environ.get('RANK', '0')}"), "w").close()
    # Leave without interpreter finalization. Objects that outlive destroy_process_group (the
    # device mesh, FSDP state) keep gloo's process groups alive, and their worker threads can then
    # free tensors while the interpreter is being torn down: a rare "terminate called without an
    # active exception" (SIGABRT) after a finished run, which torchrun reports as a failure
    # (pytorch/pytorch#179291). Everything was written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
