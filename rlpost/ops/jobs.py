"""Ray Jobs: submit a run to a Ray cluster and watch it (`rlpost submit | status | logs | stop | scale`).

A submitted run is `rlpost train CONFIG key=value ...`, started by Ray's job supervisor on the
head node in a runtime environment built here:

    rlpost submit CONFIG [key=value ...] --address http://HEAD:8265
      validate CONFIG locally (a bad key exits 2; nothing is submitted)
      working dir: the rlpost checkout around the current directory, uploaded without .venv, .git,
                   run directories and caches (or --working-dir DIR, or --no-working-dir when the
                   cluster's image holds rlpost and the config)
      env vars:    resources.env_vars of the config
      job id:      rlpost-<logging.run_name> (a run name is chosen now when the config has none)

    rlpost submit --resume RUN_DIR [key=value ...] --address http://HEAD:8265
      runs `rlpost train --resume RUN_DIR ...` (RUN_DIR on storage the nodes share)

Authentication follows Ray's own CLI (:func:`find_auth_token`), as an ``Authorization: Bearer``
header. Every request has a timeout; an unreachable, silent or refusing cluster raises
:class:`ClusterError` naming the address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import tomllib

from rlpost.config import ConfigError, JobConfig, check_overrides, default_run_name, load_config, path_values
from rlpost.runtime.ray_start import WORKING_DIR_EXCLUDES

REQUEST_TIMEOUT_S = 30.0
UPLOAD_TIMEOUT_S = 600.0  # the working-dir package goes up in one PUT
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
# PYTHONUNBUFFERED: the driver's output reaches `rlpost logs --follow` as it is printed.
# RAY_OVERRIDE_JOB_RUNTIME_ENV: the driver's ray.init passes resources.env_vars again (for local
# runs); Ray refuses to merge a driver runtime_env that repeats a job env var unless this is set.
BASE_ENV_VARS = {"PYTHONUNBUFFERED": "1", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ClusterError(RuntimeError):
    """The cluster could not be reached, refused the request or failed it; names the address."""


class JobNotFoundError(LookupError):
    """The cluster holds no job with this id (a user input error)."""


# ------------------------------------------------------------------------------ authentication


@dataclasses.dataclass(frozen=True)
class AuthToken:
    value: str
    source: str  # where it was found, for messages; the value itself is never printed

    def header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.value}"}


def find_auth_token(environ: Mapping[str, str] = os.environ, home: Path | None = None) -> AuthToken | None:
    """The token Ray's CLI would send, or None (none found, or RAY_AUTH_MODE=disabled).

    Order as in Ray's AuthenticationTokenLoader: RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH
    (set but unreadable or empty is an error, as in Ray), then ~/.ray/auth_token.
    """
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    if environ.get("RAY_AUTH_TOKEN", "").strip():
        return AuthToken(environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN")
    if environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        token = path.read_text().strip() if path.is_file() else ""
        if not token:
            raise ConfigError(f"RAY_AUTH_TOKEN_PATH={path}: no token there (missing or empty file)")
        return AuthToken(token, f"RAY_AUTH_TOKEN_PATH={path}")
    path = (home or Path.home()) / ".ray" / "auth_token"
    token = path.read_text().strip() if path.is_file() else ""
    return AuthToken(token, str(path)) if token else None


# ------------------------------------------------------------------------------ what is submitted


@dataclasses.dataclass
class Submission:
    """One job, ready to send: what runs, in which environment, under which id."""

    entrypoint: str
    runtime_env: dict
    job_id: str
    run_name: str
    metadata: dict[str, str]
    notes: list[str]  # things the user should know (paths that must exist on the cluster)


def plan_submission(config: str | Path, overrides: list[str] | tuple[str, ...] = (), *, working_dir: Path | None,
                    job_id: str | None = None, cwd: Path | None = None) -> Submission:  # fmt: skip
    """Validate the config locally and build the job (no network). ``working_dir``: the folder
    uploaded (holding the config), or None when the cluster's image holds rlpost and the config."""
    cwd = (cwd or Path.cwd()).resolve()
    overrides = list(overrides)
    config_path = cwd / config  # an absolute ``config`` stays as it is
    cfg = load_config(config_path if config_path.is_file() else config, overrides)
    if cfg.logging.run_name is None:
        cfg.logging.run_name = default_run_name()
        overrides.append(f"logging.run_name={cfg.logging.run_name}")
    source = "--job-id" if job_id else "logging.run_name"
    job_id = _checked_job_id(job_id or f"rlpost-{cfg.logging.run_name}", source)
    config_arg = str(config)
    working_dir = working_dir.resolve() if working_dir is not None else None
    notes = _path_notes(cfg, working_dir, cwd)
    if working_dir is not None:
        config_arg = _path_in_upload("config", config_path.resolve(), working_dir).as_posix()
    return Submission(
        entrypoint=build_entrypoint(config_arg, overrides),
        runtime_env=build_runtime_env(cfg, working_dir),
        job_id=job_id,
        run_name=cfg.logging.run_name,
        metadata={"rlpost_config": config_arg, "rlpost_run_name": cfg.logging.run_name},
        notes=notes,
    )


def plan_resume(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), *, working_dir: Path | None,
                job_id: str | None = None) -> Submission:  # fmt: skip
    """A job that runs ``rlpost train --resume RUN_DIR key=value ...`` on the cluster (no network).

    RUN_DIR must be absolute, on storage the nodes share (a relative one would resolve in the
    job's temporary working dir). When visible here too, its config.yaml plus ``overrides`` is
    validated now and its ``resources.env_vars`` go to the job; otherwise the cluster checks it.
    """
    path = Path(run_dir)
    if not path.is_absolute():
        raise ConfigError(f"--resume {run_dir}: give the run directory's absolute path on the cluster's shared storage")
    overrides = list(overrides)
    check_overrides(overrides)
    notes = []
    if (path / "config.yaml").is_file():
        cfg = load_config(path / "config.yaml", overrides)
    else:
        cfg = JobConfig()
        notes.append(f"{path} is not visible here: the job checks on the cluster that it holds a run and a checkpoint")
    run_name = cfg.logging.run_name or path.name
    job_id = _checked_job_id(job_id or f"rlpost-{run_name}-resume-{time.strftime('%Y%m%d-%H%M%S')}", "--job-id")
    return Submission(
        entrypoint=shlex.join(["rlpost", "train", "--resume", str(path), *overrides]),
        runtime_env=build_runtime_env(cfg, working_dir.resolve() if working_dir is not None else None),
        job_id=job_id,
        run_name=run_name,
        metadata={"rlpost_resume": str(path), "rlpost_run_name": run_name},
        notes=notes,
    )


def plan_serve(config: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *, working_dir: Path | None,
               job_id: str | None = None, cwd: Path | None = None) -> Submission:  # fmt: skip
    """A job that runs ``rlpost serve [CONFIG] key=value ...`` on the cluster (no network): the
    serve config is validated here first. Its driver runs on the head node, where the API listens."""
    from rlpost.config import ServeConfig

    cwd = (cwd or Path.cwd()).resolve()
    overrides = list(overrides)
    config_path = cwd / config if config is not None else None
    cfg = load_config(config_path if config_path is not None and config_path.is_file() else config, overrides,
                      schema=ServeConfig)  # fmt: skip
    job_id = _checked_job_id(job_id or f"rlpost-serve-{time.strftime('%Y%m%d-%H%M%S')}", "--job-id")
    args = []
    if config is not None:
        config_arg = str(config)
        if working_dir is not None:
            config_arg = _path_in_upload("config", config_path.resolve(), working_dir.resolve()).as_posix()
        args.append(config_arg)
    notes = [f"the API listens on port {cfg.port} of the node the job's driver runs on (the head node)"]
    if cfg.host in ("127.0.0.1", "localhost"):
        notes.append(f"host is {cfg.host}: only the head node itself reaches it; set host=0.0.0.0 to serve clients")
    keys = cfg.api_keys_file or "$RLPOST_SERVE_API_KEYS in the job's environment"
    notes.append(f"API keys from {keys} on the cluster (resources are the cluster's; keep the key file off the image)")
    env: dict = {"env_vars": dict(BASE_ENV_VARS)}
    if working_dir is not None:
        env["working_dir"] = str(working_dir.resolve())
        env["excludes"] = list(WORKING_DIR_EXCLUDES) + [f"/{Path(cfg.storage_dir).name}"]
    return Submission(
        entrypoint=shlex.join(["rlpost", "serve", *args, *overrides]),
        runtime_env=env,
        job_id=job_id,
        run_name="serve",
        metadata={"rlpost_serve": args[0] if args else "(defaults)"},
        notes=notes,
    )


def _checked_job_id(job_id: str, source: str) -> str:
    if not _JOB_ID.match(job_id):
        raise ConfigError(f"{source}: job id {job_id!r} may hold only letters, digits, '.', '_' and '-'")
    return job_id


def plan_scale(info, job_id: str, changes: list[str], *, wait_s: float = 0.0) -> Submission:
    """A short job that runs ``rlpost scale --namespace rlpost-<run> JOB CHANGES`` beside the
    running job ``job_id`` (:func:`plan_beside`)."""
    args = [*changes, "--wait", f"{wait_s:g}"] if wait_s else list(changes)
    return plan_beside(info, job_id, "scale", args, "scaled")


def plan_beside(info, job_id: str, command: str, args: list[str], what: str) -> Submission:
    """A short job that runs ``rlpost COMMAND --namespace rlpost-<run> JOB ARGS`` beside the running
    job ``job_id`` (``info``: its JobDetails), in its runtime environment: it reaches the run's
    mailbox actor from inside the cluster, when only the dashboard's address is known here.
    ConfigError when the job is not running (``what``: e.g. "scaled") or not ``rlpost submit``'s."""
    status = str(info.status)
    if status != "RUNNING":
        raise ConfigError(f"job {job_id} is {status}: only a running job can be {what}")
    run_name = (info.metadata or {}).get("rlpost_run_name")
    if not run_name:
        raise ConfigError(f"job {job_id} was not submitted by `rlpost submit` (no rlpost_run_name in its metadata)")
    return Submission(
        entrypoint=shlex.join(["rlpost", command, "--namespace", f"rlpost-{run_name}", job_id, *args]),
        runtime_env=dict(info.runtime_env or {}),
        job_id=f"{job_id}-{command}-{time.strftime('%Y%m%d-%H%M%S')}",
        run_name=run_name,
        metadata={f"rlpost_{command}_of": job_id},
        notes=[],
    )


def wait_until_ended(client, job_id: str, timeout_s: float, *, poll_s: float = 1.0):
    """The job's JobDetails once it ended (ClusterError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = job_info(client, job_id)
        if str(info.status) in TERMINAL_STATUSES:
            return info
        if time.monotonic() >= deadline:
            raise ClusterError(f"job {job_id} is still {info.status} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def entrypoint_exit_code(info) -> int:
    """The exit code of an ended job's entrypoint: 0 when it succeeded, the code Ray's message
    names when it failed ("... failed with exit code 2"), else 1."""
    if str(info.status) == "SUCCEEDED":
        return 0
    match = re.search(r"exit code (\d+)", info.message or "")
    return int(match.group(1)) if match else 1


def build_entrypoint(config: str, overrides: list[str] | tuple[str, ...]) -> str:
    """The job's shell command; every argument is quoted (values may hold spaces or quotes)."""
    return shlex.join(["rlpost", "train", config, *overrides])


def build_runtime_env(cfg: JobConfig, working_dir: Path | None) -> dict:
    # the job's driver starts with the run's hash seed (rlpost train would start its Python again otherwise)
    hash_seed = {"PYTHONHASHSEED": str(cfg.resources.python_hash_seed)}
    env: dict = {"env_vars": {**BASE_ENV_VARS, **cfg.resources.env_vars, **hash_seed}}
    if working_dir is not None:
        env["working_dir"] = str(working_dir)
        env["excludes"] = list(WORKING_DIR_EXCLUDES)
        run_dir = Path(cfg.logging.run_dir)
        if not run_dir.is_absolute() and run_dir.parts and run_dir.parts[0] not in ("runs", ".", ".."):
            env["excludes"].append(f"/{run_dir.parts[0]}")  # earlier runs of a custom run_dir stay home
    return env


def choose_working_dir(working_dir: str | None, *, upload: bool = True, cwd: Path | None = None) -> Path | None:
    """The folder to upload: ``working_dir``, else the rlpost checkout around ``cwd``; None without upload."""
    if not upload:
        return None
    if working_dir is not None:
        if not Path(working_dir).is_dir():
            raise ConfigError(f"--working-dir {working_dir}: not a folder")
        return Path(working_dir).resolve()
    root = find_project_root(cwd or Path.cwd())
    if root is None:
        raise ConfigError(
            "not inside an rlpost source checkout: pass --working-dir DIR (uploaded with the job) or "
            "--no-working-dir (the cluster's image holds rlpost and the config)"
        )
    return root


def find_project_root(start: Path) -> Path | None:
    """The rlpost source checkout holding ``start``: the nearest folder upwards whose
    pyproject.toml names the project rlpost."""
    for folder in [start.resolve(), *start.resolve().parents]:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            try:
                name = tomllib.loads(pyproject.read_text()).get("project", {}).get("name")
            except tomllib.TOMLDecodeError:
                name = None
            if name == "rlpost":
                return folder
    return None


def is_excluded(relative: Path) -> bool:
    """Whether a path inside the working dir is left out of the upload by WORKING_DIR_EXCLUDES."""
    parts = relative.parts
    for pattern in WORKING_DIR_EXCLUDES:
        if pattern.startswith("/"):
            if parts and fnmatch.fnmatch(parts[0], pattern[1:]):
                return True
        elif any(fnmatch.fnmatch(part, pattern) for part in parts):
            return True
    return False


def _path_in_upload(key: str, path: Path, working_dir: Path) -> Path:
    """``path`` relative to the working dir; an error naming ``key`` when it is not uploaded."""
    try:
        relative = path.relative_to(working_dir)
    except ValueError:
        raise ConfigError(
            f"{key}: {path} is outside the working dir {working_dir} that is uploaded with the job; "
            "move it there or pass --working-dir DIR"
        ) from None
    if is_excluded(relative):
        raise ConfigError(
            f"{key}: {relative} is not uploaded with the working dir (excluded: {', '.join(WORKING_DIR_EXCLUDES)})"
        )
    return relative


def _path_notes(cfg: JobConfig, working_dir: Path | None, cwd: Path) -> list[str]:
    """Check the config's local input paths against what the cluster will see: a relative path
    must be uploaded (an error otherwise); an absolute one must exist on the nodes (a note)."""
    notes = []
    for key, value in path_values(cfg).items():
        if not (value.startswith((".", "/", "~")) or (cwd / value).exists()):
            continue  # a hub name
        path = Path(value).expanduser()
        if path.is_absolute():
            notes.append(f"{key}={value} is an absolute path: it must exist there on the cluster's nodes")
        elif working_dir is None:
            notes.append(f"{key}={value} is relative: it must exist relative to the job's directory on the cluster")
        elif not (working_dir / path).exists():
            raise ConfigError(
                f"{key}: {value} is not in the working dir {working_dir} (relative paths resolve there on the cluster)"
            )
        else:
            _path_in_upload(key, (working_dir / path).resolve(), working_dir)
    if not Path(cfg.logging.run_dir).is_absolute():
        notes.append(
            f"logging.run_dir={cfg.logging.run_dir} is relative: on the cluster the run directory lands in the job's "
            "temporary working dir on each node; set logging.run_dir to storage every node shares"
        )
    return notes


# ------------------------------------------------------------------------------ the client


def resolve_address(address: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The dashboard URL: ``--address``, else RAY_API_SERVER_ADDRESS, else an http(s) RAY_ADDRESS
    (an explicit address wins, where Ray's own client lets the environment override it)."""
    chosen = address or environ.get("RAY_API_SERVER_ADDRESS")
    if not chosen and "://" in environ.get("RAY_ADDRESS", "") and environ["RAY_ADDRESS"].startswith("http"):
        chosen = environ["RAY_ADDRESS"]
    if not chosen:
        raise ConfigError(
            "no cluster address: pass --address http://HEAD:8265 (the Ray dashboard) or set RAY_API_SERVER_ADDRESS"
        )
    if "://" not in chosen:
        chosen = f"http://{chosen}"
    if not chosen.startswith(("http://", "https://")):
        raise ConfigError(f"--address {chosen}: give the dashboard's http(s) address, e.g. http://HEAD:8265")
    return chosen.rstrip("/")


def dashboard_url(address: str, job_id: str) -> str:
    return f"{address}/#/jobs/{job_id}"


def connect(address: str, *, timeout_s: float = REQUEST_TIMEOUT_S, environ: Mapping[str, str] = os.environ):
    """A JobSubmissionClient for the dashboard at ``address`` (checked with one request)."""
    token = find_auth_token(environ)
    with _environ_without("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        return _client_class()(address, token=token, timeout_s=timeout_s)


@contextlib.contextmanager
def _environ_without(*names: str):
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _client_class():
    """JobSubmissionClient with a timeout on every request and errors that name the address.

    Trap: Ray's client sends requests without a timeout (a silent head would hang it); its private
    ``_do_request`` forwards keyword arguments to ``requests``, so the timeout goes there (Ray is
    pinned to 2.60 in pyproject.toml).
    """
    import requests
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    class Client(JobSubmissionClient):
        def __init__(self, address: str, *, token: AuthToken | None, timeout_s: float):
            self.rlpost_address, self.token, self.timeout_s = address, token, timeout_s
            super().__init__(address, headers=token.header() if token else None)

        def _do_request(self, method, endpoint, **kwargs):
            kwargs.setdefault("timeout", UPLOAD_TIMEOUT_S if method == "PUT" else self.timeout_s)
            where = f"the Ray dashboard at {self.rlpost_address}"
            try:
                return super()._do_request(method, endpoint, **kwargs)
            except requests.exceptions.Timeout:
                raise ClusterError(f"{where} did not answer within {kwargs['timeout']:.0f} s") from None
            except requests.exceptions.ConnectionError as exc:
                raise ClusterError(
                    f"cannot reach {where} ({_reason(exc)}); is the cluster up, and is this its dashboard "
                    "address (http://HEAD:8265)?"
                ) from None
            except AuthenticationError:
                raise ClusterError(_auth_failure(where, self.token)) from None

        @property
        def cluster_ray_version(self) -> str | None:
            return self._server_ray_version  # recorded by the client's version check on connect

        def _raise_error(self, r):
            if r.status_code == 404 and "/api/jobs/" in r.url:
                raise JobNotFoundError(f"no job {r.url.split('/api/jobs/')[1].split('/')[0]} on {self.rlpost_address}")
            raise ClusterError(
                f"the Ray dashboard at {self.rlpost_address} answered {r.status_code}: {r.text.strip()[:500]}"
            )

    return Client


def _reason(exc: Exception) -> str:
    text = str(exc)
    match = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    return match.group(1).strip() if match else text[:200]


def _auth_failure(where: str, token: AuthToken | None) -> str:
    if token is None:
        return (
            f"{where} requires token authentication and no token was found: set RAY_AUTH_TOKEN, or "
            "RAY_AUTH_TOKEN_PATH, or write ~/.ray/auth_token (`ray get-auth-token` on the head prints it)"
        )
    return f"{where} rejected the authentication token from {token.source}"


# ------------------------------------------------------------------------------ job operations


def submit(client, submission: Submission) -> str:
    return client.submit_job(entrypoint=submission.entrypoint, runtime_env=submission.runtime_env,
                             submission_id=submission.job_id, metadata=submission.metadata)  # fmt: skip


def job_info(client, job_id: str):
    """Ray's JobDetails (status, message, entrypoint, ...)."""
    return client.get_job_info(job_id)


def status_exit_code(status: str) -> int:
    """0 while a job is pending, running or succeeded; 1 when it failed or was stopped."""
    return 1 if str(status) in ("FAILED", "STOPPED") else 0


def print_logs(client, job_id: str, out: TextIO = sys.stdout) -> None:
    job_info(client, job_id)  # an unknown id is a JobNotFoundError, not an empty log
    out.write(client.get_job_logs(job_id))
    out.flush()


def follow_logs(client, job_id: str, out: TextIO = sys.stdout, *, poll_s: float = 5.0) -> str:
    """Print the job's logs as they come until it ends; returns its final status.

    Trap: the log stream (a websocket) has no timeout, so after ``poll_s`` of silence the job's
    status is asked (bounded): a vanished cluster raises, and an ended job stops the wait even if
    the stream stays open.
    """
    job_info(client, job_id)
    asyncio.run(_follow(client, job_id, out, poll_s))
    return str(job_info(client, job_id).status)


async def _follow(client, job_id: str, out: TextIO, poll_s: float) -> None:
    import aiohttp

    chunks: asyncio.Queue = asyncio.Queue()

    async def pump():
        try:
            async for chunk in client.tail_job_logs(job_id):
                await chunks.put(chunk)
        finally:
            await chunks.put(None)

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.get(), timeout=poll_s)
            except asyncio.TimeoutError:
                if str(await asyncio.to_thread(client.get_job_status, job_id)) in TERMINAL_STATUSES:
                    return
                continue
            if chunk is None:
                break
            out.write(chunk)
            out.flush()
        await task  # re-raises a stream failure
    except ClusterError:
        raise
    except (aiohttp.ClientError, RuntimeError) as exc:
        raise ClusterError(f"the log stream of job {job_id} from {client.rlpost_address} broke: {exc}") from None
    finally:
        task.cancel()


def stop(client, job_id: str, *, wait_s: float = 60.0) -> str:
    """Ask the job to stop (SIGTERM to `rlpost train`, which stops its actors) and wait up to
    ``wait_s`` for it to end; returns the status it reached."""
    status = str(job_info(client, job_id).status)
    if status in TERMINAL_STATUSES:
        return status
    client.stop_job(job_id)
    deadline = time.monotonic() + wait_s
    while status not in TERMINAL_STATUSES and time.monotonic() < deadline:
        time.sleep(1.0)
        status = str(client.get_job_status(job_id))
    return status
