"""The `rlpost` command line.

Exit codes (a contract scripts and CI rely on): 0 success; 2 a config or input error, printed as one line that
names the offending key or file (no traceback); 1 any other failure, with its cause. For the Ray
Jobs commands a job that failed or was stopped is a failure (1), an unknown job id an input error
(2), and an unreachable or refusing cluster a failure (1) named by its address.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlpost.config import ConfigError, JobConfig, check_overrides, load_config, resolve_local_paths
from rlpost.ops.jobs import ClusterError, JobNotFoundError
from rlpost.runtime.shutdown import StopRequested, exit_code, in_own_session, run_in_own_session

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    if argv is None and _shield_local_cluster(sys.argv[1:]):
        # `rlpost train` from a shell starting a local cluster: the driver runs in a session of its
        # own, out of reach of the signals a terminal or scheduler sends a whole process group
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
    """Whether this command line is a ``train`` that starts a local Ray cluster (no --address,
    no RAY_ADDRESS) on a POSIX system, in a driver not already in a session of its own
    (:func:`rlpost.runtime.shutdown.run_in_own_session`)."""
    return (
        bool(argv)
        and argv[0] == "train"
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
    tiny.add_argument(
        "--seed", type=int, default=0, help="seed (the same seed gives identical files on the same kind of CPU)"
    )
    tiny.add_argument("--force", action="store_true", help="rebuild even if DIR already holds a model")
    tiny.add_argument(
        "--task",
        choices=["arithmetic", "tool_arithmetic"],
        default="arithmetic",
        help="arithmetic: the default model (a + b, answers at once); tool_arithmetic: the variant "
        "warm-started to sometimes compute a * b with a ```python block",
    )
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
    _add_job_commands(sub)
    _add_scale_command(sub)
    _add_doctor_command(sub)
    _add_monitor_command(sub)
    return parser


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

    _config_or_override(args)
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
    from rlpost.service.loop import run_training

    # `ray job stop` and schedulers send SIGTERM: run_training turns it (and Ctrl-C) into a clean
    # stop that writes a final checkpoint and stops every actor (rlpost.runtime.shutdown)
    return run_training(cfg, run_dir, resume=bool(args.resume))


def _start_again_with_hash_seed(seed: int) -> None:
    """Run this command line again, in this process, with PYTHONHASHSEED=``seed``: Python reads it
    once, at start, and the driver must hash strings as the run's actors do (it draws the held-out
    rows that the actors must never train on). Nothing was started yet."""
    argv = [sys.executable, "-m", "rlpost.ops.cli", *sys.argv[1:]]
    sys.stdout.flush()
    os.execve(sys.executable, argv, {**os.environ, "PYTHONHASHSEED": str(seed)})


def _resolve_paths_for_a_cluster(cfg: JobConfig) -> None:
    """On an existing cluster (``--address``, ``resources.address``, RAY_ADDRESS) the actors do
    not start in this directory: a relative local path of the config resolves against it here,
    and the resolved config records where it pointed. Not in a Ray job with a working dir
    (``rlpost submit``): there every actor starts in its copy of that dir, where relative paths
    resolve as written."""
    import json

    if not (cfg.resources.address or os.environ.get("RAY_ADDRESS")):
        return
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    if (job.get("runtime_env") or {}).get("working_dir"):
        return
    for key, (written, absolute) in resolve_local_paths(cfg, Path.cwd()).items():
        print(f"rlpost: {key}={written} is relative: the cluster's actors read {absolute}")


def _config_or_override(args) -> None:
    """``--resume RUN_DIR key=value``: argparse took the first override for CONFIG."""
    if args.config and "=" in args.config and not Path(args.config).exists():
        args.overrides.insert(0, args.config)
        args.config = None


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

    _config_or_override(args)
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
    """Make torch's OpenMP threads sleep rather than spin when idle, for a tiny model's build
    (``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it; read once, when torch loads, so
    this runs before the build imports torch).

    The builds train a 1M-parameter model on 2 threads: thousands of tiny parallel regions, whose
    idle thread spins by default. With any other busy process on a 2-core machine the spinning
    thread and the working one fight for the cores: measured on a 2-core Xeon, the tiny model's
    build took 22 s alone and 257 s beside one busy process; sleeping threads take 31 s and 41 s.
    The threads' number and work are unchanged, so the files are byte for byte the same.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cmd_make_tiny_reward_model(args) -> int:
    from rlpost.config import ConfigError

    if not (Path(args.lm) / "config.json").is_file():
        raise ConfigError(f"--lm {args.lm}: no tiny LM there; build it first with `rlpost make-tiny-model {args.lm}`")
    _idle_openmp_threads_sleep()
    from rlpost.tiny.reward_model import build_tiny_reward_model, ensure_tiny_reward_model

    if args.force:
        build_tiny_reward_model(args.dir, args.lm)
    elif not ensure_tiny_reward_model(args.dir, args.lm):
        print(f"rlpost: tiny reward model already built at {args.dir} (use --force to rebuild)")
    return EXIT_OK


# ------------------------------------------------------------------------------ Ray Jobs


def _add_job_commands(sub) -> None:
    submit = sub.add_parser(
        "submit",
        help="submit a training job to a Ray cluster (Ray Jobs)",
        description="Validate CONFIG locally, then run `rlpost train CONFIG key=value ...` on the cluster as a Ray job. "
        "The rlpost checkout around the current directory is uploaded as the job's working dir (without .venv, .git, "
        "runs/, .cache/ and build outputs); resources.env_vars become the job's environment. Prints the job id and "
        "its dashboard URL.",
    )
    submit.add_argument(
        "config", nargs="?", help="YAML job config inside the working dir, e.g. configs/gsm8k-qwen2.5-1.5b.yaml"
    )
    submit.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    submit.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="run `rlpost train --resume RUN_DIR` instead (RUN_DIR: absolute, on storage the nodes share)",
    )
    upload = submit.add_mutually_exclusive_group()
    upload.add_argument(
        "--working-dir", help="folder to upload as the job's working dir (default: the rlpost checkout)"
    )
    upload.add_argument(
        "--no-working-dir",
        action="store_true",
        help="upload nothing: the cluster's image holds rlpost and CONFIG at the same relative path",
    )
    submit.add_argument(
        "--job-id",
        "--submission-id",
        dest="job_id",
        help="job id (default: rlpost-<logging.run_name>; a run name is chosen when the config has none)",
    )
    submit.add_argument(
        "--follow", action="store_true", help="then print the job's logs until it ends; exit with its result"
    )
    _add_cluster_arguments(submit)
    submit.set_defaults(handler=_cmd_submit)

    status = sub.add_parser(
        "status",
        help="print a Ray job's status, or a run's",
        description="Print a job's status and message (exit 0 pending/running/succeeded, 1 failed/stopped; with "
        "--fleet, a running job's inference workers and env pools as the run reports them), or, for a run directory, "
        "its last step, reward, inference workers, env pools and restarts.",
    )
    status.add_argument(
        "--fleet", action="store_true", help="a running job's fleet too (asked by a short job beside it: a few seconds)"
    )
    # the helper job's (rlpost status JOB --fleet): the run's Ray namespace on the cluster it runs in
    status.add_argument("--namespace", help=argparse.SUPPRESS)
    logs = sub.add_parser(
        "logs",
        help="print a Ray job's logs",
        description="Print a job's logs; with --follow, until it ends (exit 0 if it succeeded, else 1).",
    )
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    stop = sub.add_parser(
        "stop",
        help="stop a Ray job",
        description="Stop a job (`rlpost train` gets SIGTERM and stops its actors) and wait for it to end.",
    )
    stop.add_argument(
        "--wait", type=float, default=60.0, metavar="SECONDS", help="how long to wait for it to end (default 60)"
    )
    status.add_argument("job_id", metavar="RUN_DIR|JOB", help="a run directory, or a job id from `rlpost submit`")
    for command, handler in ((status, _cmd_status), (logs, _cmd_logs), (stop, _cmd_stop)):
        if command is not status:
            command.add_argument("job_id", metavar="JOB", help="job id, as printed by `rlpost submit`")
        _add_cluster_arguments(command)
        command.set_defaults(handler=handler)


def _add_scale_command(sub) -> None:
    scale = sub.add_parser(
        "scale",
        help="change a running job's inference workers and env pools",
        description="Ask a running job for N inference workers and/or M env pools while it trains: `rlpost scale "
        "RUN_DIR inference=N env_pools=M` for a run whose cluster this machine reaches (its run directory), `rlpost "
        "scale JOB inference=N --address http://HEAD:8265` for a submitted job. New workers and pools start where "
        "the cluster has room (until then they wait, and the run trains without them); a new inference worker "
        "loads the current weights and joins the weight bus, a new env pool takes its shard of the prompt stream. "
        "Leaving workers finish their requests first; a leaving env pool stops after its current batch (what it "
        "had not put is collected again when its shard serves again). With a range in the config "
        "(rollout.num_inference_workers: A..B, rollout.num_env_pools: A..B) the count must lie in it; env pools "
        "never exceed the prompt stream's shards (the range's top, else num_env_pools). Exit 0 once the run has "
        "the request (with --wait: once it serves it), 2 for a bad request or an unknown or stopped run, 1 "
        "otherwise.",
    )
    scale.add_argument("target", metavar="RUN_DIR|JOB", help="the run directory, or a job id from `rlpost submit`")
    scale.add_argument(
        "changes", nargs="*", metavar="inference=N|env_pools=M", help="the inference workers / env pools to have"
    )
    scale.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS", help="then wait up to SECONDS until the run serves it"
    )
    # the helper job's (rlpost scale JOB): the run's Ray namespace on the cluster it runs in
    scale.add_argument("--namespace", help=argparse.SUPPRESS)
    _add_cluster_arguments(scale)
    scale.set_defaults(handler=_cmd_scale)


def _cmd_scale(args) -> int:
    from rlpost.service import mailbox

    try:
        request = mailbox.parse_scale_request(args.changes)
        mailbox.check_scale_request({}, request)  # the run's own ranges are checked where they are known
    except ValueError as exc:
        raise ConfigError(f"scale: {exc}") from None
    if args.namespace:  # inside the cluster, as the job `rlpost scale JOB` submits
        return _scale_in(args.namespace, None, request, args.wait)
    target = Path(args.target)
    if target.is_dir():
        try:
            address, namespace, bounds = mailbox.run_namespace(target)
            mailbox.check_scale_request(bounds, request)
            mailbox.check_reachable(address)
        except (LookupError, ValueError) as exc:
            raise ConfigError(f"scale: {exc}") from None
        return _scale_in(namespace, address, request, args.wait)
    if "/" in args.target or target.exists():
        raise ConfigError(f"scale: {args.target}: not a run directory")
    return _scale_job(args)


def _scale_in(namespace: str, address: str | None, request: dict[str, int], wait_s: float) -> int:
    """Leave the request in the run's mailbox (a Ray connection to its cluster: ``address``, or
    the cluster this process runs in) and, with ``wait_s``, wait until the fleet has it."""
    import ray

    from rlpost.runtime.ray_start import use_ray_token_if_present
    from rlpost.service import mailbox

    use_ray_token_if_present()  # a driver joining a cluster sends its token only in token mode

    ray.init(address=address or "auto", namespace=namespace, logging_level="ERROR", log_to_driver=False)
    try:
        try:
            fleet = mailbox.scale_run(namespace, **request)
        except (LookupError, ValueError) as exc:
            raise ConfigError(f"scale: {exc}") from None
        print(f"rlpost: {namespace}: asked for {mailbox.describe_request(request)} (now {_fleet_words(fleet)}); "
              "the run applies it at its next health check")  # fmt: skip
        if wait_s <= 0:
            return EXIT_OK
        fleet = mailbox.wait_for_fleet(namespace, request, wait_s)
        print(f"rlpost: {namespace}: {_fleet_words(fleet)}")
        if not mailbox.fleet_reached(fleet, request):
            print(f"rlpost: failed: the run does not serve {mailbox.describe_request(request)} after {wait_s:g} s",
                  file=sys.stderr)  # fmt: skip
            return EXIT_FAILURE
        return EXIT_OK
    finally:
        ray.shutdown()


def _fleet_words(fleet: dict) -> str:
    """``inference workers: 2 serving of 2 wanted; env pools: 1 serving of 2 wanted, ...``."""
    from rlpost.service.mailbox import fleet_lines

    return "; ".join(fleet_lines(fleet)) or "not reported yet"


def _scale_job(args) -> int:
    """``rlpost scale JOB``: a short job beside it leaves the request (jobs.plan_scale)."""
    from rlpost.ops import jobs

    address = jobs.resolve_address(args.address)
    client = jobs.connect(address, timeout_s=args.timeout)
    submission = jobs.plan_scale(jobs.job_info(client, args.target), args.target, args.changes, wait_s=args.wait)
    return _run_beside(client, submission, timeout_s=args.wait + 300.0)


def _run_beside(client, submission, timeout_s: float) -> int:
    """Run a short job beside a running one (jobs.plan_beside): print its output, return its exit code."""
    from rlpost.ops import jobs

    helper = jobs.submit(client, submission)
    ended = jobs.wait_until_ended(client, helper, timeout_s=timeout_s)
    sys.stdout.write(client.get_job_logs(helper))
    return jobs.entrypoint_exit_code(ended)


def _add_cluster_arguments(parser) -> None:
    parser.add_argument(
        "--address", help="Ray dashboard address, e.g. http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS)"
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, metavar="SECONDS", help="timeout of each request (default 30)"
    )


def _cmd_submit(args) -> int:
    from rlpost.ops import jobs

    working_dir = jobs.choose_working_dir(args.working_dir, upload=not args.no_working_dir)
    _config_or_override(args)
    if args.resume:
        if args.config:
            raise ConfigError("submit --resume RUN_DIR takes the run's own config.yaml; give changes as key=value")
        submission = jobs.plan_resume(args.resume, args.overrides, working_dir=working_dir, job_id=args.job_id)
    elif args.config:
        submission = jobs.plan_submission(args.config, args.overrides, working_dir=working_dir, job_id=args.job_id)
    else:
        raise ConfigError("submit needs a CONFIG file (or --resume RUN_DIR)")
    address = jobs.resolve_address(args.address)
    job_id = jobs.submit(jobs.connect(address, timeout_s=args.timeout), submission)
    print(f"rlpost: submitted job {job_id} to {address}")
    print(f"  entrypoint:  {submission.entrypoint}")
    print(f"  working dir: {working_dir or '(none: the image provides rlpost and the config)'}")
    print(f"  dashboard:   {jobs.dashboard_url(address, job_id)}  (Ray namespace rlpost-{submission.run_name})")
    print(f"  follow:      rlpost logs {job_id} --address {address} --follow")
    for note in submission.notes:
        print(f"  note: {note}")
    if args.follow:
        return _follow(jobs, address, job_id, args.timeout)
    return EXIT_OK


def _cmd_status(args) -> int:
    from rlpost.ops import jobs

    if args.namespace:  # inside the cluster, as `rlpost status JOB --fleet` submits
        return _fleet_in(args.namespace)
    if Path(args.job_id).is_dir():
        return _run_status(Path(args.job_id))

    address = jobs.resolve_address(args.address)
    client = jobs.connect(address, timeout_s=args.timeout)
    info = jobs.job_info(client, args.job_id)
    print(f"{args.job_id}: {info.status}" + (f" ({info.message})" if info.message else ""))
    print(f"  entrypoint: {info.entrypoint}")
    print(f"  dashboard:  {jobs.dashboard_url(address, args.job_id)}")
    if args.fleet and str(info.status) == "RUNNING":
        sys.stdout.flush()
        submission = jobs.plan_beside(info, args.job_id, "status", [], "asked for its fleet")
        if _run_beside(client, submission, timeout_s=300.0) != EXIT_OK:
            print("  fleet: the run did not answer (is it still starting?)")
    elif args.fleet:
        print("  fleet: none (the job is not running)")
    return jobs.status_exit_code(info.status)


def _fleet_in(namespace: str) -> int:
    """The fleet of the run in Ray ``namespace`` of the cluster this process runs in, as its
    mailbox last heard it (``rlpost status JOB --fleet``'s short job)."""
    import ray

    from rlpost.runtime.ray_start import use_ray_token_if_present
    from rlpost.service import mailbox

    use_ray_token_if_present()
    ray.init(address="auto", namespace=namespace, logging_level="ERROR", log_to_driver=False)
    try:
        fleet = mailbox.run_fleet(namespace)
    except LookupError as exc:
        raise ConfigError(f"status: {exc}") from None
    finally:
        ray.shutdown()
    for line in mailbox.fleet_lines(fleet) or ["fleet: not reported yet"]:
        print(f"  {line}")
    return EXIT_OK


def _run_status(run_dir: Path) -> int:
    """``rlpost status RUN_DIR``: the run's last metrics line, in words (its step, reward, fleet
    and restarts)."""
    from rlpost.record.metrics import read_metrics
    from rlpost.service.mailbox import fleet_lines

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"status: {run_dir}: not a run directory (no config.yaml)")
    metrics = run_dir / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.is_file() else []
    if not rows:
        print(f"{run_dir}: no step trained yet")
        return EXIT_OK
    last = rows[-1]
    state = "stopped" if last.get("stopped") else "last step"
    print(f"{run_dir}: {state} {last['step']}, reward {_number(last.get('reward_mean'))}, "
          f"elapsed {_number(last.get('elapsed_s'), '.0f')} s")  # fmt: skip
    for line in fleet_lines(last):
        print(f"  {line}")
    restarts = {k.removeprefix("restarts_"): v for k, v in last.items() if k.startswith("restarts_") and v}
    restarts |= {k: last[k] for k in ("bus_reforms", "learner_resumes", "watchdog_kills") if last.get(k)}
    print("  restarts: " + (", ".join(f"{k} {v}" for k, v in restarts.items()) or "none"))
    return EXIT_OK


def _number(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _cmd_logs(args) -> int:
    from rlpost.ops import jobs

    address = jobs.resolve_address(args.address)
    if args.follow:
        return _follow(jobs, address, args.job_id, args.timeout)
    jobs.print_logs(jobs.connect(address, timeout_s=args.timeout), args.job_id)
    return EXIT_OK


def _follow(jobs, address: str, job_id: str, timeout_s: float) -> int:
    status = jobs.follow_logs(jobs.connect(address, timeout_s=timeout_s), job_id)
    print(f"rlpost: job {job_id} {status}", file=sys.stderr)
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILURE


def _cmd_stop(args) -> int:
    from rlpost.ops import jobs

    address = jobs.resolve_address(args.address)
    status = jobs.stop(jobs.connect(address, timeout_s=args.timeout), args.job_id, wait_s=args.wait)
    print(f"rlpost: job {args.job_id} {status}")
    if status not in jobs.TERMINAL_STATUSES:
        print(f"rlpost: failed: job {args.job_id} still {status} after {args.wait:g} s", file=sys.stderr)
        return EXIT_FAILURE
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
    monitor.add_argument(
        "run_dir",
        nargs="?",
        type=Path,
        help="a run directory: its URLs are printed, its data kept in RUN_DIR/prometheus",
    )
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
        run_dir=args.run_dir,
        port=args.port,
        scrape_interval_s=args.scrape_interval,
        ray_temp_dir=args.ray_temp_dir or default_ray_temp_dir(),
        data_dir=args.data_dir,
        prometheus=args.prometheus,
        grafana=None if args.no_grafana else "grafana",
        grafana_port=args.grafana_port,
        alerts=AlertSettings(stall_after_s=args.stall_after),
    )
    return run_monitor(settings, say=lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
