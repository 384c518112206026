import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster for the session (2 CPUs, no dashboard), shut down at the end."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlpost-tests")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def prompt_ids(tiny_tokenizer) -> list[int]:
    """The arithmetic task's prompt for "What is 3 + 4?", as the tiny model's chat template renders it."""
    from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT

    messages = [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": "What is 3 + 4?"}]
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
