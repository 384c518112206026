"""The `rlpost` command line.

Exit codes (a DESIGN.md contract): 0 success; 2 a config or input error, printed as one line that
names the offending key or file (no traceback); 1 any other failure, with its cause.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from rlpost.config import ConfigError, load_config

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"rlpost: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("rlpost: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the CLI's last line of defence: say what failed, exit 1
        if os.environ.get("RLPOST_DEBUG"):
            raise
        print(f"rlpost: failed: {type(exc).__name__}: {exc} (set RLPOST_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_FAILURE


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlpost",
        description="Ray-native RL post-training (GRPO) of LLMs with vLLM inference workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="run a training job from a YAML config",
        description="Run a training job. Overrides use dotted keys, e.g. trainer.steps=20 rollout.temperature=0.7.",
    )
    train.add_argument("config", help="YAML job config, e.g. configs/tiny-cpu.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    train.add_argument("--run-dir", help="run directory (default: <logging.run_dir>/<logging.run_name>)")
    train.add_argument("--address", help="Ray address of an existing cluster (overrides resources.address)")
    train.set_defaults(handler=_cmd_train)

    tiny = sub.add_parser(
        "make-tiny-model",
        help="build the offline tiny model (tokenizer + Qwen2 LM) used by the demo and tests",
        description="Build the offline tiny model into DIR; skipped when DIR already holds one built from the same spec (use --force).",
    )
    tiny.add_argument("dir", help="output folder, e.g. .cache/tiny-model")
    tiny.add_argument("--seed", type=int, default=0, help="seed (the same seed gives identical files)")
    tiny.add_argument("--force", action="store_true", help="rebuild even if DIR already holds a model")
    tiny.set_defaults(handler=_cmd_make_tiny_model)

    check = sub.add_parser(
        "check-config",
        help="validate a config (with overrides) and print the resolved YAML",
        description="Validate a config and its overrides and print the resolved config; exit 2 on an error.",
    )
    check.add_argument("config", help="YAML job config")
    check.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    check.set_defaults(handler=_cmd_check_config)

    plot = sub.add_parser(
        "plot",
        help="draw reward.png (reward and loss against step) from a run's metrics.jsonl",
        description="Read RUN_DIR/metrics.jsonl and write RUN_DIR/reward.png (or --out).",
    )
    plot.add_argument("run_dir", help="run directory holding metrics.jsonl")
    plot.add_argument("--out", help="output PNG path (default: RUN_DIR/reward.png)")
    plot.set_defaults(handler=_cmd_plot)
    return parser


def _load(args) -> "JobConfig":  # noqa: F821
    overrides = list(args.overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
    cfg = load_config(args.config, overrides)
    if getattr(args, "address", None):
        cfg.resources.address = args.address
    return cfg


def _cmd_check_config(args) -> int:
    import yaml

    cfg = _load(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


def _cmd_train(args) -> int:
    from rlpost.runs import check_inputs_exist, create_run_dir

    cfg = _load(args)
    check_inputs_exist(cfg)
    run_dir = create_run_dir(cfg, args.run_dir)
    print(f"rlpost: run directory {run_dir} (resolved config in {run_dir / 'config.yaml'})")
    from rlpost.controller import run_training

    # `ray job stop` and schedulers send SIGTERM: treat it like Ctrl-C so the controller stops
    # every actor (and its vLLM engine) instead of leaving them behind.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    return run_training(cfg, run_dir)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _cmd_plot(args) -> int:
    from rlpost.metrics import plot_metrics, read_metrics

    metrics = Path(args.run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"no metrics.jsonl in run directory {args.run_dir}")
    records = read_metrics(metrics)
    if not records:
        raise ConfigError(f"{metrics} holds no steps yet")
    out = plot_metrics(records, args.out or Path(args.run_dir) / "reward.png", title=Path(args.run_dir).name)
    print(f"rlpost: wrote {out} ({len(records)} steps)")
    return EXIT_OK


def _cmd_make_tiny_model(args) -> int:
    from rlpost.tiny_model import TinyModelSpec, build_tiny_model, ensure_tiny_model

    out, spec = Path(args.dir), TinyModelSpec(seed=args.seed)
    if args.force:
        build_tiny_model(out, spec)
    elif not ensure_tiny_model(out, spec):
        print(f"rlpost: tiny model already built at {out} (use --force to rebuild)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
