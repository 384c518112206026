"""The `rlpost` command line.

Exit codes (a contract scripts and CI rely on): 0 success; 2 a config or input error (one line
naming the key or file, no traceback; also an unknown job id); 1 any other failure, with its cause
(also a job that failed or was stopped, and an unreachable or refusing cluster, named by address).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlpost.config import ConfigError, JobConfig, check_overrides, load_config, resolve_local_paths
from rlpost.ops.cluster_commands import add_job_commands, add_scale_command
from rlpost.ops.commands import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, config_or_override
from rlpost.ops.jobs import ClusterError, JobNotFoundError
from rlpost.runtime.shutdown import StopRequested, exit_code, in_own_session, run_in_own_session


def main(argv: list[str] | None = None) -> int:
    if argv is None and _shield_local_cluster(sys.argv[1:]):
        # `rlpost train` or `rlpost serve` from a shell starting a local cluster: the driver runs in a
        # session of its own, out of reach of the signals a terminal or scheduler sends a whole
        # process group
        return run_in_own_session(sys.argv[1:])
    parser = _build_parser()
    args = parser.parse_args(argv)
    args.command_line = argv is None  # this process is the command (not a caller's in-process call)
    try:
        return args.handler(args)
    except (ConfigError, JobNotFoundError) as exc:
        print(f"rlpost: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ClusterError as exc:
        print(f"rlpost: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except StopRequested as stop:  # `rlpost train` stopped cleanly on SIGTERM / Ctrl-C
        print(f"rlpost: stopped by {stop.signal_name}", file=sys.stderr)
        return exit_code(stop)
    except KeyboardInterrupt:
        print("rlpost: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the CLI's last line of defence: say what failed, exit 1
        if os.environ.get("RLPOST_DEBUG"):
            raise
        print(f"rlpost: failed: {type(exc).__name__}: {exc} (set RLPOST_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_FAILURE


def _shield_local_cluster(argv: list[str]) -> bool:
    """Whether this is a ``train`` or ``serve`` starting a local Ray cluster on POSIX, in a driver
    not already in a session of its own (:func:`rlpost.runtime.shutdown.run_in_own_session`)."""
    return (
        bool(argv)
        and argv[0] in ("train", "serve")
        and "--address" not in argv
        and not any(arg.startswith("--address=") for arg in argv)
        and not os.environ.get("RAY_ADDRESS")
        and os.name == "posix"
        and not in_own_session()
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlpost",
        description="Ray-native RL post-training (GRPO) of LLMs with vLLM inference workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="run a training job from a YAML config",
        description="Run a training job. Overrides use dotted keys, e.g. trainer.steps=20 rollout.temperature=0.7. "
        "`rlpost train --resume RUN_DIR [key=value ...]` continues a run after its latest checkpoint "
        "(with the run's config.yaml unless CONFIG is given; e.g. trainer.steps=1000 extends it).",
    )
    train.add_argument("config", nargs="?", help="YAML job config, e.g. configs/tiny-cpu.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    train.add_argument("--run-dir", help="run directory (default: <logging.run_dir>/<logging.run_name>)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its latest checkpoint")
    train.add_argument("--address", help="Ray address of an existing cluster (overrides resources.address)")
    train.set_defaults(handler=_cmd_train)

    tiny = sub.add_parser(
        "make-tiny-model",
        help="build the offline tiny model (tokenizer + Qwen2 LM) used by the demo and tests",
        description="Build the offline tiny model into DIR; skipped when DIR already holds one built from the same spec "
        "(use --force). The repository ships the result in models/ (models/README.md): rebuild there only when the "
        "spec changes, then record the digests in models/SHA256SUMS.",
    )
    tiny.add_argument("dir", help="output folder, e.g. models/tiny-model")
    tiny.add_argument("--seed", type=int, default=0,
                      help="seed (the same seed gives identical files on the same kind of CPU)")  # fmt: skip
    tiny.add_argument("--force", action="store_true", help="rebuild even if DIR already holds a model")
    tiny.add_argument("--task", choices=["arithmetic", "tool_arithmetic"], default="arithmetic",
                      help="arithmetic: the default model (a + b, answers at once); tool_arithmetic: the variant "
                      "warm-started to sometimes compute a * b with a ```python block")  # fmt: skip
    tiny.set_defaults(handler=_cmd_make_tiny_model)

    tiny_rm = sub.add_parser(
        "make-tiny-reward-model",
        help="build the offline tiny reward model (a one-label classifier on the tiny LM) for reward_model tests",
        description="Train the tiny reward model into DIR from the tiny LM in --lm (~15 s on 2 cores): the LM's trunk "
        "with a score head, regressed on the arithmetic task's rule reward of right, wrong and untagged answers. "
        "Skipped when DIR holds one of the same recipe built from the same LM (use --force). The repository ships "
        "the result in models/tiny-reward-model (models/README.md).",
    )
    tiny_rm.add_argument("dir", help="output folder, e.g. models/tiny-reward-model")
    tiny_rm.add_argument("--lm", default="models/tiny-model", help="the tiny LM to start from (make-tiny-model's DIR)")
    tiny_rm.add_argument("--force", action="store_true", help="rebuild even if DIR already holds a model")
    tiny_rm.set_defaults(handler=_cmd_make_tiny_reward_model)

    check = sub.add_parser(
        "check-config",
        help="validate a config (with overrides) and print the resolved YAML",
        description="Validate a config and its overrides and print the resolved config; exit 2 on an error.",
    )
    check.add_argument("config", help="YAML job config")
    check.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    check.set_defaults(handler=_cmd_check_config)

    evaluate = sub.add_parser(
        "eval",
        help="score a checkpoint on held-out prompts, as a run's evaluation does (eval section of the config)",
        description="Score TARGET (a run directory: its latest checkpoint; or a checkpoint folder) on the eval "
        "split with a vLLM engine in this process, and print eval_reward_mean, eval_pass_at_1 (eval_pass_at_k "
        "when eval.samples_per_prompt > 1) and eval_length_mean as JSON. The config is CONFIG or the run's "
        "config.yaml, plus key=value overrides (e.g. eval.num_prompts=200).",
    )
    evaluate.add_argument("target", metavar="RUN_DIR|CHECKPOINT", help="run directory or checkpoint folder")
    evaluate.add_argument("config", nargs="?", help="YAML job config (default: the run's config.yaml)")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    evaluate.add_argument("--out", help="also write the result as JSON to this file")
    evaluate.set_defaults(handler=_cmd_eval)

    plot = sub.add_parser(
        "plot",
        help="draw a run's figures (reward, KL, length, staleness, step time) from its metrics.jsonl",
        description="Read RUN_DIR/metrics.jsonl and write RUN_DIR/reward.png (or --out) and, beside it in "
        "RUN_DIR, kl.png, length.png, staleness.png and step_time.png; a figure whose metrics the run "
        "lacks is skipped. Prints every path written.",
    )
    plot.add_argument("run_dir", help="run directory holding metrics.jsonl")
    plot.add_argument("--out", help="reward.png's path (default: RUN_DIR/reward.png); the others stay in RUN_DIR")
    plot.set_defaults(handler=_cmd_plot)
    add_job_commands(sub)
    add_scale_command(sub)
    _add_doctor_command(sub)
    _add_monitor_command(sub)
    _add_serve_command(sub)
    return parser


def _add_serve_command(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the Tinker API (the official tinker SDK, tinker-cookbook) over a fleet on the Ray cluster",
        description="Start a long-lived service: a trainer holding the base model and each client's LoRA adapter, "
        "and vLLM inference workers sampling with them, behind the Tinker API at http://HOST:PORT/api/v1 "
        "(docs/service.md). CONFIG is a serve config (rlpost.config.ServeConfig; configs/serve-tiny-cpu.yaml), "
        "key=value overrides on top. API keys come from api_keys_file or $RLPOST_SERVE_API_KEYS (tenant=key,...). "
        "Ctrl-C or SIGTERM stops it.",
    )
    serve.add_argument("config", nargs="?", help="YAML serve config (default: every default)")
    serve.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. port=8080")
    serve.add_argument("--address", help="Ray address of an existing cluster (overrides resources.address)")
    serve.add_argument("--host", help="interface to listen on (overrides host)")
    serve.add_argument("--port", type=int, help="TCP port (overrides port; 0: any free port)")
    serve.set_defaults(handler=_cmd_serve)


def _cmd_serve(args) -> int:
    from rlpost.config import ServeConfig
    from rlpost.serve.server import run_server

    config_or_override(args)
    cfg = load_config(args.config, list(args.overrides), schema=ServeConfig)
    for key in ("address", "host", "port"):
        value = getattr(args, key)
        if value is not None:
            if key == "address":
                cfg.resources.address = value
            else:
                setattr(cfg, key, value)
    return run_server(cfg)


def _load(args) -> JobConfig:
    cfg = load_config(args.config, list(args.overrides))
    if getattr(args, "address", None):
        cfg.resources.address = args.address
    return cfg


def _cmd_check_config(args) -> int:
    import yaml

    cfg = _load(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


def _cmd_train(args) -> int:
    from rlpost.record.run_dir import check_inputs_exist, create_run_dir, open_run_for_resume

    config_or_override(args)
    if args.resume:
        if args.run_dir:
            raise ConfigError("--resume RUN_DIR and --run-dir cannot be combined: a resumed run stays in its folder")
        check_overrides(args.overrides)
        cfg = open_run_for_resume(args.resume, args.config, args.overrides)
        if args.address:
            cfg.resources.address = args.address
        run_dir = Path(args.resume)
        print(f"rlpost: resuming {run_dir} from its latest checkpoint")
    else:
        if not args.config:
            raise ConfigError("train needs a CONFIG file (or --resume RUN_DIR)")
        cfg = _load(args)
        run_dir = None
    _resolve_paths_for_a_cluster(cfg)
    if args.command_line and os.environ.get("PYTHONHASHSEED") != str(cfg.resources.python_hash_seed):
        _start_again_with_hash_seed(cfg.resources.python_hash_seed)
    check_inputs_exist(cfg)
    if run_dir is None:
        run_dir = create_run_dir(cfg, args.run_dir)
        print(f"rlpost: run directory {run_dir} (resolved config in {run_dir / 'config.yaml'})")
    from rlpost.service.run import run_training

    # `ray job stop` and schedulers send SIGTERM: run_training turns it (and Ctrl-C) into a clean
    # stop that writes a final checkpoint and stops every actor (rlpost.runtime.shutdown)
    return run_training(cfg, run_dir, resume=bool(args.resume))


def _start_again_with_hash_seed(seed: int) -> None:
    """Run this command line again, in this process, with PYTHONHASHSEED=``seed`` (read once, at
    start): the driver must hash strings as the run's actors do (it draws the held-out rows they
    must never train on). Nothing was started yet."""
    argv = [sys.executable, "-m", "rlpost.ops.cli", *sys.argv[1:]]
    sys.stdout.flush()
    os.execve(sys.executable, argv, {**os.environ, "PYTHONHASHSEED": str(seed)})


def _resolve_paths_for_a_cluster(cfg: JobConfig) -> None:
    """On an existing cluster the actors do not start in this directory: resolve the config's
    relative local paths here (the resolved config records them). Not in a Ray job with a working
    dir (``rlpost submit``), where every actor starts in its copy of it."""
    import json

    if not (cfg.resources.address or os.environ.get("RAY_ADDRESS")):
        return
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    if (job.get("runtime_env") or {}).get("working_dir"):
        return
    for key, (written, absolute) in resolve_local_paths(cfg, Path.cwd()).items():
        print(f"rlpost: {key}={written} is relative: the cluster's actors read {absolute}")


def _cmd_plot(args) -> int:
    from rlpost.record.metrics import plot_run, read_metrics

    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"no metrics.jsonl in run directory {args.run_dir}")
    records = read_metrics(metrics)
    if not records:
        raise ConfigError(f"{metrics} holds no steps yet")
    for out in plot_run(records, run_dir, title=run_dir.name, reward_path=args.out):
        print(f"rlpost: wrote {out} ({len(records)} steps)")
    return EXIT_OK


def _cmd_eval(args) -> int:
    import json

    from rlpost.service.evaluation import evaluate_checkpoint

    config_or_override(args)
    check_overrides(args.overrides)
    checkpoint, metrics = evaluate_checkpoint(args.target, args.config, args.overrides)
    result = {"checkpoint": str(checkpoint), **metrics}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return EXIT_OK


def _cmd_make_tiny_model(args) -> int:
    from rlpost.tiny.spec import TinyModelSpec, built_spec, spec_dict

    out, spec = Path(args.dir), TinyModelSpec.for_task(args.task, seed=args.seed)
    if not args.force and built_spec(out) == spec_dict(spec):  # checked before torch is imported
        print(f"rlpost: tiny model already built at {out} (use --force to rebuild)")
        return EXIT_OK
    _idle_openmp_threads_sleep()
    from rlpost.tiny.model import build_tiny_model, ensure_tiny_model

    if args.force:
        build_tiny_model(out, spec)
    else:
        ensure_tiny_model(out, spec)
    return EXIT_OK


def _idle_openmp_threads_sleep() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless set (read once, when torch loads: call before the build
    imports torch), so a tiny model's build has its idle OpenMP threads sleep, not spin.

    Trap: the builds train a 1M-parameter model on 2 threads (thousands of tiny parallel regions);
    a spinning idle thread fights any other busy process for a 2-core machine: measured on a
    2-core Xeon, 22 s alone and 257 s beside one busy process; sleeping threads take 31 s and
    41 s. Threads and work are unchanged, so the files are byte for byte the same.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cmd_make_tiny_reward_model(args) -> int:
    if not (Path(args.lm) / "config.json").is_file():
        raise ConfigError(f"--lm {args.lm}: no tiny LM there; build it first with `rlpost make-tiny-model {args.lm}`")
    _idle_openmp_threads_sleep()
    from rlpost.tiny.reward_model import build_tiny_reward_model, ensure_tiny_reward_model

    if args.force:
        build_tiny_reward_model(args.dir, args.lm)
    elif not ensure_tiny_reward_model(args.dir, args.lm):
        print(f"rlpost: tiny reward model already built at {args.dir} (use --force to rebuild)")
    return EXIT_OK


# ------------------------------------------------------------------------------ doctor


def _add_doctor_command(sub) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check versions, devices, Ray auth and (given a config) that its model and tokenizer load",
        description="Print Python/torch/vLLM/Ray/transformers/tensordict/pydantic/datasets versions, known-bad version "
        "combinations, CPUs and GPUs, the Ray authentication this machine would use, and with CONFIG whether its model "
        "config, tokenizer and local dataset load. Exit 1 when a check fails.",
    )
    doctor.add_argument("config", nargs="?", help="YAML job config to check (optional)")
    doctor.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    doctor.add_argument("--address", help="also compare Ray versions with the cluster at this dashboard address")
    doctor.set_defaults(handler=_cmd_doctor)


def _cmd_doctor(args) -> int:
    from rlpost.ops.doctor import print_checks, run_checks

    cfg = load_config(args.config, args.overrides) if args.config else None
    address = None
    if args.address:
        from rlpost.ops.jobs import resolve_address

        address = resolve_address(args.address)
    checks = run_checks(cfg, address=address)
    print_checks(checks)
    return EXIT_FAILURE if any(c.status == "fail" for c in checks) else EXIT_OK


# ------------------------------------------------------------------------------ monitor


def _add_monitor_command(sub) -> None:
    monitor = sub.add_parser(
        "monitor",
        help="start Prometheus (and Grafana, where installed) with rlpost's alerts and dashboard; Ctrl-C stops them",
        description="Start the prometheus binary on 127.0.0.1:PORT, scraping every node of the local Ray cluster "
        "(Ray's node list in RAY_TEMP_DIR) with rlpost's alert rules; copy rlpost's Grafana dashboard beside Ray's "
        "own and start Grafana on port 3000 when a grafana binary is on PATH. Prints the URLs and waits; Ctrl-C or "
        "SIGTERM stops what it started. Exit 2 when Prometheus is not installed or its port is taken.",
    )
    monitor.add_argument("run_dir", nargs="?", type=Path,
                         help="a run directory: its URLs are printed, its data kept in RUN_DIR/prometheus")  # fmt: skip
    monitor.add_argument("--port", type=int, default=9090, help="Prometheus's port (default 9090, where Ray looks)")
    monitor.add_argument("--scrape-interval", type=float, default=10.0, metavar="S", help="seconds (default 10)")
    monitor.add_argument("--ray-temp-dir", type=Path, help="the cluster's --temp-dir (default: Ray's, /tmp/ray)")
    monitor.add_argument(
        "--data-dir", type=Path, help="Prometheus's data (default RUN_DIR/prometheus or a temporary one)"
    )
    monitor.add_argument(
        "--prometheus", default="prometheus", help="the Prometheus binary (default: prometheus on PATH)"
    )
    monitor.add_argument("--no-grafana", action="store_true", help="do not start Grafana even when it is installed")
    monitor.add_argument(
        "--grafana-port", type=int, default=3000, help="Grafana's port (default 3000, where Ray looks)"
    )
    monitor.add_argument(
        "--stall-after", type=float, default=600.0, metavar="S",
        help="seconds without a learner step before RlpostNoLearnerStep fires (default 600)",
    )  # fmt: skip
    monitor.set_defaults(handler=_cmd_monitor)


def _cmd_monitor(args) -> int:
    from rlpost.ops.dashboards import AlertSettings
    from rlpost.ops.prometheus import MonitorSettings, default_ray_temp_dir, run_monitor

    if args.run_dir is not None and not args.run_dir.is_dir():
        raise ConfigError(f"run directory {args.run_dir} does not exist")
    for option, port in (("--port", args.port), ("--grafana-port", args.grafana_port)):
        if not 0 < port < 65536:
            raise ConfigError(f"{option} {port} is not a TCP port")
    if args.scrape_interval < 1 or args.stall_after <= 0:
        raise ConfigError("--scrape-interval must be at least 1 s and --stall-after above 0")
    settings = MonitorSettings(
        run_dir=args.run_dir, port=args.port, scrape_interval_s=args.scrape_interval,
        ray_temp_dir=args.ray_temp_dir or default_ray_temp_dir(), data_dir=args.data_dir, prometheus=args.prometheus,
        grafana=None if args.no_grafana else "grafana", grafana_port=args.grafana_port,
        alerts=AlertSettings(stall_after_s=args.stall_after),
    )  # fmt: skip
    return run_monitor(settings, say=lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
