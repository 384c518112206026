"""The `rlpost` commands that reach a Ray cluster: ``submit``, ``status``, ``logs``, ``stop`` (Ray
Jobs, :mod:`rlpost.ops.jobs`) and ``scale`` (a running job's mailbox, :mod:`rlpost.service.mailbox`).

:func:`add_job_commands` and :func:`add_scale_command` add them to the command line's parser
(:mod:`rlpost.ops.cli`); the exit codes are the command line's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlpost.config import ConfigError
from rlpost.ops.commands import EXIT_FAILURE, EXIT_OK, config_or_override


def add_job_commands(sub) -> None:
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
        "--serve",
        action="store_true",
        help="run `rlpost serve CONFIG key=value ...` (a serve config) instead: the Tinker API on the head node",
    )
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


def add_scale_command(sub) -> None:
    scale = sub.add_parser(
        "scale",
        help="change a running job's inference workers and env pools",
        description="Ask a running job for N inference workers and/or M env pools while it trains: `rlpost scale "
        "RUN_DIR inference=N env_pools=M` for a run whose cluster this machine reaches (its run directory), `rlpost "
        "scale JOB inference=N --address http://HEAD:8265` for a submitted job, `rlpost scale STORAGE_DIR inference=N` "
        "for an `rlpost serve` (its storage_dir; its inference workers only). New workers and pools start where "
        "the cluster has room (until then they wait, and the run trains without them); a new inference worker "
        "loads the current weights and joins the weight bus, a new env pool takes its shard of the prompt stream. "
        "Leaving workers finish their requests first; a leaving env pool stops after its current batch (what it "
        "had not put is collected again when its shard serves again). With a range in the config "
        "(rollout.num_inference_workers: A..B, rollout.num_env_pools: A..B) the count must lie in it; env pools "
        "never exceed the prompt stream's shards (the range's top, else num_env_pools). Exit 0 once the run has "
        "the request (with --wait: once it serves it), 2 for a bad request or an unknown or stopped run, 1 "
        "otherwise.",
    )
    scale.add_argument("target", metavar="RUN_DIR|JOB|STORAGE_DIR",
                       help="the run directory, a job id from `rlpost submit`, or an `rlpost serve`'s storage_dir")  # fmt: skip
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
            service = (target / mailbox.SERVICE_FILE).is_file()  # a service's storage folder
            mailbox.check_scale_request(bounds, request, mailbox.SERVICE_KEYS if service else mailbox.SCALE_KEYS)
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
    config_or_override(args)
    if args.serve:
        if args.resume:
            raise ConfigError("submit: --serve and --resume do not go together")
        submission = jobs.plan_serve(args.config, args.overrides, working_dir=working_dir, job_id=args.job_id)
    elif args.resume:
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
