import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster for the session (2 CPUs, no dashboard), shut down at the end."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlpost-tests")
    yield ray
    ray.shutdown()
