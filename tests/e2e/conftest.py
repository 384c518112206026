"""Ray clusters for the e2e tier.

Most e2e runs share one cluster, :func:`ray_head` (a pytest session fixture): a ``ray start
--head`` with its dashboard and token authentication, which CLI runs join with ``--address``,
Ray Jobs are submitted to, and in-process controllers connect to (:func:`connect_driver`). A run
on it skips the start and stop of a cluster of its own (~10 s of the 2 cores each). A test that is
about a cluster of its own (a local run's dashboard, say) starts one with ``start_ray_head``, or
lets ``rlpost train`` start a local one.

Each cluster is :mod:`rlpost.ops.local_cluster`'s: `ray start --block` processes with their own temp
dirs and ports, stopped (their whole process trees) when the fixture or block ends; `ray stop`,
which kills every Ray process on the machine, is never used.
"""

from __future__ import annotations

import contextlib
import os
import secrets

import pytest

from rlpost.ops.local_cluster import driver_token, head_node

# Ray's processes report their metrics every 10 s by default; the clusters the tests start report
# every second, so that a test waiting for a run's metrics on Prometheus waits ~1 s, not ~10.
FAST_METRICS = {"RAY_metrics_report_interval_ms": "1000"}


@pytest.fixture(scope="module")
def start_ray_head():
    """``start_ray_head(dashboard=..., env=...) -> RayHead``; every cluster stops when the module ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **kwargs: stack.enter_context(head_node(**kwargs))


@pytest.fixture
def fast_metrics() -> dict[str, str]:
    """:data:`FAST_METRICS`, for a test that starts Ray through a run of its own."""
    return dict(FAST_METRICS)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """The tier's shared cluster: dashboard on, token authentication with a token file of its own,
    found through RAY_AUTH_TOKEN_PATH with RAY_AUTH_MODE unset in its clients' environment
    (``head.env``), as a user's shell would have it. Runs on it stop their actors when they end
    (the CLI, the supervisor's ``Fleet.stop``, a job's driver), so one run leaves the cluster's
    CPUs free for the next."""
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(FAST_METRICS, RAY_AUTH_TOKEN_PATH=str(token))
    with head_node(dashboard=True, env=env) as head:
        yield head


@pytest.fixture
def connect_driver(ray_head):
    """``connect_driver(namespace) -> ray``: this test process joins the shared cluster as a
    driver in ``namespace`` (as ``ray.init(address=...)`` in a user's script); it leaves at the
    end of the test, and Ray then ends the actors it owned that are still alive."""
    import ray

    with contextlib.ExitStack() as stack:

        def connect(namespace: str):
            stack.enter_context(driver_token(ray_head))
            ray.init(address=ray_head.gcs_address, namespace=namespace, log_to_driver=False)
            stack.callback(ray.shutdown)
            return ray

        yield connect


@pytest.fixture(autouse=True)
def no_ray_connection_from_an_earlier_tier():
    """e2e tests join the tier's cluster or start their own; the integration tier's session
    cluster, which this process is still connected to when the tiers run in one session, would
    make their ``ray.init`` fail."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    yield
