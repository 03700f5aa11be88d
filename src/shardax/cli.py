"""The ``shardax`` command: ``train``, ``generate``, ``launch`` and ``plan``.

    shardax train --mesh dp=2,fsdp=2,tp=2 --steps 200 --out runs/a
    shardax plan --model llama-8b --devices 64 --hbm 80GiB --search
    shardax generate --out runs/a --prompt "def "
    shardax launch --nproc 2 --devices-per-proc 4 -- shardax train --out runs/b

Arguments are read before JAX starts a backend, because ``--devices`` (emulated CPU devices
when there is no accelerator) must be set before that. Bad input is one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

__all__ = ["main"]

# Set by `shardax launch` for its workers; takes precedence over --devices.
DEVICES_ENV = "SHARDAX_DEVICES_PER_PROCESS"


def _set_devices(count: int) -> None:
    """Emulates ``count`` CPU devices. The flag only affects the CPU platform, so on a machine
    with GPUs or TPUs they are used as they are."""
    count = int(os.environ.get(DEVICES_ENV, count))
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])


def _train_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``shardax train`` (``shardax plan`` takes them too): TrainConfig's fields."""
    from shardax.train.loop import TrainConfig

    defaults = TrainConfig()
    p.add_argument("--model", default=defaults.model, help="model name (default %(default)s)")
    p.add_argument("--mesh", default=defaults.mesh,
                   help="mesh axes out of dp, fsdp, tp, pp, cp, ep, e.g. fsdp=-1 or "
                        "pp=2,fsdp=2,tp=2 (default %(default)s)")
    p.add_argument("--rules", default=defaults.rules,
                   help="rule preset: dp, fsdp, tp, fsdp_tp, nd; pp/cp/ep axes are added "
                        "to any of them (default %(default)s)")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--precision", default=defaults.precision,
                   help="float32, bfloat16 or params=float32,compute=bfloat16,output=float32")
    p.add_argument("--remat", default=defaults.remat, help="none, full, save_dots, offload")
    p.add_argument("--scan-layers", action="store_true",
                   help="stack the layers and run them in a scan (faster compiles)")
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--optimizer", default=defaults.optimizer, choices=["adamw", "sgd"])
    p.add_argument("--tp-mode", default=defaults.tp_mode,
                   choices=["none", "sync", "async", "async_bidi"],
                   help="tensor parallelism over 'tp': none (XLA, from --rules), sync "
                        "(Megatron), async / async_bidi (collective matmul; implies "
                        "--sequence-parallel) (default %(default)s)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism over 'tp' (sync TP if no --tp-mode)")
    p.add_argument("--pp-schedule", default=defaults.pp_schedule,
                   choices=["gpipe", "circular", "1f1b"],
                   help="pipeline schedule over 'pp' (1f1b: activation memory bounded "
                   "by the 'pp' size, not the microbatch count)")
    p.add_argument("--microbatches", type=int, default=defaults.microbatches,
                   help="pipeline microbatches (default: the 'pp' size)")
    p.add_argument("--virtual-stages", type=int, default=defaults.virtual_stages,
                   help="layer chunks per pipeline stage (circular schedule)")
    p.add_argument("--out", default=defaults.out, help="run directory (default %(default)s)")
    p.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out (any --mesh)")
    p.add_argument("--log-every", type=int, default=defaults.log_every)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--data", nargs="+", default=[], metavar="PATH",
                   help="text files or directories (default: the Python standard library)")
    p.add_argument("--log-to", default=defaults.log_to,
                   help="metrics trackers, comma-separated: jsonl (always on), tensorboard, "
                        "wandb (offline unless WANDB_MODE is set) (default %(default)s)")
    p.add_argument("--profile-steps", default=defaults.profile_steps, metavar="START:STOP",
                   help="write a jax.profiler trace of steps START..STOP-1 into "
                        "<out>/profile, e.g. 10:13")
    p.add_argument("--peak-tflops", type=float, default=defaults.peak_tflops,
                   help="peak TFLOP/s per device for MFU (default: from the device table; "
                        "MFU is n/a on CPU)")



def _plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=8,
                   help="emulated CPU devices to plan for (default 8; up to hundreds)")
    p.add_argument("--target", default=None,
                   help="device whose peak FLOP/s, memory and link bandwidth the estimate uses, "
                        "e.g. h100, h200, a100, b200, 'tpu v5p' (default: this machine's "
                        "accelerator, else h100)")
    p.add_argument("--hbm", default=None,
                   help="memory per device, e.g. 80GiB or 94GB (default: the target's)")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="one-way link bandwidth per device in GB/s (default: the target's)")
    p.add_argument("--search", action="store_true",
                   help="search meshes, remat, scan and microbatching for the fastest layout "
                        "that fits (model, batch, sequence, precision and optimizer stay)")
    p.add_argument("--top", type=int, default=5, help="layouts to print with --search")
    p.add_argument("--max-compiles", type=int, default=16,
                   help="layouts compiled with --search, analytically best first")
    p.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds --search may spend compiling (default %(default)s)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes compiling in parallel with --search")
    p.add_argument("--cache", default=None,
                   help="directory of compiled-layout results (default ~/.cache/shardax/plan; "
                        "'none' to disable)")
    p.add_argument("--json", default=None, help="also write the result here as JSON")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a byte-level language model, sharded")
    _train_flags(train)
    train.add_argument("--devices", type=int, default=8,
                       help="emulated CPU devices when there is no accelerator (default 8)")
    plan = sub.add_parser(
        "plan", help="compile a train configuration abstractly: memory, collectives, step "
                     "time; --search finds the fastest layout that fits")
    _train_flags(plan)
    _plan_flags(plan)

    generate = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    generate.add_argument("--out", required=True, help="run directory of a shardax train run")
    generate.add_argument("--prompt", default="", help="text to continue")
    generate.add_argument("--max-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--devices", type=int, default=1)

    launch = sub.add_parser(
        "launch", help="run N local processes of a command as one multi-process JAX job",
        usage="shardax launch --nproc N [--devices-per-proc K] [--port P] -- COMMAND ...")
    launch.add_argument("--nproc", type=int, required=True, help="number of processes")
    launch.add_argument("--devices-per-proc", type=int, default=None,
                        help="emulated CPU devices per process (overrides train's --devices)")
    launch.add_argument("--port", type=int, default=None,
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    launch.add_argument("--timeout", type=float, default=None,
                        help="seconds processes wait for each other to join (default 60)")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the program to run, e.g. shardax train ...")
    return parser


def _launch(args: argparse.Namespace) -> int:
    from shardax.launch import launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return launch(command, args.nproc, devices_per_proc=args.devices_per_proc,
                      port=args.port, timeout_s=args.timeout)
    except ValueError as e:
        print(f"shardax {e}", file=sys.stderr)
        return 2


class _StdoutHandler(logging.StreamHandler):
    """Status messages to whatever ``sys.stdout`` is when they are written."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _setup_logging() -> None:
    """``shardax`` status messages (logger ``shardax``) as plain lines on stdout, once."""
    logger = logging.getLogger("shardax")
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # absl may have configured the root logger too


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging()
    if args.command == "launch":
        return _launch(args)
    if args.command == "plan":
        os.environ["JAX_PLATFORMS"] = "cpu"  # planning compiles for emulated devices
        _set_devices(args.devices)
        from shardax.plan.command import run_plan
        from shardax.train.loop import UsageError

        try:
            return run_plan(args)
        except UsageError as e:
            print(f"shardax plan: error: {e}", file=sys.stderr)
            return 2
    _set_devices(args.devices)
    from shardax import distributed

    if distributed.requested():  # under `shardax launch`, or SHARDAX_DISTRIBUTED=auto
        try:
            distributed.initialize()
        except (ValueError, distributed.DistributedError) as e:
            print(f"shardax {args.command}: error: {e}", file=sys.stderr)
            return 1
    from shardax.train.loop import TrainConfig, UsageError, generate, train

    try:
        if args.command == "train":
            fields = {k: v for k, v in vars(args).items() if k not in ("command", "devices")}
            train(TrainConfig(**fields))
        elif args.command == "generate":
            print(generate(args.out, args.prompt, args.max_tokens, args.temperature, args.seed))
    except UsageError as e:
        print(f"shardax {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
